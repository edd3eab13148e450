"""The GRPO objective: PPO's clipped surrogate with a group-relative advantage and a k3 KL penalty.

Per token t of completion i (ratio r = pi / pi_old, advantage A_i shared by the whole completion):
    L_t = -min(r * A_i, clip(r, 1 - epsilon, 1 + epsilon_high) * A_i) + beta * KL_t
    KL_t = exp(ref - logp) - (ref - logp) - 1        (Schulman's k3 estimator, >= 0)
Aggregation over tokens follows TRL's `loss_type` definitions exactly:
    grpo    mean over each sequence's tokens, then mean over sequences (DeepSeekMath)
    bnpo    token mean over the mini-batch
    dr_grpo sum / (sequences x max_completion_length) (Dr. GRPO, https://arxiv.org/abs/2503.20783)
    dapo    sum / masked tokens of the whole optimiser step (DAPO, https://arxiv.org/abs/2503.14476)

Gradient accumulation: for grpo, bnpo and dr_grpo the returned loss is the mini-batch's own
value; when a step is split into k mini-batches, divide each by k before backward (as TRL does).
For dapo pass `num_items_in_batch` = masked completion tokens of the whole step and do NOT divide:
the mini-batch losses then sum to the token mean of the whole step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worker.grpo.config import LossType

LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1. Shapes (B, C)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    """Detached mean of `values` over mask == 1 (0.0 when nothing is masked in)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return float(kept.sum() / mask.sum().clamp(min=1.0))


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    loss_type: LossType,
    max_completion_length: int,
    num_items_in_batch: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss for one mini-batch and detached statistics.

    logps: (B, C) float32 policy log-probs of the sampled tokens (with grad).
    old_logps: (B, C) log-probs under the policy that generated the batch; None = on-policy
        (the detached `logps`, ratio exactly 1 with the gradient of log pi, as TRL does for mu = 1).
    ref_logps: (B, C) reference log-probs; required when beta > 0, may be None when beta == 0.
    advantages: (B,) one per completion. mask: (B, C) 1 for completion tokens that count.
    num_items_in_batch: dapo only, masked tokens of the whole step (None = this mini-batch's).

    Stats: kl (masked token mean of k3, 0.0 without a reference), clip_ratio/low (ratio below
    1 - epsilon where A < 0), clip_ratio/high (above 1 + epsilon_high where A > 0),
    clip_ratio/region (either), ratio_mean; all token means over the mask.
    """
    if logps.shape != mask.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"shape mismatch: logps {tuple(logps.shape)}, mask {tuple(mask.shape)}, "
            f"advantages {tuple(advantages.shape)} (expected (B, C), (B, C), (B,))"
        )
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps")
    mask = mask.to(logps.dtype)  # (B, C)
    if old_logps is None:
        old_logps = logps.detach()

    keep = mask.bool()  # (B, C)
    # Masked positions are zeroed before exp (not only after): a stray huge value in a padded slot
    # would otherwise give inf there and NaN gradients through the where below.
    log_ratio = torch.where(keep, logps - old_logps, torch.zeros_like(logps))  # (B, C)
    ratio = torch.exp(log_ratio)  # (B, C)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # (B, C)
    adv = advantages.to(logps.dtype).unsqueeze(1)  # (B, 1): the sequence's advantage on every token
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, C)

    kl: Tensor | None = None
    if ref_logps is not None:
        kl = k3_kl(logps, torch.where(keep, ref_logps, logps.detach()))  # (B, C), 0 where masked
        if beta > 0:
            per_token = per_token + beta * kl  # added per token, before aggregation (as TRL)

    loss = _aggregate(per_token, mask, loss_type, max_completion_length, num_items_in_batch)

    with torch.no_grad():
        is_low = (ratio < 1 - epsilon) & (adv < 0)  # (B, C): the lower clip is binding
        is_high = (ratio > 1 + epsilon_high) & (adv > 0)  # (B, C): the upper clip is binding
        stats = {
            "kl": 0.0 if kl is None else _masked_mean(kl.detach(), mask),
            "clip_ratio/low": _masked_mean(is_low.to(mask.dtype), mask),
            "clip_ratio/high": _masked_mean(is_high.to(mask.dtype), mask),
            "clip_ratio/region": _masked_mean((is_low | is_high).to(mask.dtype), mask),
            "ratio_mean": _masked_mean(ratio.detach(), mask),
        }
    return loss, stats


def _aggregate(
    per_token: Tensor,
    mask: Tensor,
    loss_type: LossType,
    max_completion_length: int,
    num_items_in_batch: int | None,
) -> Tensor:
    """Reduce the (B, C) per-token loss to a scalar; masked (pad, after-EOS) tokens contribute 0."""
    # where, not multiply: a non-finite value at a padded position must not leak in as NaN * 0.
    masked = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))  # (B, C)
    if loss_type == "grpo":
        per_sequence = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # (B,)
        return per_sequence.mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.shape[0] * max_completion_length)
    # dapo: normalise by the whole step's token count so accumulated mini-batches sum to one mean.
    tokens = mask.sum() if num_items_in_batch is None else mask.new_tensor(float(num_items_in_batch))
    return masked.sum() / tokens.clamp(min=1.0)
