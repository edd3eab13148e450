"""API key material: the key's shape, its stored hash and its lookup prefix.

A key is "grpo_sk_" + 43 url-safe characters (32 random bytes). Stored: the sha256 of the whole key and the
first PREFIX_LEN characters of the random part as a lookup index. Its own module because both key creation
(service.tenants.service) and authentication (service.tenants.auth) need it, and the service drops revoked
keys from auth's cache: neither imports the other both ways.
"""

from __future__ import annotations

import hashlib

KEY_PREFIX = "grpo_sk_"
PREFIX_LEN = 12


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def lookup_prefix(token: str) -> str | None:
    """The stored lookup prefix of a presented token, or None if it is not shaped like one of our keys."""
    if not token.startswith(KEY_PREFIX) or len(token) < len(KEY_PREFIX) + PREFIX_LEN:
        return None
    return token[len(KEY_PREFIX) : len(KEY_PREFIX) + PREFIX_LEN]
