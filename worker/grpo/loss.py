"""The GRPO objective: a policy-gradient term with a group-relative advantage, plus a k3 KL penalty.

Notation per token t of completion i: ratio r = pi / pi_old (token level; with importance
sampling level "sequence", GSPO's one ratio per completion, exp(mean_t log r_t),
https://arxiv.org/abs/2507.18071), A_i the completion's advantage, KL_t = exp(ref - logp) - (ref - logp) - 1
(Schulman's k3 estimator, >= 0, http://joschu.net/blog/kl-approx.html).
Per-token policy term by `loss_type` (TRL 1.16's names and definitions):

    grpo, bnpo, dr_grpo, dapo, luspo   -min(min(r, delta) * A, clip(r, 1 - eps, 1 + eps_high) * A)
                                       (delta only when set: INTELLECT-2's two-sided clipping,
                                       https://arxiv.org/abs/2505.07291)
    cispo   -stopgrad(min(r, eps_high)) * A * logp            (MiniMax-M1, https://arxiv.org/abs/2506.13585)
    sapo    -(4 / tau) * sigmoid(tau * (r - 1)) * A           (tau by the sign of A, https://arxiv.org/abs/2511.20347)
    vespo   -stopgrad(phi(w)) * A * logp, phi(w) = e^lambda w^k e^(-lambda w), w = prod_t r_t
                                       (k, lambda by the sign of A, https://arxiv.org/abs/2602.10693)

Then, in this order: the off-policy sequence mask and the high-entropy token mask multiply the
policy term, beta * KL_t is added (times r, differentiable, with `use_bias_correction_kl`: the
unbiased reverse-KL gradient of DeepSeek-V3.2, https://arxiv.org/abs/2512.02556), and the per-token
loss is aggregated:

    grpo, sapo          mean over each sequence's tokens, then mean over sequences (DeepSeekMath)
    bnpo                token mean over the mini-batch
    dr_grpo             sum / (sequences x max_completion_length) (Dr. GRPO, https://arxiv.org/abs/2503.20783)
    dapo, cispo, vespo  sum / masked tokens of the whole optimiser step (DAPO, https://arxiv.org/abs/2503.14476)
    luspo               sum over each sequence's tokens, then mean over sequences (https://arxiv.org/abs/2602.05261)

Finally the entropy bonus, coef x the mean entropy over the tokens the policy term uses, is
subtracted. The returned loss is the one to call backward on: with a step split into k
mini-batches, the per-mini-batch means are divided by k (as TRL does) and the step-token losses
divide by the whole step's token count, so the k backward passes add up to the step's loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch
from torch import Tensor

from contract.config import CLIPPED_LOSSES, GRPOConfig, ImportanceSamplingLevel, LossType

LOSS_TYPES: tuple[str, ...] = get_args(LossType)
# Normalised by the masked tokens of the whole optimiser step (`step_tokens`), not per mini-batch.
STEP_TOKEN_LOSSES: tuple[str, ...] = ("dapo", "cispo", "vespo")
# log(w) bounds for vespo's sequence weight (as the reference implementation: w in [1e-8, e^20]).
_VESPO_LOG_W_MIN, _VESPO_LOG_W_MAX = math.log(1e-8), 20.0


@dataclass(frozen=True)
class LossSettings:
    """The objective's fixed settings (see GRPOConfig for each field's meaning)."""

    loss_type: LossType = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2  # resolved: GRPOConfig.clip_high
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    max_completion_length: int = 256
    importance_sampling_level: ImportanceSamplingLevel = "token"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_bonus: bool = False

    @classmethod
    def from_config(cls, config: GRPOConfig) -> LossSettings:
        return cls(
            loss_type=config.loss_type,
            epsilon=config.epsilon,
            epsilon_high=config.clip_high,
            beta=config.beta,
            use_bias_correction_kl=config.use_bias_correction_kl,
            max_completion_length=config.max_completion_length,
            importance_sampling_level=config.importance_sampling_level,
            delta=config.delta,
            sapo_temperature_pos=config.sapo_temperature_pos,
            sapo_temperature_neg=config.sapo_temperature_neg,
            vespo_k_pos=config.vespo_k_pos,
            vespo_lambda_pos=config.vespo_lambda_pos,
            vespo_k_neg=config.vespo_k_neg,
            vespo_lambda_neg=config.vespo_lambda_neg,
            off_policy_mask_threshold=config.off_policy_mask_threshold,
            top_entropy_quantile=config.top_entropy_quantile,
            entropy_bonus=config.entropy_bonus,
        )

    @property
    def needs_entropy(self) -> bool:
        """Whether `grpo_loss` needs the per-token entropies of the current policy."""
        return self.entropy_bonus or self.top_entropy_quantile < 1.0


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1. Shapes (B, C)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    """Detached mean of `values` over mask == 1 (0.0 when nothing is masked in)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return float(kept.sum() / mask.sum().clamp(min=1.0))


def _ratio_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of a (B, C) per-token quantity over the mask, or of a (B, 1) per-sequence one over sequences."""
    if values.shape[1] == 1:
        return float(values.float().mean())
    return _masked_mean(values.float(), mask)


def _per_sequence(values: Tensor, mask: Tensor) -> Tensor:
    """(B,) mean of a (B, C) per-token quantity over each sequence's mask; a (B, 1) one as is."""
    if values.shape[1] == 1:
        return values.float().squeeze(1)
    kept = torch.where(mask.bool(), values.float(), torch.zeros_like(mask))
    return kept.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def high_entropy_mask(entropies: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """(B, C) bool: masked-in tokens whose entropy is at least the (1 - quantile) quantile of the
    masked-in entropies (https://arxiv.org/abs/2506.01939). quantile 1 keeps every token."""
    keep = mask.bool()
    values = entropies.detach()[keep].float()
    if values.numel() == 0:
        return torch.zeros_like(keep)
    threshold = torch.quantile(values, 1.0 - quantile)  # linear interpolation, as torch/TRL
    return (entropies.detach() >= threshold) & keep


def off_policy_mask(advantages: Tensor, logps: Tensor, old_logps: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """(B, 1) float, 0 for completions to drop (DeepSeek-V3.2, eq. 9): negative advantage and a mean
    per-token log(pi_old / pi) above `threshold`."""
    log_drift = torch.where(mask.bool(), old_logps - logps.detach(), torch.zeros_like(logps))  # (B, C)
    mean_drift = log_drift.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (B, 1)
    return ((advantages >= 0) | (mean_drift <= threshold)).to(logps.dtype)


@torch.no_grad()
def vespo_weights(
    log_ratio: Tensor, advantages: Tensor, mask: Tensor, settings: LossSettings
) -> Tensor:
    """(B, 1) detached phi(w) = exp(lambda + k log w - lambda w), w the sequence ratio prod_t r_t;
    phi(1) = 1. log_ratio (B, C) per token, advantages (B, 1)."""
    per_token = torch.where(mask.bool(), log_ratio.clamp(-20.0, 20.0), torch.zeros_like(log_ratio))
    log_w = per_token.sum(dim=1, keepdim=True).clamp(_VESPO_LOG_W_MIN, _VESPO_LOG_W_MAX)  # (B, 1)
    non_negative = advantages >= 0
    k = torch.where(non_negative, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(non_negative, settings.vespo_lambda_pos, settings.vespo_lambda_neg)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    ref_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    settings: LossSettings,
    *,
    step_tokens: int | None = None,
    num_mini_batches: int = 1,
    entropies: Tensor | None = None,
    entropy_coef: float = 0.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss for one mini-batch (ready for backward) and detached statistics.

    logps: (B, C) float32 policy log-probs of the sampled tokens (with grad).
    old_logps: (B, C) log-probs under the policy that generated the batch; None = on-policy
        (the detached `logps`, ratio exactly 1 with the gradient of log pi, as TRL does for mu = 1).
    ref_logps: (B, C) reference log-probs; required when beta > 0, may be None when beta == 0.
    advantages: (B,) one per completion. mask: (B, C) 1 for completion tokens that count.
    step_tokens: dapo/cispo/vespo, masked tokens of the whole optimiser step (None = this mini-batch's).
    num_mini_batches: how many mini-batches the step's loss is accumulated over.
    entropies: (B, C) per-token entropy of the current policy, needed for the high-entropy mask
        and the entropy bonus (with grad for the bonus). entropy_coef: the bonus's coefficient now
        (the adaptive controller's value, or 0 while it holds the bonus off).
    is_weights: (B, C) or (B, 1) detached importance-sampling weights pi_old / pi_sampler when another
        engine sampled the batch (worker.grpo.sampling_correction); they scale the policy term, not the KL.

    Stats (means over masked tokens, or over sequences at sequence level): kl, ratio_mean;
    clip_ratio/low (A < 0 and r < 1 - eps), clip_ratio/high (A > 0 and r > 1 + eps_high),
    clip_ratio/region (either), clip_ratio/low_min and clip_ratio/high_max (the lowest and highest
    per-sequence share) for the clipped types; cispo_clip_ratio; vespo/phi_seq_mean;
    off_policy/masked_fraction (share of sequences dropped); entropy_mask/kept_fraction;
    policy_loss (before the bonus, x num_mini_batches) with the bonus on; entropy/bonus_sum and entropy/bonus_tokens
    (the entropy the bonus acts on, for the adaptive controller; sums, not means).
    """
    s = settings
    _check_inputs(logps, ref_logps, advantages, mask, s, entropies)
    mask = mask.to(logps.dtype)  # (B, C)
    if old_logps is None:
        old_logps = logps.detach()

    keep = mask.bool()  # (B, C)
    # Masked positions are zeroed before exp (not only after): a stray huge value in a padded slot
    # would otherwise give inf there and NaN gradients through the where below.
    log_ratio = torch.where(keep, logps - old_logps, torch.zeros_like(logps))  # (B, C)
    ratio = _importance_ratio(log_ratio, mask, s.importance_sampling_level)  # (B, C), or (B, 1) by sequence
    adv = advantages.to(logps.dtype).unsqueeze(1)  # (B, 1): the sequence's advantage on every token
    kl_weight = ratio  # the bias correction's factor: the ratio before delta's cap (as TRL)

    policy, stats = _policy_term(ratio, log_ratio, adv, logps, mask, s)
    policy, bonus_mask, mask_stats = _masked_policy_term(policy, adv, logps, old_logps, mask, entropies, s)
    stats.update(mask_stats)
    if is_weights is not None:
        policy = policy * is_weights  # the sampler's distribution, corrected towards pi_old (as TRL)
    per_token = policy.expand_as(logps)  # (B, C): a sequence-level term is the same on each token

    kl = _kl_term(logps, ref_logps, keep, kl_weight, s)
    if kl is not None and s.beta > 0:
        per_token = per_token + s.beta * kl  # added per token, before aggregation (as TRL)
    stats["kl"] = 0.0 if kl is None else _masked_mean(kl.detach(), mask)

    loss = _aggregate(per_token, mask, s, step_tokens, num_mini_batches)
    if s.entropy_bonus:
        assert entropies is not None  # checked above
        loss, bonus_stats = _with_entropy_bonus(loss, entropies, bonus_mask, entropy_coef, num_mini_batches)
        stats.update(bonus_stats)
    return loss, stats


def _check_inputs(
    logps: Tensor,
    ref_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    s: LossSettings,
    entropies: Tensor | None,
) -> None:
    """Raise ValueError for shapes or settings grpo_loss cannot compute with."""
    if logps.shape != mask.shape or advantages.shape != logps.shape[:1]:
        raise ValueError(
            f"shape mismatch: logps {tuple(logps.shape)}, mask {tuple(mask.shape)}, "
            f"advantages {tuple(advantages.shape)} (expected (B, C), (B, C), (B,))"
        )
    if s.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {s.loss_type!r}")
    if s.beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps")
    if s.needs_entropy and entropies is None:
        raise ValueError("top_entropy_quantile < 1 and the entropy bonus need the per-token entropies")


def _importance_ratio(log_ratio: Tensor, mask: Tensor, level: ImportanceSamplingLevel) -> Tensor:
    """r = pi / pi_old from the masked (B, C) log-ratio: per token, or GSPO's one per sequence, (B, 1)."""
    if level == "sequence":
        return torch.exp(log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0))
    return torch.exp(log_ratio)


def _policy_term(
    ratio: Tensor, log_ratio: Tensor, adv: Tensor, logps: Tensor, mask: Tensor, s: LossSettings
) -> tuple[Tensor, dict[str, float]]:
    """The per-token (or per-sequence) policy term of `s.loss_type` (the table of the module docstring),
    with its statistics: the clip ratios, cispo's and vespo's, and ratio_mean (after delta's cap)."""
    stats: dict[str, float] = {}
    if s.loss_type in CLIPPED_LOSSES:
        clipped = torch.clamp(ratio, 1 - s.epsilon, 1 + s.epsilon_high)
        if s.delta is not None:
            ratio = torch.clamp(ratio, max=s.delta)  # two-sided: the unclipped side is capped too
        policy = -torch.min(ratio * adv, clipped * adv)
        with torch.no_grad():
            is_low = (ratio < 1 - s.epsilon) & (adv < 0)  # the lower clip is binding
            is_high = (ratio > 1 + s.epsilon_high) & (adv > 0)  # the upper clip is binding
            stats["clip_ratio/low"] = _ratio_mean(is_low, mask)
            stats["clip_ratio/high"] = _ratio_mean(is_high, mask)
            stats["clip_ratio/region"] = _ratio_mean(is_low | is_high, mask)
            stats["clip_ratio/low_min"] = float(_per_sequence(is_low, mask).min())
            stats["clip_ratio/high_max"] = float(_per_sequence(is_high, mask).max())
    elif s.loss_type == "cispo":
        capped = torch.clamp(ratio, max=s.epsilon_high).detach()
        policy = -capped * adv * logps
        stats["cispo_clip_ratio"] = _ratio_mean((ratio > s.epsilon_high) & (adv > 0), mask)
    elif s.loss_type == "sapo":
        tau = torch.where(adv > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)  # (B, 1)
        policy = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
    else:  # vespo
        phi = vespo_weights(log_ratio, adv, mask, s)  # (B, 1)
        policy = -phi * adv * logps
        stats["vespo/phi_seq_mean"] = float(phi.mean())
    stats["ratio_mean"] = _ratio_mean(ratio.detach(), mask)
    return policy, stats


def _masked_policy_term(
    policy: Tensor,
    adv: Tensor,
    logps: Tensor,
    old_logps: Tensor,
    mask: Tensor,
    entropies: Tensor | None,
    s: LossSettings,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """The policy term under the off-policy sequence mask and the high-entropy token mask (not the KL, not the
    normaliser), the mask of the tokens the entropy bonus acts on, and the masks' statistics."""
    stats: dict[str, float] = {}
    if s.off_policy_mask_threshold is not None:
        sequence_keep = off_policy_mask(adv, logps, old_logps, mask, s.off_policy_mask_threshold)  # (B, 1)
        policy = policy * sequence_keep
        stats["off_policy/masked_fraction"] = float(1 - sequence_keep.mean())
    bonus_mask = mask
    if entropies is not None and s.top_entropy_quantile < 1.0:
        token_keep = high_entropy_mask(entropies, mask, s.top_entropy_quantile).to(logps.dtype)  # (B, C)
        policy = policy * token_keep
        bonus_mask = mask * token_keep
        stats["entropy_mask/kept_fraction"] = float(token_keep.sum() / mask.sum().clamp(min=1.0))
    return policy, bonus_mask, stats


def _kl_term(
    logps: Tensor, ref_logps: Tensor | None, keep: Tensor, kl_weight: Tensor, s: LossSettings
) -> Tensor | None:
    """(B, C) k3 KL to the reference, 0 where masked, times the ratio with the bias correction; None without
    a reference."""
    if ref_logps is None:
        return None
    kl = k3_kl(logps, torch.where(keep, ref_logps, logps.detach()))  # (B, C), 0 where masked
    if s.use_bias_correction_kl:
        kl = kl * kl_weight  # (B, C); a sequence-level (B, 1) ratio on each of its tokens
    return kl


def _with_entropy_bonus(
    loss: Tensor, entropies: Tensor, bonus_mask: Tensor, entropy_coef: float, num_mini_batches: int
) -> tuple[Tensor, dict[str, float]]:
    """`loss` less the entropy bonus (coef x the mean entropy over `bonus_mask`), and its statistics."""
    stats: dict[str, float] = {}
    # x num_mini_batches: the trainer averages stats over mini-batches, and the step's loss is their sum.
    stats["policy_loss"] = float(loss.detach()) * num_mini_batches
    bonus_entropy = torch.where(bonus_mask.bool(), entropies, torch.zeros_like(entropies))  # (B, C)
    mean_entropy = bonus_entropy.sum() / bonus_mask.sum().clamp(min=1.0)
    loss = loss - entropy_coef * mean_entropy / num_mini_batches
    stats["entropy/bonus_sum"] = float(bonus_entropy.detach().sum())
    stats["entropy/bonus_tokens"] = float(bonus_mask.sum())
    return loss, stats


def _aggregate(
    per_token: Tensor,
    mask: Tensor,
    settings: LossSettings,
    step_tokens: int | None,
    num_mini_batches: int,
) -> Tensor:
    """Reduce the (B, C) per-token loss to this mini-batch's share of the step's loss; masked (pad,
    after-EOS) tokens contribute 0."""
    # where, not multiply: a non-finite value at a padded position must not leak in as NaN * 0.
    masked = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))  # (B, C)
    loss_type = settings.loss_type
    if loss_type in STEP_TOKEN_LOSSES:
        # Normalise by the whole step's token count so accumulated mini-batches sum to one mean.
        tokens = mask.sum() if step_tokens is None else mask.new_tensor(float(step_tokens))
        return masked.sum() / tokens.clamp(min=1.0)
    if loss_type in ("grpo", "sapo"):
        loss = (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (per_token.shape[0] * settings.max_completion_length)
    else:  # luspo: the sequence's loss scales with its length
        loss = masked.sum(dim=1).mean()
    return loss / num_mini_batches


class AdaptiveEntropy:
    """Skywork-OR1's entropy-coefficient controller (https://arxiv.org/abs/2505.22312), as TRL runs it.

    `coef_to_apply()` is the coefficient for every mini-batch of the next optimiser update: the
    current coefficient when the last update's entropy was at or below the target, else 0 (and 0
    before any measurement). After each update, `update(mean_entropy)` moves the coefficient by
    `delta` towards more bonus when entropy <= target, towards less otherwise, within [low, high].
    Without `adaptive`, the coefficient is constant and always applied.
    """

    def __init__(
        self, coef: float, *, adaptive: bool, target: float, delta: float, low: float, high: float
    ) -> None:
        self.coef = coef
        self.adaptive = adaptive
        self.target, self.delta, self.low, self.high = target, delta, low, high
        self.last_entropy = math.inf

    @classmethod
    def from_config(cls, config: GRPOConfig) -> AdaptiveEntropy:
        return cls(
            config.entropy_coef,
            adaptive=config.use_adaptive_entropy,
            target=config.entropy_target,
            delta=config.entropy_coef_delta,
            low=config.entropy_coef_min,
            high=config.entropy_coef_max,
        )

    def coef_to_apply(self) -> float:
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, mean_entropy: float) -> None:
        if not self.adaptive:
            return
        if mean_entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = mean_entropy

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])
        self.last_entropy = float(state["last_entropy"])
