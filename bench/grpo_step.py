"""GRPO step benchmark: our engine against TRL's GRPOTrainer on the same model, data, reward and knobs.

    .venv/bin/python bench/grpo_step.py --presets tiny,small --steps 8 --reps 2

Needs the `bench` extra (trl). Each (framework, preset, repetition) runs in its own child process so
peak RSS is that framework's alone (read from the child's rusage by `os.wait4`); the two frameworks
alternate (A B B A ...) because these shared machines drift 15-30 % in speed over minutes.

Workload (issue 2, acceptance 8): 4 prompts x 8 completions per optimiser step, 32 new tokens,
beta 0.04, epsilon 0.2, loss dapo, constant lr 1e-5, fp32, 2 torch threads, no gradient
checkpointing, no saving. Step 1 is excluded from the figures (warm-up).

Also measures our reward phase alone: a remote-like source that sleeps 100 ms per call (async),
32 completions sent in batches of 8, through `CompositeReward` (target <= 150 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from common import (
    BETA,
    COMPLETIONS_PER_STEP,
    EPSILON,
    LEARNING_RATE,
    LOSS_TYPE,
    MAX_COMPLETION_LENGTH,
    MAX_GRAD_NORM,
    NUM_GENERATIONS,
    PROMPTS_PER_STEP,
    SEED,
    TEMPERATURE,
    TORCH_THREADS,
    RunRecord,
    Summary,
    digit_reward,
    read_prompts,
    summarise,
    write_prompts,
)

FRAMEWORKS = ("trl", "ours")
PRESETS = ("tiny", "small", "medium")
# Step-time ratio ours/TRL we aim for, per preset (issue 2).
TARGET_RATIO = {"tiny": 0.5, "small": 0.5, "medium": 0.9}


# ==================================================================================================
# Child processes: one framework, one preset, N steps
# ==================================================================================================


def _limit_threads() -> None:
    import torch

    torch.set_num_threads(TORCH_THREADS)


def run_trl(model_dir: Path, data: Path, steps: int, record: RunRecord, work: Path) -> None:
    """TRL's GRPOTrainer with every default that differs from our workload overridden."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = read_prompts(data)

    def reward_digit(completions: list[str], answer: list[str], **_: object) -> list[float | None]:
        return [digit_reward(c, a) for c, a in zip(completions, answer, strict=True)]

    class StepClock(TrainerCallback):  # type: ignore[misc]
        """Times whole optimiser steps (generation + reference + loss + optimiser) and counts tokens."""

        def on_step_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
            self.started, self.cpu_started = time.perf_counter(), time.process_time()

        def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
            record.step_s.append(time.perf_counter() - self.started)
            record.cpu_s.append(time.process_time() - self.cpu_started)

        def on_log(
            self,
            args: object,
            state: object,
            control: object,
            logs: dict[str, float] | None = None,
            **_: object,
        ) -> None:
            if logs and "completions/mean_length" in logs:  # logging_steps=1: one log per step
                record.completion_tokens.append(logs["completions/mean_length"] * COMPLETIONS_PER_STEP)

    started = time.perf_counter()
    config = GRPOConfig(
        output_dir=str(work / "trl-out"),
        per_device_train_batch_size=COMPLETIONS_PER_STEP,  # counts completions: 4 prompts x 8
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_GRAD_NORM,
        beta=BETA,
        epsilon=EPSILON,
        loss_type=LOSS_TYPE,
        max_steps=steps,
        bf16=False,  # TRL turns bf16 on by default, even on CPU
        gradient_checkpointing=False,  # TRL's default is True
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=SEED,
    )
    trainer = GRPOTrainer(
        model=str(model_dir),  # loaded by TRL in float32, as is its reference copy
        reward_funcs=reward_digit,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[StepClock()],
    )
    record.setup_s = time.perf_counter() - started
    trainer.train()


def run_ours(model_dir: Path, data: Path, steps: int, record: RunRecord, work: Path) -> None:
    """Our GRPOTrainer with the same workload, timed from outside (between metric callbacks)."""
    from worker.grpo.config import GRPOConfig
    from worker.grpo.data import load_jsonl
    from worker.grpo.reward_types import RewardInput
    from worker.grpo.rewards import CompositeReward, FunctionSource
    from worker.grpo.trainer import GRPOTrainer

    def score(item: RewardInput) -> float:
        return digit_reward(item.completion, str(item.extras["answer"]))

    config = GRPOConfig(
        num_generations=NUM_GENERATIONS,
        prompts_per_step=PROMPTS_PER_STEP,
        max_steps=steps,
        max_completion_length=MAX_COMPLETION_LENGTH,
        max_prompt_length=None,  # TRL no longer truncates prompts
        temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE,
        lr_scheduler="constant",
        max_grad_norm=MAX_GRAD_NORM,
        beta=BETA,
        epsilon=EPSILON,
        loss_type=LOSS_TYPE,
        advantage_std="unbiased",  # TRL's definition (no effect on speed, keeps the runs comparable)
        dtype="float32",
        gradient_checkpointing=False,
        checkpoint_every=steps + 1,  # no periodic saving (train() still saves once after the last step)
        log_completions_every=steps + 1,
        seed=SEED,
    )
    clock = [0.0, 0.0]  # wall, CPU at the end of the previous step

    def on_metrics(step: int, metrics: dict[str, float], samples: list[dict[str, object]]) -> None:
        now, cpu_now = time.perf_counter(), time.process_time()
        record.step_s.append(now - clock[0])
        record.cpu_s.append(cpu_now - clock[1])
        record.completion_tokens.append(metrics["completion_length/mean"] * COMPLETIONS_PER_STEP)
        clock[:] = [now, cpu_now]

    started = time.perf_counter()
    trainer = GRPOTrainer(
        config,
        base_model=str(model_dir),
        train_rows=load_jsonl(data),
        reward=CompositeReward([(FunctionSource("reward_digit", score), 1.0)]),
        output_dir=work / "ours-out",
        on_metrics=on_metrics,
        device="cpu",
    )
    record.setup_s = time.perf_counter() - started
    clock[:] = [time.perf_counter(), time.process_time()]
    trainer.train()


def child_main(args: argparse.Namespace) -> None:
    _limit_threads()
    # Our trainer raises glibc's malloc thresholds for its process (worker.grpo.allocator); TRL's process gets
    # the same setting, so that the comparison is between the engines, not the allocator configuration.
    from worker.grpo.allocator import keep_freed_memory

    keep_freed_memory()
    record = RunRecord(framework=args.child, preset=args.preset)
    runner = run_trl if args.child == "trl" else run_ours
    runner(Path(args.model_dir), Path(args.data), args.steps, record, Path(args.work))
    if not len(record.step_s) == len(record.cpu_s) == len(record.completion_tokens) == args.steps:
        raise RuntimeError(
            f"{args.child}: recorded {len(record.step_s)} step times and {len(record.completion_tokens)} "
            f"token counts for {args.steps} steps"
        )
    record.save(Path(args.record))


# ==================================================================================================
# Parent: build models, alternate children, summarise
# ==================================================================================================


def spawn(
    framework: str, preset: str, model_dir: Path, data: Path, steps: int, work: Path, omp_wait_policy: str
) -> RunRecord:
    """Run one child to completion; its peak RSS comes from its own rusage (not the other children's)."""
    record_path = work / f"{framework}-{preset}.json"
    env = os.environ | {"OMP_NUM_THREADS": str(TORCH_THREADS), "MKL_NUM_THREADS": str(TORCH_THREADS)}
    if omp_wait_policy != "inherit":
        # Same for both frameworks. On an oversubscribed machine OpenMP's default spin-waiting burns
        # 5-20x the CPU of the actual work (measured here: 2-thread generate 3.6 s CPU vs 0.35 s passive).
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    env |= {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    command = [
        sys.executable,
        __file__,
        "--child",
        framework,
        "--preset",
        preset,
        "--model-dir",
        str(model_dir),
    ]
    command += ["--data", str(data), "--steps", str(steps), "--work", str(work), "--record", str(record_path)]
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = child.stdout.read() if child.stdout else ""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{framework} on {preset} failed (exit {child.returncode}):\n{output[-4000:]}")
    record = RunRecord.load(record_path)
    record.peak_rss_mib = usage.ru_maxrss / 1024  # Linux reports KiB
    return record


def bench_preset(
    preset: str, steps: int, reps: int, work: Path, omp_wait_policy: str, log: list[str]
) -> dict[str, Summary]:
    from worker.grpo.tiny import build_tiny_model

    model_dir = build_tiny_model(preset, work / "models" / preset)  # type: ignore[arg-type]
    data = write_prompts(work / "prompts.jsonl", max(64, PROMPTS_PER_STEP * steps))
    records: dict[str, list[RunRecord]] = {fw: [] for fw in FRAMEWORKS}
    for rep in range(reps):
        order = FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]  # A B, B A, ...: drift hits both alike
        for framework in order:
            record = spawn(framework, preset, model_dir, data, steps, work, omp_wait_policy)
            records[framework].append(record)
            median = statistics.median(record.step_s[1:]) if len(record.step_s) > 1 else float("nan")
            log.append(
                f"{preset} rep {rep + 1} {framework:4s}: median step {median:.3f} s, "
                f"rss {record.peak_rss_mib:.0f} MiB, setup {record.setup_s:.1f} s"
            )
            print(log[-1], flush=True)
    return {fw: summarise(recs) for fw, recs in records.items()}


# ==================================================================================================
# Reward phase: async source sleeping 100 ms per call, 32 completions in batches of 8
# ==================================================================================================


class SleepyBatchedSource:
    """Stands in for a remote endpoint: batches of `batch_size` items sent concurrently, 100 ms each."""

    def __init__(self, name: str = "remote:sleepy", *, batch_size: int = 8, latency_s: float = 0.1) -> None:
        self.name = name
        self.batch_size = batch_size
        self.latency_s = latency_s
        self.calls = 0

    async def _call(self, completions: list[str]) -> list[float | None]:
        self.calls += 1
        await asyncio.sleep(self.latency_s)
        return [float(len(c)) for c in completions]

    async def __call__(self, items: Sequence[object], *, step: int) -> list[float | None]:
        texts = [getattr(item, "completion", "") for item in items]
        batches = [texts[i : i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        answers = await asyncio.gather(*(self._call(b) for b in batches))
        return [value for answer in answers for value in answer]


def bench_reward_phase(repeats: int = 5) -> tuple[float, int]:
    """Median wall time of `CompositeReward.score` over 32 completions, and the calls per score."""
    from worker.grpo.reward_types import RewardInput
    from worker.grpo.rewards import CompositeReward, FunctionSource

    items = [
        RewardInput(
            prompt="p", completion="x" * i, completion_ids=[0] * i, group_id=i // NUM_GENERATIONS, index=i
        )
        for i in range(COMPLETIONS_PER_STEP)
    ]
    sleepy = SleepyBatchedSource()
    rule = FunctionSource("length", lambda item: float(len(item.completion)))
    composite = CompositeReward([(sleepy, 1.0), (rule, 0.5)])

    async def measure() -> list[float]:
        times = []
        for step in range(repeats):
            started = time.perf_counter()
            await composite.score(items, step=step)
            times.append(time.perf_counter() - started)
        return times

    times = asyncio.run(measure())
    return statistics.median(times), sleepy.calls // repeats


# ==================================================================================================
# Report
# ==================================================================================================


def render(
    results: dict[str, dict[str, Summary]], reward_s: float, reward_calls: int, args: argparse.Namespace
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"GRPO step: ours vs TRL, {args.steps} steps x {args.reps} reps, step 1 excluded, "
        f"{TORCH_THREADS} threads, OMP_WAIT_POLICY={args.omp_wait_policy}"
    )
    columns = (
        "preset",
        "framework",
        "median step s",
        "median CPU s/step",
        "completion tok/s",
        "peak RSS MiB",
        "steps",
    )
    for column in columns:
        table.add_column(column, justify="right" if column != "framework" else "left")
    for preset, by_fw in results.items():
        for fw in FRAMEWORKS:
            s = by_fw[fw]
            table.add_row(
                preset,
                fw,
                f"{s.median_step_s:.3f}",
                f"{s.median_cpu_s:.3f}",
                f"{s.tokens_per_s:.0f}",
                f"{s.peak_rss_mib:.0f}",
                str(s.steps),
            )
        ours, trl = by_fw["ours"], by_fw["trl"]
        ratio = ours.median_step_s / trl.median_step_s
        verdict = "ok" if ratio <= TARGET_RATIO[preset] and ours.peak_rss_mib <= trl.peak_rss_mib else "MISS"
        table.add_row(
            preset,
            f"ours/TRL [{verdict}]",
            f"{ratio:.2f} (target <= {TARGET_RATIO[preset]})",
            f"{ours.median_cpu_s / trl.median_cpu_s:.2f}",
            f"{ours.tokens_per_s / trl.tokens_per_s:.2f}x",
            f"{ours.peak_rss_mib / trl.peak_rss_mib:.2f} (target <= 1)",
            "",
            end_section=True,
        )
    console = Console(width=None if sys.stdout.isatty() else 140)  # a pipe would wrap the table at 80
    console.print(table)
    verdict = "ok" if reward_s <= 0.150 else "MISS"
    console.print(
        f"reward phase: 32 completions, batches of 8, 100 ms per call ({reward_calls} calls/step): "
        f"median {reward_s * 1000:.0f} ms (target <= 150 ms) [{verdict}]"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", default="tiny,small", help="comma-separated: tiny, small, medium")
    parser.add_argument("--steps", type=int, default=8, help="optimiser steps per run (step 1 is excluded)")
    parser.add_argument("--reps", type=int, default=2, help="runs per framework and preset, alternating")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="models and scratch files (default: a temp dir)"
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=("passive", "active", "inherit"),
        default="passive",
        help="OMP_WAIT_POLICY for both children (default passive: spinning threads distort shared machines)",
    )
    # Internal: the child-process entry point.
    parser.add_argument("--child", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    for internal in ("--preset", "--model-dir", "--data", "--work", "--record"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is excluded as warm-up)")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = sorted(set(presets) - set(PRESETS))
    if unknown or not presets:
        parser.error(
            f"--presets: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(PRESETS)}"
        )
    args.preset_list = presets
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        log: list[str] = []
        results = {
            preset: bench_preset(preset, args.steps, args.reps, work, args.omp_wait_policy, log)
            for preset in args.preset_list
        }
        reward_s, reward_calls = bench_reward_phase()
        render(results, reward_s, reward_calls, args)


if __name__ == "__main__":
    main()
