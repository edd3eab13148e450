"""The launcher of a node's ranks (worker.grpo.launch): each rank gets its place in the world, the first rank to
fail stops the others and gives the launcher its exit code, the same whether the ranks start fresh
(`python -m`) or are forked from a server that imported their module once (worker.grpo.rank_fork)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from worker.grpo.launch import STOP_GRACE_S, launch_command

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH = "import sys; from worker.grpo.launch import Launcher, parse; w, (m, *a) = parse(sys.argv[1:]); " \
         "sys.exit(Launcher(w, m, a, fork={fork}).run())"


def launch(tmp_path: Path, codes: str, *, fork: bool, env: dict[str, str] | None = None) -> int:
    """Two ranks of tests.engine.launch_probe under a launcher in a child process; the launcher's exit code."""
    command = launch_command("tests.engine.launch_probe", [str(tmp_path), codes], nproc_per_node=2, run_id="r" * 32)
    code = LAUNCH.format(fork=fork)
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} if env is None else env
    environ["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run([sys.executable, "-c", code, *command[3:]], env=environ, timeout=120).returncode


def seen(tmp_path: Path, rank: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"rank-{rank}.json").read_text())


def runs(pid: int) -> bool:
    """Whether `pid` still runs: a rank orphaned by its fork server's death may linger as a zombie no one reaps."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_each_rank_runs_the_module_as_main_in_its_place_of_the_world(tmp_path: Path, fork: bool) -> None:
    assert launch(tmp_path, "0,0", fork=fork) == 0
    ranks = [seen(tmp_path, rank) for rank in (0, 1)]
    for rank, view in enumerate(ranks):
        assert view["name"] == "__main__"
        assert view["argv"] == [str(tmp_path), "0,0"]
        assert view["env"] == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "GRPO_RUN_ID": "r" * 32}
        assert view["threads"] == 1  # the launcher's default, as torchrun's, read by OpenMP when torch loads
        assert view["preloaded"] is fork
        assert (tmp_path / f"atexit-{rank}").exists()  # a forked rank ends like an interpreter too
    assert ranks[0]["pid"] != ranks[1]["pid"]


@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_the_first_rank_to_fail_stops_the_others_and_its_code_is_the_launchers(tmp_path: Path, fork: bool) -> None:
    started = time.monotonic()
    assert launch(tmp_path, "sleep,7", fork=fork) == 7
    assert time.monotonic() - started < STOP_GRACE_S + 60  # rank 0 would sleep for 120 s
    assert not runs(seen(tmp_path, 0)["pid"])


def test_a_forked_rank_keeps_an_operators_thread_setting(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    assert launch(tmp_path, "0,0", fork=True, env=env) == 0
    assert seen(tmp_path, 0)["threads"] == seen(tmp_path, 1)["threads"] == 2


@pytest.mark.parametrize("fork", [False, True], ids=["fresh", "forked"])
def test_a_module_that_fails_to_import_fails_the_launch(tmp_path: Path, fork: bool) -> None:
    """An ImportError the fork server swallows while preloading is raised again in each rank; any other error
    there ends the server, and the launcher with it. Either way the launch fails, as with fresh ranks."""
    (tmp_path / "broken_rank.py").write_text("raise RuntimeError('a rank module that cannot load')\n")
    for module in ("tests.engine.no_such_rank_module", "broken_rank"):
        command = launch_command(module, [], nproc_per_node=2, run_id="r" * 32)
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}
        run = subprocess.run([sys.executable, "-c", LAUNCH.format(fork=fork), *command[3:]], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0, (module, run.stderr[-2000:])


def test_a_killed_fork_server_ends_the_launch_and_its_ranks(tmp_path: Path) -> None:
    command = launch_command("tests.engine.launch_probe", [str(tmp_path), "sleep,sleep"], nproc_per_node=2,
                             run_id="r" * 32)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(REPO_ROOT)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCH.format(fork=True), *command[3:]], env=env)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank-{rank}.json").exists() for rank in (0, 1)):
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        servers = [p for p in psutil.Process(launcher.pid).children()
                   if "multiprocessing.forkserver" in " ".join(p.cmdline())]
        assert len(servers) == 1
        servers[0].kill()
        assert launcher.wait(timeout=STOP_GRACE_S + 30) != 0
        assert not any(runs(seen(tmp_path, rank)["pid"]) for rank in (0, 1))
    finally:
        launcher.kill()
