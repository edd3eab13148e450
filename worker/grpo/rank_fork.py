"""A node's ranks forked from one process that has imported their module already (machines without CUDA).

`python -m MODULE` per rank imports torch, transformers, peft and the engine in every rank: seconds of CPU each,
paid again by each rank of each job that starts. On a machine without CUDA the launcher (worker.grpo.launch)
instead starts one fork server (multiprocessing's "forkserver" start method) that imports MODULE once; each
rank is forked from it and runs MODULE as `__main__`, with its own argv and environment, as `python -m` would.

Rules that make a forked rank the same as a fresh one:
- Not on CUDA machines (`forking_is_safe`): a forked process cannot use CUDA state its parent created, and an
  optional dependency may touch the driver at import (bitsandbytes, which peft imports where it is installed):
  every rank would then fail. There each rank starts fresh.
- What a rank reads when it runs (RANK, WORLD_SIZE, the store's address, the socket interfaces) is set in the
  rank before its module runs. What is read once at import belongs in the server's environment, which is the
  launcher's: libgomp reads OMP_NUM_THREADS when torch loads, so the launcher sets the ranks' default there first.
- The module itself is dropped from `sys.modules` before it runs as `__main__`, as `python -m` leaves it.
- `atexit` handlers run when the module returns or exits, as at an interpreter's exit (a forked process
  otherwise ends without them).

The server listens on a Unix socket in a private temporary directory (0700), never on the network, and exits
with the launcher.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

import psutil


def forking_is_safe() -> bool:
    """Whether ranks may be forked from a preloaded server: no CUDA device on this machine."""
    # torch here only: the launcher imports none of it otherwise (its store aside, on node 0).
    import torch

    return not torch.cuda.is_available()


class ForkServer:
    """Forks the ranks of one module from a server process that imported it once."""

    def __init__(self, module: str, args: Sequence[str]) -> None:
        self.module = module
        self.args = list(args)
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([module])

    def start(self, env: dict[str, str]) -> ForkedRank:
        """One rank with environment `env` (the server starts, and imports the module, with the first)."""
        process = self._context.Process(target=run_module, args=(self.module, self.args, env), daemon=False)
        process.start()
        return ForkedRank(process)


class ForkedRank:
    """A forked rank, with the part of subprocess.Popen's interface the launcher uses.

    The fork server reports a rank's exit code. If the server dies first (killed), that report is lost:
    multiprocessing then gives 255 while the rank may still run, and would no longer signal it. So the rank is
    also followed by its pid (with its start time, against pid reuse): a launcher that stops its ranks stops
    this one too, and waits until it is gone."""

    def __init__(self, process: BaseProcess) -> None:
        self.process = process
        assert process.pid is not None  # started by ForkServer.start
        self.pid = process.pid
        try:
            self._started = psutil.Process(self.pid).create_time()
        except psutil.NoSuchProcess:
            self._started = None  # already gone: nothing to follow

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal; 255: the server died before reporting it), or None
        while it runs."""
        return self.process.exitcode

    def running(self) -> bool:
        """Whether the rank's process still runs (neither exited nor a zombie), whatever the server reported."""
        if self._started is None:
            return False
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self._started and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.process.join(timeout)
        while self.running():  # a rank whose server died: only its pid tells
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.process.name, timeout or 0.0)
            time.sleep(0.05)
        code = self.process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout or 0.0)
        return code

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.running():
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass


def run_module(module: str, args: list[str], env: dict[str, str]) -> None:
    """In the forked rank: `python -m module args` with environment `env`."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *args]  # runpy puts the module's file in sys.argv[0], as `python -m` does
    sys.modules.pop(module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()
