"""The tiny model actually learns under GRPO: the reward rises on two toy tasks (fixed seed, CPU).

Settings were tuned on the shared 2-core machine (one torch thread): each run takes well under a
minute when the machine is quiet, and the margins asserted are a fraction of those observed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.reward_types import RewardInput
from tests.engine.trainer_helpers import WORDS, char_count_reward, small_config
from worker.grpo.data import PromptRow
from worker.grpo.rewards import CompositeReward, FunctionSource
from worker.grpo.trainer import GRPOTrainer


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _train(
    tmp_path: Path, tiny_model_dir: Path, rows: list[PromptRow], reward: CompositeReward, **config: object
):  # type: ignore[no-untyped-def]
    return GRPOTrainer(
        small_config(**config),
        base_model="builtin:tiny",
        train_rows=rows,
        reward=reward,
        output_dir=tmp_path / "run",
        model_cache_dir=tiny_model_dir.parent,
    ).train()


@pytest.mark.slow
def test_learns_to_emit_the_target_character(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Reward = share of completion characters that are 'a' (chance: ~1%)."""
    rows = [PromptRow(f"{word}: ") for word in WORDS]
    result = _train(
        tmp_path,
        tiny_model_dir,
        rows,
        char_count_reward("a"),
        num_generations=8,
        prompts_per_step=4,
        max_steps=20,
        learning_rate=3e-3,
        max_completion_length=6,
    )
    rewards = [m["reward/mean"] for m in result.history]
    first, last = _mean(rewards[:5]), _mean(rewards[-5:])
    print(f"target character: reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.4, rewards


def _copy_reward() -> CompositeReward:
    """1.0 when the completion starts with the prompt's digit, plus a small bonus for any digit."""

    def copied(item: RewardInput) -> float:
        return float(item.completion[:1] == item.extras["digit"])

    def any_digit(item: RewardInput) -> float:
        return float(item.completion[:1].isdigit())

    return CompositeReward([(FunctionSource("copy", copied), 1.0), (FunctionSource("digit", any_digit), 0.1)])


@pytest.mark.slow
def test_learns_to_copy_the_digit_in_the_prompt(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The answer depends on the prompt: the model must copy its digit (chance: 1%)."""
    rows = [PromptRow(f"digit {d}", {"digit": str(d)}) for d in range(10)]
    result = _train(
        tmp_path,
        tiny_model_dir,
        rows,
        _copy_reward(),
        num_generations=8,
        prompts_per_step=8,
        max_steps=60,
        learning_rate=3e-3,
        max_completion_length=1,  # only the first token matters: no noise from the tokens after it
    )
    copied = [m["reward/copy/mean"] for m in result.history]
    first, last = _mean(copied[:5]), _mean(copied[-5:])
    print(f"copy digit: exact-copy rate first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.1, copied
    # Always emitting one favourite digit would give 0.1: the model must really condition on the prompt.
    assert last > 0.15, copied
