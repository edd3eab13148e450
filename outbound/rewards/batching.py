"""Split a step's items into requests of at most `max_batch_size`, keeping each group in one request.

Greedy and order-preserving: groups are appended to the current batch while they fit; a group that does
not fit starts a new batch; a group larger than `max_batch_size` is split into full-size chunks (the only
case where a group spans requests).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")


def group_in_order(items: Sequence[T], key: Callable[[T], Hashable]) -> list[list[T]]:
    """Items grouped by `key`, groups ordered by first appearance, items in their original order."""
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def make_batches(items: Sequence[T], *, max_batch_size: int, key: Callable[[T], Hashable]) -> list[list[T]]:
    """Batches of at most `max_batch_size` items with whole groups kept together when they fit."""
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be >= 1")
    batches: list[list[T]] = []
    current: list[T] = []
    for group in group_in_order(items, key):
        if len(group) > max_batch_size:
            if current:
                batches.append(current)
                current = []
            chunks = [group[i : i + max_batch_size] for i in range(0, len(group), max_batch_size)]
            batches.extend(chunks[:-1])
            current = list(chunks[-1])  # the remainder can share a batch with the next groups
            continue
        if len(current) + len(group) > max_batch_size:
            batches.append(current)
            current = []
        current.extend(group)
    if current:
        batches.append(current)
    return batches
