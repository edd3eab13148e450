"""The launcher of a node's ranks (worker.grpo.launch): each rank gets its place in the world, the first rank to
fail stops the others and gives the launcher its exit code, the same whether the ranks start fresh
(`python -m`) or are forked from the launcher once it has imported their module (worker.grpo.rank_fork)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from worker.grpo.launch import LAUNCHER, STOP_GRACE_S, launch_command

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH = "import sys; from worker.grpo.launch import Launcher, parse; w, (m, *a) = parse(sys.argv[1:]); " \
         "sys.exit(Launcher(w, m, a, fork={fork}).run())"


def launch(tmp_path: Path, codes: str, *, fork: bool, env: dict[str, str] | None = None) -> int:
    """Two ranks of tests.engine.launch_probe under a launcher in a child process; the launcher's exit code."""
    command = launch_command("tests.engine.launch_probe", [str(tmp_path), codes], nproc_per_node=2, run_id="r" * 32)
    code = LAUNCH.format(fork=fork)
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} if env is None else env
    environ["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run([sys.executable, "-c", code, *command[len(LAUNCHER):]], env=environ, timeout=120).returncode


def seen(tmp_path: Path, rank: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"rank-{rank}.json").read_text())


def runs(pid: int) -> bool:
    """Whether `pid` still runs (an orphaned rank may linger a moment as a zombie before it is reaped)."""
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
        assert view["listening"] == []  # the store's socket is the launcher's alone
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
    """A module that fails to import fails the launch, whether each rank imports it (fresh) or the launcher
    does, once, before it forks them."""
    (tmp_path / "broken_rank.py").write_text("raise RuntimeError('a rank module that cannot load')\n")
    for module in ("tests.engine.no_such_rank_module", "broken_rank"):
        command = launch_command(module, [], nproc_per_node=2, run_id="r" * 32)
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO_ROOT}"}
        run = subprocess.run([sys.executable, "-c", LAUNCH.format(fork=fork), *command[len(LAUNCHER):]], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0, (module, run.stderr[-2000:])


def test_a_killed_launcher_takes_its_forked_ranks_with_it(tmp_path: Path) -> None:
    """Killed outright, the launcher stops nothing itself: each forked rank dies with it (PR_SET_PDEATHSIG)
    instead of running on, holding the job's inputs and waiting for peers that will never answer."""
    command = launch_command("tests.engine.launch_probe", [str(tmp_path), "sleep,sleep"], nproc_per_node=2,
                             run_id="r" * 32)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(REPO_ROOT)}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCH.format(fork=True), *command[len(LAUNCHER):]], env=env)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank-{rank}.json").exists() for rank in (0, 1)):
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        ranks = [seen(tmp_path, rank)["pid"] for rank in (0, 1)]
        assert {child.pid for child in psutil.Process(launcher.pid).children()} == set(ranks)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10  # the ranks would sleep for 120 s
        while any(runs(pid) for pid in ranks):
            assert time.monotonic() < deadline, "a rank outlived its launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()


RUN_RANKS = "import sys, threading, time; from worker.grpo.launch import run_ranks; {thread}" \
            "sys.exit(run_ranks('tests.engine.launch_probe', sys.argv[1:], nproc_per_node=2, run_id='r' * 32))"
A_THREAD = "threading.Thread(target=time.sleep, args=(600,), daemon=True).start(); "


@pytest.mark.parametrize("thread", [False, True], ids=["alone", "beside-a-thread"])
def test_run_ranks_forks_them_from_its_caller_unless_another_thread_runs(tmp_path: Path, thread: bool) -> None:
    """`grpo train` is its ranks' launcher, with no interpreter between them; a caller that runs threads has
    its ranks started by a launcher process of its own, as a thread's lock would stay held in a forked rank."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(REPO_ROOT)}
    code = RUN_RANKS.format(thread=A_THREAD if thread else "")
    caller = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "0,0"], env=env)
    assert caller.wait(timeout=120) == 0
    ranks = [seen(tmp_path, rank) for rank in (0, 1)]
    assert all(view["preloaded"] for view in ranks)  # forked from a launcher either way (no CUDA here)
    assert {view["ppid"] == caller.pid for view in ranks} == {not thread}


def test_the_caller_launching_its_ranks_stops_them_on_sigint_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C on `grpo train` reaches its launcher, the command itself: it stops the ranks and exits 130, the
    code of a command interrupted, rather than dying and leaving them to its death signal."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"PYTHONPATH": str(REPO_ROOT)}
    caller = subprocess.Popen([sys.executable, "-c", RUN_RANKS.format(thread=""), str(tmp_path), "sleep,sleep"],
                              env=env)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank-{rank}.json").exists() for rank in (0, 1)):
            assert time.monotonic() < deadline and caller.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        caller.send_signal(signal.SIGINT)
        assert caller.wait(timeout=STOP_GRACE_S + 30) == 130  # the ranks would sleep for 120 s
        assert not any(runs(seen(tmp_path, rank)["pid"]) for rank in (0, 1))
    finally:
        caller.kill()
