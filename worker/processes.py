"""Stopping a child process the worker launched (a job's ranks, or one node's launcher)."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen[bytes], *, grace_s: float) -> None:
    """Let `process` exit by itself for `grace_s`, then terminate it, then kill it."""
    for stop in (None, process.terminate, process.kill):
        if stop is not None:
            stop()
        try:
            process.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
