"""bench/primitives_memory.py: its command line, its table, and one measurement of 1 and 3 clients on the tiny model.

The benchmark runs as a script with bench/ on sys.path; this test does the same. The measurement runs two
children (the `tiny` preset, the architecture of builtin:tiny-instruct, random weights: nothing is trained
first) and checks the records' structure and that three clients hold at least what one does; no ratio is
asserted (bench/README.md has the figures).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import primitives_memory as bench  # noqa: E402

from worker.grpo.tiny import build_tiny_model  # noqa: E402


def test_defaults_and_the_configurations_each_count_gets() -> None:
    args = bench.parse_args([])
    assert (args.model_list, args.rank_list, args.client_list) == (["tiny", "smollm2"], [8, 32], [1, 3])
    assert (args.reps, args.calls) == (2, 3)
    names = [layout.name for layout in bench.layouts_for([1, 3, 8])]
    assert names == ["shared x1", "shared x3", "shared x8", "separate x3", "separate x8"]
    assert [layout.bases for layout in bench.layouts_for([1, 3])] == [1, 1, 3]


@pytest.mark.parametrize(
    "argv", [["--clients", "3"], ["--clients", "1"], ["--ranks", "0"], ["--models", "gpt2"], ["--reps", "0"]]
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def _record(steady: float, peak: float, trimmed: float, adapter: int = 1_000_000) -> dict[str, float]:
    return {
        "runtime_mib": 500.0, "loaded_mib": 600.0, "steady_mib": steady, "peak_mib": peak, "trimmed_mib": trimmed,
        "ru_maxrss_mib": peak, "base_params": 10_000_000, "adapter_params": adapter,
        "first_loss": 2.0, "last_loss": 1.0,
    }


def test_rows_ratios_and_verdict() -> None:
    one, three = bench.Layout("shared", 1), bench.Layout("shared", 3)
    records = {
        one: [_record(1000, 1200, 800), _record(1010, 1220, 810)],
        three: [_record(1250, 1500, 820), _record(1290, 1540, 830)],
        bench.Layout("separate", 3): [_record(2500, 2600, 2000)],
    }
    (row,) = bench.rows_for("m", 8, records)
    assert row.one["steady_mib"] == 1005 and row.shared["steady_mib"] == 1270  # medians over repetitions
    assert row.steady_ratio == pytest.approx(1270 / 1005) and row.peak_ratio == pytest.approx(1520 / 1210)
    assert row.per_added_client() == pytest.approx(265 / 2)
    assert row.vs_separate == pytest.approx(1270 / 2500) and row.vs_processes == pytest.approx(1270 / 3015)
    assert row.verdict == "ok"
    records[three] = [_record(1400, 1500, 820)]
    assert bench.rows_for("m", 8, records)[0].verdict == "MISS"  # steady 1.39 > 1.3
    lines = bench.table_lines([row])
    assert len(lines) == 3 and all(line.count("|") == len(bench.COLUMNS) + 1 for line in lines)
    assert lines[2].startswith("| m | 8 | 3 | 1005 | 1270 | 1.26 |") and lines[2].endswith("| ok |")


def test_one_and_three_clients_on_the_tiny_model(tmp_path: Path) -> None:
    model_dir = build_tiny_model("tiny", tmp_path / "tiny", seed=0)
    workload = bench.Workload(rank=32, calls=2, datums=2, tokens=32)
    one = bench.measure(model_dir, bench.Layout("shared", 1), workload, tmp_path, threads=1, timeout_s=300)
    three = bench.measure(model_dir, bench.Layout("shared", 3), workload, tmp_path, threads=1, timeout_s=300)
    for record in (one, three):
        assert set(record) == set(bench.RECORD_KEYS)
        assert all(math.isfinite(value) and value > 0 for value in record.values()), record
        assert record["runtime_mib"] <= record["loaded_mib"] <= record["peak_mib"]
        assert record["steady_mib"] <= record["peak_mib"] <= record["ru_maxrss_mib"] + 1
        assert record["trimmed_mib"] <= record["steady_mib"] + 1
        assert record["last_loss"] < record["first_loss"]  # the client trained (same data every call)
    assert one["adapter_params"] == three["adapter_params"] > 0
    assert one["base_params"] == three["base_params"] > one["adapter_params"]
    for key in ("steady_mib", "peak_mib", "trimmed_mib"):
        assert three[key] >= one[key], (key, one[key], three[key])
    assert not list(tmp_path.glob("record-*.json"))  # the parent read and removed the children's records
