"""bench/rank_start.py: one launch each way of two ranks importing a light module (`json`), and its report; the
same with `--spare` (the launcher of its own vs forked from the task).

No ratio is asserted (bench/README.md has the figures): the run shows the script still drives the launcher both
ways, counts the CPU of what the launcher leaves behind, and prints its lines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("option", "ways"), [([], ("fresh", "forked")), (["--spare"], ("own", "spare"))])
def test_one_round_of_each_way_prints_wall_cpu_and_the_ratio(option: list[str], ways: tuple[str, str]) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "rank_start.py"), *option, "--rounds", "1", "--module", "json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = dict(re.findall(rf"^\s*({'|'.join(ways)}): wall\s+[\d.]+ s\s+CPU\s+([\d.]+) s$", run.stdout, re.MULTILINE))
    assert set(figures) == set(ways), run.stdout
    # Either way the launcher imports torch (for its store, or the spare's check for CUDA) and forks two ranks:
    # neither costs nothing.
    assert all(float(cpu) > 0.5 for cpu in figures.values()), run.stdout
    baseline, ours = ways
    assert re.search(rf"^{ours} / {baseline}: wall [\d.]+x, CPU [\d.]+x$", run.stdout, re.MULTILINE), run.stdout
