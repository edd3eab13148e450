"""Helpers for the shipping tests: free ports, the `grpo` CLI as a subprocess, live processes that are always stopped.

Every long-lived process runs in its own session (process group), so stopping it also stops what it started
(`grpo serve --worker` starts a Celery worker, which forks a child per job).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer.main
from typer.core import TyperGroup

from cli import app as cli_app
from tests.worker.procs import stop_together

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
GRPO = [PYTHON, "-m", "cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**overrides: str) -> dict[str, str]:
    """The test process's environment without any GRPO_* setting (so the developer's shell cannot leak in),
    one torch thread per process (the machine is shared), plus `overrides`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(overrides)
    return env


def run_cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `python -m cli <args>` and return it whatever its exit code (the caller asserts)."""
    return subprocess.run([*GRPO, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def describe(done: subprocess.CompletedProcess[str]) -> str:
    """A failed command's argv, exit code and output, for assertion messages."""
    return f"{' '.join(map(str, done.args))} -> {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"


@dataclass
class Live:
    """A background process in its own process group, logging to a file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the leader (so it can stop its children cleanly), then SIGKILL the whole group."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # whatever is left of the group (a worker, a job child)
        except ProcessLookupError:
            pass
        self.popen.wait()


class Processes:
    """Starts background processes and stops all of them, together, at the end of the test."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Live] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Live:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as handle:
            popen = subprocess.Popen(
                args, env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
        live = Live(name, popen, log_path)
        self.started.append(live)
        return live

    def stop_all(self) -> None:
        stop_together(self.started)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (exit {p.popen.poll()}):\n{p.log()[-4000:]}" for p in self.started)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture(scope="session")
def instruct_model() -> Path:
    """builtin:tiny-instruct, built once per machine into the tests' model cache, where the engine's and the
    worker's tests find it too (named by its recipe hash, so never stale)."""
    # The engine (torch) only for the tests that train: the other shipping tests import none of it.
    from tests.engine.trainer_helpers import shared_model_cache
    from worker.grpo.warm import build_instruct_model

    return build_instruct_model(shared_model_cache())


def wait_http_ok(url: str, live: Live, *, timeout: float) -> None:
    """Poll `url` until it answers 200; fail early with the log when the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if live.popen.poll() is not None:
            raise AssertionError(f"{live.name} exited with {live.popen.returncode}:\n{live.log()[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{url} not ready after {timeout:.0f}s:\n{live.log()[-4000:]}")


def resolve(words: list[str]) -> tuple[list[str], Any, list[str]]:
    """Split `grpo <sub> [<sub>...] <args>` into the subcommand path, its click command and its arguments."""
    assert words[0] == "grpo", words
    # typer's (vendored) click command tree; groups are TyperGroup, leaves have `make_context`.
    command: Any = typer.main.get_command(cli_app)
    path: list[str] = []
    rest = words[1:]
    while isinstance(command, TyperGroup) and rest and not rest[0].startswith("-"):
        sub = command.commands.get(rest[0])
        assert sub is not None, f"`grpo {' '.join(path + rest[:1])}`: no such subcommand"
        command, path, rest = sub, [*path, rest[0]], rest[1:]
    assert not isinstance(command, TyperGroup), f"`grpo {' '.join(path)}` is a group, not a command"
    return path, command, rest
