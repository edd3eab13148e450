"""datasets domain."""
