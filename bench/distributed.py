"""Step time of one GRPO job on 1 process vs 2 ranks (DDP, FSDP) on CPU, gloo, one thread per process; with
`--memory`, each rank's peak RSS under DDP and FSDP against one process's.

    python bench/distributed.py [--model builtin:small] [--steps 6] [--rounds 3] [--json out.json]
    python bench/distributed.py --memory [--lora] [--model builtin:smollm2-135m-instruct] [--steps 3] [--rounds 2]

Each case is `grpo train` (worker.grpo.local) in a child process: one process with one intra-op thread,
or two ranks launched by worker.grpo.launch (one thread each). Cases alternate round by round so that
a machine whose load changes affects them alike; a case's figure is the median over rounds of its
median step time (time/step_s, the first step left out: it warms caches up). On two cores two ranks
cannot be much faster than one process: the figures measure the overhead of the collectives, the
gathered metrics and FSDP's gathers of each layer's weights. See bench/README.md.

`--memory`: full fine-tuning (or with `--lora`, LoRA r 16 on every linear layer of the decoder) in fp32 with
AdamW and beta 0 (no reference model), as one process, as 2 DDP ranks and as 2 FSDP ranks, each process wrapped
by bench/peak_rss.py, which records its own peak RSS (the high-water mark of the whole run: loading, every step,
the final checkpoint). Cases alternate round by round; a figure is the median over rounds. Printed beside: the
weights W (from the saved checkpoint, fp32), the trainable part T (W, or the adapters), and the theoretical
weights + gradients + AdamW state per rank: W - T + 4T (G = T, O = 2T) on one process and under DDP, divided by
N under FSDP.
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
MEMORY_CASES = {"1 process": (1, "auto"), "2 ranks ddp": (2, "ddp"), "2 ranks fsdp": (2, "fsdp")}
MIB = 1024 * 1024


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


def memory_spec(model: str, devices: int, parallelism: str, steps: int, lora: bool) -> dict[str, Any]:
    """fp32, AdamW, beta 0: the weights, their gradients and AdamW's state dominate memory."""
    document: dict[str, Any] = {
        "base_model": model,
        "train_dataset": "train.jsonl",
        "resources": {"devices": devices},
        "rewards": [{"type": "builtin", "name": "regex_match", "params": {"pattern": "[aeiou]"}}],
        "hyperparameters": {
            "max_steps": steps, "num_generations": 4, "prompts_per_step": 2, "max_completion_length": 8,
            "learning_rate": 1e-5, "beta": 0.0, "seed": 0, "dtype": "float32",
            "parallelism": parallelism, "checkpoint_every": 10_000, "save_total_limit": 1,
        },
    }
    if lora:
        document["lora"] = {"r": 16, "alpha": 32}
    return document


def run_memory_case(root: Path, name: str, document: dict[str, Any]) -> tuple[list[float], float, int, int]:
    """Train in child processes wrapped by bench/peak_rss.py; returns every rank's peak RSS (MiB, by rank), the
    median step time after the first, and the saved model's and adapter's parameter counts."""
    from safetensors import safe_open

    from worker.grpo.launch import launch_command
    from worker.grpo.local import RANK_MODULE

    config = root / f"mem-{name.replace(' ', '-')}.yaml"
    config.write_text(yaml.safe_dump(document))
    output, results = root / f"out-{config.stem}", root / f"rss-{config.stem}"
    results.mkdir()
    devices = document["resources"]["devices"]
    inner = [RANK_MODULE, str(config), str(output)]
    command = (
        [sys.executable, "-m", "bench.peak_rss", str(results), *inner]
        if devices == 1
        else launch_command("bench.peak_rss", [str(results), *inner], nproc_per_node=devices, run_id="0" * 32)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    peaks = [json.loads((results / f"rank-{r}.json").read_text())["peak_rss_mib"] for r in range(devices)]
    checkpoint = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    history = torch.load(checkpoint / "trainer_state.pt", weights_only=True)["history"]
    counts = {"model": 0, "adapter": 0}
    # One file, or fsdp's shards (one per decoder layer); with LoRA the merged model and the adapter.
    for pattern, kind in (("model*.safetensors", "model"), ("merged/model*.safetensors", "model"),
                          ("adapter_model.safetensors", "adapter")):
        for file in checkpoint.glob(pattern):
            with safe_open(str(file), "pt") as weights:
                counts[kind] += sum(_numel(weights.get_slice(key).get_shape()) for key in weights.keys())
    subprocess.run(["rm", "-rf", str(output), str(results)], check=True)  # the next round starts fresh
    return peaks, statistics.median(float(m["time/step_s"]) for m in history[1:]), counts["model"], counts["adapter"]


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def memory(args: argparse.Namespace) -> None:
    peaks: dict[str, list[list[float]]] = {name: [] for name in MEMORY_CASES}
    steps: dict[str, list[float]] = {name: [] for name in MEMORY_CASES}
    numel = adapter = 0
    with tempfile.TemporaryDirectory(prefix="bench-dist-mem-") as tmp:
        root = Path(tmp)
        (root / "train.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{w}: "}) + "\n" for w in ["cat", "dog", "sun", "map", "hat", "pen"])
        )
        for round_index in range(args.rounds):
            # Alternate which case runs first, so that drift in the machine's load hits both alike.
            order = list(MEMORY_CASES) if round_index % 2 == 0 else list(reversed(MEMORY_CASES))
            for name in order:
                devices, parallelism = MEMORY_CASES[name]
                document = memory_spec(args.model, devices, parallelism, args.steps, args.lora)
                case_peaks, step, numel, adapter = run_memory_case(root, name, document)
                peaks[name].append(case_peaks)
                steps[name].append(step)
                print(f"round {round_index + 1}: {name}: peak RSS {', '.join(f'{p:.0f}' for p in case_peaks)} MiB, "
                      f"median step {step:.2f} s", flush=True)
    weights_mib = numel * 4 / MIB  # fp32
    trainable_mib = adapter * 4 / MIB if args.lora else weights_mib
    base = statistics.median(p[0] for p in peaks["1 process"])
    base_step = statistics.median(steps["1 process"])
    kind = "LoRA r 16" if args.lora else "full fine-tuning"
    print(f"\n{args.model}, {kind}, fp32, AdamW, beta 0; W = {numel:,} parameters = {weights_mib:.0f} MiB, "
          f"T = {trainable_mib:.0f} MiB")
    print(f"{'case':<14} {'rank':>4} {'peak RSS MiB':>13} {'vs 1 process':>13} {'W-T+4T (/N) MiB':>16} {'step s':>8} {'vs 1':>6}")
    figures: dict[str, Any] = {}
    for name, (devices, parallelism) in MEMORY_CASES.items():
        step = statistics.median(steps[name])
        theory = (weights_mib + 3 * trainable_mib) / (devices if parallelism == "fsdp" else 1)
        figures[name] = {"step_s": step, "theory_mib": theory, "ranks": []}
        for rank in range(devices):
            peak = statistics.median(p[rank] for p in peaks[name])
            figures[name]["ranks"].append({"peak_rss_mib": peak, "rounds": [p[rank] for p in peaks[name]]})
            print(f"{name:<14} {rank:>4} {peak:13.0f} {peak / base:12.2f}x {theory:16.0f} {step:8.2f} {step / base_step:5.2f}x")
    if args.json:
        summary = {"model": args.model, "lora": args.lora, "weights_mib": weights_mib, "trainable_mib": trainable_mib}
        args.json.write_text(json.dumps({**summary, "cases": figures}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--memory", action="store_true", help="peak RSS per rank, 1 process vs 2 DDP / FSDP ranks")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.memory:
        args.model, args.steps = args.model or "builtin:smollm2-135m-instruct", args.steps or 3
        args.rounds = args.rounds or 2
        memory(args)
        return
    args.model, args.steps, args.rounds = args.model or "builtin:small", args.steps or 6, args.rounds or 3
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
