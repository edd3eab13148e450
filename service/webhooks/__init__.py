"""Webhooks: tenants register URLs that receive signed job lifecycle events (see outbox.py, delivery.py)."""
