"""specgraft.train."""
