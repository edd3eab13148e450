"""Multi-turn learning on a real model: held-out success of tool episodes before and after GRPO.

Runs examples/smollm2_tools as a user would: generates its data (make_data.py: "a*b=?" questions, two worked
examples in each prompt), then `grpo train --config job.yaml` in a child process, timed:
SmolLM2-135M-Instruct (real weights, LoRA) calls the calculator's `multiply`, reads the result and `submit`s it;
the calculator class (examples/environments/arithmetic.py, run in process) rewards 1 when the submitted answer is
the product. Held-out success is the trainer's own evaluation of a multi-turn job (worker.grpo.held_out): G sampled
episodes (temperature 1) per held-out question, at step 0 and at the last step; the success figure is the share of
episodes that succeed (`eval/reward/mean`), pass@G the share of questions with at least one (read from the run's
console lines `step N eval ...`).

    .venv/bin/python bench/multi_turn.py                        # the example as it is (figures: bench/README.md)
    .venv/bin/python bench/multi_turn.py --seed 1 --max-steps 4 # another seed, a quicker check

`builtin:smollm2-135m-instruct` is converted once into --model-cache (default: the test suite's,
~/.cache/grpo/models) before the clock starts. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "smollm2_tools"
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import example_job  # noqa: E402

make_data = example_job.load_make_data(EXAMPLE)


def prepare_job(work: Path, overrides: dict[str, Any]) -> Path:
    """The example's job.yaml and freshly generated data in `work`, with hyperparameter overrides."""
    return example_job.prepare_job(EXAMPLE, work, overrides, make_data.main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, help="override the example's max_steps (and eval_every)")
    parser.add_argument("--seed", type=int, help="override the example's seed (sampling, data order, LoRA init)")
    parser.add_argument("--workdir", type=Path, help="keep the data, checkpoints and log here (default: a temp dir)")
    parser.add_argument("--model-cache", type=Path, default=Path.home() / ".cache" / "grpo" / "models")
    args = parser.parse_args()

    from worker.grpo.checkpoint import latest_checkpoint, load_checkpoint
    from worker.grpo.pretrained import build_smollm2

    work = example_job.run_folder(args.workdir, "smollm2-tools-")
    config = prepare_job(work, example_job.run_overrides(args.seed, args.max_steps))
    base = build_smollm2(args.model_cache)

    started = time.perf_counter()
    with open(work / "train.log", "w", encoding="utf-8") as log:
        subprocess.run(
            [str(example_job.GRPO), "train", "--config", str(config), "--output-dir", str(work / "out")],
            stdout=log, stderr=subprocess.STDOUT, check=True, cwd=EXAMPLE,  # the environment class's module path
            env={**os.environ, "COLUMNS": "120", "PYTHONPATH": str(REPO),
                 "GRPO_MODEL_CACHE_DIR": str(base.parent)},  # the folder built above
        )
    train_s = time.perf_counter() - started
    checkpoint = latest_checkpoint(work / "out")
    assert checkpoint is not None
    history = [m for m in load_checkpoint(checkpoint).trainer_state["history"] if "reward/mean" in m]
    evals = evaluations((work / "train.log").read_text(encoding="utf-8"))
    hyper = yaml.safe_load(config.read_text(encoding="utf-8"))["hyperparameters"]
    pass_g = f"pass@{hyper['num_generations']}"
    (first_step, first), (last_step, last) = evals[0], evals[-1]
    result = {
        "before": first["reward/mean"], "after": last["reward/mean"], "eval_steps": [first_step, last_step],
        f"{pass_g}_before": first.get(pass_g), f"{pass_g}_after": last.get(pass_g),
        "train_s": train_s, "steps": len(history),
        "first3_reward": _mean([m["reward/mean"] for m in history[:3]]),
        "last3_reward": _mean([m["reward/mean"] for m in history[-3:]]),
        "hyperparameters": hyper, "workdir": str(work),
    }
    print(f"held-out success {result['before']:.1%} -> {result['after']:.1%} in {train_s / 60:.1f} min of "
          f"`grpo train` ({result['steps']} steps)")
    print(json.dumps(result))


def evaluations(log: str) -> list[tuple[int, dict[str, float]]]:
    """The held-out evaluations `grpo train` printed (`step N eval name value  name value ...`), in order."""
    found = []
    for match in re.finditer(r"^step (\d+) eval (.+)$", log, flags=re.MULTILINE):
        pairs = match.group(2).split()
        found.append((int(match.group(1)), {k: float(v) for k, v in zip(pairs[::2], pairs[1::2], strict=True)}))
    return found


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


if __name__ == "__main__":
    main()
