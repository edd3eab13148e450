"""Learning on a real model: `grpo train` on SmolLM2-135M-Instruct with LoRA raises held-out exact match.

Runs examples/smollm2_sums as a user would: generates its data (reasoning-gym small sums, make_data.py), then
`grpo train --config job.yaml` (LoRA, the example's hyperparameters) in a child process, timed, and measures
held-out exact match before (the base model) and after (the run's final checkpoint, `merged/`) with one
evaluator (bench/learning.py's: greedy, chat template, stripped completion equals the answer). The trainer's
own eval/accuracy at the last step is printed beside it.

    .venv/bin/python bench/learning_smollm2.py                    # the example as it is (~10 min on 2 cores)
    .venv/bin/python bench/learning_smollm2.py --max-steps 5      # a quick check

`builtin:smollm2-135m-instruct` is converted once into --model-cache (default: the test suite's,
~/.cache/grpo/models) and linked into the run's model cache before the clock starts (a conversion, ~40 s, is
timed separately). Needs reasoning-gym (dev and bench extras). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "smollm2_sums"
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import example_job  # noqa: E402
from learning import exact_match_accuracy  # noqa: E402

make_data = example_job.load_make_data(EXAMPLE)


def prepare_job(work: Path, overrides: dict[str, Any]) -> Path:
    """The example's job.yaml and freshly generated data in `work`, with hyperparameter overrides."""
    return example_job.prepare_job(EXAMPLE, work, overrides, make_data.main)


def held_out(model_dir: Path, data: Path) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = yaml.safe_load((EXAMPLE / "job.yaml").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return exact_match_accuracy(
        model, tokenizer, [r["prompt"] for r in rows], [r["answer"] for r in rows],
        spec["hyperparameters"]["max_completion_length"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, help="override the example's max_steps (and eval_every)")
    parser.add_argument("--seed", type=int, help="override the example's seed (sampling, data order, LoRA init)")
    parser.add_argument("--workdir", type=Path, help="keep the data, checkpoints and log here (default: a temp dir)")
    parser.add_argument("--model-cache", type=Path, default=Path.home() / ".cache" / "grpo" / "models")
    args = parser.parse_args()

    import torch

    from worker.grpo.checkpoint import latest_checkpoint, load_checkpoint
    from worker.grpo.pretrained import build_smollm2

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    work = example_job.run_folder(args.workdir, "smollm2-sums-")
    config = prepare_job(work, example_job.run_overrides(args.seed, args.max_steps))
    output = work / "out"
    started = time.perf_counter()
    base = build_smollm2(args.model_cache)
    build_s = time.perf_counter() - started
    before = held_out(base, work / "data" / "eval.jsonl")
    print(f"model ready in {build_s:.0f} s; held-out exact match before: {before:.1%}", flush=True)

    started = time.perf_counter()
    with open(work / "train.log", "w", encoding="utf-8") as log:
        subprocess.run(
            [str(example_job.GRPO), "train", "--config", str(config), "--output-dir", str(output)],
            stdout=log, stderr=subprocess.STDOUT, check=True,
            env={**os.environ, "COLUMNS": "120", "GRPO_MODEL_CACHE_DIR": str(base.parent)},  # the folder built above
        )
    train_s = time.perf_counter() - started
    checkpoint = latest_checkpoint(output)
    assert checkpoint is not None
    after = held_out(checkpoint / "merged", work / "data" / "eval.jsonl")
    history = load_checkpoint(checkpoint).trainer_state["history"]
    hyper = yaml.safe_load(config.read_text(encoding="utf-8"))["hyperparameters"]
    result = {
        "before": before, "after": after, "gain": after - before, "train_s": train_s, "build_s": build_s,
        "steps": len(history), "trainer_final_eval_accuracy": history[-1].get("eval/accuracy"),
        "first5_reward": sum(m["reward/mean"] for m in history[:5]) / min(5, len(history)),
        "last5_reward": sum(m["reward/mean"] for m in history[-5:]) / min(5, len(history)),
        "hyperparameters": hyper, "workdir": str(work),
    }
    print(f"held-out exact match {before:.1%} -> {after:.1%} ({after - before:+.1%}) in {train_s / 60:.1f} min "
          f"of `grpo train` ({len(history)} steps)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
