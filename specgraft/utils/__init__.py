"""Small shared helpers (atomic file writes, seeding, devices)."""
