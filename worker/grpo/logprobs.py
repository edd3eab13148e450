"""Per-token log-probabilities of completions, in float32, without a full float32 log-softmax.

For a (B, T, V) logits tensor a `log_softmax(...).float()` would allocate another B*T*V floats
(and keep them for backward). We only need log p(chosen token) = logit[token] - logsumexp(logits),
so we gather one value per row and compute the logsumexp over row chunks.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel

from worker.grpo import fast_decoder

# Rows (positions) per chunk: bounds the float32 temporaries to about CHUNK_ROWS * V floats
# when logits are in a lower precision.
CHUNK_ROWS = 1024


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """log_softmax(logits, -1).gather(-1, index) in float32, computed chunk by chunk.

    logits: (..., V) in any float dtype; index: (...) int64 token ids. Returns (...) float32.
    Differentiable with respect to `logits`.
    """
    if logits.shape[:-1] != index.shape:
        raise ValueError(f"index shape {tuple(index.shape)} does not match logits {tuple(logits.shape)}[:-1]")
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (R, V)
    flat_index = index.reshape(-1, 1)  # (R, 1)
    pieces = []
    for start in range(0, flat_logits.shape[0], CHUNK_ROWS):
        chunk = flat_logits[start : start + CHUNK_ROWS].float()  # (r, V); no copy when already float32
        chosen = chunk.gather(-1, flat_index[start : start + CHUNK_ROWS]).squeeze(-1)  # (r,)
        pieces.append(chosen - torch.logsumexp(chunk, dim=-1))
    if not pieces:
        return torch.zeros(index.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(index.shape)


@torch.no_grad()
def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, float32, chunked. (..., V) -> (...). A metric: no grad."""
    flat = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in range(0, flat.shape[0], CHUNK_ROWS):
        logp = torch.log_softmax(flat[start : start + CHUNK_ROWS].float(), dim=-1)  # (r, V)
        pieces.append(-(logp.exp() * logp).sum(-1))
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(logits.shape[:-1])


def completion_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    completion_length: int,
    *,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (N, C) of the last C tokens of `input_ids` under `model`, from logits / temperature.

    input_ids, attention_mask: (N, P + C), prompt left-padded, completion last. Only the C + 1
    last positions get logits (`logits_to_keep`): position t predicts token t + 1, so the logits
    at P - 1 .. P + C - 2 score the completion; the final position is dropped. Returns float32
    log-probs and, when `with_entropy`, the per-token entropy (N, C) of the tempered distribution
    (no grad). Values at masked (padding) completion positions are meaningless: mask them.
    """
    if completion_length < 1 or completion_length >= input_ids.shape[1]:
        raise ValueError(
            f"completion_length {completion_length} must be in [1, {input_ids.shape[1] - 1}] "
            f"for input_ids of length {input_ids.shape[1]}"
        )
    # Positions count real tokens only, as in generate(), so left padding does not shift them.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (N, P+C)
    if fast_decoder.supports(model, input_ids.shape[1]):
        # Same logits, far fewer ops (see fast_decoder); only the C predicting positions get logits.
        logits = fast_decoder.DecoderFunctional(model).completion_logits(
            input_ids, attention_mask, position_ids, completion_length
        )  # (N, C, V)
    else:
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=completion_length + 1,
            use_cache=False,
        ).logits[:, :-1, :]  # (N, C, V): predictions of the C completion tokens
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -completion_length:]  # (N, C)
    logps = selective_log_softmax(logits, targets)  # (N, C) float32
    entropy = entropy_from_logits(logits.detach()) if with_entropy else None
    return logps, entropy
