"""Fixtures for the real services the suite needs. A missing service fails the test; it never skips."""

from __future__ import annotations

import gc
import itertools
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

POSTGRES_ADMIN_URL = os.environ.get("GRPO_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("GRPO_TEST_REDIS_URL", "redis://127.0.0.1:6379")

# Every app lifespan would otherwise run a full collection of the test process's heap before freezing it
# (~0.2 s with torch loaded, hundreds of times a run). tests/service/test_heap.py turns it on where it is tested.
os.environ.setdefault("GRPO_GC_FREEZE", "false")

# The test processes run the cyclic collector less often than CPython's default (700, 10, 10). A full collection
# walks every object the process tracks, and one that has imported torch, transformers, vLLM and the app tracks
# millions; the objects the tests keep alive for a while (apps, engines, models, sessions) set one off every few
# seconds at the default thresholds, which then took a sizeable share of a test process's CPU (bench/README.md).
# Garbage is still collected: a young collection every 10,000 net allocations, and a full one after every ten
# collections of the middle generation, as by default.
gc.set_threshold(10_000, 20, 10)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a test marked slow run first. `make test` hands whole files to its pytest-xdist workers in
    collection order (`--dist loadfile`): the long files start at once and the short ones fill in around them,
    instead of one long file running alone at the end.

    Within each of the two groups the folders take turns, a file of each (tests/bench, tests/engine, ...,
    tests/worker, then again): the end-to-end files of one folder spend much of their time waiting on their
    stacks (a lease to lapse, a queue, a timeout), and side by side on every worker they left the cores idle,
    where beside another folder's computing tests they do not. A stable sort: the order within each file is kept."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    files = list(dict.fromkeys(item.path for item in items))
    order: dict[Path, int] = {}
    for slow in (True, False):
        folders: dict[Path, list[Path]] = {}
        for path in files:
            if (path in slow_files) == slow:
                folders.setdefault(path.parent, []).append(path)
        for turn in itertools.zip_longest(*folders.values()):
            order.update((path, len(order)) for path in turn if path is not None)
    items.sort(key=lambda item: order[item.path])


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    if not _reachable("127.0.0.1", 5432):
        pytest.fail("PostgreSQL is required at 127.0.0.1:5432 (see .ci/run for how to start it)")
    return POSTGRES_ADMIN_URL


@pytest.fixture(scope="session")
def redis_base_url() -> Iterator[str]:
    if not _reachable("127.0.0.1", 6379):
        pytest.fail("Redis is required at 127.0.0.1:6379 (see .ci/run for how to start it)")
    yield REDIS_URL


@pytest.fixture(scope="session", autouse=True)
def _webhook_outbox() -> None:
    """The test process writes job events like the service's processes do, so it announces them too (each
    entry point calls service.webhooks.outbox.register; tests often write events without one). Imported here,
    not at the top: suites that never touch the service (tests/engine) do not import its models."""
    from service.webhooks import outbox

    outbox.register()


@pytest.fixture(scope="session")
def calculator_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The example OpenEnv calculator (8 sessions), one process per pytest worker (tests/openenv_servers.py)."""
    from tests.openenv_servers import calculator  # only the environment tests start it

    with calculator(tmp_path_factory.mktemp("calculator")) as url:
        yield url
