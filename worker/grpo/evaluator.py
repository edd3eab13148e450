"""Evaluation of one model: k completions of each dataset item, scored by the job's reward sources.

The model is loaded for generation only (no optimiser, no reference, eval mode). Each item's samples come from
a generator seeded by the evaluation's seed and the item's index alone, so an item gets the same completions
whichever batch it falls in: an evaluation resumed by a later attempt, or run again with the same spec, scores
the same samples. Temperature 0 decodes greedily (one completion per item).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from contract.evaluation import EvaluationSpec
from worker.grpo.batch import reward_inputs
from worker.grpo.checkpoint import MERGED_DIR
from worker.grpo.data import PromptRow
from worker.grpo.model_paths import resolve_model_path
from worker.grpo.modeling import greedy_generate
from worker.grpo.rewards import CompositeReward
from worker.grpo.rollout import Rollout, generate_rollout, render_prompt

# Completions generated per batch: each batch is one report (items, progress, usage) and one stop check.
COMPLETIONS_PER_BATCH = 32


@dataclass(frozen=True)
class ItemResult:
    index: int
    prompt: str
    completions: list[str]
    rewards: list[float | None]  # total per completion; None where every source abstained
    sources: list[dict[str, float | None]]  # each completion's value of every source


@dataclass(frozen=True)
class BatchResult:
    items: list[ItemResult]
    tokens_generated: int
    seconds: float


def item_seed(seed: int, index: int) -> int:
    """The generator seed of one item's samples: a function of the evaluation's seed and the item only."""
    return (seed * 1_000_003 + index * 7_919 + 1) % (2**63)


def items_per_batch(samples_per_item: int) -> int:
    return max(1, COMPLETIONS_PER_BATCH // samples_per_item)


class Evaluator:
    def __init__(self, spec: EvaluationSpec, model: str, reward: CompositeReward, *, cache_dir: Path,
                 device: str | None = None) -> None:
        self.spec = spec
        self.reward = reward
        self.config = spec.generation_config().model_copy(update={"num_generations": spec.samples_per_item})
        path = _loadable(resolve_model_path(model, cache_dir))
        target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token  # generation and batching need a pad id
        loaded: Any = AutoModelForCausalLM.from_pretrained(path)
        self.model = loaded.to(target).eval().requires_grad_(False)

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def run_batch(self, rows: list[PromptRow], first_index: int) -> BatchResult:
        """Items first_index .. first_index + len(rows) - 1 of the dataset."""
        started = time.perf_counter()
        prompts = [render_prompt(self.tokenizer, row.prompt) for row in rows]
        rollout = self._generate(prompts, first_index)
        scored = asyncio.run(self.reward.score(reward_inputs(rollout, rows, prompts), step=first_index))
        k = rollout.group_size
        items = []
        for i in range(len(rows)):
            span = range(i * k, (i + 1) * k)
            items.append(ItemResult(
                index=first_index + i,
                prompt=prompts[i],
                completions=[rollout.completion_texts[j] for j in span],
                rewards=[_finite_or_none(scored.total[j]) for j in span],
                sources=[{name: values[j] for name, values in scored.per_source.items()} for j in span],
            ))
        tokens = int(rollout.completion_lengths.sum().item())
        return BatchResult(items, tokens, time.perf_counter() - started)

    def _generate(self, prompts: list[str], first_index: int) -> Rollout:
        if self.spec.greedy:
            return greedy_generate(self.model, self.tokenizer, prompts, self.config)
        seeds = [item_seed(self.spec.seed, first_index + i) for i in range(len(prompts))]
        return generate_rollout(self.model, self.tokenizer, prompts, self.config, generator_seed=seeds)


def _loadable(path: str) -> str:
    """A LoRA checkpoint holds only its adapter at the top: its merged copy is the whole model."""
    merged = Path(path) / MERGED_DIR
    return str(merged) if merged.is_dir() else path


def _finite_or_none(value: Any) -> float | None:
    number = float(value)
    return number if math.isfinite(number) else None
