"""tenants domain."""
