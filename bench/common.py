"""What both sides of the GRPO step benchmark share: the task, the reward, the hyperparameters, the record.

Imported by `bench/grpo_step.py` (run as a script, so this directory is on `sys.path`).
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# --- the workload ---------------------------------------------------------------------------------
PROMPTS_PER_STEP = 4
NUM_GENERATIONS = 8
COMPLETIONS_PER_STEP = PROMPTS_PER_STEP * NUM_GENERATIONS  # TRL's per_device_train_batch_size
MAX_COMPLETION_LENGTH = 32
LEARNING_RATE = 1e-5
BETA = 0.04
EPSILON = 0.2
LOSS_TYPE = "dapo"
TEMPERATURE = 1.0
MAX_GRAD_NORM = 1.0
TORCH_THREADS = 2
SEED = 42


def write_prompts(path: Path, num_prompts: int, *, seed: int = 0, chat: bool = False) -> Path:
    """A JSONL of short plain-text prompts ("Repeat the digit 7: ") with the digit as `answer`; with `chat`, the
    same request as one user message (rendered by the model's chat template, as users prompt instruct models)."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(num_prompts):
            digit = str(rng.randrange(10))
            prompt: str | list[dict[str, str]] = f"Repeat the digit {digit}: "
            if chat:
                prompt = [{"role": "user", "content": f"Repeat the digit {digit} as many times as you can."}]
            handle.write(json.dumps({"prompt": prompt, "answer": digit}) + "\n")
    return path


def read_prompts(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def digit_reward(completion: str, answer: str) -> float:
    """Share of the completion's characters that are the prompt's digit (cheap, dense, deterministic)."""
    if not completion:
        return 0.0
    return completion.count(answer) / len(completion)


# --- what a child run reports ---------------------------------------------------------------------


@dataclass
class RunRecord:
    """One framework's run in one child process. Step 1 (warm-up) is kept here, dropped in summaries."""

    framework: str  # "trl" | "ours"
    case: str  # e.g. "small", "qwen2 32k lora"
    step_s: list[float] = field(default_factory=list)  # wall time of each optimiser step, generation included
    completion_tokens: list[float] = field(default_factory=list)  # completion tokens generated in each step
    cpu_s: list[float] = field(default_factory=list)  # process CPU time (all threads) of each step
    generate_s: list[float] = field(default_factory=list)  # wall time of each step's generation (sampling)
    setup_s: float = 0.0  # model loading and trainer construction
    peak_rss_mib: float = 0.0  # filled in by the parent from the child's rusage
    backend: str = ""  # what ran the model: ours "fused" or "hf" (trainer.backend.name), or "trl"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        return cls(**json.loads(path.read_text()))


@dataclass
class Summary:
    """Pooled over repetitions, step 1 of every run excluded."""

    median_step_s: float
    median_cpu_s: float  # less sensitive than wall time to other processes on a shared machine
    tokens_per_s: float  # completion tokens per second of whole steps
    generate_tokens_per_s: float  # completion tokens per second of generation
    median_train_s: (
        float  # the step less its generation: reference, rewards, policy forward + backward, optimiser
    )
    completion_tokens: float  # mean completion tokens per step
    peak_rss_mib: float
    steps: int


def summarise(records: list[RunRecord]) -> Summary:
    step_s = [t for r in records for t in r.step_s[1:]]
    tokens = [n for r in records for n in r.completion_tokens[1:]]
    cpu_s = [t for r in records for t in r.cpu_s[1:]]
    generate_s = [t for r in records for t in r.generate_s[1:]]
    if not step_s:
        raise ValueError("need at least 2 steps per run (step 1 is excluded as warm-up)")
    return Summary(
        median_step_s=statistics.median(step_s),
        median_cpu_s=statistics.median(cpu_s),
        tokens_per_s=sum(tokens) / sum(step_s),
        generate_tokens_per_s=sum(tokens) / sum(generate_s),
        median_train_s=statistics.median(s - g for s, g in zip(step_s, generate_s, strict=True)),
        completion_tokens=statistics.fmean(tokens),
        peak_rss_mib=max(r.peak_rss_mib for r in records),
        steps=len(step_s),
    )
