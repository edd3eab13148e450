"""What it costs a node to start a job's ranks: forked from the launcher once it has imported the rank's
module (worker.grpo.rank_fork, machines without CUDA) against each rank starting fresh with `python -m` (CUDA machines).

    python bench/rank_start.py [--ranks 2] [--rounds 5] [--module worker.rank_job]

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
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAUNCH = (
    "import sys; from worker.grpo.launch import Launcher, parse; w, (m, *a) = parse(sys.argv[1:]); "
    "sys.exit(Launcher(w, m, a, fork={fork}).run())"
)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--module", default="worker.rank_job", help="what each rank imports")
    args = parser.parse_args()
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="rank-start-") as tmp:
        workdir = Path(tmp)
        probe = rank_module(workdir, args.module)
        figures: dict[str, list[tuple[float, float]]] = {"fresh": [], "forked": []}
        launch(args.ranks, probe, workdir, fork=False)  # warms the page cache for both
        for _ in range(args.rounds):
            for way in ("fresh", "forked"):
                figures[way].append(launch(args.ranks, probe, workdir, fork=way == "forked"))
    print(f"{args.ranks} ranks importing {args.module}, {args.rounds} launches each, {os.cpu_count()} CPUs")
    medians = {}
    for way, runs in figures.items():
        medians[way] = (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        print(f"{way:>7}: wall {medians[way][0]:6.2f} s   CPU {medians[way][1]:6.2f} s")
    print(f"forked / fresh: wall {medians['forked'][0] / medians['fresh'][0]:.2f}x, "
          f"CPU {medians['forked'][1] / medians['fresh'][1]:.2f}x")


if __name__ == "__main__":
    main()
