"""Tinker's built-in losses for the primitive training API, over the per-token tensors of one datum.

A datum holds the model input (N tokens) and `loss_fn_inputs`, each of length N: position i's target
`target_tokens[i]` is predicted from tokens[:i + 1]. Every loss below is elementwise over the N positions
and the datum's loss is the SUM of its elementwise losses (Tinker sums, it never averages: each loss's
page ends in `loss = -(...).sum()` and reports `loss:sum`; https://tinker-docs.thinkingmachines.ai/losses).
Notation: lp = target_logprobs (the trainer's, with gradient), q = the sampler's `logprobs` input,
A = `advantages`, r = exp(lp - q), sg = stop-gradient.

    cross_entropy         -lp * weights
    importance_sampling   -r * A
    ppo                   -min(r * A, clip(r, low, high) * A)                 low, high = 0.8, 1.2
    cispo                 -sg(clip(r, low, high)) * lp * A                    low, high = 0.0, 4.0
    dro                   -(lp * A - beta / 2 * (lp - q)^2)                   beta = 0.1
    gspo                  ppo's term with r_t = sg(s) * exp(lp_t - sg(lp_t)), s = exp(mean over the
                          sequence_ratio_mask of sg(lp) - q): GSPO-token, https://arxiv.org/abs/2507.18071

`loss_fn_config` overrides the defaults on the right (clip_low_threshold / clip_high_threshold are
absolute bounds on the ratio, not epsilons; beta for dro). The ppo and cispo defaults are Tinker's (its
loss-functions tutorial); Tinker documents no default for dro's beta nor gspo's thresholds: we take 0.1
and ppo's. gspo's optional `sequence_ratio_mask` picks the tokens of the sequence ratio; without it, the
tokens with a nonzero advantage (the sampled ones in Tinker's RL data, whose prompt positions carry
advantage 0 and a placeholder sampler log-prob that would swamp the mean).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, get_args

import numpy as np
import torch
from torch import Tensor

from worker.grpo.loss import LossSettings, _importance_ratio, _policy_term
from worker.grpo.primitive_errors import PrimitiveInputError

LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
LOSS_FNS: tuple[str, ...] = get_args(LossFn)

_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "gspo": _RL_INPUTS,
}
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {"gspo": ("sequence_ratio_mask",)}
CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.1},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


# --- validation ----------------------------------------------------------------------------------------


def check_loss_fn(loss_fn: str) -> LossFn:
    """`loss_fn` as a LossFn, or PrimitiveInputError naming the field `loss_fn`."""
    if loss_fn not in LOSS_FNS:
        raise PrimitiveInputError("loss_fn", f"unknown loss {loss_fn!r}; expected one of {', '.join(LOSS_FNS)}")
    return loss_fn  # type: ignore[return-value]


def resolve_config(loss_fn: LossFn, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's settings: its defaults overridden by `config`. Unknown keys, values that are not finite
    numbers, clip thresholds outside 0 <= low <= high and a negative beta are refused."""
    settings = dict(CONFIG_DEFAULTS[loss_fn])
    for key, value in (config or {}).items():
        field = f"loss_fn_config.{key}"
        if key not in settings:
            allowed = ", ".join(settings) or "none"
            raise PrimitiveInputError(field, f"{loss_fn} takes no setting {key!r} (settings: {allowed})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise PrimitiveInputError(field, f"must be a finite number, got {value!r}")
        settings[key] = float(value)
    if "clip_low_threshold" in settings:
        low, high = settings["clip_low_threshold"], settings["clip_high_threshold"]
        if not 0.0 <= low <= high:
            raise PrimitiveInputError(
                "loss_fn_config", f"clip thresholds must satisfy 0 <= low <= high, got low={low}, high={high}"
            )
    if settings.get("beta", 0.0) < 0:
        raise PrimitiveInputError("loss_fn_config.beta", f"must be >= 0, got {settings['beta']}")
    return settings


def check_inputs(
    loss_fn: LossFn, inputs: Mapping[str, np.ndarray], length: int, vocab_size: int, where: str
) -> dict[str, Tensor]:
    """One datum's `loss_fn_inputs` as CPU tensors: target_tokens int64, the rest float32, each (length,).

    `where` prefixes the field of an error (e.g. `data[2]`): a missing or unknown input, a shape other than
    (length,), target tokens that are not integers in [0, vocab_size), values that are not finite numbers.
    """
    required, optional = REQUIRED_INPUTS[loss_fn], OPTIONAL_INPUTS.get(loss_fn, ())
    for name in required:
        if name not in inputs:
            raise PrimitiveInputError(f"{where}.loss_fn_inputs.{name}", f"{loss_fn} needs this input")
    tensors: dict[str, Tensor] = {}
    for name, value in inputs.items():
        field = f"{where}.loss_fn_inputs.{name}"
        if name not in required and name not in optional:
            known = ", ".join(required + optional)
            raise PrimitiveInputError(field, f"{loss_fn} takes no input {name!r} (inputs: {known})")
        array = np.asarray(value)
        if array.shape != (length,):
            raise PrimitiveInputError(field, f"shape {array.shape}, expected ({length},): one value per input token")
        if name == "target_tokens":
            tensors[name] = _token_tensor(array, vocab_size, field)
        else:
            tensors[name] = _float_tensor(array, field)
    return tensors


def _token_tensor(array: np.ndarray, vocab_size: int, field: str) -> Tensor:
    if array.dtype.kind not in "iu":
        raise PrimitiveInputError(field, f"token ids must be integers, got dtype {array.dtype}")
    bad = np.flatnonzero((array < 0) | (array >= vocab_size))
    if bad.size:
        position = int(bad[0])
        raise PrimitiveInputError(
            f"{field}[{position}]", f"token id {int(array[position])} is outside the vocabulary [0, {vocab_size})"
        )
    return torch.from_numpy(array.astype(np.int64))


def _float_tensor(array: np.ndarray, field: str) -> Tensor:
    if array.dtype.kind not in "iuf":
        raise PrimitiveInputError(field, f"must hold numbers, got dtype {array.dtype}")
    values = array.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise PrimitiveInputError(f"{field}[{int(bad[0])}]", f"{values[bad[0]]} is not a finite number")
    return torch.from_numpy(values)


# --- the losses (elementwise over the last dimension; shapes (..., N)) ----------------------------------


def cross_entropy(target_logprobs: Tensor, weights: Tensor) -> Tensor:
    """-lp * weights. Weights may be any real (0 masks a position; the SDK's custom losses send -dC/dlp)."""
    return -target_logprobs * weights


def _ratio(target_logprobs: Tensor, sampling_logprobs: Tensor) -> Tensor:
    """r = exp(lp - q), per token: the engine's importance ratio (worker.grpo.loss) at token level."""
    log_ratio = target_logprobs - sampling_logprobs
    return _importance_ratio(log_ratio, torch.ones_like(log_ratio), "token")


def importance_sampling(target_logprobs: Tensor, sampling_logprobs: Tensor, advantages: Tensor) -> Tensor:
    """-r * A: REINFORCE with the sampler's distribution corrected towards the learner's."""
    return -_ratio(target_logprobs, sampling_logprobs) * advantages


def _clipped_term(ratio: Tensor, target_logprobs: Tensor, advantages: Tensor, low: float, high: float) -> Tensor:
    """-min(r * A, clip(r, low, high) * A), per token: the engine's clipped policy term (worker.grpo.loss,
    loss type grpo with epsilon = 1 - low and epsilon_high = high - 1), on (..., N) tensors."""
    settings = LossSettings(loss_type="grpo", epsilon=1.0 - low, epsilon_high=high - 1.0)
    shape = target_logprobs.shape
    flat = target_logprobs.reshape(-1, shape[-1])  # (B, N): loss.py's (sequences, tokens)
    policy, _ = _policy_term(
        ratio.reshape(flat.shape), torch.zeros_like(flat), advantages.reshape(flat.shape), flat,
        torch.ones_like(flat), settings,
    )
    return policy.reshape(shape)


def ppo(
    target_logprobs: Tensor, sampling_logprobs: Tensor, advantages: Tensor, *, low: float, high: float
) -> Tensor:
    """-min(r * A, clip(r, low, high) * A) per token (PPO's clipped surrogate, https://arxiv.org/abs/1707.06347)."""
    ratio = _ratio(target_logprobs, sampling_logprobs)
    return _clipped_term(ratio, target_logprobs, advantages, low, high)


def cispo(
    target_logprobs: Tensor, sampling_logprobs: Tensor, advantages: Tensor, *, low: float, high: float
) -> Tensor:
    """-sg(clip(r, low, high)) * lp * A (CISPO, https://arxiv.org/abs/2506.13585). Both bounds apply, unlike
    the engine's cispo (an upper cap only), so this one is written out here."""
    coefficient = torch.clamp(_ratio(target_logprobs, sampling_logprobs), low, high).detach()
    return -coefficient * target_logprobs * advantages


def dro(target_logprobs: Tensor, sampling_logprobs: Tensor, advantages: Tensor, *, beta: float) -> Tensor:
    """-(lp * A - beta / 2 * (lp - q)^2): DRO's quadratic penalty (https://arxiv.org/abs/2405.19107)."""
    return -(target_logprobs * advantages - 0.5 * beta * (target_logprobs - sampling_logprobs) ** 2)


def gspo(
    target_logprobs: Tensor,
    sampling_logprobs: Tensor,
    advantages: Tensor,
    *,
    low: float,
    high: float,
    sequence_ratio_mask: Tensor | None = None,
) -> Tensor:
    """GSPO-token: ppo's clipped term where every token's ratio has the value of the sequence ratio
    s = exp(mean over the mask of sg(lp) - q) and the gradient of its own lp, r_t = sg(s) * exp(lp_t - sg(lp_t)).
    The mean is over the last dimension (one sequence per row). Mask: `sequence_ratio_mask != 0`, default
    A != 0; a row with no masked token has s = 1."""
    mask = (advantages != 0) if sequence_ratio_mask is None else (sequence_ratio_mask != 0)
    mask = mask.to(target_logprobs.dtype)
    detached = target_logprobs.detach()
    log_ratio = torch.where(mask.bool(), detached - sampling_logprobs, torch.zeros_like(detached))
    shape = target_logprobs.shape
    flat_log_ratio, flat_mask = log_ratio.reshape(-1, shape[-1]), mask.reshape(-1, shape[-1])
    # The engine's sequence ratio (worker.grpo.loss, GSPO's level "sequence"): (B, 1), here on detached values.
    sequence = _importance_ratio(flat_log_ratio, flat_mask, "sequence").reshape(*shape[:-1], 1)
    ratio = sequence * torch.exp(target_logprobs - detached)  # value s, gradient of lp_t
    return _clipped_term(ratio, target_logprobs, advantages, low, high)


def elementwise_loss(
    loss_fn: LossFn, target_logprobs: Tensor, inputs: Mapping[str, Tensor], settings: Mapping[str, float]
) -> Tensor:
    """The elementwise loss of `loss_fn` (checked inputs from `check_inputs`, settings from `resolve_config`),
    the shape of `target_logprobs`; the datum's loss is its sum."""
    if loss_fn == "cross_entropy":
        return cross_entropy(target_logprobs, inputs["weights"])
    q, advantages = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        return importance_sampling(target_logprobs, q, advantages)
    if loss_fn == "dro":
        return dro(target_logprobs, q, advantages, beta=settings["beta"])
    low, high = settings["clip_low_threshold"], settings["clip_high_threshold"]
    if loss_fn == "ppo":
        return ppo(target_logprobs, q, advantages, low=low, high=high)
    if loss_fn == "cispo":
        return cispo(target_logprobs, q, advantages, low=low, high=high)
    mask = inputs.get("sequence_ratio_mask")
    return gspo(target_logprobs, q, advantages, low=low, high=high, sequence_ratio_mask=mask)
