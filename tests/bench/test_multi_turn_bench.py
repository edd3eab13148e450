"""examples/smollm2_tools and bench/multi_turn.py: the data, the log reader and a short run of the example.

The full run (held-out success before and after GRPO) is bench/multi_turn.py's, with its figure in
bench/README.md; here one step checks that the pipeline runs on the real model: `grpo train` runs multi-turn
episodes of SmolLM2-135M-Instruct against the calculator class, trains LoRA on them and prints the held-out
evaluations the benchmark reads. No learning gain is asserted: one step cannot deliver one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import multi_turn  # noqa: E402

from worker.grpo.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from worker.grpo.pretrained import build_smollm2  # noqa: E402

pytestmark = pytest.mark.slow

GRPO = Path(sys.executable).parent / "grpo"
# One prompt of G = 2 episodes per step and one held-out prompt: the test checks that episodes run, train and are
# evaluated, not what they learn.
SHORT_RUN = {"max_steps": 1, "eval_every": 1, "eval_samples": 1, "prompts_per_step": 1, "num_generations": 2}


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_data_is_reproducible_and_held_out(tmp_path: Path) -> None:
    multi_turn.make_data.main(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):  # the committed files are what the generator writes
        assert (tmp_path / name).read_bytes() == (multi_turn.EXAMPLE / "data" / name).read_bytes(), name
    train, held_out = _rows(tmp_path / "train.jsonl"), _rows(tmp_path / "eval.jsonl")
    assert (len(train), len(held_out)) == (150, 74)
    questions = [row["question"] for row in train + held_out]
    assert len(set(questions)) == 224 and not {r["question"] for r in train} & {r["question"] for r in held_out}
    shots = {f"{a}*{b}=?" for a, b in multi_turn.make_data.EXAMPLES}
    for row in train + held_out:
        a, b = map(int, row["question"].removesuffix("=?").split("*"))
        assert row["answer"] == str(a * b) and row["question"] not in shots
        assert row["prompt"][-1] == {"role": "user", "content": row["question"]}
        assert [m["content"] for m in row["prompt"] if m["role"] == "user"][:-1] == sorted(shots, reverse=True)


def test_the_log_reader_takes_every_printed_evaluation() -> None:
    log = ("step 0 eval accuracy 0.469  pass@4 0.938  reward/mean 0.469\nstep 4 sample 'x' -> 'y'\n"
           "step 12 eval accuracy 0.800  pass@4 1.000  reward/mean 0.812\n")
    assert multi_turn.evaluations(log) == [
        (0, {"accuracy": 0.469, "pass@4": 0.938, "reward/mean": 0.469}),
        (12, {"accuracy": 0.8, "pass@4": 1.0, "reward/mean": 0.812}),
    ]


def test_a_short_run_of_the_example_trains_on_episodes(tmp_path: Path) -> None:
    cache = Path(os.environ.get("GRPO_TEST_MODEL_CACHE", Path.home() / ".cache" / "grpo" / "models"))
    smollm2_dir = build_smollm2(cache)
    config = multi_turn.prepare_job(tmp_path / "job", SHORT_RUN)
    output = tmp_path / "out"
    completed = subprocess.run(
        [str(GRPO), "train", "--config", str(config), "--output-dir", str(output)],
        capture_output=True, text=True, timeout=400, check=False, cwd=multi_turn.EXAMPLE,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(multi_turn.REPO),
             "GRPO_MODEL_CACHE_DIR": str(smollm2_dir.parent)},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    evals = multi_turn.evaluations(completed.stdout)
    assert [step for step, _ in evals] == [0, 1], completed.stdout[-3000:]
    assert all(0.0 <= metrics["reward/mean"] <= 1.0 and "pass@2" in metrics for _, metrics in evals)

    checkpoint = latest_checkpoint(output)
    assert checkpoint is not None and (checkpoint / "adapter_config.json").exists()
    (metrics,) = load_checkpoint(checkpoint).trainer_state["history"]
    assert metrics["env/episodes"] == 2 and metrics["env/errors"] == 0 and metrics["env/tool_calls"] > 0
