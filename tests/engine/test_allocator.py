"""keep_freed_memory: glibc's malloc thresholds are raised once per process."""

from __future__ import annotations

import platform
import sys

import pytest

from worker.grpo import allocator


def test_applies_the_thresholds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[int, int]] = []

    def fake(settings: dict[int, int]) -> bool:
        calls.append(settings)
        return True

    monkeypatch.setattr(allocator, "_applied", None)
    monkeypatch.setattr(allocator, "_mallopt", fake)
    assert allocator.keep_freed_memory()
    assert allocator.keep_freed_memory()
    assert calls == [{-3: allocator.MMAP_THRESHOLD, -1: allocator.TRIM_THRESHOLD}]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_glibc_accepts_the_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    """mallopt returns 1 for both (a threshold over glibc's cap would be refused and return 0)."""
    monkeypatch.setattr(allocator, "_applied", None)
    assert allocator.keep_freed_memory()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_glibc_accepts_the_thresholds_that_return_freed_memory() -> None:
    """A fixed mmap threshold (an fsdp rank's): glibc accepts it and stops raising its own."""
    assert allocator.return_freed_memory()
