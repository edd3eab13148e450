"""worker.spare_launcher: a job's launcher forked from the task's child, which has the engine loaded.

Each scenario runs in a child interpreter that imports torch first, as a worker's child with the engine preloaded
would have: the pytest worker itself runs threads, and a spare is forked only from a process with one thread.
The ranks are tests.engine.launch_probe's, launched through the real worker.grpo.launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from tests.worker.procs import wait_for
from worker.spare_launcher import can_fork

ROOT = Path(__file__).resolve().parents[2]
PREAMBLE = """
import json, os, sys, time
import torch  # the engine preloaded, as in a CPU worker's child
from worker.grpo.launch import launch_command
from worker.spare_launcher import spare_launcher, start_launcher
"""


def run_script(body: str, *args: str) -> dict[str, object]:
    """Run PREAMBLE + body in a child interpreter; its last stdout line, as JSON."""
    done = subprocess.run([sys.executable, "-c", PREAMBLE + body, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


LAUNCH = """
out, codes = sys.argv[1], sys.argv[2]
with spare_launcher(True) as spare:
    assert spare is not None
    command = launch_command("tests.engine.launch_probe", [out, codes], nproc_per_node=2, run_id="r" * 32)
    launcher = start_launcher(command, spare)
    code = launcher.wait()
print(json.dumps({"code": code, "spare": spare.process.pid, "me": os.getpid()}))
"""


@pytest.mark.parametrize(("codes", "expected"), [("0,0", 0), ("0,5", 5)])
def test_the_spare_becomes_the_launcher_and_forks_the_ranks(tmp_path: Path, codes: str, expected: int) -> None:
    result = run_script(LAUNCH, str(tmp_path), codes)
    assert result["code"] == expected  # the launcher's code: the first failing rank's
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for rank, seen in enumerate(ranks):
        assert seen["ppid"] == result["spare"] != result["me"]  # the spare launched them, not the task's process
        assert seen["preloaded"] is True  # forked from it, with torch loaded: no interpreter started
        assert seen["name"] == "__main__" and seen["env"]["RANK"] == str(rank)
        assert (seen["process_name"], seen["launcher_name"]) == (f"grpo-rank-{rank}", "grpo-launcher")
        assert (tmp_path / f"atexit-{rank}").exists()


UNUSED = """
with spare_launcher(True) as spare:
    assert spare is not None
    pid = spare.process.pid
    try:
        spare.launch([sys.executable, "-m", "not.a.launcher"])
        refused = False
    except ValueError:
        refused = True
print(json.dumps({"pid": pid, "refused": refused, "code": spare.process.returncode}))
"""


def test_an_unused_spare_exits_with_the_task_and_refuses_other_commands() -> None:
    result = run_script(UNUSED)
    assert result["refused"] is True
    assert result["code"] == 0  # it exited by itself once let go, and was waited for
    assert not psutil.pid_exists(int(result["pid"]))  # type: ignore[call-overload]


ORPHANED = """
with spare_launcher(True) as spare:
    print(json.dumps({"spare": spare.process.pid}), flush=True)
    time.sleep(120)
"""


def test_a_spare_whose_task_dies_exits() -> None:
    task = subprocess.Popen([sys.executable, "-c", PREAMBLE + ORPHANED], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert task.stdout is not None
        spare = psutil.Process(json.loads(task.stdout.readline())["spare"])
        task.send_signal(signal.SIGKILL)
        task.wait(30)

        def gone() -> bool:
            try:
                return spare.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        wait_for(gone, timeout=30, what="the spare to exit when its task died")
    finally:
        task.kill()
        task.wait()


def test_no_spare_beside_another_thread_or_without_the_engine_preloaded() -> None:
    """(The scripts above fork theirs: one thread, the engine preloaded.)"""
    assert not can_fork(False)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork(True)
    finally:
        stop.set()
        thread.join()
