"""Bounds on failed API-key lookups: a negative cache of refused key hashes and a per-address budget.

Why: a key the positive cache (keycache) does not know costs a database query on a thread. Unbounded, a
client sending random keys costs one query per request. Two bounds, both in-process:

- a key hash the database refused is refused from memory for `GRPO_AUTH_NEGATIVE_CACHE_SECONDS` (the same
  bad key sent again, e.g. a revoked key left in a client's config, costs no query);
- each client address has a token bucket of `GRPO_AUTH_LOOKUPS_PER_MINUTE` failed lookups (that many at
  once, refilled at that rate). A lookup takes a token and gives it back when the key turns out valid, so
  only failures spend the budget. An address with none left is still looked up, but its lookups take turns
  in one lane per process (service.tenants.auth): a valid key, cached or not, authenticates, and an unknown
  key gets 429 `too_many_auth_failures` instead of 401. Whoever shares the address with an attacker (a NAT,
  a proxy) keeps working, and the attacker's flood costs one query at a time.

The address is the TCP peer's (gRPC: the peer address), or the one a proxy listed in GRPO_TRUSTED_PROXIES
forwards (X-Forwarded-For); a client cannot choose it by sending that header itself.

Keyed by the sha256 of the key, like the positive cache: the presented key is still compared with the
stored hash in constant time on every database lookup.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import grpc

from service.kit.errors import DomainError

MAX_ENTRIES = 10_000


class TooManyAuthFailures(DomainError):
    code = "too_many_auth_failures"
    http_status = 429
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedLookups:
    """Thread-safe; both maps bounded by evicting the least recently touched entries."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._max_entries = max_entries
        self._refused: OrderedDict[str, float] = OrderedDict()  # key hash -> refused until (monotonic)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (tokens, at)
        self._lock = threading.Lock()

    # --- negative cache -------------------------------------------------------------------------------

    def refused(self, key_hash: str) -> bool:
        until = self._refused.get(key_hash)  # lock-free fast path: dict reads are atomic
        if until is None:
            return False
        if until > time.monotonic():
            return True
        with self._lock:
            if self._refused.get(key_hash) == until:
                del self._refused[key_hash]
        return False

    def remember_refused(self, key_hash: str, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            self._refused.pop(key_hash, None)
            self._refused[key_hash] = time.monotonic() + seconds
            while len(self._refused) > self._max_entries:
                self._refused.popitem(last=False)

    # --- per-address budget ---------------------------------------------------------------------------

    def acquire(self, address: str, per_minute: int) -> bool:
        """Take one lookup token for `address`; False when it has none left (0 per minute = no limit)."""
        if per_minute <= 0:
            return True
        with self._lock:
            tokens = self._refilled(address, per_minute)
            if tokens < 1:
                self._buckets[address] = (tokens, time.monotonic())
                return False
            self._buckets[address] = (tokens - 1, time.monotonic())
            while len(self._buckets) > self._max_entries:
                self._buckets.popitem(last=False)
            return True

    def release(self, address: str, per_minute: int) -> None:
        """Give back the token of a lookup that did not fail (the key was valid, or the database was down)."""
        if per_minute <= 0:
            return
        with self._lock:
            tokens = self._refilled(address, per_minute)
            self._buckets[address] = (min(float(per_minute), tokens + 1), time.monotonic())

    def seconds_until_token(self, address: str, per_minute: int) -> float:
        with self._lock:
            tokens = self._refilled(address, per_minute) if per_minute > 0 else 1.0
        return max(0.0, (1 - tokens) * 60 / per_minute) if per_minute > 0 else 0.0

    def _refilled(self, address: str, per_minute: int) -> float:
        """The bucket's tokens now (caller holds the lock); moves it to the recently-used end."""
        tokens, at = self._buckets.pop(address, (float(per_minute), time.monotonic()))
        now = time.monotonic()
        self._buckets[address] = (tokens, at)
        return min(float(per_minute), tokens + (now - at) * per_minute / 60)

    def clear(self) -> None:
        with self._lock:
            self._refused.clear()
            self._buckets.clear()
