"""specgraft.export."""
