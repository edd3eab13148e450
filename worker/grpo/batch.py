"""The data of one GRPO step between phases, and the pure functions over it.

Kept apart from the trainer so `worker.grpo.trainer` reads as the loop itself: these are the
containers (`Generated`, `Scored`, `StepBatch`, `MiniBatchResult`) and the helpers that build
reward inputs, pick groups for dynamic sampling and compute step metrics.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from contract.reward_types import RewardInput
from worker.grpo.data import PromptRow
from worker.grpo.modeling import merge_groups
from worker.grpo.rollout import Rollout


@dataclass
class Generated:
    """One round of generation, before scoring. Rows are grouped: group g is rows g*G .. g*G + G - 1."""

    rollout: Rollout
    rows: list[PromptRow]  # one per group
    prompts: list[str]  # rendered prompt, one per group


@dataclass
class Scored:
    """A rollout and its rewards. Rows are grouped: group g is rows g*G .. g*G + G - 1."""

    rollout: Rollout
    rows: list[PromptRow]  # one per group
    prompts: list[str]  # rendered prompt, one per group
    rewards: Tensor  # (N,) float32, NaN where every source abstained
    per_source: dict[str, list[float | None]]
    group_std: Tensor  # (num_groups,)


@dataclass
class HalfForward:
    """One half of the rows' policy forward, run on a lane of its own: its log-probs (B, C) and
    entropy (B, C), still attached to that half's graph."""

    rows: slice
    logps: Tensor
    entropy: Tensor | None

    def outputs(self) -> list[Tensor]:
        """The outputs a backward runs from: the log-probs, and the entropy when it carries gradients."""
        return [t for t in (self.logps, self.entropy) if t is not None and t.requires_grad]


@dataclass
class StepBatch:
    """Everything the optimisation phase needs."""

    scored: Scored
    advantages: Tensor  # (N,)
    loss_mask: Tensor  # (N, C) tokens that count in the loss
    old_logps: Tensor | None  # (N, C), None when mu == 1 (on-policy)
    reference: Future[Tensor] | None  # (N, C) reference log-probs, None when beta == 0; may still be running
    generated: list[Scored]  # every group generated this step (for reward metrics)
    # The first mini-batch's policy forward (rows, (log-probs, entropy)), run while rewards were scored
    early_forward: tuple[slice, tuple[Tensor, Tensor | None]] | None = None
    # When that forward ran as two halves side by side: each half's outputs, whose graphs its backward
    # runs from (GRPOTrainer._backward_in_halves); early_forward holds them concatenated
    halves: list[HalfForward] | None = None

    @property
    def ref_logps(self) -> Tensor | None:
        """The reference log-probs, waiting for them if the side thread is still computing them."""
        return None if self.reference is None else self.reference.result()


@dataclass
class MiniBatchResult:
    """What one mini-batch's forward, loss and backward report to the optimisation pass."""

    loss: float  # this mini-batch's share of the step's loss
    stats: dict[str, float]  # grpo_loss's statistics of this mini-batch
    entropy_sum: float | None  # entropy summed over its completion tokens; first pass only
    # (B, C) the trainer's log-probs under the weights that sampled, when another engine sampled (vLLM);
    # first pass only: the step's sampling-correction metrics
    sampled_by: Tensor | None = None


def reward_inputs(rollout: Rollout, rows: list[PromptRow], prompts: list[str]) -> list[RewardInput]:
    group_size = rollout.group_size
    lengths = rollout.completion_lengths.tolist()
    ids = rollout.completion_ids.tolist()
    episodes = rollout.episodes
    return [
        RewardInput(
            prompt=prompts[i // group_size],
            completion=rollout.completion_texts[i],
            completion_ids=ids[i][: lengths[i]],
            extras=dict(rows[i // group_size].extras),
            group_id=i // group_size,
            index=i,
            turns=None if episodes is None else episodes[i]["turns"],
            environment_reward=None if episodes is None else episodes[i]["reward"],
        )
        for i in range(len(rollout.completion_texts))
    ]


def select_groups(
    generated: list[Scored], num_groups: int, group_size: int, pad_id: int
) -> tuple[Scored, Tensor]:
    """`num_groups` groups, those with spread first; zero-spread fillers are excluded from the loss."""
    useful = [(s, g) for s in generated for g in range(len(s.rows)) if s.group_std[g] > 0]
    flat = [(s, g) for s in generated for g in range(len(s.rows)) if not s.group_std[g] > 0]
    chosen = (useful + flat)[:num_groups]
    in_loss = torch.tensor([bool(s.group_std[g] > 0) for s, g in chosen])  # (num_groups,)
    rollout = merge_groups([(s.rollout, g) for s, g in chosen], pad_id)
    rewards = torch.cat([s.rewards[g * group_size : (g + 1) * group_size] for s, g in chosen])
    per_source = {
        name: [v for s, g in chosen for v in s.per_source[name][g * group_size : (g + 1) * group_size]]
        for name in generated[0].per_source
    }
    group_std = torch.stack([s.group_std[g] for s, g in chosen])
    selected = Scored(
        rollout,
        [s.rows[g] for s, g in chosen],
        [s.prompts[g] for s, g in chosen],
        rewards,
        per_source,
        group_std,
    )
    return selected, in_loss


def loss_mask_for(rollout: Rollout, in_loss: Tensor, *, mask_truncated: bool) -> Tensor:
    """(N, C) tokens that count in the loss: the tokens the policy sampled, minus truncated completions when
    `mask_truncated` (DAPO's overlong filtering), minus groups excluded by dynamic sampling (`in_loss`, per group)."""
    mask = rollout.policy_mask.clone()  # (N, C): the environment's tokens (multi-turn) never count
    if mask_truncated:
        mask = mask * (~rollout.is_truncated).unsqueeze(1).to(mask.dtype)
    keep = in_loss.repeat_interleave(rollout.group_size).to(mask.device)  # (N,)
    return mask * keep.unsqueeze(1).to(mask.dtype)


def batch_metrics(batch: StepBatch) -> dict[str, float]:
    """Reward statistics over every completion generated this step; shape statistics of the trained batch."""
    rewards = torch.cat([s.rewards for s in batch.generated])
    finite = rewards[~rewards.isnan()]
    group_std = torch.cat([s.group_std for s in batch.generated])
    rollout = batch.scored.rollout
    lengths = rollout.completion_lengths.float()
    loss_rows = batch.loss_mask.sum(dim=1) > 0
    metrics = {
        "reward/mean": float(finite.mean()) if finite.numel() else math.nan,
        "reward/std": float(finite.std(correction=0)) if finite.numel() else math.nan,
        "frac_zero_std_groups": float((group_std == 0).float().mean()),
        "advantage/abs_mean": float(batch.advantages[loss_rows.to(batch.advantages.device)].abs().mean())
        if bool(loss_rows.any())
        else 0.0,
        "completion_length/mean": float(lengths.mean()),
        "completion_length/min": float(lengths.min()),
        "completion_length/max": float(lengths.max()),
        "truncated_fraction": float(rollout.is_truncated.float().mean()),
    }
    for name in batch.generated[0].per_source:
        values = [v for s in batch.generated for v in s.per_source[name] if v is not None]
        metrics[f"reward/{name}/mean"] = sum(values) / len(values) if values else math.nan
    return metrics


def episode_metrics(batch: StepBatch) -> dict[str, float]:
    """Multi-turn steps: episodes of every completion generated this step (env/*); nothing for single turns."""
    episodes = [e for s in batch.generated for e in (s.rollout.episodes or [])]
    if not episodes:
        return {}
    turns = [t for e in episodes for t in e["turns"]]
    rewards = [e["reward"] for e in episodes if e["reward"] is not None]
    return {
        "env/episodes": float(len(episodes)),
        "env/errors": float(sum(e["error"] is not None for e in episodes)),
        "env/turns_mean": sum(t["role"] == "assistant" for t in turns) / len(episodes),
        "env/tool_calls": float(sum(t["role"] == "tool" for t in turns)),
        "env/tool_errors": float(sum(t["role"] == "tool" and t["error"] is not None for t in turns)),
        "env/reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
    }


def sample_records(step: int, batch: StepBatch, count: int, policy_version: int) -> list[dict[str, Any]]:
    """The first `count` completions of the trained batch, for display and storage, with the reward of
    each source by name (one source included) and the policy version that sampled them."""
    scored = batch.scored
    count = min(count, len(scored.rollout.completion_texts))
    group_size = scored.rollout.group_size
    return [
        {
            "step": step,
            "group": i // group_size,
            "prompt": scored.prompts[i // group_size],
            "completion": scored.rollout.completion_texts[i],
            "reward": float(scored.rewards[i]),
            "rewards": {name: values[i] for name, values in scored.per_source.items()},  # None: abstained
            "advantage": float(batch.advantages[i]),
            "policy_version": policy_version,
            **({} if scored.rollout.episodes is None else {"episode": scored.rollout.episodes[i]}),
        }
        for i in range(count)
    ]
