"""The client installs alone: `pip install .` (no extras) in a fresh venv gives the SDK and the `grpo` commands
that call the API, without torch, SQLAlchemy or Celery."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ship.conftest import REPO

pytestmark = pytest.mark.slow

PACKAGES = ("contract", "client", "cli", "service", "worker", "outbound")
SERVER_ONLY = ("torch", "transformers", "sqlalchemy", "celery", "fastapi", "alembic", "grpc")

CHECK = f"""
import importlib.util, sys
from client import GRPOClient, AsyncGRPOClient
from contract.api.jobs import JobOut
import cli
present = [m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is not None]
print("present:" + ",".join(present))
"""


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with `pip install <copy of the tree>`: the copy keeps build files out of the checkout."""
    root = tmp_path_factory.mktemp("client-install")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(source)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


def test_the_sdk_imports_without_the_server_dependencies(client_venv: Path, tmp_path: Path) -> None:
    # Run outside the checkout, so that only the installed packages can be imported.
    result = subprocess.run(
        [str(client_venv / "bin" / "python"), "-c", CHECK],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "present:", result.stdout


@pytest.mark.parametrize(
    "argv",
    [["jobs", "list", "--help"], ["datasets", "list", "--help"], ["rewards", "--help"], ["checkpoints", "--help"]],
    ids=lambda argv: " ".join(argv),
)
def test_the_user_commands_run(client_venv: Path, tmp_path: Path, argv: list[str]) -> None:
    result = subprocess.run(
        [str(client_venv / "bin" / "grpo"), *argv],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Usage: grpo" in result.stdout


def test_an_operator_command_names_the_missing_extra(client_venv: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(client_venv / "bin" / "grpo"), "migrate"],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "pip install 'grpo-service[server,worker]'" in result.stderr, result.stderr
