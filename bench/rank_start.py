"""What it costs a node to start a job's ranks: forked from the launcher once it has imported the rank's
module (worker.grpo.rank_fork, machines without CUDA) against each rank starting fresh with `python -m` (CUDA machines).

    python bench/rank_start.py [--ranks 2] [--rounds 5] [--module worker.rank_job]
    python bench/rank_start.py --spare [--ranks 2] [--rounds 5]

`--spare` compares, both with forked ranks, what a CPU worker's task spends on a job's launcher: a launcher process
of its own (`python -m worker.grpo.launch`) against one forked from the task (worker.spare_launcher). Each launch
is then a task process that has imported the module first, as a worker with the engine preloaded has (not
counted), and times the launch from there.

Each launch is worker.grpo.launch's Launcher in a child process, starting `--ranks` ranks on loopback whose
module imports what a job's rank imports (`--module`, default the worker's rank, worker.rank_job) and exits.
The two ways alternate launch by launch, so that a machine whose load changes affects both alike. Printed per
way: the median wall time of a launch and the median CPU seconds of the launcher and everything it started
(user + system); then forked / fresh. The driver is a child subreaper (Linux): whatever outlives the launcher
is handed to the driver and waited for, so that its CPU time counts too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAUNCH = (
    "import sys; from worker.grpo.launch import Launcher, parse; w, (m, *a) = parse(sys.argv[1:]); "
    "sys.exit(Launcher(w, m, a, fork={fork}).run())"
)


TASK = """
import json, resource, sys, time
import {module}  # noqa: F401  (preloaded, as in a CPU worker's task)
from worker.spare_launcher import spare_launcher, start_launcher

def used():
    me, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime

cpu, started = used(), time.perf_counter()
with spare_launcher({spare}) as spare:
    code = start_launcher(json.loads(sys.argv[1]), spare).wait()
print(json.dumps({{"code": code, "wall": time.perf_counter() - started, "cpu": used() - cpu}}))
"""

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants become this process's children."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def reap_orphans() -> None:
    """Wait for every descendant the launcher left behind, so that its rusage is counted."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def rank_module(workdir: Path, module: str) -> str:
    """A module that imports `module` and exits: a rank's start-up, without its job."""
    (workdir / "rank_start_probe.py").write_text(f"import {module}  # noqa: F401\n")
    return "rank_start_probe"


def launch(ranks: int, probe: str, workdir: Path, *, fork: bool) -> tuple[float, float]:
    """Wall seconds and CPU seconds (the launcher and all it started) of one launch."""
    from worker.grpo.launch import LAUNCHER, launch_command  # imported here: the driver itself stays light

    command = launch_command(probe, [], nproc_per_node=ranks, run_id="b" * 32)[len(LAUNCHER):]
    env = {**os.environ, "PYTHONPATH": f"{workdir}{os.pathsep}{REPO}"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", LAUNCH.format(fork=fork), *command], env=env, check=True)
    reap_orphans()
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def launch_from_task(ranks: int, probe: str, workdir: Path, *, spare: bool) -> tuple[float, float]:
    """Wall seconds and CPU seconds of one launch by a task that has imported the module: the launcher's, the
    ranks' and the task's own from the moment it launches."""
    from worker.grpo.launch import launch_command

    command = launch_command(probe, [], nproc_per_node=ranks, run_id="b" * 32)
    env = {**os.environ, "PYTHONPATH": f"{workdir}{os.pathsep}{REPO}"}
    task = TASK.format(module=probe, spare=spare)
    run = subprocess.run([sys.executable, "-c", task, json.dumps(command)], env=env, check=True, capture_output=True,
                         text=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if result["code"] != 0:
        raise SystemExit(f"the launch failed ({result['code']}):\n{run.stderr}")
    return float(result["wall"]), float(result["cpu"])


def compare(ways: Mapping[str, Callable[[], tuple[float, float]]], rounds: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) per way, the ways alternating launch by launch after one unmeasured warm-up."""
    next(iter(ways.values()))()  # warms the page cache for all
    figures: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    for _ in range(rounds):
        for way, run in ways.items():
            figures[way].append(run())
    return {way: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
            for way, runs in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--module", default="worker.rank_job", help="what each rank imports")
    parser.add_argument("--spare", action="store_true",
                        help="the launcher of its own vs forked from the task (worker.spare_launcher)")
    args = parser.parse_args()
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="rank-start-") as tmp:
        workdir = Path(tmp)
        probe = rank_module(workdir, args.module)
        if args.spare:
            ways = {"own": partial(launch_from_task, args.ranks, probe, workdir, spare=False),
                    "spare": partial(launch_from_task, args.ranks, probe, workdir, spare=True)}
        else:
            ways = {"fresh": partial(launch, args.ranks, probe, workdir, fork=False),
                    "forked": partial(launch, args.ranks, probe, workdir, fork=True)}
        medians = compare(ways, args.rounds)
    print(f"{args.ranks} ranks importing {args.module}, {args.rounds} launches each, {os.cpu_count()} CPUs")
    for way, (wall, cpu) in medians.items():
        print(f"{way:>7}: wall {wall:6.2f} s   CPU {cpu:6.2f} s")
    ours, theirs = list(medians)[::-1]
    print(f"{ours} / {theirs}: wall {medians[ours][0] / medians[theirs][0]:.2f}x, "
          f"CPU {medians[ours][1] / medians[theirs][1]:.2f}x")


if __name__ == "__main__":
    main()
