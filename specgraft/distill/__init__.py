"""specgraft.distill."""
