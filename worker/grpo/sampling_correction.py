"""Importance-sampling correction for completions sampled by another engine (vLLM).

The sampler's log-probs of the sampled tokens differ from the trainer's for the same weights
(other kernels, other precision, bf16 KV caches): the batch is slightly off-policy. TRL's
correction (https://fengyao.notion.site/off-policy-rl, "truncated importance sampling") weights
each token's policy loss by rho = pi_trainer / pi_sampler, detached, with rho truncated
(clipped to [C_min, C_max]) or masked (0 outside the bounds), per token or per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from contract.config import GRPOConfig, VLLMImportanceSamplingMode


@dataclass(frozen=True)
class SamplingCorrection:
    mode: VLLMImportanceSamplingMode
    clip_min: float | None
    clip_max: float | None

    @classmethod
    def from_config(cls, config: GRPOConfig) -> SamplingCorrection | None:
        """None when completions come from the policy itself, or the correction is off.

        Asynchronous generation samples from weights older than the policy's (stale batches): the same correction
        weighs them, as decoupled PPO does (AReaL, https://arxiv.org/abs/2505.24298): the ratio is clipped against
        the current policy (pi_prox, the detached log-probs at mu = 1), and each token's loss is weighted by
        pi_prox / pi_sampler, truncated. Per token: the product over a stale sequence vanishes or explodes, so
        async_generation defaults the mode to token_truncate (contract.config)."""
        if not ((config.use_vllm or config.async_generation) and config.vllm_importance_sampling_correction):
            return None
        return cls(
            config.vllm_importance_sampling_mode,
            config.vllm_importance_sampling_clip_min,
            config.vllm_importance_sampling_clip_max,
        )

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")

    @torch.no_grad()
    def weights(self, trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> Tensor:
        """(B, C) per-token weights, or (B, 1) per-sequence ones, for the policy loss.

        trainer_logps: (B, C) the trainer's log-probs of the sampled tokens under the weights that
        sampled them (pi_old); sampler_logps: (B, C) the sampler's; mask: (B, C) completion tokens.
        """
        # Padding is zeroed (not only masked later): a NaN log-prob the sampler could not give
        # counts as "no correction" for that token, as in TRL.
        diff = torch.where(mask.bool(), trainer_logps - sampler_logps, torch.zeros_like(trainer_logps))
        diff = torch.nan_to_num(diff, nan=0.0)  # (B, C)
        if self.per_sequence:
            diff = diff.sum(dim=1, keepdim=True)  # (B, 1): log of the product of the token ratios
        ratio = torch.exp(diff)
        if self.mode.endswith("truncate"):
            return torch.clamp(ratio, min=self.clip_min, max=self.clip_max)
        low = -math.inf if self.clip_min is None else self.clip_min
        high = math.inf if self.clip_max is None else self.clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)

    @torch.no_grad()
    def metrics(self, trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> dict[str, float]:
        """The step's mismatch and correction, under TRL's names (sampling/...): |logp_trainer -
        logp_sampler| mean and max over completion tokens; the weight's min, mean and max (over tokens,
        or sequences in the sequence modes); the share of tokens (sequences) the mask zeroed."""
        keep = mask.bool()
        delta = (trainer_logps - sampler_logps).abs()[keep]
        delta = delta[~torch.isnan(delta)]
        weights = self.weights(trainer_logps, sampler_logps, mask)
        flat = weights.flatten() if self.per_sequence else weights[keep]
        empty = flat.numel() == 0
        return {
            "sampling/sampling_logp_difference/mean": float(delta.mean()) if delta.numel() else 0.0,
            "sampling/sampling_logp_difference/max": float(delta.max()) if delta.numel() else 0.0,
            "sampling/importance_sampling_ratio/min": 0.0 if empty else float(flat.min()),
            "sampling/importance_sampling_ratio/mean": 0.0 if empty else float(flat.mean()),
            "sampling/importance_sampling_ratio/max": 0.0 if empty else float(flat.max()),
            "sampling/importance_sampling_masked_fraction": (
                0.0 if empty or self.mode.endswith("truncate") else float((flat == 0).float().mean())
            ),
        }
