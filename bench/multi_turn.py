"""Multi-turn learning benchmark: held-out success of two-turn tool episodes before and after GRPO.

The task (worker.grpo.tool_tasks): "a*b=?", which the tiny model cannot compute; an episode succeeds when the
policy calls `multiply` with the question's numbers, reads the result and `submit`s it (the calculator's
`get_reward`, examples/environments/arithmetic.py, run in process as `grpo train` runs a local class). The
model starts from `builtin:tiny-tools` (or a warm model of another recipe: `--warm-steps`), trains with the job
engine's multi-turn rollouts for `--steps` steps, and is measured on the held-out third of the questions, which
neither its supervised warm-up nor RL saw: each question sampled `--samples` times at temperature 1, success =
mean environment reward.

    PYTHONPATH=. python bench/multi_turn.py                    # 3 seeds, 40 steps
    PYTHONPATH=. python bench/multi_turn.py --seeds 0 --steps 10

Each seed runs in its own child process (one torch thread).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS = 40
SEEDS = (0, 1, 2)
SAMPLES = 4


def _episodes_success(models: Any, config: Any, rows: list[Any], samples: int, seed: int) -> float:
    """Mean environment reward of `samples` sampled episodes per held-out row."""
    from examples.environments.arithmetic import Arithmetic
    from worker.grpo.environment import LocalEnvironment, MultiTurnSettings
    from worker.grpo.multi_turn import MultiTurnRollout
    from worker.grpo.rollout import eos_token_ids, sample_continuations

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, loop)

    measure = config.model_copy(update={"num_generations": samples})
    environment = LocalEnvironment(Arithmetic, settings=MultiTurnSettings(max_turns=3))
    engine = MultiTurnRollout(
        models.tokenizer, measure, environment,
        lambda s, b, seeds: sample_continuations(models.policy, models.tokenizer, s, b, seeds, measure), run,
        eos_token_ids(models.policy, models.tokenizer),
    )
    try:
        rollout, _ = engine.generate(rows, [seed * 100_003 + i for i in range(len(rows))])
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert rollout.episodes is not None
    return statistics.fmean(e["reward"] or 0.0 for e in rollout.episodes)


def child(seed: int, steps: int, samples: int, warm_steps: int | None) -> dict[str, float]:
    """One seed: warm model, success before, GRPO steps, success after."""
    import torch

    from contract.config import GRPOConfig
    from examples.environments.arithmetic import Arithmetic
    from worker.grpo.data import PromptRow
    from worker.grpo.environment import LocalEnvironment, MultiTurnSettings
    from worker.grpo.rewards import CompositeReward, EnvironmentReward
    from worker.grpo.tool_tasks import split
    from worker.grpo.trainer import GRPOTrainer
    from worker.grpo.warm_tools import TOOLS_RECIPE, build_tools_model

    torch.set_num_threads(1)
    cache = Path.home() / ".cache" / "grpo" / "models"
    recipe = TOOLS_RECIPE if warm_steps is None else replace(TOOLS_RECIPE, steps=warm_steps)
    model_dir = build_tools_model(cache, recipe)
    train, held_out = split()
    to_row = lambda item: PromptRow(item.row()["prompt"], {"question": item.question, "answer": item.answer})  # noqa: E731
    config = GRPOConfig(
        num_generations=8, prompts_per_step=8, max_steps=max(steps, 1), learning_rate=1e-3, lr_scheduler="constant",
        beta=0.0, loss_type="dapo", max_completion_length=160, temperature=1.0, checkpoint_every=10_000,
        log_completions_every=10_000, seed=seed,
    )
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(
            config, base_model=str(model_dir), train_rows=[to_row(i) for i in train],
            reward=CompositeReward([(EnvironmentReward(), 1.0)]), output_dir=Path(out),
            environment=LocalEnvironment(Arithmetic, settings=MultiTurnSettings(max_turns=3)),
        )
        held = [to_row(i) for i in held_out]
        before = _episodes_success(trainer.models, config, held, samples, seed)
        started = time.perf_counter()
        result = trainer.train() if steps else None
        seconds = time.perf_counter() - started
        after = _episodes_success(trainer.models, config, held, samples, seed)
    history = result.history if result is not None else []
    return {
        "seed": seed, "before": before, "after": after, "seconds": seconds,
        "train_reward_first": history[0]["reward/mean"] if history else float("nan"),
        "train_reward_last": history[-1]["reward/mean"] if history else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--warm-steps", type=int, default=None, help="Another warm recipe's step count.")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.seeds[0], args.steps, args.samples, args.warm_steps)))
        return
    rows = []
    for seed in args.seeds:
        command = [sys.executable, __file__, "--child", "--seeds", str(seed), "--steps", str(args.steps),
                   "--samples", str(args.samples)]
        if args.warm_steps is not None:
            command += ["--warm-steps", str(args.warm_steps)]
        done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO,
                              env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    print(f"\nheld-out success ({len(args.seeds)} seeds, {args.steps} steps, {args.samples} samples per question):")
    print(f"  before {statistics.fmean(r['before'] for r in rows):.1%}  after {statistics.fmean(r['after'] for r in rows):.1%}")
    print(f"  train reward first step {statistics.fmean(r['train_reward_first'] for r in rows):.2f}, "
          f"last {statistics.fmean(r['train_reward_last'] for r in rows):.2f}; "
          f"{statistics.fmean(r['seconds'] for r in rows):.0f} s per run")


if __name__ == "__main__":
    main()
