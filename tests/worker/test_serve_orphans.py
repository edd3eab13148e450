"""`grpo serve --worker` killed outright (SIGKILL) takes its embedded worker with it: no orphan keeps polling.
Stopped with SIGTERM, it stops the worker itself before it exits."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.worker.procs import Proc, Stack, private_tmp, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _workers(pid: int) -> list[int]:
    """The embedded worker among the children of `pid`."""
    found = []
    for child in _children(pid):
        try:
            if b"--queues" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextmanager
def serve_with_worker(prefix: str) -> Iterator[tuple[Proc, list[int]]]:
    """`grpo serve --worker` on SQLite and the embedded broker, and its worker's pid, once it runs. Afterwards nothing
    is left behind, even when the test failed."""
    data_dir = private_tmp(prefix)
    stack = Stack(database_url=f"sqlite:///{data_dir}/grpo.db", broker_url="", data_dir=data_dir)
    workers: list[int] = []
    try:
        serve = stack.start_api(worker=True)
        # Its other children (multiprocessing's forkserver and resource tracker) exit by themselves after it.
        wait_for(lambda: _workers(serve.popen.pid) or None, timeout=60, what="the embedded worker")
        workers = _workers(serve.popen.pid)
        yield serve, workers
    finally:
        stack.stop_all()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigkilled_serve_takes_its_embedded_worker_down() -> None:
    with serve_with_worker("grpo-orphan-") as (serve, workers):
        os.kill(serve.popen.pid, signal.SIGKILL)
        serve.popen.wait(timeout=10)
        wait_for(lambda: not any(_alive(pid) for pid in workers) or None, timeout=60, what="the worker to exit")


def test_sigterm_stops_serve_after_its_embedded_worker() -> None:
    with serve_with_worker("grpo-sigterm-") as (serve, workers):
        os.kill(serve.popen.pid, signal.SIGTERM)
        # SystemExit(128 + SIGTERM) once its cleanups ran, not the signal's default action (-SIGTERM).
        assert serve.popen.wait(timeout=60) == 128 + signal.SIGTERM, serve.log()
        assert "embedded worker stopped" in serve.log()
        assert not any(_alive(pid) for pid in workers)
