"""examples/smollm2_sums and bench/learning_smollm2.py: the data and a short run of the example.

The full run (40 steps, held-out exact match 12.5 % -> ~90 %) is bench/learning_smollm2.py's, with its figure in
bench/README.md; here a few steps check that the pipeline runs on the real model: the data is reproducible and
held out, `grpo train` trains SmolLM2-135M-Instruct with LoRA, logs its metrics and computes the held-out
eval/accuracy before and after. No learning gain is asserted: two steps cannot deliver one reliably.

SmolLM2 is built once per machine under GRPO_TEST_MODEL_CACHE (default ~/.cache/grpo/models), as in
tests/engine/test_smollm2.py, and linked into the run's model cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import learning_smollm2  # noqa: E402

make_data = learning_smollm2.make_data  # examples/smollm2_sums/make_data.py

from worker.grpo.checkpoint import MERGED_DIR, latest_checkpoint, load_checkpoint, verify_manifest  # noqa: E402
from worker.grpo.pretrained import build_smollm2  # noqa: E402

pytestmark = pytest.mark.slow

GRPO = Path(sys.executable).parent / "grpo"
# Two held-out prompts: the test checks that the evaluations are computed, printed and recorded, not their value.
SHORT_RUN = {
    "max_steps": 2, "eval_every": 2, "eval_samples": 2, "prompts_per_step": 2, "num_generations": 4,
    "log_completions_every": 1,
}


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    cache = Path(os.environ.get("GRPO_TEST_MODEL_CACHE", Path.home() / ".cache" / "grpo" / "models"))
    return build_smollm2(cache)


def test_the_data_is_reproducible_and_held_out(tmp_path: Path) -> None:
    make_data.main(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):  # the committed files are what the generator writes
        assert (tmp_path / name).read_bytes() == (learning_smollm2.EXAMPLE / "data" / name).read_bytes(), name
    train, held_out = _rows(tmp_path / "train.jsonl"), _rows(tmp_path / "eval.jsonl")
    assert (len(train), len(held_out)) == (78, 40)
    train_sums = {row["expression"] for row in train}
    held_out_sums = {row["expression"] for row in held_out}
    shots = {expression for expression, _ in make_data.SHOTS["+"]}
    assert len(train_sums) == 78 and len(held_out_sums) == 40
    assert not train_sums & held_out_sums and not (train_sums | held_out_sums) & shots
    for row in train + held_out:
        a, b = map(int, row["expression"].split(" + "))
        assert row["answer"] == str(a + b) and 0 <= a <= 10 and 0 <= b <= 10
        assert row["prompt"][0] == {"role": "system", "content": make_data.SYSTEM}
        assert row["prompt"][-1] == {"role": "user", "content": f"{row['expression']} ="}


def test_the_differences_are_checked_by_the_task_and_held_out(tmp_path: Path) -> None:
    """bench/learning.py's second task on SmolLM2: the same generator with `-`."""
    train, held_out = make_data.generate(operator="-")
    assert (len(train), len(held_out)) == (118 - 40, 40)
    assert not {r["expression"] for r in train} & {r["expression"] for r in held_out}
    for row in train + held_out:
        a, b = map(int, row["expression"].split(" - "))
        assert row["answer"] == str(a - b) and 0 <= a <= 10 and 0 <= b <= 10
        assert row["prompt"][1:3] == [{"role": "user", "content": "8 - 3 ="}, {"role": "assistant", "content": "5"}]


def test_a_short_run_of_the_example_trains_and_reports_held_out_accuracy(tmp_path: Path, smollm2_dir: Path) -> None:
    config = learning_smollm2.prepare_job(tmp_path / "job", SHORT_RUN)
    output = tmp_path / "out"
    env = {**os.environ, "COLUMNS": "200", "GRPO_MODEL_CACHE_DIR": str(smollm2_dir.parent)}  # built once per machine
    completed = subprocess.run(
        [str(GRPO), "train", "--config", str(config), "--output-dir", str(output)],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    printed = {int(step): float(value) for step, value in re.findall(r"step (\d+) eval accuracy ([\d.]+)", completed.stdout)}
    assert sorted(printed) == [0, 2] and all(0.0 <= v <= 1.0 for v in printed.values()), completed.stdout[-3000:]

    checkpoint = latest_checkpoint(output)
    assert checkpoint is not None and checkpoint.name == "checkpoint-2"
    verify_manifest(checkpoint)
    assert (checkpoint / "adapter_config.json").exists()  # LoRA: the adapter, and the merged model beside it
    assert (checkpoint / MERGED_DIR / "config.json").exists()
    history = load_checkpoint(checkpoint).trainer_state["history"]
    assert len(history) == 2
    for metrics in history:
        assert 0.0 <= metrics["reward/mean"] <= 1.0 and metrics["time/step_s"] > 0 and "loss" in metrics
    final = history[-1]
    assert final["eval/accuracy"] == printed[2]  # the held-out exact match, over the 2 prompts evaluated
    assert 0.0 <= final["eval/pass@4"] <= 1.0
