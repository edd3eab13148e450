"""The test process's side of tests/zygote.py: processes forked from an interpreter that has their modules
imported, behind subprocess.Popen's surface (pid, poll, wait, send_signal, kill), so the tests drive them as they
drive any child process. The end-to-end stacks fork their `grpo worker` and `grpo serve` processes this way
(`fork_process`), the engine tests their `python -c` runs (tests/engine/preloaded.py)."""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

# Settings (GRPO_*) are read by the forked worker itself; PYTEST_CURRENT_TEST changes with every test. Every other
# variable may be read by a library while the zygote imports it, so it must be the same as the zygote's.
PER_PROCESS_PREFIXES = ("GRPO_", "PYTEST_CURRENT_TEST")
ZYGOTE_MODULES = {
    # What `grpo worker` with GRPO_WORKER_PRELOAD_ENGINE imports before its pool forks, less the modules that read
    # settings when imported (worker.celery_app builds its Celery app from them; worker.tasks imports it).
    "worker": [
        "cli", "cli.worker", "celery.apps.worker", "celery.worker", "kombu.transport.redis", "service.kit.config",
        "service.observability.logs", "service.execution", "worker.grpo.trainer",
    ],
    # What `grpo serve` imports before it serves (cli/serve.py), less the app itself, which it builds; never torch.
    "api": [
        "cli", "cli.serve", "cli.migrate", "alembic.command", "uvicorn", "service.app", "service.grpc.server",
        "service.execution.reaper", "service.kit.queue", "service.observability.logs",
    ],
}
ZYGOTE_START_TIMEOUT_S = 120
FORK_TIMEOUT_S = 30


def library_environment(env: dict[str, str]) -> dict[str, str]:
    """The part of a process's environment the zygote's imports may have read."""
    return {key: value for key, value in env.items() if not key.startswith(PER_PROCESS_PREFIXES)}


class ForkedChild:
    """A child of the zygote, as the tests use a subprocess.Popen: a signal reaches it by pid; its exit status
    comes from the zygote, which reaps it."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One `python -m tests.zygote MODULE...`, with `env` less its settings, and the exit statuses of its
    children."""

    def __init__(self, modules: list[str], env: dict[str, str], cwd: Path) -> None:
        self.environment = library_environment(env)
        self._stderr = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", *modules], env=self.environment, cwd=cwd, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, start_new_session=True,
        )
        self._pids: queue.Queue[int] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._ended = threading.Condition()
        self._gone = False
        self._requests = threading.Lock()
        self._ready: queue.Queue[bool] = queue.Queue()
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()
        try:
            self._ready.get(timeout=ZYGOTE_START_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"the zygote did not start:\n{self.stderr()}") from None
        if self._gone:
            raise RuntimeError(f"the zygote exited:\n{self.stderr()}")

    def fork(
        self, args: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path | None = None, *,
        session: bool = True,
    ) -> ForkedChild:
        """`args` (`[python, "-c", CODE, ...]`) in a forked child writing to `stdout` and `stderr` (appending;
        both to `stdout` without `stderr`), in a session of its own with `session`."""
        request = {"args": args, "env": env, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr or stdout),
                   "session": session}
        with self._requests:
            stdin: IO[str] = self._process.stdin  # type: ignore[assignment]
            stdin.write(json.dumps(request) + "\n")
            stdin.flush()
            try:
                pid = self._pids.get(timeout=FORK_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"the zygote did not fork:\n{self.stderr()}") from None
        return ForkedChild(self, pid, args)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit status once it has ended; None if it still runs after `timeout` seconds."""
        with self._ended:
            self._ended.wait_for(lambda: pid in self._exits or self._gone, timeout=timeout)
            if pid in self._exits:
                return self._exits[pid]
            if self._gone:
                raise RuntimeError(f"the zygote exited before its child {pid}:\n{self.stderr()}")
            return None

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=30)

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message: dict[str, Any] = json.loads(line)
            if "ready" in message:
                self._ready.put(True)
            elif "pid" in message:
                with self._ended:  # an earlier child's status under a reused pid is not this child's
                    self._exits.pop(int(message["pid"]), None)
                self._pids.put(int(message["pid"]))
            else:
                with self._ended:
                    self._exits[int(message["exit"])] = int(message["code"])
                    self._ended.notify_all()
        with self._ended:
            self._gone = True
            self._ended.notify_all()
        self._ready.put(False)


_zygotes: dict[str, Zygote] = {}
_zygotes_lock = threading.Lock()


def process_zygote(kind: str, env: dict[str, str], cwd: Path) -> Zygote:
    """This test process's zygote of `kind` (tests/zygote.py), started on first use with `env`'s library
    environment."""
    with _zygotes_lock:
        if kind not in _zygotes:
            _zygotes[kind] = Zygote(ZYGOTE_MODULES[kind], env, cwd)
            atexit.register(_zygotes[kind].close)
        return _zygotes[kind]


def fork_process(kind: str, args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> ForkedChild | None:
    """`args` forked from this test process's zygote of `kind`; None where `env` differs from the zygote's outside
    settings, and a fresh process must run it instead."""
    if os.environ.get("GRPO_TEST_FORK_PROCESSES", "true") == "false":  # each a fresh interpreter instead
        return None
    zygote = process_zygote(kind, env, cwd)
    if library_environment(env) != zygote.environment:
        return None
    return zygote.fork(args, env, cwd, log_path)
