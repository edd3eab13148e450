"""A small in-process cache of recently authenticated API keys (sha256 of the key -> TenantContext).

Why: every request authenticates, and on a busy read path the key lookup (a joined query) costs more than
the read itself. Only successful lookups are cached, for `GRPO_AUTH_CACHE_SECONDS` (0 disables), and at
most `MAX_ENTRIES` keys. A key revoked through `service.tenants.service.revoke_api_key` is dropped from
this process's cache when the revocation commits; other processes (more uvicorn workers, the gRPC server,
an admin CLI writing the database directly) keep accepting it until their entry expires, so the setting
is also the longest revocation delay.

The cache is keyed by the sha256 of the key, never the key itself. A dict lookup is not constant-time,
but what it could leak is how a hash of the secret compares, which does not help anyone guess the secret.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class _Context(Protocol):
    @property
    def api_key_id(self) -> str: ...


T = TypeVar("T", bound=_Context)

MAX_ENTRIES = 10_000


class KeyCache(Generic[T]):
    """Thread-safe TTL cache, bounded by evicting the oldest entries (insertion order = expiry order)."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, T]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key_hash: str) -> T | None:
        entry = self._entries.get(key_hash)  # lock-free fast path: dict reads are atomic
        if entry is None:
            return None
        expires, value = entry
        if time.monotonic() >= expires:
            with self._lock:
                if self._entries.get(key_hash) is entry:
                    del self._entries[key_hash]
            return None
        return value

    def put(self, key_hash: str, value: T, ttl_seconds: float) -> None:
        if ttl_seconds <= 0:
            return
        with self._lock:
            self._entries.pop(key_hash, None)
            self._entries[key_hash] = (time.monotonic() + ttl_seconds, value)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def forget_key_id(self, api_key_id: str) -> None:
        """Drop every entry of one key (on revocation)."""
        with self._lock:
            for key_hash in [h for h, (_, v) in self._entries.items() if v.api_key_id == api_key_id]:
                del self._entries[key_hash]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
