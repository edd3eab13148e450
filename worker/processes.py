"""Stopping a child process the worker launched (a job's ranks, or one node's launcher)."""

from __future__ import annotations

import subprocess
from typing import Protocol


class ChildProcess(Protocol):
    """What the worker uses of a child: subprocess.Popen's, or a forked one's (worker.grpo.rank_fork)."""

    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def stop_process(process: ChildProcess, *, grace_s: float) -> None:
    """Let `process` exit by itself for `grace_s`, then terminate it, then kill it."""
    for stop in (None, process.terminate, process.kill):
        if stop is not None:
            stop()
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
