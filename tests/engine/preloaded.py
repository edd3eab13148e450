"""`python -c CODE ARGS...` in a process forked from one that has imported the engine already.

A test that starts the engine in several child processes pays for importing torch, transformers, peft and the
engine in each of them. `Preloaded` imports them once, in a zygote (tests/zygote.py), and forks every run from
it, as the launcher forks a job's ranks (worker.grpo.rank_fork): each child is a new process that has run nothing
but those imports, then runs CODE as `__main__` with its own argv, environment, working directory and output
files, and ends with its `atexit` handlers run and its exit code reported, as `python -c` would. What is read once
at import (OpenMP's thread count, when torch loads) comes from the zygote's environment: give it the one the runs
would have had.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tests.forked_processes import Zygote

REPO = Path(__file__).resolve().parents[2]


class Preloaded:
    """A zygote that imported `modules` with environment `env`; `run` forks one `python -c` from it."""

    def __init__(self, modules: Sequence[str], env: dict[str, str]) -> None:
        self.env = env
        self._zygote = Zygote(list(modules), env, REPO)

    def run(
        self, code: str, args: Sequence[str] = (), *, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """As subprocess.run([python, "-c", code, *args], capture_output=True, text=True): a child that runs
        longer than `timeout` is killed and raises subprocess.TimeoutExpired."""
        with tempfile.TemporaryDirectory(prefix="preloaded-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            child = self._zygote.fork([sys.executable, "-c", code, *args], self.env if env is None else env,
                                      cwd or Path.cwd(), out, err, session=False)
            try:
                returncode = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.send_signal(signal.SIGKILL)
                child.wait()
                raise subprocess.TimeoutExpired(["-c", code], timeout, _read(out), _read(err)) from None
            return subprocess.CompletedProcess(["-c", code, *args], returncode, _read(out), _read(err))

    def close(self) -> None:
        """Ends the zygote."""
        self._zygote.close()

    def __enter__(self) -> Preloaded:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
