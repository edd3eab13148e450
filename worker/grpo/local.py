"""`grpo train --config job.yaml`: run the engine locally on a JSONL file with built-in rewards.

The YAML file is the job spec a user would submit to the service (`contract.spec.JobSpec`),
where `train_dataset` / `eval_dataset` are JSONL paths relative to the YAML file, plus an optional
`output_dir` (relative to the YAML file too). Re-running with the same output directory resumes
from its newest checkpoint. On one device, Ctrl-C stops after the current step and saves a checkpoint; on
several, it stops the ranks, and the run resumes from its last checkpoint.

With `resources.devices: N > 1` the command launches N ranks on this machine (worker.grpo.launch,
gloo on CPU, NCCL on GPUs) that each run `run_local` (worker.grpo.local_rank); rank 0 shows the progress and
writes the checkpoint.

Models the engine builds (`builtin:` presets, SmolLM2 converted from its GGUF file, local GGUF files) are kept
in one cache for every run of the user (`model_cache_dir`), so a new output directory does not build them again.

Exit codes: 0 done, 2 bad input (YAML, spec, dataset, checkpoint), 1 training failed, 130 interrupted.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from contract.environment_factory import load_class
from contract.reward_types import RewardError
from contract.spec import JobSpec
from worker.grpo.data import DatasetError, PromptRow, load_jsonl
from worker.grpo.environment import LocalEnvironment, MultiTurnSettings
from worker.grpo.launch import run_ranks
from worker.grpo.tool_calls import NoToolFormat

if TYPE_CHECKING:
    from worker.grpo.distributed import Ranks

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
# What each rank of a multi-device run executes: it imports the engine at the top, once, in the launcher the ranks are forked from.
RANK_MODULE = "worker.grpo.local_rank"


class LocalJobError(Exception):
    """Bad local input; the message says what and where."""


@dataclass
class LocalJob:
    spec: JobSpec
    output_dir: Path
    train_rows: list[PromptRow]
    eval_rows: list[PromptRow] | None
    retain_rows: list[PromptRow] | None = None


def load_local_job(config_path: Path, output_dir: Path | None) -> LocalJob:
    """Parse and validate the YAML spec and its datasets; raises LocalJobError naming the problem."""
    try:
        document = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise LocalJobError(f"cannot read {config_path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise LocalJobError(f"{config_path} is not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise LocalJobError(
            f"{config_path} must hold a mapping (the job spec), got {type(document).__name__}"
        )
    base = config_path.resolve().parent
    yaml_output = document.pop("output_dir", None)
    try:
        spec = JobSpec.model_validate(document)
    except ValidationError as exc:
        raise LocalJobError(f"invalid job spec in {config_path}:\n{_describe(exc)}") from exc
    if output_dir is None:
        name = spec.name or config_path.stem
        output_dir = base / str(yaml_output) if yaml_output else Path("runs") / name
    try:
        train_rows = load_jsonl(base / spec.train_dataset)
        eval_rows = load_jsonl(base / spec.eval_dataset) if spec.eval_dataset else None
        retain_rows = load_jsonl(base / spec.retain_dataset) if spec.retain_dataset else None
    except DatasetError as exc:
        raise LocalJobError(str(exc)) from exc
    return LocalJob(spec, Path(output_dir), train_rows, eval_rows, retain_rows)


def _describe(exc: ValidationError) -> str:
    return "\n".join(
        f"  {'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()
    )


@dataclass
class _Progress:
    """Per-step display state fed by the trainer's on_metrics hook."""

    progress: Progress
    task: Any
    history: list[dict[str, float]] = field(default_factory=list)

    def on_metrics(self, step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
        evals = {k: v for k, v in metrics.items() if k.startswith("eval/") and ("accuracy" in k or "pass@" in k
                                                                              or k.endswith("reward/mean"))}
        if evals:
            self.progress.console.print(f"[dim]step {step} eval[/dim] " + "  ".join(
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in sorted(evals.items())))
        if "reward/mean" not in metrics:  # the evaluation before the first step
            return
        self.history.append(metrics)
        kl = metrics.get("kl")
        self.progress.update(
            self.task,
            completed=step,
            reward=f"{metrics['reward/mean']:.3f}",
            kl="-" if kl is None else f"{kl:.4f}",
        )
        for sample in samples[:1]:
            self.progress.console.print(
                f"[dim]step {step} sample[/dim] {sample['prompt']!r} -> {sample['completion']!r} "
                f"(reward {sample['reward']:.2f})"
            )


class _StopFlag:
    """First Ctrl-C asks the trainer to stop after the current step; a second one aborts."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def should_stop(self) -> bool:
        return self.requested


def run_local(config_path: Path, output_dir: Path | None) -> int:
    """Train the job described by `config_path`; returns the process exit code."""
    in_launched_rank = "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    console = Console(quiet=rank != 0)
    try:
        job = load_local_job(config_path, output_dir)
    except LocalJobError as exc:
        console.print(f"[bold red]error:[/bold red] {exc}", highlight=False)
        return EXIT_BAD_INPUT
    devices = job.spec.resources.devices
    if devices > 1 and not in_launched_rank:
        if job.spec.resources.nodes > 1:
            console.print("[bold red]error:[/bold red] grpo train runs on one machine: set resources.nodes to 1")
            return EXIT_BAD_INPUT
        return _launch_ranks(config_path, job.output_dir, devices)
    # worker.grpo.distributed imports transformers and worker.grpo.checkpoint torch (seconds): bad input fails
    # first, and a multi-device run loads them once, for its forked ranks (worker.grpo.local_rank).
    from worker.grpo.checkpoint import CheckpointCorrupt
    from worker.grpo.distributed import Ranks, init_from_env

    ranks = init_from_env() if in_launched_rank else Ranks()
    try:
        return _train(job, console, ranks)
    except (CheckpointCorrupt, LocalJobError, NoToolFormat) as exc:
        console.print(f"[bold red]error:[/bold red] {exc}", highlight=False)
        return EXIT_BAD_INPUT
    except RewardError as exc:
        console.print(f"[bold red]training failed:[/bold red] {exc}", highlight=False)
        return EXIT_FAILED
    finally:
        if in_launched_rank:
            from worker.grpo.distributed import shutdown  # imported here, as Ranks above (transformers)

            shutdown()


def _launch_ranks(config_path: Path, output_dir: Path, devices: int) -> int:
    """Run worker.grpo.local_rank as `devices` ranks; rank 0's exit code (the launcher's) is the command's.
    This process launches them (worker.grpo.launch.run_ranks), with no interpreter between: Ctrl-C stops them and
    the command exits 130."""
    return run_ranks(RANK_MODULE, [str(config_path), str(output_dir)], nproc_per_node=devices,
                     run_id=secrets.token_hex(16))


def model_cache_dir() -> Path:
    """Where `grpo train` keeps the models it builds: $GRPO_MODEL_CACHE_DIR, else the user's cache directory
    ($XDG_CACHE_HOME or ~/.cache, then grpo/models). Builds are deterministic and written atomically,
    so runs in parallel share it safely."""
    configured = os.environ.get("GRPO_MODEL_CACHE_DIR")
    if configured:
        return Path(configured)
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "grpo" / "models"


def _train(job: LocalJob, console: Console, ranks: Ranks) -> int:
    # Imported here: torch and transformers take seconds to import; bad input should fail fast.
    import transformers

    from worker.grpo.checkpoint import latest_checkpoint
    from worker.grpo.distributed import device_for
    from worker.grpo.rewards import build_reward_sources
    from worker.grpo.trainer import GRPOTrainer
    from worker.grpo.vllm_rollout import VLLMUnavailable, vllm_installed

    if job.spec.hyperparameters.use_vllm and not vllm_installed():
        raise LocalJobError(str(VLLMUnavailable()))

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    reward = build_reward_sources(job.spec.rewards)  # no remote client locally: remote specs are refused
    environment = local_environment(job.spec)
    config = job.spec.hyperparameters
    resume = latest_checkpoint(job.output_dir)
    if resume is not None:
        console.print(f"resuming from {resume}")
    stop = _StopFlag()
    previous_handler = signal.signal(signal.SIGINT, stop)
    main = ranks.is_main
    columns = (
        TextColumn("[bold]GRPO[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TextColumn("KL {task.fields[kl]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    started = time.perf_counter()
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(
                "train", total=config.total_steps(len(job.train_rows)), reward="-", kl="-"
            )
            display = _Progress(progress, task)
            trainer = GRPOTrainer(
                config,
                base_model=job.spec.base_model,
                train_rows=job.train_rows,
                eval_rows=job.eval_rows,
                retain_rows=job.retain_rows,
                reward=reward,
                output_dir=job.output_dir,
                model_cache_dir=model_cache_dir(),
                resume_from=resume,
                on_metrics=display.on_metrics if main else None,
                should_stop=stop.should_stop,
                on_health=lambda f: progress.console.print(f"[yellow]health[/yellow] step {f.step} {f.kind}: {f.message}"),
                checkpoint_metadata={"job_name": job.spec.name or ""},
                ranks=ranks,
                device=device_for(ranks),
                environment=environment,
            )
            progress.update(task, completed=trainer.step)
            if ranks.distributed:
                progress.console.print(f"[dim]{trainer.parallel.describe()}[/dim]", highlight=False)
            result = trainer.train()
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    if main:
        console.print(_summary(result.history, result.step, time.perf_counter() - started))
    console.print(f"checkpoint: {result.last_checkpoint}", highlight=False, soft_wrap=True)
    return EXIT_INTERRUPTED if result.stopped else EXIT_OK


def local_environment(spec: JobSpec) -> LocalEnvironment | None:
    """A multi-turn job's environment locally: `environment_id` names a Python class `module:Class` with TRL's
    environment_factory contract (`reset(**row)`, public methods as tools, optional `get_reward()`)."""
    if spec.environment is None:
        return None
    settings = MultiTurnSettings(max_turns=spec.environment.max_turns, reward_mode=spec.environment.reward)
    try:
        cls = load_class(spec.environment.environment_id)
        return LocalEnvironment(cls, spec.environment.max_sessions or 64, settings)
    except (ImportError, ValueError) as exc:
        raise LocalJobError(f"environment.environment_id: {exc}") from exc


def _summary(history: list[dict[str, float]], step: int, seconds: float) -> Table:
    table = Table(title="GRPO run summary", show_header=True)
    table.add_column("metric")
    table.add_column("first step", justify="right")
    table.add_column("last step", justify="right")
    for name in ("reward/mean", "kl", "completion_length/mean", "eval/reward/mean"):
        values = [m[name] for m in history if name in m]
        if values:
            table.add_row(name, _fmt(values[0]), _fmt(values[-1]))
    table.add_row("steps", "", str(step))
    table.add_row("wall time", "", f"{seconds:.1f} s")
    return table


def _fmt(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4f}"
