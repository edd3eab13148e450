"""Held-out evaluation metrics: what the user reads to know whether the model got better.

Pure functions over reward values (no torch). Names, all under ``eval/``:

- ``eval/reward/mean``: mean reward of one greedy completion per eval prompt;
- ``eval/accuracy``: the share of prompts whose greedy completion scored 1.0, only when every reward
  seen is 0 or 1 (an exact-match style reward, where "accuracy" means something);
- ``eval/pass@G``: the share of prompts with at least one of G sampled completions scoring 1.0
  (G = num_generations, binary rewards only): how often the model *can* answer, which RL sharpens
  into answering greedily.

The retain set (prompts of skills the user wants kept) gets the same names under ``eval/retain/``. Multi-turn
jobs compute them over G sampled episodes per prompt instead (worker.grpo.held_out): mean and accuracy over
every episode, pass@G over each prompt's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def is_binary(values: Sequence[float]) -> bool:
    return bool(values) and all(v in (0.0, 1.0) for v in values)


def greedy_metrics(rewards: Sequence[float], prefix: str = "eval/") -> dict[str, float]:
    """Mean reward (NaN rewards ignored) and, for 0/1 rewards, exact accuracy."""
    finite = [v for v in rewards if not math.isnan(v)]
    metrics = {f"{prefix}reward/mean": sum(finite) / len(finite) if finite else math.nan}
    if is_binary(finite) and len(finite) == len(rewards):
        metrics[f"{prefix}accuracy"] = sum(finite) / len(finite)
    return metrics


def pass_at_k(rewards: Sequence[float], group_size: int, prefix: str = "eval/") -> dict[str, float]:
    """`{prefix}pass@G` over contiguous groups of G sampled rewards; empty unless every reward is 0 or 1."""
    if group_size < 2 or len(rewards) % group_size or not is_binary(rewards):
        return {}
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return {f"{prefix}pass@{group_size}": sum(1.0 for g in groups if max(g) == 1.0) / len(groups)}
