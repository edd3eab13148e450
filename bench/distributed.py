"""Step time of one GRPO job on 1 process vs 2 ranks (DDP, FSDP) on CPU, gloo, one thread per process.

    python bench/distributed.py [--model builtin:small] [--steps 6] [--rounds 3] [--json out.json]

Each case is `grpo train` (worker.grpo.local) in a child process: one process with one intra-op thread,
or two ranks launched by worker.grpo.launch (one thread each). Cases alternate round by round so that
a machine whose load changes affects them alike; a case's figure is the median over rounds of its
median step time (time/step_s, the first step left out: it warms caches up). On two cores two ranks
cannot be much faster than one process: the figures measure the overhead of the collectives, the
gathered metrics and (FSDP) the weight copy into the generation model. See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
CASES = {"1 process": (1, "auto"), "2 ranks ddp": (2, "ddp"), "2 ranks fsdp": (2, "fsdp")}


def spec(model: str, devices: int, parallelism: str, steps: int, lora: bool) -> dict[str, Any]:
    document: dict[str, Any] = {
        "base_model": model,
        "train_dataset": "train.jsonl",
        "resources": {"devices": devices},
        "rewards": [{"type": "builtin", "name": "regex_match", "params": {"pattern": "[aeiou]"}}],
        "hyperparameters": {
            "max_steps": steps, "num_generations": 8, "prompts_per_step": 4, "max_completion_length": 16,
            "learning_rate": 1e-4, "beta": 0.04, "seed": 0, "parallelism": parallelism,
            "checkpoint_every": 10_000, "save_total_limit": 1,
        },
    }
    if lora:
        document["lora"] = {"r": 8, "alpha": 16}
    return document


def run_case(root: Path, name: str, document: dict[str, Any]) -> list[float]:
    """Train in a child process; returns the step times after the first."""
    config = root / f"{name.replace(' ', '-')}.yaml"
    config.write_text(yaml.safe_dump(document))
    output = root / f"out-{config.stem}"
    code = (
        "import sys; from pathlib import Path; from worker.grpo.local import run_local; "
        f"sys.exit(run_local(Path({str(config)!r}), Path({str(output)!r})))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    checkpoint = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    history = torch.load(checkpoint / "trainer_state.pt", weights_only=True)["history"]
    subprocess.run(["rm", "-rf", str(output)], check=True)  # the next round starts fresh, not resuming
    return [float(m["time/step_s"]) for m in history[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    per_case: dict[str, list[float]] = {name: [] for name in CASES}
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        root = Path(tmp)
        (root / "train.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{w}: "}) + "\n" for w in ["cat", "dog", "sun", "map", "hat", "pen"])
        )
        for round_index in range(args.rounds):
            for name, (devices, parallelism) in CASES.items():
                times = run_case(root, name, spec(args.model, devices, parallelism, args.steps, args.lora))
                per_case[name].append(statistics.median(times))
                print(f"round {round_index + 1}: {name}: median step {per_case[name][-1]:.3f} s", flush=True)
    base = statistics.median(per_case["1 process"])
    print(f"\n{args.model}{' LoRA' if args.lora else ''}, 4 prompts x 8 completions x 16 tokens per step")
    print(f"{'case':<14} {'step s':>8} {'vs 1 process':>13}")
    figures = {}
    for name, values in per_case.items():
        step = statistics.median(values)
        figures[name] = {"step_s": step, "rounds": values}
        print(f"{name:<14} {step:8.3f} {step / base:12.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "lora": args.lora, "cases": figures}, indent=2))


if __name__ == "__main__":
    main()
