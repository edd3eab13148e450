"""The CUDA tests of the suite, for bench/gpu_check.py: a pytest plugin (`-p cuda_tests`) that keeps only them,
and the child pytest run that reports their result.

A CUDA test is one that skips without a CUDA device: a `skipif` whose reason names CUDA, or a `cuda` marker;
they are collected from the test files that call `torch.cuda.is_available()`, wherever the suite keeps them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
COUNTS_ENV = "GPU_CHECK_TESTS_JSON"  # where the plugin writes the counts; set only for the child run


def is_cuda_test(item: Any) -> bool:
    """A test that needs a CUDA device: a `cuda` marker, or a skipif whose reason names CUDA."""
    if item.get_closest_marker("cuda") is not None:
        return True
    return any("cuda" in str(mark.kwargs.get("reason", "")).lower() for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if not os.environ.get(COUNTS_ENV):
        return
    kept = [item for item in items if is_cuda_test(item)]
    dropped = [item for item in items if not is_cuda_test(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_terminal_summary(terminalreporter: Any) -> None:
    path = os.environ.get(COUNTS_ENV)
    if path:
        stats = terminalreporter.stats
        counts = {key: len(stats.get(key, [])) for key in ("passed", "failed", "skipped", "error")}
        Path(path).write_text(json.dumps(counts))


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """Test files under root/tests that ask for a CUDA device (wherever the suite moves its CUDA tests)."""
    return sorted(
        str(path.relative_to(root))
        for path in (root / "tests").rglob("test_*.py")
        if "cuda.is_available(" in path.read_text(errors="replace")
    )


def run_cuda_tests(work: Path, timeout_s: float, root: Path = ROOT) -> tuple[str, bool]:
    """One pytest child over the CUDA tests of the suite at `root`: (the result line, and whether all passed)."""
    files = cuda_test_files(root)
    if not files:
        return "cuda tests: none found (no test file asks torch.cuda.is_available())", False
    counts_path = work / "cuda-tests.json"
    env = os.environ | {
        COUNTS_ENV: str(counts_path),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), str(root), os.environ.get("PYTHONPATH")])),
    }
    started = time.perf_counter()
    command = [
        sys.executable, "-m", "pytest", "-q", "-rfEs", "--tb=short", "-p", "no:cacheprovider", "-p", "cuda_tests",
        *files,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        output = f"{error.stdout or ''}{error.stderr or ''}\n(killed at its {timeout_s:.0f} s limit)"
    took = time.perf_counter() - started
    if not counts_path.is_file():
        tail = "\n".join(output.strip().splitlines()[-25:])
        return f"cuda tests: pytest did not finish ({', '.join(files)}) [FAIL]\n{tail}", False
    counts = json.loads(counts_path.read_text())
    selected = sum(counts.values())
    line = (
        f"cuda tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
        f"{counts['error']} errors of {selected} selected in {took:.0f} s ({', '.join(files)})"
    )
    ok = selected > 0 and counts["passed"] == selected
    if ok:
        return f"{line} [ok]", True
    if selected and counts["skipped"] == selected:
        return f"{line} [skipped: no CUDA device]", False
    return "\n".join([f"{line} [FAIL]", *output.strip().splitlines()[-60:]]), False  # tracebacks, summary
