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
        self._forgets = 0  # bumped by every forget: see `generation`

    def get(self, key_hash: str) -> T | None:
        entry = self.lookup(key_hash)
        return entry[0] if entry is not None else None

    def lookup(self, key_hash: str) -> tuple[T, float] | None:
        """The cached value and the seconds it has left, or None when absent or expired."""
        entry = self._entries.get(key_hash)  # lock-free fast path: dict reads are atomic
        if entry is None:
            return None
        expires, value = entry
        left = expires - time.monotonic()
        if left <= 0:
            with self._lock:
                if self._entries.get(key_hash) is entry:
                    del self._entries[key_hash]
            return None
        return value, left

    @property
    def generation(self) -> int:
        """Read before a database lookup and passed to `put`: a revocation that commits while the lookup runs
        (after it read the key as active) then keeps its result out of the cache."""
        return self._forgets

    def put(self, key_hash: str, value: T, ttl_seconds: float, generation: int | None = None) -> None:
        if ttl_seconds <= 0:
            return
        with self._lock:
            if generation is not None and generation != self._forgets:
                return
            self._entries.pop(key_hash, None)
            self._entries[key_hash] = (time.monotonic() + ttl_seconds, value)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def forget(self, key_hash: str) -> None:
        """Drop one entry (its key was found revoked)."""
        with self._lock:
            if self._entries.pop(key_hash, None) is not None:
                self._forgets += 1

    def forget_key_id(self, api_key_id: str) -> None:
        """Drop every entry of one key (on revocation)."""
        with self._lock:
            self._forgets += 1
            for key_hash in [h for h, (_, v) in self._entries.items() if v.api_key_id == api_key_id]:
                del self._entries[key_hash]

    def clear(self) -> None:
        with self._lock:
            self._forgets += 1
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
