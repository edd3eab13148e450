"""One token of incremental decoding for `worker.grpo.backends.fused.static_decoder`, as a function TorchScript compiles.

Why TorchScript: a decode step of a small model is ~40 small ops per layer besides its four
matmuls, and from Python every op takes the GIL to parse its arguments and hands it back to run.
Two lanes decoding the halves of a batch on two threads (`static_decoder.decode_lanes`) then pass
the GIL back and forth on every op, and a small op costs several times more with two threads issuing
them than with one. A scripted function runs its whole body in TorchScript's interpreter with the GIL
released, so the lanes run side by side. `torch.compile` fuses more, but on a CPU it needs a C++
toolchain at run time, and a decode layer compiled over a static horizon took long to compile and then
ran slower than eager (bench/README.md, "Measured reasons", has the figures).

TorchScript is deprecated in recent torch releases (scripting warns) but still ships; where
scripting fails (no TorchScript, or no source to read) the same function runs as plain Python,
with identical results (tests/engine/test_fast_decoder_family.py holds the two to bit equality).

Everything the step reads is prepared once per rollout in a `DecodeState`: the decode weights
(W^T, LoRA merged, RMSNorm weights and the attention scale folded in where `fold`), the KV cache
and the buffers its products are written into, and the views of them it needs.
"""

import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.grpo.backends.fused.ops import head_rms_norm, llama_rms_norm, rotate_pairs


class DecodeState(NamedTuple):
    """A rollout lane's decode weights, cache and buffers (per-layer lists, layer by layer)."""

    embed: Tensor  # (V, E)
    fold: bool  # RMSNorm weights folded into the matrices after them: a norm is a row scale
    norm_eps: Tensor  # E * eps as a tensor (folded norms)
    eps: float
    input_norms: list[Tensor]  # read when not `fold`
    post_norms: list[Tensor]
    final_norm: Tensor
    qkv: list[Tensor]  # (E, (H + 2KV) * D): W^T
    qkv_bias: list[Tensor | None]
    qk_norm: list[Tensor | None]  # (H + KV, D), Qwen3
    o: list[Tensor]
    o_bias: list[Tensor | None]
    gate_up: list[Tensor]
    gate_up_bias: list[Tensor | None]
    down: list[Tensor]
    down_bias: list[Tensor | None]
    head: Tensor  # (E, V)
    head_bias: Tensor | None
    caches: list[Tensor]  # (2, B, KV, S, D): keys and values
    keys_t: list[Tensor]  # (B*KV, D, S) views of the keys
    values: list[Tensor]  # (B*KV, S, D) views of the values
    qkv_out: Tensor  # (B, (H + 2KV) * D): the qkv product
    q: Tensor  # (B, H, D) view of qkv_out
    qk: Tensor  # (B, H + KV, D) view
    qk_complex: Tensor | None  # complex view of qk's RoPE pairs (float32/float64)
    new_kv: Tensor  # (2, B, KV, D) view
    gate_up_out: Tensor  # (B, 2I): the gate/up product
    gate: Tensor  # (B, I) view
    up: Tensor  # (B, I) view
    cis: Tensor | None  # (B, S, D/2) RoPE tables per row and position
    cos: Tensor
    sin: Tensor
    key_bias: Tensor  # (B*KV, 1, S): -inf at prompt padding
    kv_heads: int
    groups: int  # query heads per KV head
    head_dim: int


def row_norm(x: Tensor, weight: Tensor, s: DecodeState) -> Tensor:
    """RMSNorm of (B, E) rows; folded, only the row scale x * rsqrt(sum(x^2) + E*eps) (sqrt(E) and
    the weight are in the matrix after it)."""
    if not s.fold:
        return llama_rms_norm(x, weight, s.eps)
    return x * (x * x).sum(dim=-1, keepdim=True).add_(s.norm_eps).rsqrt_()


def logits_of(hidden: Tensor, s: DecodeState) -> Tensor:
    """(B, E) last hidden states -> (B, V) logits."""
    logits = torch.mm(row_norm(hidden, s.final_norm, s), s.head)
    head_bias = s.head_bias
    return logits if head_bias is None else logits.add_(head_bias)


def _into(x: Tensor, weight_t: Tensor, bias: Tensor | None, out: Tensor) -> None:
    torch.mm(x, weight_t, out=out)
    if bias is not None:
        out.add_(bias)


def _residual(residual: Tensor, x: Tensor, weight_t: Tensor, bias: Tensor | None) -> Tensor:
    # In place: a constant-coefficient `torch.addmm` is split by TorchScript into mm + add, which
    # rounds differently from the single GEMM the Python path runs.
    residual.addmm_(x, weight_t)
    return residual if bias is None else residual.add_(bias)


def decode_step(tokens: Tensor, position: int, s: DecodeState) -> Tensor:
    """(B,) tokens at `position` -> (B, V) logits of the next ones; writes their K/V into the cache.
    The MLP's activation is SiLU, the only one `fast_decoder.supports` admits."""
    end = position + 1
    batch = tokens.shape[0]
    key_bias = s.key_bias[:, :, :end]
    cis = s.cis
    cis_at = None if cis is None else cis[:, position:end]  # (B, 1, D/2): broadcasts over heads
    cos, sin = s.cos[:, position:end], s.sin[:, position:end]
    x = torch.embedding(s.embed, tokens)  # (B, E), a new tensor: updated in place below
    for i in range(len(s.qkv)):
        _into(row_norm(x, s.input_norms[i], s), s.qkv[i], s.qkv_bias[i], s.qkv_out)
        qk_norm = s.qk_norm[i]
        if qk_norm is not None:
            s.qk.copy_(head_rms_norm(s.qk, qk_norm, s.eps))
        qk_complex = s.qk_complex
        if qk_complex is not None and cis_at is not None:
            qk_complex.mul_(cis_at)
        else:
            s.qk.copy_(rotate_pairs(s.qk, cos, sin))
        s.caches[i].select(3, position).copy_(s.new_kv)
        # Heads of one KV group are adjacent: (B*KV, groups, D) queries against (B*KV, end, D) keys.
        # 1/sqrt(D) is folded into the q rows of the qkv matrix or of the q norm (RoPE is linear).
        q = s.q.reshape(batch * s.kv_heads, s.groups, s.head_dim)
        probs = torch.baddbmm(key_bias, q, s.keys_t[i][:, :, :end]).softmax(dim=-1)
        attn = torch.bmm(probs, s.values[i][:, :end]).view(batch, -1)
        x = _residual(x, attn, s.o[i], s.o_bias[i])
        _into(row_norm(x, s.post_norms[i], s), s.gate_up[i], s.gate_up_bias[i], s.gate_up_out)
        x = _residual(x, F.silu(s.gate).mul_(s.up), s.down[i], s.down_bias[i])
    return logits_of(x, s)


StepFunction = Callable[[Tensor, int, DecodeState], Tensor]


@functools.cache
def scripted_decode_step() -> StepFunction:
    """`decode_step` compiled by TorchScript, or the Python function where that fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # scripting's own deprecation notice
        try:
            return torch.jit.script(decode_step)  # type: ignore[no-any-return]
        except (AttributeError, OSError, RuntimeError):  # no TorchScript, or no source to compile
            return decode_step
