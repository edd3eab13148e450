"""OpenEnv servers for the tests, each its own process in the OpenEnv venv (`make openenv`, `.venv-openenv`).

OpenEnv 0.10 needs `mcp<2` (through fastmcp 3) and the vLLM CPU build needs `mcp>=2`: they cannot share the test
venv, so OpenEnv and the servers built on it run beside it, as users host theirs. A missing venv fails the test
that needs it, saying how to build it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.worker.procs import REPO, free_port, spawn, wait_for

OPENENV_VENV = REPO / ".venv-openenv"
OPENENV_PYTHON = OPENENV_VENV / "bin" / "python"
CALCULATOR = "examples.environments.calculator:app"


def openenv_python() -> str:
    if not OPENENV_PYTHON.exists():
        pytest.fail(f"{OPENENV_VENV} is missing: `make openenv` builds it (make test does)")
    return str(OPENENV_PYTHON)


@contextmanager
def openenv_server(args: Sequence[str], log_dir: Path, *, sessions: int = 8) -> Iterator[str]:
    """`python -m <args> --port N` of the OpenEnv venv on 127.0.0.1; yields its base URL once `/health` answers."""
    port = free_port()
    env = {**os.environ, "CALCULATOR_MAX_SESSIONS": str(sessions), "PYTHONPATH": str(REPO)}
    proc = spawn("openenv", [openenv_python(), "-m", *args, "--port", str(port)], env, log_dir)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.popen.poll() is not None:
            raise AssertionError(f"the OpenEnv server exited:\n{proc.log()[-4000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(up, timeout=90, what=f"the OpenEnv server {' '.join(args)}")
        yield url
    finally:
        proc.stop()


@contextmanager
def calculator(log_dir: Path, *, sessions: int = 8) -> Iterator[str]:
    """examples/environments/calculator.py (OpenEnv's `create_app`) with `sessions` sessions at once."""
    with openenv_server(["uvicorn", CALCULATOR, "--host", "127.0.0.1"], log_dir, sessions=sessions) as url:
        yield url
