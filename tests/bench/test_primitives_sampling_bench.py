"""bench/primitives_sampling.py: its command line, its table, and one measurement of each sampler on the tiny model.

The benchmark runs as a script with bench/ on sys.path; this test does the same. The measurement runs one native
and one vllm child (the `tiny` preset, random weights) with two samplers and checks that both generated every
token asked for; no speed is asserted (bench/README.md has the figures).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import primitives_sampling as bench  # noqa: E402

from worker.grpo.tiny import build_tiny_model  # noqa: E402


def test_defaults() -> None:
    args = bench.parse_args([])
    assert (args.model_list, args.sampler_list, args.rank, args.max_lora_rank) == (["smollm2"], [1, 3], 32, 32)
    assert (args.samples, args.tokens, args.calls, args.reps) == (8, 64, 6, 2)


@pytest.mark.parametrize(
    "argv",
    [["--samplers", "0"], ["--samplers", "x"], ["--models", "gpt2"], ["--reps", "0"], ["--rank", "64"]],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_the_table_is_medians_and_their_ratio() -> None:
    records = {
        "native": [{"tokens": 100, "seconds": 1.0, "build_s": 0.0}, {"tokens": 100, "seconds": 2.0, "build_s": 0.0},
                   {"tokens": 100, "seconds": 4.0, "build_s": 0.0}],
        "vllm": [{"tokens": 100, "seconds": 0.5, "build_s": 3.0}, {"tokens": 100, "seconds": 0.25, "build_s": 5.0},
                 {"tokens": 100, "seconds": 1.0, "build_s": 4.0}],
    }
    lines = bench.table_lines({("tiny", 3): records})
    assert lines[-1] == "| tiny | 3 | 50 | 200 | 4.00 | 4.0 |"


def test_one_measurement_of_each_sampler(tmp_path: Path) -> None:
    model_dir = build_tiny_model("tiny", tmp_path / "tiny", seed=0)
    args = argparse.Namespace(rank=8, max_lora_rank=8, samples=2, tokens=5, calls=2, threads=1, device="cpu")
    for sampler in bench.SAMPLERS:
        record = bench.measure(sampler, model_dir, 2, args, tmp_path)
        assert record["tokens"] == 2 * 2 * 5  # calls x samples x tokens: stop=[] runs every sample to the end
        assert record["seconds"] > 0
        assert (record["build_s"] > 0) == (sampler == "vllm")
