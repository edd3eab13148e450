"""The suite's Redis brokers are split between pytest-xdist workers: two workers never share one."""

from __future__ import annotations

import pytest

from tests.worker.procs import _broker_databases


def _split(count: int, monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    shares = []
    for worker in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        shares.append(set(_broker_databases()))
    return shares


@pytest.mark.parametrize("count", [1, 2, 3, 8, 13])
def test_every_worker_has_brokers_of_its_own(count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    shares = _split(count, monkeypatch)
    assert all(shares), shares
    assert sum(len(share) for share in shares) == len(set().union(*shares)), f"shared between workers: {shares}"
    assert set().union(*shares) <= set(range(1, 14))  # never db 0 (health checks) or 14 (rate limiter tests)


def test_more_workers_than_brokers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "14")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    with pytest.raises(RuntimeError, match="13 at most"):
        _broker_databases()
