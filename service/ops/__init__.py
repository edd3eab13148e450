"""ops domain."""
