"""bench/gpu_check.sh: the GPU check's dry run (the same code paths on the CPU, tiny shapes) and its lookups.

CI has no GPU: the dry run keeps the script working until a session with a lent GPU machine runs it for real.
Nothing here checks a timing, only that every section of the output is there and holds figures.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cuda_tests  # noqa: E402
import gpu_check  # noqa: E402


@pytest.mark.parametrize(
    ("device", "peak", "label"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12, "H100 SXM"),  # what torch names the SXM card
        ("NVIDIA H100 PCIe", 756e12, "H100 PCIe"),
        ("NVIDIA H100 NVL", 835e12, "H100 NVL"),
        ("NVIDIA H200", 989e12, "H200 (the H100 SXM's chip)"),
        ("NVIDIA A100-SXM4-80GB", 312e12, "A100"),
    ],
)
def test_the_bf16_peak_is_looked_up_by_the_device_name(device: str, peak: float, label: str) -> None:
    assert gpu_check.bf16_peak(device) == (peak, label)


def test_an_unknown_card_has_no_datasheet_peak() -> None:
    assert gpu_check.bf16_peak("NVIDIA GeForce RTX 2080") is None


def test_the_cuda_tests_are_found_where_the_suite_asks_for_a_device() -> None:
    files = cuda_tests.cuda_test_files()
    assert files and all(f.startswith("tests/") for f in files)
    assert "tests/bench/test_gpu_check.py" not in files  # its stand-in below never spells the call out


CUDA_TESTS = """
import pytest

DEVICE = True  # stands in for {call} on a GPU machine


@pytest.mark.skipif(not DEVICE, reason="needs a CUDA device")
def test_on_the_device() -> None:
    pass


@pytest.mark.skipif(not DEVICE, reason="needs a CUDA device")
def test_on_the_device_too() -> None:
    assert OUTCOME == "pass", "the planted failure"


def test_of_the_cpu() -> None:
    raise AssertionError("not a CUDA test: deselected")
"""


@pytest.mark.parametrize("outcome", ["pass", "fail"])
def test_the_cuda_tests_run_alone_and_fail_the_check_unless_all_pass(tmp_path: Path, outcome: str) -> None:
    """What the check does on a GPU machine, where the CUDA tests' skip conditions are false."""
    (tmp_path / "tests").mkdir()
    code = CUDA_TESTS.replace("{call}", "torch.cuda" + ".is_available()")  # how the finder knows the file
    (tmp_path / "tests" / "test_device.py").write_text(f"OUTCOME = {outcome!r}\n" + code)
    (tmp_path / "tests" / "test_other.py").write_text("def test_elsewhere() -> None:\n    raise AssertionError\n")
    line, ok = cuda_tests.run_cuda_tests(tmp_path, timeout_s=120, root=tmp_path)
    assert cuda_tests.cuda_test_files(tmp_path) == ["tests/test_device.py"]
    if outcome == "pass":
        assert ok and line.startswith("cuda tests: 2 passed, 0 failed, 0 skipped, 0 errors of 2 selected")
        assert line.endswith("[ok]")
    else:
        assert not ok and line.startswith("cuda tests: 1 passed, 1 failed, 0 skipped, 0 errors of 2 selected")
        assert "[FAIL]" in line and "the planted failure" in line  # the traceback comes with it


@pytest.mark.slow
def test_dry_run_prints_every_section(tmp_path: Path) -> None:
    report = tmp_path / "check.json"
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--json", str(report)],
        env=os.environ | {"PYTHON": sys.executable, "XDG_CACHE_HOME": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]
    lines = out.splitlines()

    assert lines[0].startswith("gpu check: cpu") and "torch " in lines[0] and "transformers " in lines[0]
    assert "bf16 peak: none known for cpu" in out
    assert re.search(r"^measured peak: [0-9.e+-]+ TFLOP/s \(float32 matmul", out, re.M)
    # The CUDA tests are selected and all skip here: none of the suite's CPU tests run among them.
    tests = re.search(r"^cuda tests: 0 passed, 0 failed, (\d+) skipped, 0 errors of (\d+) selected", out, re.M)
    assert tests and tests[1] == tests[2] and int(tests[1]) >= 1, out
    assert "[skipped: no CUDA device]" in out
    assert "model: qwen2, hidden 64, 2 layers, 4/2 heads of 16, MLP 128, vocabulary 512, tied True," in out
    assert "workload: 4 prompts x 8 completions, 8 new tokens" in out
    header = "| " + " | ".join(gpu_check.TABLE_COLUMNS) + " |"
    assert header in lines
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith(("| full", "| lora"))}
    assert rows.keys() == {"full", "lora"}
    assert re.search(r"^gpu check: done in \d+ s \[ok\]$", out, re.M)

    payload = json.loads(report.read_text())
    assert payload["plan"] == {"dry_run": True, "steps": 2, "reps": 1, "completion_length": 8}
    frameworks = ["ours", "trl"] if importlib.util.find_spec("trl") else ["ours"]
    for row in payload["results"]:
        assert sorted(key for key in row if key != "case") == frameworks
        for framework in frameworks:
            figures = row[framework]
            assert figures["step_s"] > 0 and figures["gen_tokens_per_s"] > 0, (row["case"], framework)
            assert figures["train_flops_per_s"] > 0 and 0 < figures["train_matmul_share"]
            assert figures["peak_rss_mib"] > 0
    if "trl" in frameworks:
        assert re.search(r"^result full: ours/TRL step time [0-9.]+", out, re.M)
    else:
        assert "trl: not installed" in out
