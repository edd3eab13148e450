"""A node's ranks forked from their launcher once it has imported their module (machines without CUDA).

`python -m MODULE` per rank imports torch, transformers, peft and the engine in every rank: seconds of CPU each,
paid again by each rank of each job that starts. On a machine without CUDA the launcher (worker.grpo.launch)
instead imports MODULE itself, once, and forks each rank from itself; the rank runs MODULE as `__main__`, with
its own argv and environment, as `python -m` would. No process stands between the launcher and its ranks: it
waits for them as for any child, and a rank's exit code or signal is its own.

Rules that make a forked rank the same as a fresh one:
- Not on CUDA machines (`forking_is_safe`): a forked process cannot use CUDA state its parent created, and an
  optional dependency may touch the driver at import (bitsandbytes, which peft imports where it is installed):
  every rank would then fail. There each rank starts fresh.
- The launcher forks while it has a single thread: its ranks before its store, whose server runs threads.
- What a rank reads when it runs (RANK, WORLD_SIZE, the store's address, the socket interfaces) is set in the
  rank before its module runs. What is read once at import comes from the launcher's environment when it
  imports the module: libgomp reads OMP_NUM_THREADS when torch loads, so the launcher sets the ranks' default
  there first, and each rank sets torch's intra-op thread count from its own OMP_NUM_THREADS again, as a fresh
  rank's torch would read it, whatever the launcher's torch read.
- The rank closes the launcher's descriptors that are not its own (the store's listening socket), takes back
  the default signal handlers, and dies with its launcher (PR_SET_PDEATHSIG): a launcher killed outright takes
  its ranks with it, as a fresh rank's exit would not. It names itself `grpo-rank-N` (its command line is the
  launcher's).
- The module itself is dropped from `sys.modules` before it runs as `__main__`, as `python -m` leaves it.
- `atexit` handlers run when the module returns or exits, and the exit code is the interpreter's: 0 on return,
  `sys.exit`'s code, 1 with the traceback on an uncaught exception.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from typing import NoReturn

POLL_S = 0.05
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def forking_is_safe() -> bool:
    """Whether ranks may be forked from their launcher: no CUDA device on this machine."""
    # torch here only: the launcher imports none of it otherwise (its store and the ranks' module aside).
    import torch

    return not torch.cuda.is_available()


class RankForker:
    """Forks the ranks of one module from this process, which imports the module first (once)."""

    def __init__(self, module: str, args: Sequence[str], *, close_fds: Sequence[int] = ()) -> None:
        self.module = module
        self.args = list(args)
        self.close_fds = list(close_fds)  # the launcher's own descriptors, closed in each rank
        importlib.import_module(module)

    def start(self, env: dict[str, str]) -> ForkedProcess:
        """One rank with environment `env`."""
        sys.stdout.flush()  # what is buffered would otherwise be written again by the rank
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            become_rank(self.module, self.args, env, self.close_fds, parent)
        return ForkedProcess(pid)


class ForkedProcess:
    """A forked child (a rank, or a job's launcher: worker.spare_launcher), with the part of subprocess.Popen's
    interface its parent uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while it runs."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return code

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this rank's
            os.kill(self.pid, signum)


def become_rank(
    module: str, args: list[str], env: dict[str, str], close_fds: Sequence[int], parent: int
) -> NoReturn:
    """In the rank forked from `parent`: `python -m module args` with environment `env`, then exit as its
    interpreter would."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        die_with(parent)
        set_process_name(f"grpo-rank-{env.get('RANK', '')}")
        for fd in close_fds:
            os.close(fd)
        run_module(module, args, env)
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def die_with(parent: int) -> None:
    """SIGKILL this process when `parent`, the process that forked it, dies; if it is gone already, now."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def set_process_name(name: str) -> None:
    """This process's name (Linux's `comm`: `top`, `ps -o comm`; 15 bytes at most): a forked rank's command line
    is its launcher's, so its name tells it apart."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def exit_code(stop: SystemExit) -> int:
    """The interpreter's exit code for `stop`; a message is printed to stderr, with code 1."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    sys.stderr.write(f"{stop.code}\n")
    return 1


def run_module(module: str, args: list[str], env: dict[str, str]) -> None:
    """In the forked rank: `python -m module args` with environment `env`."""
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")  # loaded by the launcher with the module, or not at all
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [module, *args]  # runpy puts the module's file in sys.argv[0], as `python -m` does
    sys.modules.pop(module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()
