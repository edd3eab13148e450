"""Shared plumbing for the service: settings, database session, errors, ids."""
