"""jobs domain."""
