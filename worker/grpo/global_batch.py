"""The step's global batch on every rank, for metrics (worker.grpo.distributed): each rank's batch goes over
the wire as plain values (worker.grpo.wire), then the parts are joined in rank order. Without futures or
log-probs: only what the metrics read."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from worker.grpo.batch import Scored, StepBatch
from worker.grpo.data import PromptRow
from worker.grpo.modeling import merge_groups
from worker.grpo.rollout import Rollout
from worker.grpo.wire import all_gather_values


def gather_batch(batch: StepBatch) -> StepBatch:
    """Every rank's `batch` joined in rank order (a collective: call it on every rank)."""
    return _concat([_batch_from_plain(part) for part in all_gather_values(_plain_batch(batch))])


def _plain_batch(batch: StepBatch) -> dict[str, Any]:
    """What the metrics read of `batch`, as tensors and plain containers (worker.grpo.wire), on the CPU."""
    return {
        "scored": _plain_scored(batch.scored), "advantages": batch.advantages.cpu(),
        "loss_mask": batch.loss_mask.cpu(), "generated": [_plain_scored(s) for s in batch.generated],
    }


def _plain_scored(scored: Scored) -> dict[str, Any]:
    rollout = scored.rollout
    return {
        "prompt_ids": rollout.prompt_ids.cpu(), "prompt_mask": rollout.prompt_mask.cpu(),
        "completion_ids": rollout.completion_ids.cpu(), "completion_mask": rollout.completion_mask.cpu(),
        "is_truncated": rollout.is_truncated.cpu(), "completion_texts": list(rollout.completion_texts),
        "group_size": rollout.group_size, "tool_mask": None if rollout.tool_mask is None else rollout.tool_mask.cpu(),
        "episodes": rollout.episodes,
        "rows": [{"prompt": row.prompt, "extras": row.extras} for row in scored.rows],
        "prompts": list(scored.prompts), "rewards": scored.rewards.cpu(), "per_source": dict(scored.per_source),
        "group_std": scored.group_std.cpu(),
    }


def _batch_from_plain(plain: dict[str, Any]) -> StepBatch:
    return StepBatch(
        _scored_from_plain(plain["scored"]), plain["advantages"], plain["loss_mask"], None, None,
        [_scored_from_plain(s) for s in plain["generated"]],
    )


def _scored_from_plain(plain: dict[str, Any]) -> Scored:
    rollout = Rollout(
        plain["prompt_ids"], plain["prompt_mask"], plain["completion_ids"], plain["completion_mask"],
        plain["is_truncated"], plain["completion_texts"], plain["group_size"], tool_mask=plain["tool_mask"],
        episodes=plain["episodes"],
    )
    rows = [PromptRow(prompt=row["prompt"], extras=row["extras"]) for row in plain["rows"]]
    return Scored(rollout, rows, plain["prompts"], plain["rewards"], plain["per_source"], plain["group_std"])


def _concat(parts: list[StepBatch]) -> StepBatch:
    pad_id = 0  # completion padding is masked everywhere the metrics look
    rollout = merge_groups([(p.scored.rollout, g) for p in parts for g in range(len(p.scored.rows))], pad_id)
    width = max(p.loss_mask.shape[1] for p in parts)
    scored = Scored(
        rollout,
        [row for p in parts for row in p.scored.rows],
        [prompt for p in parts for prompt in p.scored.prompts],
        torch.cat([p.scored.rewards for p in parts]),
        {name: [v for p in parts for v in p.scored.per_source[name]] for name in parts[0].scored.per_source},
        torch.cat([p.scored.group_std for p in parts]),
    )
    return StepBatch(
        scored,
        torch.cat([p.advantages for p in parts]),
        torch.cat([F.pad(p.loss_mask, (0, width - p.loss_mask.shape[1])) for p in parts]),
        None,
        None,
        [s for p in parts for s in p.generated],
    )
