"""Asynchronous vs synchronous GRPO on `builtin:small` with a slow remote reward endpoint, same run.

The endpoint (the user helper's app under uvicorn, its own process, on loopback) sleeps --latency-ms per request
and scores the share of the letter "a" in each completion. Each step generates 32 completions (4 prompts x 8),
scored in batches of 8 (4 requests, --concurrency in flight). Ours runs synchronously (async_generation off) and
asynchronously (async_generation on, max_staleness --staleness), the same --steps and seeds, in alternating child
processes (sync seed 0, async seed 0, sync seed 1, ...). Each child reports steps per second from the end of
step 1 to the end of the last (step 1's compilation and warm-up left out) and the mean reward of the last
--tail steps (rewards of the batches trained, which an asynchronous run sampled with older weights) and the final
policy's reward on fresh samples (8 per prompt, fixed seeds); the table gives the ratio async / sync per seed and
the rewards side by side.

TRL's AsyncGRPOTrainer is not run: it needs a vLLM server process with NCCL weight transfer (TRL's docs:
separate GPUs for the server and the trainer), which has no CPU path here.

    .venv/bin/python bench/async_grpo.py                          # 3 seeds, 12 steps, 16 tokens, 300 ms, staleness 2
    .venv/bin/python bench/async_grpo.py --completion-length 32  # more compute per step: less to overlap
    .venv/bin/python bench/async_grpo.py --seeds 0 --correction sequence_truncate  # per-sequence correction
    .venv/bin/python bench/async_grpo.py --seeds 0 --steps 6      # smoke run
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# Per-step figures averaged over steps 2.. (the table's last lines): where each mode's step time goes.
PHASES = ("time/generate_s", "time/reward_s", "time/train_s", "time/step_s", "time/weight_sync_s",
          "async/trainer_busy", "async/producer_busy", "async/staleness_mean")


def child(args: argparse.Namespace) -> None:
    """One run; prints one JSON line."""
    import torch

    from contract.config import GRPOConfig
    from outbound.rewards import RemoteRewardConfig, RemoteRewardSource
    from worker.grpo.data import PromptRow
    from worker.grpo.rewards import CompositeReward
    from worker.grpo.trainer import GRPOTrainer

    torch.set_num_threads(2)
    source = RemoteRewardSource(RemoteRewardConfig(
        reward_function_id="letters", url=args.url, secret=args.secret, job_id="bench", max_batch_size=8,
        max_concurrency=args.concurrency, allow_private=True, cache_max_entries=0,
    ))
    config = GRPOConfig.model_validate({
        "num_generations": 8, "prompts_per_step": 4, "max_steps": args.steps, "learning_rate": 2e-3,
        "lr_scheduler": "constant", "max_completion_length": args.completion_length, "checkpoint_every": 10_000,
        "seed": args.seed, "async_generation": args.mode == "async", "max_staleness": args.staleness,
        "sync_check_every": None,
        **({"vllm_importance_sampling_mode": args.correction} if args.correction else {}),
    })
    rows = [PromptRow(f"{word}: ", {}) for word in ("cat", "dog", "sun", "map", "hat", "pen", "cup", "box")]
    ends: list[float] = []
    rewards: list[float] = []
    phases: dict[str, list[float]] = {}

    def on_metrics(step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
        ends.append(time.perf_counter())
        rewards.append(metrics["reward/mean"])
        for name in PHASES:
            if name in metrics and step > 1:
                phases.setdefault(name, []).append(metrics[name])

    with tempfile.TemporaryDirectory() as work:
        trainer = GRPOTrainer(
            config, base_model="builtin:small", train_rows=rows, reward=CompositeReward([(source, 1.0)]),
            output_dir=Path(work) / "run", model_cache_dir=Path(args.cache_dir), on_metrics=on_metrics,
        )
        trainer.train()
        final = final_policy_reward(trainer, rows)
    steps_per_s = (len(ends) - 1) / (ends[-1] - ends[0])
    tail = rewards[-args.tail:]
    print(json.dumps({"mode": args.mode, "seed": args.seed, "steps_per_s": steps_per_s,
                      "tail_reward": sum(tail) / len(tail), "final_reward": final, "rewards": rewards,
                      "phases": {name: sum(v) / len(v) for name, v in phases.items()}}))


def final_policy_reward(trainer: Any, rows: list[Any]) -> float:
    """The trained policy's reward on fresh samples: 8 completions of each prompt, seeds fixed across runs, scored
    as the endpoint scores (the training rewards of an asynchronous run are those of older weights)."""
    from bench.reward_fanout import SCORES
    from worker.grpo.rollout import generate_rollout, render_prompt

    prompts = [render_prompt(trainer.models.tokenizer, row.prompt) for row in rows]
    rollout = generate_rollout(
        trainer.models.policy, trainer.models.tokenizer, prompts, trainer.config,
        generator_seed=[10_000 + i for i in range(len(prompts))], fast=trainer.models.fast,
    )
    scores = [SCORES["share_of_a"](text) for text in rollout.completion_texts]
    return sum(scores) / len(scores)


def run_child(args: argparse.Namespace, mode: str, seed: int, url: str, secret: str) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--child", "--mode", mode, "--seed", str(seed), "--url", url, "--secret", secret,
        "--steps", str(args.steps), "--staleness", str(args.staleness), "--concurrency", str(args.concurrency),
        "--completion-length", str(args.completion_length), "--tail", str(args.tail), "--cache-dir", args.cache_dir,
        *(["--correction", args.correction] if args.correction else []),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=300.0)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (max_concurrency)")
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--tail", type=int, default=4, help="final reward: mean of the last N steps")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "grpo-bench-async"))
    parser.add_argument("--correction", choices=["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
                        help="vllm_importance_sampling_mode of both runs (default: each mode's own default)")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--mode", choices=["sync", "async"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url")
    parser.add_argument("--secret")
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from bench.reward_fanout import start_server

    secret = "whsec_" + base64.b64encode(os.urandom(24)).decode()
    server, port = start_server(secret, latency_s=args.latency_ms / 1000, score="share_of_a")
    url = f"http://127.0.0.1:{port}/score"
    results: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    try:
        for seed in (int(s) for s in args.seeds.split(",")):
            for mode in ("sync", "async"):  # alternating children
                results[mode].append(run_child(args, mode, seed, url, secret))
                print(f"  {mode:5s} seed {seed}: {results[mode][-1]['steps_per_s']:.3f} steps/s, "
                      f"final reward {results[mode][-1]['final_reward']:.3f}", flush=True)
    finally:
        server.terminate()
        server.join()
    print(f"\nbuiltin:small, 32 completions/step ({args.completion_length} tokens max), reward endpoint "
          f"{args.latency_ms:.0f} ms/request, batches of 8, max_concurrency {args.concurrency}, "
          f"max_staleness {args.staleness}, {args.steps} steps")
    print(f"{'seed':>4} | {'sync steps/s':>12} | {'async steps/s':>13} | {'ratio':>5} | "
          f"{'sync final reward':>17} | {'async final reward':>18} | {'sync last steps':>15} | "
          f"{'async last steps':>16}")
    ratios = []
    for ours, theirs in zip(results["async"], results["sync"], strict=True):
        ratio = ours["steps_per_s"] / theirs["steps_per_s"]
        ratios.append(ratio)
        print(f"{ours['seed']:>4} | {theirs['steps_per_s']:12.3f} | {ours['steps_per_s']:13.3f} | {ratio:5.2f} | "
              f"{theirs['final_reward']:17.3f} | {ours['final_reward']:18.3f} | {theirs['tail_reward']:15.3f} | "
              f"{ours['tail_reward']:16.3f}")
    sync_final = [r["final_reward"] for r in results["sync"]]
    async_final = [r["final_reward"] for r in results["async"]]
    spread = statistics.stdev(sync_final) if len(sync_final) > 1 else float("nan")
    for mode in ("sync", "async"):
        means = {name: statistics.mean(r["phases"][name] for r in results[mode]) for name in results[mode][0]["phases"]}
        print(f"{mode:5s} per step: " + ", ".join(f"{name} {value:.3f}" for name, value in means.items()))
    print(f"async / sync steps per second: mean {statistics.mean(ratios):.2f}x (min {min(ratios):.2f}x); "
          f"final reward sync {statistics.mean(sync_final):.3f} (sd over seeds {spread:.3f}), "
          f"async {statistics.mean(async_final):.3f}")


if __name__ == "__main__":
    main()
