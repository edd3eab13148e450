"""GRPO step benchmark: our engine against TRL's GRPOTrainer on the same model, data, reward and knobs.

    .venv/bin/python bench/grpo_step.py                      # the whole table (long: see bench/README.md)
    .venv/bin/python bench/grpo_step.py --quick              # smoke run: llama, small vocabulary, full, 3 steps
    .venv/bin/python bench/grpo_step.py --arch qwen2 --lora --vocab 32k --steps 6 --reps 2
    .venv/bin/python bench/grpo_step.py --presets none --arch smollm2,gemma3 --steps 6 --reps 1

Needs the `bench` extra (trl). Cases: the tiny/small/medium Llama presets (character vocabulary, full
fine-tune) and, for each architecture x vocabulary x {full, LoRA}, a randomly initialised model of the
realistic proportions in `bench/models.py` (hidden 256, 6 layers, 8 query / 2 KV heads, MLP 688,
untied embeddings). LoRA is r=16, alpha 32, all linear layers: peft's `LoraConfig` passed to TRL, our
`GRPOConfig.lora` on ours.

Two models of real size keep their own vocabulary (`--vocab` does not multiply them), full and LoRA:
`smollm2`, SmolLM2-135M-Instruct with its real weights (`builtin:smollm2-135m-instruct`) prompted through its
chat template (the same task as a user message); `gemma3`, gemma-3-270m's shape with random weights and a
262,144-token vocabulary, an architecture only our `hf` backend serves (the fused CPU path covers the Llama
family), held to never being slower than TRL (ratio <= 1.0). Each case prints the backend ours ran on.

Each (framework, case, repetition) runs in its own child process so peak RSS is that framework's alone
(read from the child's rusage by `os.wait4`); the two frameworks alternate (A B B A ...) because these
shared machines drift 15-30 % in speed over minutes. A third kind of child times a dense float32
`torch.matmul` with the same threads and environment, before every case and after the last: the best is
the machine's peak, against which each framework's training phase (the step less its generation) is
put as achieved FLOP/s (counted analytically, `bench/flops.py`).

Workload: 4 prompts x 8 completions per optimiser step, 32 new tokens, beta 0.04, epsilon 0.2, loss dapo,
constant lr 1e-5, fp32, 2 torch threads, no gradient checkpointing, no saving. Step 1 is excluded from
the figures (warm-up).

Also measures our reward phase alone: a remote-like source that sleeps 100 ms per call (async),
32 completions sent in batches of 8, through `CompositeReward` (target <= 150 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
from flops import ModelDims, StepTokens, matmul_peak_flops, training_phase_flops
from models import (
    ARCHS,
    REAL_VOCABS,
    VOCABS,
    BPERecipe,
    build_model,
    build_real_model,
    default_cache_dir,
    hf_tokenizer,
)

FRAMEWORKS = ("trl", "ours")
PRESETS = ("tiny", "small", "medium")
TUNES = ("full", "lora")
# Step-time ratio ours/TRL we aim for: per preset, and on every realistic architecture case.
TARGET_RATIO = {"tiny": 0.5, "small": 0.5, "medium": 0.9, "gemma3": 1.0}
REALISTIC_TARGET = 0.7
# --arch: the realistic random architectures, then the models of real size with their own vocabulary.
ARCH_CHOICES = (*ARCHS, *REAL_VOCABS)
# Prompted as chat messages through the model's chat template, as users prompt an instruct model.
CHAT_MODELS = ("smollm2",)
LORA_RANK, LORA_ALPHA = 16, 32


@dataclass(frozen=True)
class Runtime:
    """Where and in what precision a child trains, and how long its completions may be: the table's runs
    are the CPU in float32 with the workload's 32 new tokens; `bench/gpu_check.py` runs a CUDA device in
    bfloat16 (both frameworks load bfloat16 weights; TRL adds its bf16 autocast)."""

    device: str = "cpu"
    bf16: bool = False
    max_completion_length: int = MAX_COMPLETION_LENGTH


CPU = Runtime()


# ==================================================================================================
# What is measured
# ==================================================================================================


@dataclass(frozen=True)
class Case:
    """One row of the table: a tiny preset (character vocabulary, full fine-tune), an architecture at
    the realistic proportions with a vocabulary, or a model of real size with its own vocabulary
    (REAL_VOCABS), fine-tuned fully or with LoRA."""

    model: str  # a preset of PRESETS, an architecture of ARCHS or a model of REAL_VOCABS
    vocab: str = "small"
    lora: bool = False

    @property
    def name(self) -> str:
        if self.model in PRESETS:
            return self.model
        return f"{self.model} {self.vocab} {'lora' if self.lora else 'full'}"

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "-")

    @property
    def target(self) -> float:
        return TARGET_RATIO.get(self.model, REALISTIC_TARGET)

    @property
    def chat(self) -> bool:
        return self.model in CHAT_MODELS

    @classmethod
    def parse(cls, name: str) -> Case:
        """The inverse of `name` (children get their case by name)."""
        parts = name.split()
        if len(parts) == 1 and parts[0] in PRESETS:
            return cls(parts[0])
        if len(parts) == 3 and parts[0] in ARCHS and parts[1] in VOCABS and parts[2] in TUNES:
            return cls(parts[0], parts[1], parts[2] == "lora")
        if len(parts) == 3 and REAL_VOCABS.get(parts[0]) == parts[1] and parts[2] in TUNES:  # type: ignore[call-overload]
            return cls(parts[0], parts[1], parts[2] == "lora")
        raise ValueError(f"not a benchmark case: {name!r}")


def cases_for(args: argparse.Namespace) -> list[Case]:
    """Presets first (full fine-tunes: only when full is among the tunes), then architecture x vocabulary
    x tune, in that nesting order; a model with its own vocabulary gives one case per tune."""
    cases = [Case(preset) for preset in args.preset_list] if "full" in args.tune_list else []
    for arch in args.arch_list:
        own = REAL_VOCABS.get(arch)
        if own is not None:
            cases += [Case(arch, own, tune == "lora") for tune in args.tune_list]
            continue
        for vocab in args.vocab_list:
            cases += [Case(arch, vocab, tune == "lora") for tune in args.tune_list]
    return cases


# ==================================================================================================
# Child processes: one framework, one case, N steps
# ==================================================================================================


def _limit_threads() -> None:
    import torch

    torch.set_num_threads(TORCH_THREADS)


def _synchronize(runtime: Runtime) -> None:
    if runtime.device != "cpu":
        import torch

        torch.cuda.synchronize()


def run_trl(
    case: Case,
    model_dir: Path,
    data: Path,
    steps: int,
    record: RunRecord,
    work: Path,
    runtime: Runtime = CPU,
) -> None:
    """TRL's GRPOTrainer with every default that differs from our workload overridden."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = read_prompts(data)
    generating = [0.0]  # generation seconds of the current step

    def reward_digit(completions: list[Any], answer: list[str], **_: object) -> list[float | None]:
        # Chat prompts get completions as message lists: [{"role": "assistant", "content": ...}].
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [digit_reward(text, a) for text, a in zip(texts, answer, strict=True)]

    class TimedGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        """Times TRL's sampling (`_generate`: prompts in, completion ids out; rewards and the
        reference forward come after it)."""

        def _generate(self, prompts: list[Any]) -> Any:
            started = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                generating[0] += time.perf_counter() - started

    class StepClock(TrainerCallback):  # type: ignore[misc]
        """Times whole optimiser steps (generation + reference + loss + optimiser) and counts tokens."""

        def on_step_begin(self, args: object, state: object, control: object, **kwargs: object) -> None:
            _synchronize(runtime)
            self.started, self.cpu_started = time.perf_counter(), time.process_time()
            generating[0] = 0.0

        def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
            _synchronize(runtime)  # on a GPU the optimiser's kernels may still be queued
            record.step_s.append(time.perf_counter() - self.started)
            record.cpu_s.append(time.process_time() - self.cpu_started)
            record.generate_s.append(generating[0])

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

    peft_config = None
    if case.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
    started = time.perf_counter()
    config = GRPOConfig(
        output_dir=str(work / "trl-out"),
        per_device_train_batch_size=COMPLETIONS_PER_STEP,  # counts completions: 4 prompts x 8
        gradient_accumulation_steps=1,
        num_generations=NUM_GENERATIONS,
        max_completion_length=runtime.max_completion_length,
        temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_GRAD_NORM,
        beta=BETA,
        epsilon=EPSILON,
        loss_type=LOSS_TYPE,
        max_steps=steps,
        bf16=runtime.bf16,  # TRL turns bf16 on by default, even on CPU
        # TRL loads float32 weights unless told otherwise (then autocasts to bf16): ours loads bf16 weights.
        model_init_kwargs={"dtype": "bfloat16"} if runtime.bf16 else None,
        gradient_checkpointing=False,  # TRL's default is True
        use_cpu=runtime.device == "cpu",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=SEED,
    )
    trainer = TimedGRPOTrainer(
        model=str(model_dir),  # loaded by TRL in float32, as is its reference copy (full fine-tune)
        reward_funcs=reward_digit,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[StepClock()],
        peft_config=peft_config,
    )
    record.setup_s = time.perf_counter() - started
    record.backend = "trl"
    trainer.train()


def ours_config(case: Case, steps: int, runtime: Runtime = CPU) -> Any:
    """Our GRPOConfig for the bench's workload (the same knobs as TRL's child)."""
    from contract.config import GRPOConfig, LoraConfig

    lora = LoraConfig(r=LORA_RANK, alpha=LORA_ALPHA, dropout=0.0, target_modules="all-linear")
    return GRPOConfig(
        num_generations=NUM_GENERATIONS,
        prompts_per_step=PROMPTS_PER_STEP,
        max_steps=steps,
        max_completion_length=runtime.max_completion_length,
        max_prompt_length=None,  # TRL no longer truncates prompts
        temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE,
        lr_scheduler="constant",
        max_grad_norm=MAX_GRAD_NORM,
        beta=BETA,
        epsilon=EPSILON,
        loss_type=LOSS_TYPE,
        advantage_std="unbiased",  # TRL's definition (no effect on speed, keeps the runs comparable)
        dtype="bfloat16" if runtime.bf16 else "float32",
        gradient_checkpointing=False,
        lora=lora if case.lora else None,
        checkpoint_every=steps + 1,  # no periodic saving (train() still saves once after the last step)
        log_completions_every=steps + 1,
        seed=SEED,
    )


def ours_reward() -> Any:
    """The digit reward as our CompositeReward."""
    from contract.reward_types import RewardInput
    from worker.grpo.rewards import CompositeReward, FunctionSource

    def score(item: RewardInput) -> float:
        return digit_reward(item.completion, str(item.extras["answer"]))

    return CompositeReward([(FunctionSource("reward_digit", score), 1.0)])


def run_ours(
    case: Case,
    model_dir: Path,
    data: Path,
    steps: int,
    record: RunRecord,
    work: Path,
    runtime: Runtime = CPU,
) -> None:
    """Our GRPOTrainer with the same workload, timed from outside (between metric callbacks)."""
    from worker.grpo.data import load_jsonl
    from worker.grpo.trainer import GRPOTrainer

    clock = [0.0, 0.0]  # wall, CPU at the end of the previous step

    def on_metrics(step: int, metrics: dict[str, float], samples: list[dict[str, object]]) -> None:
        now, cpu_now = time.perf_counter(), time.process_time()
        record.step_s.append(now - clock[0])
        record.cpu_s.append(cpu_now - clock[1])
        record.generate_s.append(metrics["time/generate_s"])
        record.completion_tokens.append(metrics["completion_length/mean"] * COMPLETIONS_PER_STEP)
        clock[:] = [now, cpu_now]

    started = time.perf_counter()
    trainer = GRPOTrainer(
        ours_config(case, steps, runtime),
        base_model=str(model_dir),
        train_rows=load_jsonl(data),
        reward=ours_reward(),
        output_dir=work / "ours-out",
        on_metrics=on_metrics,
        device=runtime.device,
        backend=os.environ.get(OURS_BACKEND_ENV, "auto"),  # type: ignore[arg-type]  # checked by argparse
    )
    record.setup_s = time.perf_counter() - started
    record.backend = trainer.backend.name  # "fused" (the CPU fast path) or "hf" (the module forward)
    clock[:] = [time.perf_counter(), time.process_time()]
    trainer.train()


# The backend ours runs on, from `--ours-backend` to the children.
OURS_BACKEND_ENV = "GRPO_BENCH_OURS_BACKEND"


def child_main(args: argparse.Namespace) -> None:
    if args.child == "peak":
        Path(args.record).write_text(json.dumps({"flops": matmul_peak_flops(threads=TORCH_THREADS)}))
        return
    _limit_threads()
    # Our trainer raises glibc's malloc thresholds for its process (worker.grpo.allocator); TRL's process gets
    # the same setting, so that the comparison is between the engines, not the allocator configuration.
    from worker.grpo.allocator import keep_freed_memory

    keep_freed_memory()
    case = Case.parse(args.case)
    record = RunRecord(framework=args.child, case=case.name)
    runner = run_trl if args.child == "trl" else run_ours
    runner(case, Path(args.model_dir), Path(args.data), args.steps, record, Path(args.work))
    counts = {len(record.step_s), len(record.cpu_s), len(record.generate_s), len(record.completion_tokens)}
    if counts != {args.steps}:
        raise RuntimeError(
            f"{args.child}: recorded {len(record.step_s)} step times, {len(record.generate_s)} generation "
            f"times and {len(record.completion_tokens)} token counts for {args.steps} steps"
        )
    record.save(Path(args.record))


# ==================================================================================================
# Parent: build models, alternate children, summarise
# ==================================================================================================


def _child_env(omp_wait_policy: str) -> dict[str, str]:
    env = os.environ | {"OMP_NUM_THREADS": str(TORCH_THREADS), "MKL_NUM_THREADS": str(TORCH_THREADS)}
    if omp_wait_policy != "inherit":
        # Same for every child. On an oversubscribed machine OpenMP's default spin-waiting burns
        # 5-20x the CPU of the actual work (measured here: 2-thread generate 3.6 s CPU vs 0.35 s passive).
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    return env | {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def _run_child(
    command: list[str],
    env: dict[str, str],
    what: str,
    script: str = __file__,
    timeout_s: float | None = None,
) -> float:
    """Run one child (`script` with `command`) to completion; returns its peak RSS in MiB (its own rusage,
    not the other children's). A child still running after `timeout_s` is killed and reported as failed."""
    child = subprocess.Popen(
        [sys.executable, script, *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    timer = threading.Timer(timeout_s, child.kill) if timeout_s else None
    if timer:
        timer.start()
    try:
        output = child.stdout.read() if child.stdout else ""
        _, status, usage = os.wait4(child.pid, 0)
    finally:
        if timer:
            timer.cancel()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        limit = f", killed at its {timeout_s:.0f} s limit" if timer and timer.finished.is_set() else ""
        raise RuntimeError(f"{what} failed (exit {child.returncode}{limit}):\n{output[-4000:]}")
    return usage.ru_maxrss / 1024  # Linux reports KiB


def spawn(
    framework: str, case: Case, model_dir: Path, data: Path, steps: int, work: Path, omp_wait_policy: str
) -> RunRecord:
    record_path = work / f"{framework}-{case.slug}.json"
    command = ["--child", framework, "--case", case.name, "--model-dir", str(model_dir), "--data", str(data)]
    command += ["--steps", str(steps), "--work", str(work), "--record", str(record_path)]
    peak_rss_mib = _run_child(command, _child_env(omp_wait_policy), f"{framework} on {case.name}")
    record = RunRecord.load(record_path)
    record.peak_rss_mib = peak_rss_mib
    return record


def measure_peak(work: Path, omp_wait_policy: str) -> float:
    """The dense float32 matmul FLOP/s of this machine, timed in a child like the frameworks' runs."""
    record_path = work / "peak.json"
    _run_child(["--child", "peak", "--record", str(record_path)], _child_env(omp_wait_policy), "matmul peak")
    return float(json.loads(record_path.read_text())["flops"])


@dataclass
class CaseResult:
    case: Case
    trl: Summary
    ours: Summary
    dims: ModelDims
    prompt_tokens: float  # mean prompt length in tokens, BOS included
    backend: str = ""  # the backend ours ran on ("fused" or "hf"; "fused/hf" if the runs differed)

    def train_flops(self, summary: Summary) -> float:
        """Training-phase FLOPs of that framework's typical step (its own completion lengths)."""
        tokens = StepTokens(
            rows=COMPLETIONS_PER_STEP,
            group_size=NUM_GENERATIONS,
            prompt=self.prompt_tokens,
            completion=summary.completion_tokens / COMPLETIONS_PER_STEP,
        )
        return training_phase_flops(
            self.dims, tokens, lora_rank=LORA_RANK if self.case.lora else None, beta=BETA
        )

    def peak_share(self, summary: Summary, peak_flops: float) -> float:
        """Achieved training-phase FLOP/s as a share of the measured matmul peak."""
        return self.train_flops(summary) / summary.median_train_s / peak_flops

    @property
    def ratio(self) -> float:
        return self.ours.median_step_s / self.trl.median_step_s

    @property
    def rss_ratio(self) -> float:
        return self.ours.peak_rss_mib / self.trl.peak_rss_mib

    @property
    def met(self) -> bool:
        return self.ratio <= self.case.target and self.rss_ratio <= 1.0


def model_for(case: Case, work: Path, cache_dir: Path) -> Path:
    from worker.grpo.tiny import build_tiny_model

    if case.model in PRESETS:
        return build_tiny_model(case.model, work / "models" / case.model)  # type: ignore[arg-type]
    if case.model in REAL_VOCABS:
        # In the cache: deterministic, and large (SmolLM2 ~270 MB, the Gemma 3 model ~520 MB).
        out_dir = cache_dir / "models" / f"{case.model}-{case.vocab}-{BPERecipe().key}"
        return build_real_model(case.model, out_dir, cache_dir=cache_dir)  # type: ignore[arg-type]
    return build_model(
        case.model,  # type: ignore[arg-type]
        case.vocab,  # type: ignore[arg-type]
        work / "models" / f"{case.model}-{case.vocab}",
        cache_dir=cache_dir,
    )


def bench_case(
    case: Case, args: argparse.Namespace, work: Path, cache_dir: Path, log: list[str]
) -> CaseResult:
    from transformers import AutoConfig, AutoTokenizer

    from worker.grpo.rollout import render_prompt

    model_dir = model_for(case, work, cache_dir)
    data = write_prompts(
        work / f"prompts-{'chat' if case.chat else 'plain'}.jsonl",
        max(64, PROMPTS_PER_STEP * args.steps),
        chat=case.chat,
    )
    records: dict[str, list[RunRecord]] = {fw: [] for fw in FRAMEWORKS}
    for rep in range(args.reps):
        order = FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]  # A B, B A, ...: drift hits both alike
        for framework in order:
            record = spawn(framework, case, model_dir, data, args.steps, work, args.omp_wait_policy)
            records[framework].append(record)
            median = statistics.median(record.step_s[1:]) if len(record.step_s) > 1 else float("nan")
            log.append(
                f"{case.name} rep {rep + 1} {framework:4s} [{record.backend}]: median step {median:.3f} s, "
                f"rss {record.peak_rss_mib:.0f} MiB, setup {record.setup_s:.1f} s"
            )
            print(log[-1], flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [render_prompt(tokenizer, row["prompt"]) for row in read_prompts(data)]
    prompt_tokens = statistics.fmean(len(ids) for ids in tokenizer(prompts)["input_ids"])
    return CaseResult(
        case,
        trl=summarise(records["trl"]),
        ours=summarise(records["ours"]),
        dims=ModelDims.of(AutoConfig.from_pretrained(model_dir)),
        prompt_tokens=prompt_tokens,
        backend="/".join(dict.fromkeys(record.backend for record in records["ours"])),
    )


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
    from contract.reward_types import RewardInput
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

COLUMNS = (
    "case",
    "ours on",
    "TRL step s",
    "ours step s",
    "ours/TRL / target",
    "CPU ours/TRL",
    "gen tok/s TRL",
    "gen tok/s ours",
    "train/peak TRL",
    "train/peak ours",
    "RSS MiB TRL",
    "RSS MiB ours",
    "RSS ours/TRL",
    "",
)


def table_rows(results: Sequence[CaseResult], peak_flops: float) -> list[tuple[str, ...]]:
    """One row per case, in COLUMNS order."""
    rows: list[tuple[str, ...]] = []
    for result in results:
        trl, ours = result.trl, result.ours
        rows.append(
            (
                result.case.name,
                result.backend,
                f"{trl.median_step_s:.3f}",
                f"{ours.median_step_s:.3f}",
                f"{result.ratio:.2f} / {result.case.target}",
                f"{ours.median_cpu_s / trl.median_cpu_s:.2f}",
                f"{trl.generate_tokens_per_s:.0f}",
                f"{ours.generate_tokens_per_s:.0f}",
                f"{result.peak_share(trl, peak_flops):.2f}",
                f"{result.peak_share(ours, peak_flops):.2f}",
                f"{trl.peak_rss_mib:.0f}",
                f"{ours.peak_rss_mib:.0f}",
                f"{result.rss_ratio:.2f}",
                "ok" if result.met else "MISS",
            )
        )
    return rows


def render(
    results: Sequence[CaseResult],
    peak_flops: float,
    reward: tuple[float, int],
    args: argparse.Namespace,
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"GRPO step: ours vs TRL, {args.steps} steps x {args.reps} reps, step 1 excluded, "
        f"{TORCH_THREADS} threads, OMP_WAIT_POLICY={args.omp_wait_policy}"
    )
    for column in COLUMNS:
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in table_rows(results, peak_flops):
        table.add_row(*row)
    console = Console(width=None if sys.stdout.isatty() else 240)  # a pipe would wrap the table at 80
    console.print(table)
    console.print(
        f"dense float32 matmul peak ({TORCH_THREADS} threads, best of the timings before each case and after): "
        f"{peak_flops / 1e9:.0f} GFLOP/s. train/peak: training phase (step less generation) at "
        "the least FLOPs the step needs (bench/flops.py), over that peak."
    )
    reward_s, reward_calls = reward
    verdict = "ok" if reward_s <= 0.150 else "MISS"
    console.print(
        f"reward phase: 32 completions, batches of 8, 100 ms per call ({reward_calls} calls/step): "
        f"median {reward_s * 1000:.0f} ms (target <= 150 ms) [{verdict}]"
    )


def write_json(
    path: Path, results: Sequence[CaseResult], peak_flops: float, args: argparse.Namespace
) -> None:
    """Every figure of the table, unrounded, with the run's settings."""
    payload = {
        "settings": {"steps": args.steps, "reps": args.reps, "omp_wait_policy": args.omp_wait_policy},
        "peak_flops": peak_flops,
        "cases": [
            {
                "case": r.case.name,
                "backend": r.backend,
                "target": r.case.target,
                "ratio": r.ratio,
                "rss_ratio": r.rss_ratio,
                "met": r.met,
                "trl": asdict(r.trl) | {"train_peak_share": r.peak_share(r.trl, peak_flops)},
                "ours": asdict(r.ours) | {"train_peak_share": r.peak_share(r.ours, peak_flops)},
            }
            for r in results
        ],
    }
    path.write_text(json.dumps(payload, indent=2))


# ==================================================================================================
# Command line
# ==================================================================================================

# What --quick changes, unless given explicitly too.
QUICK = {"steps": 3, "reps": 1, "presets": "none", "arch": "llama", "vocab": "small", "tune": "full"}
DEFAULTS = {
    "steps": 8,
    "reps": 2,
    "presets": "tiny,small",
    "arch": ",".join(ARCH_CHOICES),
    "vocab": ",".join(VOCABS),
}
DEFAULTS["tune"] = ",".join(TUNES)


def _choices(parser: argparse.ArgumentParser, option: str, value: str, allowed: Sequence[str]) -> list[str]:
    """A comma-separated list of `allowed` names ("none" = empty), or a parser error naming the option."""
    if value.strip() == "none":
        return []
    picked = [item.strip() for item in value.split(",") if item.strip()]
    unknown = [item for item in picked if item not in allowed]
    if unknown or not picked:
        parser.error(
            f"{option}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(allowed)}"
        )
    return list(dict.fromkeys(picked))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--presets", help=f"comma-separated: {', '.join(PRESETS)}, or none (default tiny,small)"
    )
    parser.add_argument(
        "--arch",
        help=f"comma-separated: {', '.join(ARCH_CHOICES)}, or none (default: all); "
        "smollm2 (real weights, chat prompts) and gemma3 (262k vocabulary, hf backend only) keep their own vocabulary",
    )
    parser.add_argument(
        "--vocab", help=f"comma-separated: {', '.join(VOCABS)} (default: both; for the random architectures)"
    )
    parser.add_argument("--tune", help="comma-separated: full, lora (default: both)")
    parser.add_argument("--lora", action="store_true", help="LoRA cases only (= --tune lora)")
    parser.add_argument("--steps", type=int, help="optimiser steps per run, step 1 excluded (default 8)")
    parser.add_argument("--reps", type=int, help="runs per framework and case, alternating (default 2)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: llama, small vocabulary, full, no presets, 3 steps x 1 rep",
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="models and scratch files (default: a temp dir)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the trained 32k tokenizer and the smollm2/gemma3 models are kept "
        "(default $XDG_CACHE_HOME/grpo-service/bench)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    parser.add_argument(
        "--ours-backend", choices=("auto", "hf", "fused"), default="auto",
        help="the backend ours runs on (auto: the engine's own choice); hf on a Llama shows what the fused path buys",
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=("passive", "active", "inherit"),
        default="passive",
        help="OMP_WAIT_POLICY for every child (default passive: spinning threads distort shared machines)",
    )
    # Internal: the child-process entry point.
    parser.add_argument("--child", choices=(*FRAMEWORKS, "peak"), help=argparse.SUPPRESS)
    for internal in ("--case", "--model-dir", "--data", "--work", "--record"):
        parser.add_argument(internal, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.lora:
        if args.tune not in (None, "lora"):
            parser.error("--lora: conflicts with --tune (use one)")
        args.tune = "lora"
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else default)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is excluded as warm-up)")
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    args.preset_list = _choices(parser, "--presets", args.presets, PRESETS)
    args.arch_list = _choices(parser, "--arch", args.arch, ARCH_CHOICES)
    args.vocab_list = _choices(parser, "--vocab", args.vocab, VOCABS)
    args.tune_list = _choices(parser, "--tune", args.tune, TUNES)
    if not args.child and not cases_for(args):
        parser.error("nothing to measure: no preset and no architecture x vocabulary x tune")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return
    os.environ[OURS_BACKEND_ENV] = args.ours_backend  # the children inherit it (_child_env)
    cache_dir = args.cache_dir or default_cache_dir()
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if ("32k" in args.vocab_list and set(args.arch_list) & set(ARCHS)) or "gemma3" in args.arch_list:
            hf_tokenizer(
                "32k", cache_dir
            )  # trains and caches it now (~10-20 s once), not inside a timed child
        log: list[str] = []
        results: list[CaseResult] = []
        peaks: list[float] = []
        for case in cases_for(args):
            # Timed again before every case: on a shared machine the best of several is the closest to the peak.
            peaks.append(measure_peak(work, args.omp_wait_policy))
            results.append(bench_case(case, args, work, cache_dir, log))
        peaks.append(measure_peak(work, args.omp_wait_policy))
        peak_flops = max(peaks)
        reward = bench_reward_phase()
        render(results, peak_flops, reward, args)
        if args.json:
            write_json(args.json, results, peak_flops, args)


if __name__ == "__main__":
    main()
