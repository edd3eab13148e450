"""The tensor operations of the fused decoder that need no model: RMSNorm (one fused kernel in float32
training), RoPE on pair-ordered q/k features, the causal padding mask. `worker.grpo.backends.fused.fast_decoder`
builds its forward from them; the TorchScript decode step (`worker.grpo.backends.fused.decode_step`) shares
the first three functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

# The three functions below are shared with the decode step, which TorchScript compiles
# (`worker.grpo.backends.fused.decode_step`): plain tensor code with annotations it can read.


def llama_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm: normalise in float32, cast back, then scale (transformers' order). Differentiable;
    float32 training takes the fused `rms_norm` below instead."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def head_rms_norm(qk: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3's per-head RMSNorm of q and k: (..., H+KV, D) with (H+KV, D) weights, rounded like `norm`."""
    normed = F.rms_norm(qk.float(), (qk.shape[-1],), None, eps)
    if qk.dtype == torch.float32:
        return normed * weight
    return weight * normed.to(qk.dtype)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on pair-ordered features (..., D) written out on the (even, odd) pairs, for dtypes
    without complex arithmetic: a rotated copy; differentiable."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = (even * cos - odd * sin, odd * cos + even * sin)
    return torch.stack(rotated, dim=-1).flatten(-2)


_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")


class _RMSNorm(torch.autograd.Function):
    """float32 RMSNorm whose forward is one fused kernel and whose backward is seven ops.

    Why: `F.rms_norm` under autograd runs as its composite (pow, mean, add, rsqrt and two multiplies,
    each with its backward), twice per layer on the whole batch's activations. Parity with it
    (values and gradients) is tested in tests/engine/test_fast_decoder.py.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if _FUSED_RMS_NORM:
            y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        else:  # torch < 2.8 has no fused kernel
            rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
            y = x * rstd * weight
        ctx.save_for_backward(x, rstd, weight)
        return cast(Tensor, y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        normed = x * rstd
        grad_normed_x = grad * normed
        grad_weight = grad_normed_x.reshape(-1, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rstd(x) * w: rstd * (g*w - normed * mean(g*w*normed)).
            mean = (grad_normed_x @ weight).unsqueeze(-1).div_(x.shape[-1])
            grad_x = torch.addcmul(grad * weight, normed, mean, value=-1).mul_(rstd)
        return grad_x, grad_weight, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, float32; differentiable in x and weight."""
    return cast(Tensor, _RMSNorm.apply(x, weight, eps))


def causal_padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 0/1 -> (B, 1, T, T) bool: key j visible to query i when j <= i and j is real.

    Every position also sees itself, so a padded query never has an empty row (which would give
    NaN in softmax); padded positions' outputs are never read by real ones (they are masked keys).
    """
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    visible = causal & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
    return visible | torch.eye(length, dtype=torch.bool, device=attention_mask.device)


# RoPE-pair order: q and k features reordered within each head as (0, D/2, 1, D/2 + 1, ...).
# transformers rotates feature i with i + D/2 (`rotate_half`); adjacent pairs make the rotation one
# complex multiply. q and k share the order, so q.k is unchanged. It is a view of each head's
# features, (2, D/2) -> (D/2, 2), never an index (see fast_decoder's `_stacked`).


def pair_ordered(weight: Tensor) -> Tensor:
    """A head's (D,) feature weights in RoPE-pair order: (2, D/2) -> (D/2, 2)."""
    return weight.view(2, -1).t().reshape(-1)


@dataclass(frozen=True)
class Rotary:
    """RoPE cos/sin tables (..., D/2) for pair-ordered q/k features (see `pair_ordered`).

    float32/float64 rotate with one complex multiply per tensor; other dtypes (there is no complex
    bfloat16) with the same rotation written out on the pairs.
    """

    cos: Tensor
    sin: Tensor
    cis: Tensor | None  # cos + i sin, when complex arithmetic is available for the dtype

    @classmethod
    def of(cls, cos: Tensor, sin: Tensor) -> Rotary:
        complex_ok = cos.dtype in (torch.float32, torch.float64)
        return cls(cos, sin, torch.complex(cos, sin) if complex_ok else None)

    def _map(self, op: Callable[[Tensor], Tensor]) -> Rotary:
        return Rotary(op(self.cos), op(self.sin), None if self.cis is None else op(self.cis))

    def unsqueeze(self, dim: int) -> Rotary:
        return self._map(lambda t: t.unsqueeze(dim))

    def squeeze(self, dim: int) -> Rotary:
        return self._map(lambda t: t.squeeze(dim))

    def select(self, rows: Tensor, length: int) -> Rotary:
        """Tables of `rows` for their first `length` positions: (n, length, D/2)."""
        return self._map(lambda t: t[rows, :length])

    def apply(self, x: Tensor) -> Tensor:
        """Rotated copy of x (..., D); differentiable."""
        pairs = x.unflatten(-1, (-1, 2))
        if self.cis is not None:
            return torch.view_as_real(torch.view_as_complex(pairs) * self.cis).flatten(-2)
        return rotate_pairs(x, self.cos, self.sin)
