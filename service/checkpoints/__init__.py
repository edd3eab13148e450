"""checkpoints domain."""
