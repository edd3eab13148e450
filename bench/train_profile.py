"""Where our training phase's time goes, per kind of work, on the GRPO step benchmark's cases.

    PYTHONPATH=. .venv/bin/python bench/train_profile.py                          # the four 32k full cases
    PYTHONPATH=. .venv/bin/python bench/train_profile.py --case "qwen2 32k lora" --case small --steps 4

Runs our trainer on a case of `bench/grpo_step.py` (same model, data, reward and knobs, 2 torch threads) and
profiles, with torch.profiler, what the bench calls the training phase of every step after the first: the
reference forward and the policy's forward, backward and optimiser update. Each operator's own time (wall
time on its thread, children excluded) goes to one category:

    LM head matmuls        the head's matmuls (forward, the input and weight gradients, a recompute)
    LM head softmax        the rest of the head: max, exp, sums, gather, the gradient made in place
    layer matmuls          every other matmul (projections, MLP, LoRA)
    attention              scaled_dot_product_attention, forward and backward
    optimiser              fused AdamW, the gradient norm and clip, zero_grad
    other                  element-wise work, norms, RoPE, copies, indexing, the loss

Categories are by operator name and by the autograd function an operator runs under (`_HeadLogprobs`), so
they need no marks in the engine. The reference runs on a second thread beside the policy's forward when the
machine has two cores (see worker/grpo/concurrency.py): its time is listed apart (`reference forward`) and
overlaps the rest. Matmul FLOP/s are torch's own FLOP counts over the matmuls' time, against the same dense
float32 matmul peak as the step benchmark (timed here, best of several).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the step benchmark's children (see its --omp-wait-policy)

from common import PROMPTS_PER_STEP, TORCH_THREADS, write_prompts  # noqa: E402
from flops import matmul_peak_flops  # noqa: E402
from grpo_step import Case, model_for, ours_config, ours_reward  # noqa: E402
from models import default_cache_dir  # noqa: E402

DEFAULT_CASES = ("llama 32k full", "qwen2 32k full", "qwen3 32k full", "mistral 32k full")
CATEGORIES = (
    "LM head matmuls",
    "LM head softmax",
    "layer matmuls",
    "attention",
    "optimiser",
    "other",
    "reference forward",
)
MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")
OPTIMISER = ("_fused_adamw", "linalg_vector_norm", "_foreach_norm", "clip_grad", "zero_grad", "_foreach_mul")


def category(name: str, ancestors: list[str]) -> str:
    """The category of an operator given the names of the events it runs under (outermost first)."""
    if "reference_logps" in ancestors:
        return "reference forward"
    in_head = any(a.startswith("_HeadLogprobs") for a in ancestors)
    if name in MATMULS:
        return "LM head matmuls" if in_head else "layer matmuls"
    if in_head:
        return "LM head softmax"
    if "scaled_dot_product" in name or any("scaled_dot_product" in a for a in ancestors):
        return "attention"
    if any(key in name for key in OPTIMISER) or "optimizer_update" in ancestors:
        return "optimiser"
    return "other"


def profile_case(case: Case, steps: int, work: Path) -> dict[str, Any]:
    """Seconds per step by category, matmul FLOPs by category, and the training phase's wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from worker.grpo.data import load_jsonl
    from worker.grpo.trainer import GRPOTrainer

    torch.set_num_threads(TORCH_THREADS)
    model_dir = model_for(case, work, default_cache_dir())
    data = write_prompts(work / "prompts.jsonl", max(64, PROMPTS_PER_STEP * steps))
    seconds: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    train_wall: list[float] = []
    reference_wall: list[float] = []

    class ProfiledTrainer(GRPOTrainer):
        """Labels generation, the reference forward and the optimiser update, and profiles each step
        after the first."""

        def _generate(self, *args: Any) -> Any:
            with record_function("generate"):
                return super()._generate(*args)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            reference_logps = self.backend.reference_logps

            def timed_reference(rollout: Any) -> Any:
                # Often on the side thread, which the profiler does not follow: timed as a whole.
                started = time.perf_counter()
                with record_function("reference_logps"):
                    logps = reference_logps(rollout)
                if self.step > 0:
                    reference_wall.append(time.perf_counter() - started)
                return logps

            self.backend.reference_logps = timed_reference  # type: ignore[method-assign]

        def _optimizer_update(self) -> float:
            with record_function("optimizer_update"):
                return super()._optimizer_update()

        def _run_step(self, *args: Any) -> None:
            if self.step == 0:  # warm-up step, not profiled
                return super()._run_step(*args)
            with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof, warnings.catch_warnings():
                # The compiled decode step's ops pass no Python arguments the FLOP counter could read; generation
                # is not in the training phase's figures anyway.
                warnings.filterwarnings("ignore", message="Failed to save extra arguments for flops computation")
                super()._run_step(*args)
            _collect(prof, seconds, flops)
            return None

    def on_metrics(step: int, metrics: dict[str, float], _: list[dict[str, object]]) -> None:
        if step > 1:
            train_wall.append(metrics["time/step_s"] - metrics["time/generate_s"])

    ProfiledTrainer(
        ours_config(case, steps),
        base_model=str(model_dir),
        train_rows=load_jsonl(data),
        reward=ours_reward(),
        output_dir=work / "ours-out",
        on_metrics=on_metrics,
        device="cpu",
    ).train()
    profiled = steps - 1
    seconds["reference forward"] = sum(reference_wall)  # wall time (ops on the side thread are not profiled)
    return {
        "seconds": {k: v / profiled for k, v in seconds.items()},
        "flops": {k: v / profiled for k, v in flops.items()},
        "train_s": statistics.median(train_wall),
    }


def _collect(prof: Any, seconds: dict[str, float], flops: dict[str, float]) -> None:
    """Adds each training-phase operator's own time (and matmul FLOPs) to its category; generation
    (labelled `generate`) is left out."""
    events = prof.events()
    for event in events:
        if event.device_type.name != "CPU" or not event.name.startswith("aten::"):
            continue
        ancestors: list[str] = []
        parent = event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        ancestors.reverse()
        if "generate" in ancestors:
            continue
        name = category(event.name, ancestors)
        seconds[name] += event.self_cpu_time_total / 1e6
        if name == "other":
            seconds["other: " + event.name] += event.self_cpu_time_total / 1e6
        if event.name in MATMULS and event.flops:
            flops[name] += event.flops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help=f"a case of grpo_step.py (default: {', '.join(DEFAULT_CASES)})")
    parser.add_argument("--steps", type=int, default=4, help="optimiser steps per case, step 1 not profiled (4)")
    parser.add_argument("--top-other", type=int, default=0, help="also list the N operators that take most of 'other'")
    args = parser.parse_args(argv)
    cases = [Case.parse(name) for name in (args.case or DEFAULT_CASES)]
    peak = matmul_peak_flops(threads=TORCH_THREADS)
    print(f"dense float32 matmul peak: {peak / 1e9:.0f} GFLOP/s on {TORCH_THREADS} threads")
    header = ["case", "train s", *CATEGORIES, "head mm/peak", "layer mm/peak"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory(prefix="train-profile-") as tmp:
        for case in cases:
            result = profile_case(case, args.steps, Path(tmp) / case.slug)
            secs, fl = result["seconds"], result["flops"]
            total = sum(secs.get(c, 0.0) for c in CATEGORIES if c != "reference forward")
            cells = [f"{secs.get(c, 0.0) * 1e3:.0f} ms ({secs.get(c, 0.0) / total:.0%})" for c in CATEGORIES[:-1]]
            cells.append(f"{secs.get('reference forward', 0.0) * 1e3:.0f} ms")
            shares = [
                f"{fl.get(c, 0.0) / max(secs.get(c, 0.0), 1e-9) / peak:.2f}" for c in ("LM head matmuls", "layer matmuls")
            ]
            print("| " + " | ".join([case.name, f"{result['train_s']:.3f}", *cells, *shares]) + " |", flush=True)
            if args.top_other:
                other = sorted(((k[7:], v) for k, v in secs.items() if k.startswith("other: ")), key=lambda kv: -kv[1])
                print("  other: " + ", ".join(f"{name} {v * 1e3:.1f} ms" for name, v in other[: args.top_other]))


if __name__ == "__main__":
    main()
