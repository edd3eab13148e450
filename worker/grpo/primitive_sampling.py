"""Sampling for the primitive training API (worker.grpo.resident): num_samples continuations of one prompt.

The decoding reuses the rollout's pieces (worker.grpo.rollout): its KV-cache decoder over the model's own
forward, `filter_logits` (temperature, then top-k, then top-p, as transformers' warpers) and `sample_tokens`
(inverting the CDF at uniforms drawn up front from a private seeded generator, so a seed gives the same
tokens and the global RNG is left alone). What differs from a rollout: any stop sequences of token ids
rather than EOS alone, one stop reason per sequence, and Tinker's parameter conventions (top_k -1 = off,
temperature 0 = greedy).

Log-probs: each sampled token's log-prob under the temperature-scaled distribution over the whole
vocabulary, log softmax(logits / T), before top-k / top-p (the rollout's `with_logprobs` convention, which
the trainer's ratio expects); with T = 1, the default and the usual RL setting, they are the model's own
log-probs, the values forward_backward computes for the same tokens. Greedy decoding (T = 0) reports
log softmax(logits), the T = 1 values, since the T -> 0 limit carries no information.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from worker.grpo.rollout import _CacheDecoder, filter_logits, sample_tokens

StopReason = Literal["length", "stop"]


@dataclass(frozen=True)
class SampledSequence:
    """One continuation: the sampled token ids (a stop sequence that ended it included, as Tinker returns
    them), each token's log-prob, and why it ended: "stop" (a stop sequence) or "length" (max_tokens)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass(frozen=True)
class SamplingSettings:
    """How to sample (Tinker's SamplingParams): top_k <= 0 keeps every token, top_p 1 keeps every token,
    temperature 0 decodes greedily; `stop`, token-id sequences that end a sequence once it ends with one."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[tuple[int, ...], ...] = ()


def _ends_with_stop(tokens: list[int], stop: tuple[tuple[int, ...], ...]) -> bool:
    return any(len(tokens) >= len(seq) and tuple(tokens[-len(seq) :]) == seq for seq in stop)


def _pick(logits: Tensor, draws: Tensor, settings: SamplingSettings) -> tuple[Tensor, Tensor]:
    """(B, V) logits and (B,) uniforms -> the (B,) next tokens and their (B,) log-probs (module docstring)."""
    if settings.temperature == 0:
        logps = torch.log_softmax(logits.float(), dim=-1)
        tokens = logps.argmax(dim=-1)
        return tokens, logps.gather(1, tokens[:, None]).squeeze(1)
    # Before filtering, which works in place: the log-probs span the whole vocabulary.
    tempered = torch.log_softmax(logits.float() / settings.temperature, dim=-1)
    top_k = max(settings.top_k, 0)  # Tinker's -1 (and any k <= 0) keeps every token, as filter_logits' 0
    filtered = filter_logits(logits, temperature=settings.temperature, top_k=top_k, top_p=settings.top_p)
    tokens = sample_tokens(filtered, draws)
    return tokens, tempered.gather(1, tokens[:, None]).squeeze(1)


@torch.inference_mode()
def sample_sequences(
    module: Any, prompt: list[int], num_samples: int, settings: SamplingSettings
) -> list[SampledSequence]:
    """`num_samples` continuations of `prompt` from `module` (a transformers causal LM, with whatever adapter
    is active on it), each ending at a stop sequence or after `settings.max_tokens` tokens."""
    device = module.device
    prompt_ids = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)  # (B, P)
    decoder = _CacheDecoder(module, torch.ones_like(prompt_ids), settings.max_tokens)
    generator = torch.Generator(device=device).manual_seed(settings.seed)
    # One uniform per (token, sample), drawn up front: sample r's t-th token inverts its CDF at draws[t, r].
    draws = torch.rand(settings.max_tokens, num_samples, generator=generator, device=device)  # (C, B)
    tokens: list[list[int]] = [[] for _ in range(num_samples)]
    logprobs: list[list[float]] = [[] for _ in range(num_samples)]
    reasons: list[StopReason] = ["length"] * num_samples
    running = [True] * num_samples
    logits = decoder.prefill(prompt_ids)
    for step in range(settings.max_tokens):
        picked, picked_logps = _pick(logits, draws[step], settings)
        for row, (token, logp) in enumerate(zip(picked.tolist(), picked_logps.tolist(), strict=True)):
            if not running[row]:
                continue  # a finished row's tokens go on feeding the cache and are dropped
            tokens[row].append(token)
            logprobs[row].append(logp)
            if _ends_with_stop(tokens[row], settings.stop):
                running[row], reasons[row] = False, "stop"
        if not any(running) or step + 1 == settings.max_tokens:
            break
        logits = decoder.step(picked)
    return [SampledSequence(t, lp, r) for t, lp, r in zip(tokens, logprobs, reasons, strict=True)]
