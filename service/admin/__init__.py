"""Operator administration across domains: a tenant's quotas, with what its jobs and datasets use of them."""
