"""rewards domain."""
