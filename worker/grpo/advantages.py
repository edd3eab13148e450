"""Group-relative advantages: each completion's reward compared with its siblings' (GRPO).

A_i = (r_i - mean(group)) / (std + eps), one value per completion, shared by all its tokens.
https://arxiv.org/abs/2402.03300 (DeepSeekMath, section 4.1.2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from contract.config import AdvantageStd, GRPOConfig, ScaleRewards


def _nan_std(values: Tensor, mean: Tensor, count: Tensor, std: AdvantageStd) -> Tensor:
    """NaN-ignoring std along the last dim given its NaN-ignoring mean and count of valid values.

    population divides by n (the GRPO paper's, https://arxiv.org/abs/2402.03300), unbiased by n - 1 (TRL's nanstd).
    Fewer values than the estimator needs (0, or 1 for unbiased) give NaN.
    """
    squared = (values - mean.unsqueeze(-1)).square().nansum(dim=-1)
    dof = count if std == "population" else count - 1
    return torch.where(dof > 0, squared / dof.clamp(min=1), torch.full_like(squared, float("nan"))).sqrt()


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale: ScaleRewards = "group",
    std: AdvantageStd = "population",
    eps: float = 1e-4,
    in_batch: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages (N,) and per-group reward std (N / G,) for rewards (N,) in contiguous groups of G.

    - scale="group": (r - group mean) / (group std + eps); "batch": (r - group mean) / (one std
      over the whole batch + eps), as TRL does; "none": r - group mean.
    - NaN rewards (every reward source abstained) are ignored in the group statistics and get
      advantage 0.
    - A group whose valid rewards are all equal (or that has fewer than two) gets exactly 0, not
      the rounding residue of (r - mean) / eps: it carries no learning signal.
    - in_batch: (N / G,) bool, the groups that make up the batch (default all). The others (dynamic
      sampling's fillers, outside the loss) get advantage 0 and do not count in the batch std.

    The returned group std (population or unbiased, as chosen) is 0 for such groups, for the
    `frac_zero_std_groups` and `reward/std` metrics. Statistics are computed in float64 and the
    result is returned in the rewards' floating dtype.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if std not in ("population", "unbiased"):
        raise ValueError(f"std must be 'population' or 'unbiased', got {std!r}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    in_batch = _groups_in_batch(in_batch, rewards.numel() // group_size)  # (num_groups,)

    grouped = rewards.double().view(-1, group_size)  # (num_groups, G)
    valid = ~grouped.isnan()  # (num_groups, G)
    count = valid.sum(dim=1)  # (num_groups,)
    mean = grouped.nansum(dim=1) / count.clamp(min=1)  # (num_groups,)
    centred = grouped - mean.unsqueeze(1)  # (num_groups, G), NaN where the reward is NaN

    # Zero spread: compare the extremes exactly instead of trusting a float std to be 0.
    high = torch.where(valid, grouped, -torch.inf).amax(dim=1)
    low = torch.where(valid, grouped, torch.inf).amin(dim=1)
    flat_group = (count < 2) | (high == low)  # (num_groups,)

    group_std = _nan_std(grouped, mean, count, std)  # (num_groups,)
    group_std = torch.where(flat_group, torch.zeros_like(group_std), group_std)
    if scale == "group":
        advantages = centred / (group_std.unsqueeze(1) + eps)
    elif scale == "batch":
        flat = grouped[in_batch].reshape(1, -1)
        batch_count = valid[in_batch].sum().reshape(1)
        batch_mean = flat.nansum(dim=1) / batch_count.clamp(min=1)
        batch_std = _nan_std(flat, batch_mean, batch_count, std).nan_to_num(0.0)  # (1,)
        advantages = centred / (batch_std + eps)
    else:
        advantages = centred

    no_signal = flat_group.unsqueeze(1) | ~valid | ~in_batch.unsqueeze(1)  # (num_groups, G)
    advantages = torch.where(no_signal, torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1).to(out_dtype), group_std.to(out_dtype)


def _groups_in_batch(in_batch: Tensor | None, num_groups: int) -> Tensor:
    """(num_groups,) bool: `in_batch` checked, or every group."""
    if in_batch is None:
        return torch.ones(num_groups, dtype=torch.bool)
    if in_batch.shape != (num_groups,):
        raise ValueError(f"in_batch must be ({num_groups},), one flag per group, got {tuple(in_batch.shape)}")
    return in_batch.bool().cpu()


def decoupled_advantages(
    rewards_per_source: Tensor,
    weights: Tensor,
    group_size: int,
    *,
    std: AdvantageStd = "population",
    eps: float = 1e-4,
    in_batch: Tensor | None = None,
) -> Tensor:
    """GDPO's normalize_then_sum (https://arxiv.org/abs/2601.05242), as TRL computes it: advantages (N,).

    rewards_per_source: (N, F), NaN where a source abstained; weights: (F,).
    1. each source is normalised within its group: (r - group mean) / (group std + eps), NaN-ignoring;
       a source whose values in a group are all equal (or fewer than two) gives 0 there;
    2. the weighted normalised values are summed per completion (abstentions ignored);
    3. the sums are normalised once more over the whole batch: (x - mean) / (std + eps).
    A completion every source abstained on gets 0. Statistics in float64.
    in_batch: (N / G,) bool, the groups that make up the batch (default all); the others (dynamic
    sampling's fillers, outside the loss) get 0 and are left out of step 3's mean and std.
    """
    if rewards_per_source.dim() != 2 or weights.shape != rewards_per_source.shape[1:]:
        raise ValueError(
            f"expected rewards (N, F) and weights (F,), got {tuple(rewards_per_source.shape)} "
            f"and {tuple(weights.shape)}"
        )
    num_sources = rewards_per_source.shape[1]
    groups_in = _groups_in_batch(in_batch, rewards_per_source.shape[0] // group_size)
    # One column per source: group_advantages does step 1 (group std, zero-spread groups -> 0, NaN -> 0).
    per_source = torch.stack(
        [
            group_advantages(rewards_per_source[:, f], group_size, scale="group", std=std, eps=eps)[0].double()
            for f in range(num_sources)
        ],
        dim=1,
    )  # (N, F)
    abstained = rewards_per_source.isnan()  # (N, F)
    summed = (per_source * weights.double().unsqueeze(0)).sum(dim=1)  # (N,); abstentions contributed 0
    scorable = ~abstained.all(dim=1) & groups_in.repeat_interleave(group_size)  # (N,)
    values = summed[scorable]
    if values.numel() == 0:
        return torch.zeros(rewards_per_source.shape[0], dtype=torch.float32)
    mean = values.mean()
    count = torch.tensor([values.numel()])
    batch_std = _nan_std(values.reshape(1, -1), mean.reshape(1), count, std).nan_to_num(0.0)[0]
    advantages = torch.where(scorable, (summed - mean) / (batch_std + eps), torch.zeros_like(summed))
    out_dtype = rewards_per_source.dtype if rewards_per_source.is_floating_point() else torch.float32
    return advantages.to(out_dtype)


def step_advantages(
    rewards: Tensor,
    per_source: Mapping[str, list[float | None]],
    sources: Sequence[tuple[Any, float]],
    in_loss: Tensor,
    config: GRPOConfig,
) -> Tensor:
    """(N,) group-relative advantages of a step's scored completions, one reward or several (`sources`: the
    composite's (source, weight) pairs, in `per_source`'s names); groups outside the loss (in_loss
    (num_groups,) false: dynamic sampling's fillers) get 0 and stay out of the batch-wide statistics."""
    if config.multi_objective_aggregation == "normalize_then_sum":
        values = torch.tensor(
            [[math.nan if v is None else v for v in per_source[source.name]] for source, _ in sources],
            dtype=torch.float32,
        ).T  # (N, F)
        weights = torch.tensor([weight for _, weight in sources], dtype=torch.float32)  # (F,)
        return decoupled_advantages(
            values, weights, config.num_generations, std=config.advantage_std, eps=config.advantage_eps,
            in_batch=in_loss,
        )
    advantages, _ = group_advantages(
        rewards, config.num_generations, scale=config.scale_rewards, std=config.advantage_std,
        eps=config.advantage_eps, in_batch=in_loss,
    )
    return advantages
