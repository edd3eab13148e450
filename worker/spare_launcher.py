"""A job's launcher forked from the worker's child that claimed the job, on CPU workers with the engine preloaded.

A multi-device job's launcher (worker.grpo.launch) as a process of its own starts an interpreter and imports the
ranks' module, torch and the engine before it forks the ranks: seconds of CPU, and as many seconds of delay, for
every such job. The Celery child has all of that loaded already (`worker_preload_engine`), but it cannot fork
the launcher when it learns that it needs one: by then it has claimed the job, so it holds database connections
(which a forked process must neither use nor close: they are the child's), and its lease's heartbeat runs in a
thread (a lock that thread holds at the fork would stay held in the launcher forever).

So the child forks a spare as its task starts, while it has one thread and no connection, and the spare waits on
a pipe. When the job turns out to run on several devices, the child writes the launcher's arguments to the pipe
and the spare becomes the launcher (`worker.grpo.launch.main`), exiting with its code. Otherwise the child
closes the pipe, and the spare exits at once; it does too when the child dies, as the pipe closes then.

The spare starts as a fresh launcher would: default signal handlers (the launcher installs its own), the
standard streams on the worker's descriptors rather than Celery's logging proxies, and no logging configured, so
that the ranks' `logging.basicConfig` takes effect as it does in a fresh rank. It and its ranks name themselves
(`grpo-launcher`, `grpo-rank-N`: what `top` and `ps -o comm` show), as their command line is the worker's.

Nowhere else: on a machine with CUDA (worker.grpo.rank_fork.forking_is_safe), or in a child that did not
preload the engine (the spare would import it all the same, and save only the interpreter's start), or runs
another thread, the launcher is a process of its own, as before.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

from worker.grpo.launch import LAUNCHER
from worker.grpo.rank_fork import ForkedProcess, forking_is_safe, set_process_name
from worker.processes import ChildProcess, stop_process

STOP_GRACE_S = 30.0


class SpareLauncher:
    """A forked process that waits to become one job's launcher (`launch`) or to be let go (`release`)."""

    def __init__(self, pid: int, pipe: int) -> None:
        self.process = ForkedProcess(pid)
        self._pipe: int | None = pipe
        self.launched = False

    @classmethod
    def fork(cls) -> SpareLauncher:
        """Fork the spare; call it only where `can_fork()`."""
        read_end, write_end = os.pipe()
        sys.stdout.flush()  # what is buffered would otherwise be written again by the spare
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            wait_for_launch(read_end)
        os.close(read_end)
        return cls(pid, write_end)

    def launch(self, command: Sequence[str]) -> ForkedProcess:
        """Become the launcher of `command` (worker.grpo.launch.launch_command's); the running launcher."""
        if self._pipe is None:
            raise RuntimeError("this spare launcher was released or used already")
        if list(command[: len(LAUNCHER)]) != list(LAUNCHER):
            raise ValueError(f"not a launcher's command: {command[:3]}")
        os.write(self._pipe, json.dumps(list(command[len(LAUNCHER):])).encode())
        self._close_pipe()
        self.launched = True
        return self.process

    def release(self) -> None:
        """Let an unused spare go, or stop a launcher still running; waits for the process either way."""
        self._close_pipe()
        if self.launched and self.process.poll() is None:
            stop_process(self.process, grace_s=STOP_GRACE_S)
        self.process.wait()

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None


def can_fork(preloaded: bool) -> bool:
    """Whether this process may fork a spare: the engine preloaded, one thread, no CUDA."""
    return preloaded and threading.active_count() == 1 and forking_is_safe()


@contextmanager
def spare_launcher(preloaded: bool) -> Iterator[SpareLauncher | None]:
    """A spare for the task about to run (None where `can_fork` says no), released when it ends."""
    spare = SpareLauncher.fork() if can_fork(preloaded) else None
    try:
        yield spare
    finally:
        if spare is not None:
            spare.release()


def start_launcher(command: Sequence[str], spare: SpareLauncher | None) -> ChildProcess:
    """Run a launcher's `command`: by the spare where there is one, else as a process of its own."""
    if spare is None:
        return subprocess.Popen(command)
    return spare.launch(command)


def wait_for_launch(pipe: int) -> NoReturn:
    """In the spare: read the launcher's arguments until the pipe closes, then run the launcher, or exit 0 if
    none came."""
    code = 1
    try:
        received = b""
        while chunk := os.read(pipe, 65536):
            received += chunk
        os.close(pipe)
        if not received:
            code = 0
        else:
            become_fresh_process()
            # The launcher's module here, not at the top: the worker's parent imports this module, the engine
            # only where it preloads it.
            from worker.grpo.launch import main

            code = main(json.loads(received))
    except SystemExit as stop:  # argparse refusing the arguments
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        logging.getLogger(__name__).exception("the spare launcher failed")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def become_fresh_process() -> None:
    """Undo what the worker's child set up that a fresh launcher would not have (see the module docstring)."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.__stdout__ is not None and sys.__stderr__ is not None:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    set_process_name("grpo-launcher")
