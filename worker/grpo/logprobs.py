"""Per-token log-probabilities of completions, in float32, without a full float32 log-softmax.

For a (B, T, V) logits tensor a `log_softmax(...).float()` would allocate another B*T*V floats
(and keep them for backward). We only need log p(chosen token) = logit[token] - logsumexp(logits),
so we gather one value per row and compute the logsumexp over row chunks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from transformers import PreTrainedModel

from worker.grpo.fastpath import FastPath

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


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, float32, chunked. (..., V) -> (...).
    Differentiable: pass detached logits when it is only a metric."""
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
    entropy_grad: bool = False,
    adapters: bool = True,
    fast: FastPath | None = None,
    prepared: Any = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (N, C) of the last C tokens of `input_ids` under `model`, from logits / temperature.

    Through the model's module forward (`module_logprobs`), or the backend's `fast` path where it covers
    the model (worker.grpo.fastpath). `adapters=False` scores a peft model's base weights without switching
    its adapters off, on a fast path only; `prepared`: the fast path's own gathering of the model's weights,
    shared by forwards of the same weights.

    input_ids, attention_mask: (N, P + C), prompt left-padded, completion last. Only the C + 1
    last positions get logits (`logits_to_keep`): position t predicts token t + 1, so the logits
    at P - 1 .. P + C - 2 score the completion; the final position is dropped. Returns float32
    log-probs and, when `with_entropy`, the per-token entropy (N, C) of the tempered distribution
    (with grad only when `entropy_grad`, for an entropy bonus in the loss). Values at masked
    (padding) completion positions are meaningless: mask them.
    """
    if completion_length < 1 or completion_length >= input_ids.shape[1]:
        raise ValueError(
            f"completion_length {completion_length} must be in [1, {input_ids.shape[1] - 1}] "
            f"for input_ids of length {input_ids.shape[1]}"
        )
    # Positions count real tokens only, as in generate(), so left padding does not shift them.
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (N, P+C)
    targets = input_ids[:, -completion_length:]  # (N, C)
    if fast is not None and fast.covers(model, input_ids.shape[1]):
        return fast.completion_logprobs(
            model, input_ids, attention_mask, position_ids, targets, temperature=temperature,
            with_entropy=with_entropy, entropy_grad=entropy_grad, adapters=adapters, prepared=prepared,
        )
    if not adapters:
        raise ValueError("adapters=False needs the fast path; use the peft model's disable_adapter() instead")
    return module_logprobs(
        model, input_ids, attention_mask, position_ids, targets,
        temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
    )


# Model types whose causal-LM forward applies nothing after the LM head but the slice to the kept positions
# (no logit soft-capping, scaling or multiplier): their head's input is all `head_logprobs` needs. Others,
# and any model with `final_logit_softcapping` set, take their logits from the model's own forward.
HEAD_INPUT_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma3_text",
    "olmo2", "smollm3", "gpt2",
})


def module_logprobs(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`completion_logprobs` through the model's own module forward (any causal LM, plain or peft, with
    whatever wrappers see the forward). Where the model's LM head is a plain linear layer at the end of its
    forward (HEAD_INPUT_MODEL_TYPES), the forward stops at the head's input and `head_logprobs` computes the
    log-probs chunk by chunk over the vocabulary: a (tokens x vocabulary) float32 tensor never exists. Else
    the model's logits (N, C, V) are scored as they come."""
    completion_length = targets.shape[1]
    inputs = {
        "input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
        "logits_to_keep": completion_length + 1, "use_cache": False,
    }
    head = _plain_head(model)
    if head is not None:
        hidden = _head_input(model, head, inputs)[:, :-1, :]  # (N, C, E): predictions of the C tokens
        return head_logprobs(
            hidden, head.weight, head.bias, targets,
            temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
        )
    logits = model(**inputs).logits[:, :-1, :]  # (N, C, V)
    if temperature != 1.0:
        logits = logits / temperature
    logps = selective_log_softmax(logits, targets)  # (N, C) float32
    entropy = entropy_from_logits(logits if entropy_grad else logits.detach()) if with_entropy else None
    return logps, entropy


def _plain_head(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The model's LM head when the forward's logits are exactly head(final hidden states), else None."""
    config = model.config
    if config.model_type not in HEAD_INPUT_MODEL_TYPES or getattr(config, "final_logit_softcapping", None):
        return None
    head = model.get_output_embeddings()
    return head if type(head) is torch.nn.Linear else None  # not a LoRA-wrapped or quantised head


class _HeadReached(Exception):  # noqa: N818  # a signal, not an error
    """Raised by the LM head's pre-hook to stop the forward there, carrying the head's input."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__("the forward reached the LM head")
        self.hidden = hidden


def _head_input(model: PreTrainedModel, head: torch.nn.Linear, inputs: dict[str, Any]) -> Tensor:
    """The tensor the model's forward gives its LM head (with its graph), without running the head: a
    pre-hook raises it out of the forward. Everything before the head ran as in a plain forward."""

    def stop(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        raise _HeadReached(args[0])

    handle = head.register_forward_pre_hook(stop)
    try:
        model(**inputs)
    except _HeadReached as reached:
        return reached.hidden
    finally:
        handle.remove()
    raise RuntimeError(f"{type(model).__name__}'s forward did not call its LM head")


# Logits per chunk of the LM head (elements): 256 MiB in float32. Up to that the logits are made at
# once and kept for backward (as exponentials, see _HeadLogprobs; TRL keeps all of them too); above
# it they are never whole, at the price of recomputing each chunk's logits in backward: one more head
# matmul, about a quarter more FLOPs for a 32k vocabulary on a 256-wide, 6-layer model. A step of
# 32 completions x 48 tokens with a 32k vocabulary (49M logits) stays in one chunk.
HEAD_CHUNK_ELEMENTS = 2**26


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (...) float32 of `targets` (...) under softmax((hidden @ W^T + b) / temperature),
    and optionally its entropy: hidden (..., E), W (V, E). The entropy carries gradients only with
    `entropy_grad` (the entropy bonus).

    Memory stays within one chunk of HEAD_CHUNK_ELEMENTS logits however many rows there are: large
    vocabularies would otherwise hold (rows, V) logits and their gradient at once. The entropy bonus
    needs the whole logits' graph, so with `entropy_grad` the head runs unchunked through autograd.
    """
    rows = hidden.reshape(-1, hidden.shape[-1])  # (R, E)
    flat_targets = targets.reshape(-1)  # (R,)
    entropy: Tensor | None
    if with_entropy and entropy_grad:
        logits = _tempered(rows, weight, bias, temperature)
        logps = selective_log_softmax(logits, flat_targets)
        entropy = entropy_from_logits(logits)
    else:
        chunk = max(1, HEAD_CHUNK_ELEMENTS // weight.shape[0])
        logps, entropy = _HeadLogprobs.apply(rows, weight, bias, flat_targets, temperature, chunk, with_entropy)
    return logps.reshape(targets.shape), None if entropy is None else entropy.reshape(targets.shape)


class _HeadLogprobs(torch.autograd.Function):
    """The LM head and the selective log-softmax (and the entropy, as a metric) in one function.

    Per row, with x = logits - max and e = exp(x), s = sum(e): logp[t] = x[t] - log s, entropy =
    log s - sum(e x) / s, and d logp[t] / d logits = onehot(t) - e / s. Autograd's graph of the same
    (logsumexp, gather, a row slice) makes about ten full-size (rows, V) passes and temporaries in
    forward and backward; here e is made in place of the logits and turned into the gradient in
    place, two passes beside the matmuls. Up to `chunk` rows e is kept for backward (the memory
    autograd would keep for the logits); with more rows it is recomputed chunk by chunk in backward
    (one more head matmul), so memory no longer grows with rows x V. Rounding follows the autograd
    path: logits in the weights' dtype, divided by the temperature there, then float32."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        rows: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        logps = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        log_sum = torch.empty_like(logps)  # log s: the logsumexp less the row's max
        entropy = torch.empty_like(logps) if with_entropy else None
        kept: tuple[Tensor, ...] = ()
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            exps, log_sum[part], chosen = _exp_logits(rows[part], weight, bias, targets[part], temperature, entropy, part)
            logps[part] = chosen - log_sum[part]
            if rows.shape[0] <= chunk:
                kept = (exps,)
        ctx.save_for_backward(rows, weight, bias, targets, log_sum, *kept)
        ctx.temperature, ctx.chunk = temperature, chunk
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, grad_logps: Tensor, _grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        rows, weight, bias, targets, log_sum, *kept = ctx.saved_tensors
        need_rows, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_rows = torch.empty_like(rows) if need_rows else None
        # float32 sums over the chunks, whatever the weights' dtype (as one matmul would accumulate)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        for start in range(0, rows.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            if kept:
                exps = kept[0]
            else:
                exps, _, _ = _exp_logits(rows[part], weight, bias, targets[part], ctx.temperature, None, part)
            # onehot(t) - e / s, times the incoming gradient, in place of e (the saved one is used once)
            upstream = grad_logps[part, None]  # (r, 1)
            grad = exps.mul_(-upstream * torch.exp(-log_sum[part, None]))
            grad.scatter_add_(-1, targets[part, None], upstream)
            grad = grad.to(rows.dtype)
            if ctx.temperature != 1.0:
                grad = grad / ctx.temperature
            if grad_rows is not None:
                grad_rows[part] = grad @ weight
            if grad_weight is not None and grad.dtype == torch.float32:
                grad_weight.addmm_(grad.t(), rows[part])  # accumulates in the matmul: no temporary
            elif grad_weight is not None:
                grad_weight += (grad.t() @ rows[part]).float()
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_rows, grad_weight, grad_bias, None, None, None, None


def _exp_logits(
    rows: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    entropy: Tensor | None,
    part: slice,
) -> tuple[Tensor, Tensor, Tensor]:
    """For rows (r, E): e = exp(logits - max) (r, V) float32, made in place of the logits, log s (r,)
    and the targets' x = logits - max (r,); fills entropy[part] when given."""
    logits = _tempered(rows, weight, bias, temperature).float()  # (r, V), a fresh tensor
    shifted = logits.sub_(logits.amax(dim=-1, keepdim=True))  # x, in place
    chosen = shifted.gather(-1, targets[:, None]).squeeze(-1)  # (r,)
    if entropy is None:
        exps = shifted.exp_()
        sums = exps.sum(dim=-1)
    else:
        exps = shifted.exp()
        sums = exps.sum(dim=-1)
        weighted = shifted.mul_(exps).sum(dim=-1)  # sum(e x) per row, in place of x (no longer needed)
        entropy[part] = sums.log() - weighted / sums
    return exps, sums.log(), chosen


def _tempered(rows: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = F.linear(rows, weight, bias)
    return logits if temperature == 1.0 else logits / temperature
