"""`python -c CODE ARGS...` in a process forked from one that has imported the engine already.

A test that starts the engine in several child processes pays for importing torch, transformers, peft and the
engine in each of them. `Preloaded` imports them once, in a server process, and forks every run from it, as the
launcher forks a job's ranks (worker.grpo.rank_fork): each child is a new process that has run nothing but those
imports, then runs CODE as `__main__` with its own argv, environment, working directory and output files, and
ends with its `atexit` handlers run and its exit code reported, as `python -c` would. What is read once at import
(OpenMP's thread count, when torch loads) comes from the server's environment: give it the one the runs would
have had.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

# The server: imports argv[1:], then for each request (a JSON line on stdin) forks a child that runs the code
# and answers with the child's pid, then with its exit code once it has ended (JSON lines on stdout).
SERVER = r"""
import atexit, importlib, json, os, sys, traceback
for module in sys.argv[1:]:
    importlib.import_module(module)
requests, answers = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")


def child(request):
    code = 1
    try:
        requests.close()
        answers.close()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["-c", *request["args"]]
        try:
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if not isinstance(stop.code, int | None):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


print("ready", file=answers, flush=True)
for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    print(json.dumps({"pid": pid}), file=answers, flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)
"""


class Preloaded:
    """A server that imported `modules` with environment `env`; `run` forks one `python -c` from it at a time."""

    def __init__(self, modules: Sequence[str], env: dict[str, str]) -> None:
        self.env = env
        self._lock = threading.Lock()
        self._server = subprocess.Popen(
            [sys.executable, "-c", SERVER, *modules], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )

    def run(
        self, code: str, args: Sequence[str] = (), *, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """As subprocess.run([python, "-c", code, *args], capture_output=True, text=True): a child that runs
        longer than `timeout` is killed and raises subprocess.TimeoutExpired."""
        with self._lock, tempfile.TemporaryDirectory(prefix="preloaded-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request: dict[str, object] = {"code": code, "args": list(args), "env": self.env if env is None else env,
                       "cwd": str(cwd or Path.cwd()), "stdout": str(out), "stderr": str(err)}
            self._send(request)
            pid = int(self._answer()["pid"])
            killed = threading.Event()

            def kill() -> None:
                killed.set()
                os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                returncode = int(self._answer()["returncode"])
            finally:
                timer.cancel()
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
            if killed.is_set():
                raise subprocess.TimeoutExpired(["-c", code], timeout, stdout, stderr)
            return subprocess.CompletedProcess(["-c", code, *args], returncode, stdout, stderr)

    def _send(self, request: dict[str, object]) -> None:
        assert self._server.stdin is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()

    def _answer(self) -> dict[str, int]:
        assert self._server.stdout is not None
        line = self._server.stdout.readline()
        while line == "ready\n":
            line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the preloaded server ended (exit code {self._server.wait()}): see its stderr")
        answer: dict[str, int] = json.loads(line)
        return answer

    def close(self) -> None:
        """Ends the server (after the run in progress, if any)."""
        for stream in (self._server.stdin, self._server.stdout):
            if stream is not None:
                stream.close()
        try:
            self._server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()

    def __enter__(self) -> Preloaded:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

