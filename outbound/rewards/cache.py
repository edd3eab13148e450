"""Reward cache for one job and one reward function: identical (prompt, completion, metadata) scored once.

Keys are SHA-256 digests rather than the strings themselves so a long job's cache stays small; the cache is
an LRU bounded by `max_entries`. Metadata is part of the key (beyond the issue's (prompt, completion)) because
two dataset rows may share a prompt but carry different answers; the reward function id is implicit since
each `RemoteRewardSource` owns its cache.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any


def cache_key(prompt: str, completion: str, metadata: dict[str, Any]) -> bytes:
    digest = hashlib.sha256()
    for part in (prompt, completion, json.dumps(metadata, sort_keys=True, default=str)):
        encoded = part.encode()
        digest.update(len(encoded).to_bytes(8, "big"))  # length-prefixed: no ambiguity between fields
        digest.update(encoded)
    return digest.digest()


class RewardCache:
    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, float | None] = OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[bool, float | None]:
        """(found, value): a cached abstention (None) is a hit too."""
        if key not in self._entries:
            return False, None
        self._entries.move_to_end(key)
        self.hits += 1
        return True, self._entries[key]

    def put(self, key: bytes, value: float | None) -> None:
        if self.max_entries <= 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
