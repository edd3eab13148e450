"""Calls to URLs users register: the SSRF policy, the pinned transport, Standard Webhooks signing, and the
reward protocol client with its retries and breaker. Used by the API (dry runs, webhooks) and the worker (rewards)."""
