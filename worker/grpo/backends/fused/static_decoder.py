"""Incremental decoding for the sampling loop on the functional Llama-family forward
(`worker.grpo.backends.fused.fast_decoder`): a preallocated KV cache written in place, decode weights prepared
once per rollout (LoRA adapters merged, RMSNorm weights and the attention scale folded in), and
how many threads or lanes a CPU decodes with (a rule of thumb, then what the machine measures).
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from worker.grpo.backends.fused.decode_step import DecodeState, logits_of, scripted_decode_step
from worker.grpo.backends.fused.fast_decoder import DecoderFunctional, FusedLayer
from worker.grpo.backends.fused.ops import Rotary, causal_padding_mask


class StaticDecoder:
    """Prefill once, then one token per call, with K/V written into a preallocated (B, KV, S, D) cache.

    Positions follow `generate()`: prompt positions count real tokens (left padding does not
    shift them) and each new token takes the next position. Call under torch.inference_mode(),
    with `threads` intra-op threads (see `decode_threads`). A decode step (`worker.grpo.backends.fused.decode_step`,
    compiled by TorchScript) works on (B, E) matrices with weights prepared once per rollout
    (`_DecodeLinear`), RoPE applied in place, the residual adds fused into the matmuls after
    attention and MLP, and attention as two batched matmuls over the cache (cheaper than SDPA's
    kernel for one query).
    """

    def __init__(
        self,
        net: DecoderFunctional,
        prompt_mask: Tensor,
        max_new_tokens: int,
        weights: DecodeWeights | None = None,
        threads: int | None = None,
    ) -> None:
        """Decoders of one rollout's lanes share `weights` (prepared here when not given). `threads`:
        intra-op threads to decode with (default: `decode_threads`' rule of thumb)."""
        if net.act is not F.silu:  # the decode step's MLP is SiLU's
            raise ValueError(f"the decode step implements SiLU, not {net.act}")
        weights = weights or DecodeWeights.of(net)
        self.net = net
        batch, prompt_length = prompt_mask.shape
        total = prompt_length + max_new_tokens
        device, dtype = prompt_mask.device, net.embed.dtype
        # Per layer, keys and values in one (2, B, KV, S, D) tensor: a step writes both with one copy.
        self._caches = [
            torch.empty(2, batch, net.num_kv_heads, total, net.head_dim, dtype=dtype, device=device)
            for _ in net.layers
        ]
        self.keys = [cache[0] for cache in self._caches]  # (B, KV, S, D)
        self.values = [cache[1] for cache in self._caches]
        self.rotary = net.rotary(_positions(prompt_mask, max_new_tokens), dtype)  # (B, S, D/2)
        self.prompt_mask = prompt_mask
        self.threads = threads or decode_threads(net, batch)
        self.length = 0  # filled cache positions
        key_bias = _key_bias(prompt_mask, total, dtype)
        self.state = _decode_state(net, weights, self._caches, self.rotary, key_bias)
        self._step = scripted_decode_step()

    def prefill(self, prompt_ids: Tensor) -> Tensor:
        """(B, P) -> logits (B, V) of the next token.

        Consecutive identical prompts (a GRPO group) are run once and their keys/values copied
        to every row of the group.
        """
        net, length = self.net, prompt_ids.shape[1]
        unique = torch.cat([prompt_ids, self.prompt_mask], dim=1)
        _, counts = torch.unique_consecutive(unique, dim=0, return_counts=True)
        firsts = torch.cumsum(counts, 0) - counts  # (n,) first row of each group
        mask = causal_padding_mask(self.prompt_mask[firsts])
        rotary = self.rotary.select(firsts, length)
        x = net.embed_ids(prompt_ids[firsts])  # (n, P, E)
        for index, layer in enumerate(net.layers):
            q, k, v = net.qkv(layer, net.norm(x, layer.input_norm), rotary)
            self.keys[index][:, :, :length] = k.repeat_interleave(counts, dim=0)
            self.values[index][:, :, :length] = v.repeat_interleave(counts, dim=0)
            x = x + net.attention_out(layer, net.sdpa(q, k, v, mask))
            x = x + net.mlp(layer, x)
        self.length = length
        return logits_of(x[:, -1], self.state).repeat_interleave(counts, dim=0)

    def step(self, tokens: Tensor) -> Tensor:
        """(B,) tokens just sampled -> logits (B, V) of the next one."""
        logits = self._step(tokens, self.length, self.state)
        self.length += 1
        return logits


@dataclass
class DecodeWeights:
    """The decode step's matrices, prepared once per rollout (shared by its lanes, read only)."""

    fold: bool  # RMSNorm weights folded into the matrices after them
    layers: list[_DecodeLayer]
    head: _DecodeLinear

    @classmethod
    def of(cls, net: DecoderFunctional) -> DecodeWeights:
        # float32: fold each RMSNorm weight into the matrix after it, so a norm is one row scale
        # (same rounding class as LlamaRMSNorm; in lower precision its cast order would differ).
        fold = net.embed.dtype == torch.float32
        # Folded norm weights also carry sqrt(E): rsqrt(mean(x^2) + eps) = sqrt(E) * rsqrt(sum(x^2) + E*eps).
        norm_gain = net.hidden**0.5 if fold else 1.0
        layers = [_DecodeLayer.of(layer, net, fold=fold, norm_gain=norm_gain) for layer in net.layers]
        head_scale = net.final_norm * norm_gain if fold else None
        return cls(fold, layers, _DecodeLinear(net.lm_head, net.lm_head_bias, in_scale=head_scale))


def _positions(prompt_mask: Tensor, max_new_tokens: int) -> Tensor:
    """(B, S) positions as `generate()` numbers them: the prompt's count real tokens (left padding does not
    shift them), each new token takes the next."""
    prompt_positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P)
    last = prompt_positions[:, -1:]  # left padding: the last column is a real token
    steps = torch.arange(1, max_new_tokens + 1, device=prompt_mask.device)
    return torch.cat([prompt_positions, last + steps], dim=1)


def _key_bias(prompt_mask: Tensor, total: int, dtype: torch.dtype) -> Tensor:
    """(B, S) additive key mask over the whole horizon: prompt padding -inf, generated tokens visible."""
    batch, prompt_length = prompt_mask.shape
    bias = torch.zeros(batch, total, dtype=dtype, device=prompt_mask.device)
    bias[:, :prompt_length].masked_fill_(prompt_mask == 0, float("-inf"))
    return bias


def _decode_state(
    net: DecoderFunctional, weights: DecodeWeights, caches: list[Tensor], rotary: Rotary, key_bias: Tensor
) -> DecodeState:
    """Everything a decode step reads, over the (2, B, KV, S, D) `caches` of one decoder.

    Besides its matmuls, a decode step is dozens of small ops per layer (a large share of its time), so every
    view it needs is made here, once: the caches as (B*KV, S, D) batches (keys transposed), and the qkv and
    gate/up products written into buffers (`out=`) that every layer and step reuse, with their parts (q, k, v,
    the complex view RoPE rotates, gate, up) viewed once."""
    _, batch, _, total, _ = caches[0].shape
    device, dtype = caches[0].device, caches[0].dtype
    kv_rows = batch * net.num_kv_heads
    heads, kv_heads = net.num_heads, net.num_kv_heads
    qkv_out = torch.empty(batch, (heads + 2 * kv_heads) * net.head_dim, dtype=dtype, device=device)
    fused = qkv_out.view(batch, heads + 2 * kv_heads, net.head_dim)
    qk = fused[:, : heads + kv_heads]
    complex_ok = rotary.cis is not None
    gate_up_out = torch.empty(batch, 2 * net.intermediate, dtype=dtype, device=device)
    gate, up = gate_up_out.split(net.intermediate, dim=-1)
    layers = weights.layers
    return DecodeState(
        embed=net.embed,
        fold=weights.fold,
        norm_eps=torch.tensor(net.hidden * net.eps, dtype=dtype, device=device),
        eps=net.eps,
        input_norms=[layer.input_norm for layer in net.layers],
        post_norms=[layer.post_norm for layer in net.layers],
        final_norm=net.final_norm,
        qkv=[t.qkv.weight_t for t in layers],
        qkv_bias=[t.qkv.bias for t in layers],
        qk_norm=[t.qk_norm for t in layers],
        o=[t.o.weight_t for t in layers],
        o_bias=[t.o.bias for t in layers],
        gate_up=[t.gate_up.weight_t for t in layers],
        gate_up_bias=[t.gate_up.bias for t in layers],
        down=[t.down.weight_t for t in layers],
        down_bias=[t.down.bias for t in layers],
        head=weights.head.weight_t,
        head_bias=weights.head.bias,
        caches=caches,
        keys_t=[cache[0].view(kv_rows, total, net.head_dim).transpose(1, 2) for cache in caches],
        values=[cache[1].view(kv_rows, total, net.head_dim) for cache in caches],
        qkv_out=qkv_out,
        q=fused[:, :heads],
        qk=qk,
        qk_complex=torch.view_as_complex(qk.unflatten(-1, (-1, 2))) if complex_ok else None,
        new_kv=fused[:, heads:].view(batch, 2, kv_heads, net.head_dim).transpose(0, 1),
        gate_up_out=gate_up_out,
        gate=gate,
        up=up,
        cis=rotary.cis,
        cos=rotary.cos,
        sin=rotary.sin,
        key_bias=key_bias.repeat_interleave(kv_heads, dim=0).unsqueeze(1),
        kv_heads=kv_heads,
        groups=heads // kv_heads,
        head_dim=net.head_dim,
    )


# The rule of thumb below is the first guess; a trainer measures the alternatives (LayoutChooser).
# With OpenMP's passive waiting (what `grpo` processes run with, see cli/), every parallel
# region wakes the sleeping pool threads, which can cost more than a second core saves on a decode
# step's small matmuls. The threshold sits between the presets where one thread decoded faster than two
# and where two won, on the 2-core CPUs measured (bench/README.md, "Measured reasons"); machines differ,
# hence the measurement. Spinning (the default policy) keeps the pool awake, and every thread helps.
_PASSIVE_PARALLEL_MIN_FLOP = 2**25


# Two lanes (half the rows each, one thread each, on two cores) pay when each lane's largest decode
# matmul is at least this. The scripted decode step runs without the GIL, so the lanes hand it over
# once per step, not per op, and even the tiny preset's lanes beat one thread (bench/README.md,
# "Measured reasons"); with a GIL hand-off per op they would not.
_LANE_MIN_FLOP = 2**20


def _largest_matmul_flop(net: DecoderFunctional, rows: int) -> int:
    widest = max(layer.qkv.weight.shape[0] for layer in net.layers)
    return 2 * rows * net.hidden * max(widest, 2 * net.intermediate)


def decode_threads(net: DecoderFunctional, rows: int) -> int:
    """Intra-op threads for decoding `rows` sequences with `net`: all of them, except one when the
    OpenMP pool sleeps between ops (OMP_WAIT_POLICY=PASSIVE) and the largest matmul is small."""
    threads = torch.get_num_threads()
    if threads == 1 or not _passive() or net.embed.device.type != "cpu":
        return threads
    return 1 if _largest_matmul_flop(net, rows) < _PASSIVE_PARALLEL_MIN_FLOP else threads


def decode_lanes(net: DecoderFunctional, rows: int) -> int:
    """2 when `rows` should be decoded as two halves side by side (each on one thread and its own
    core): decoding would otherwise run on one thread of several, and half the rows still make
    matmuls worth a core. Else 1."""
    if rows < 2 or torch.get_num_threads() < 2 or decode_threads(net, rows) != 1:
        return 1
    return 2 if _largest_matmul_flop(net, rows // 2) >= _LANE_MIN_FLOP else 1


@dataclass(frozen=True)
class DecodeLayout:
    """How a CPU decodes one rollout's rows: `lanes` side-by-side parts (two halves on two cores,
    see `decode_lanes`), each on `threads` intra-op threads."""

    lanes: int
    threads: int


def layout_candidates(net: DecoderFunctional, rows: int, *, two_lanes: bool) -> list[DecodeLayout]:
    """The layouts worth trying for `rows` rows, the rule of thumb's first. Only a CPU whose OpenMP
    pool sleeps between ops has a choice: a spinning pool, one thread or another device decode
    all rows on every thread. `two_lanes`: a side thread is there to run the second lane."""
    threads = torch.get_num_threads()
    lanes = decode_lanes(net, rows) if two_lanes else 1
    guess = DecodeLayout(lanes, 1 if lanes == 2 else decode_threads(net, rows))
    if threads == 1 or net.embed.device.type != "cpu" or not _passive():
        return [guess]
    others = [DecodeLayout(1, 1), DecodeLayout(1, threads)]
    if two_lanes and rows >= 2:
        others.append(DecodeLayout(2, 1))
    return [guess, *(layout for layout in others if layout != guess)]


def layout_key(net: DecoderFunctional, rows: int) -> Hashable:
    """What a decode step's cost depends on: the model's shapes, the rows, the dtype and the threads."""
    return (
        rows,
        net.hidden,
        net.intermediate,
        len(net.layers),
        net.num_heads,
        net.num_kv_heads,
        net.head_dim,
        net.lm_head.shape[0],
        net.embed.dtype,
        torch.get_num_threads(),
    )


@dataclass
class LayoutChooser:
    """Chooses each rollout's decode layout by measurement: after a first rollout of a key that only
    warms up (its time, with first-call costs, is not kept), rollouts try every candidate `trials`
    times (round robin, the rule of thumb's first); later ones take the layout with the least median
    seconds per decoding step.

    Why: whether a second thread or a second lane pays off on a decode step's small matmuls depends
    on the machine (what waking a sleeping OpenMP thread costs, GIL hand-offs between lanes, cache
    sizes), and a fixed threshold is right on one machine only: two 2-vCPU machines chose different
    layouts for the same model. Rows are independent, so every layout samples the same tokens.
    """

    trials: int = 1  # the differences worth having show in one rollout; each trial of a slower layout costs a step
    _seconds: dict[Hashable, dict[DecodeLayout, list[float]]] = field(default_factory=dict)
    _warm: set[Hashable] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def choose(self, key: Hashable, candidates: list[DecodeLayout]) -> DecodeLayout:
        with self._lock:
            measured = self._seconds.setdefault(key, {})
            untried = [layout for layout in candidates if len(measured.get(layout, [])) < self.trials]
            if untried:  # round robin: the candidate measured fewest times, the earliest on ties
                return min(untried, key=lambda layout: len(measured.get(layout, [])))
            return min(candidates, key=lambda layout: statistics.median(measured[layout]))

    def record(self, key: Hashable, layout: DecodeLayout, seconds_per_step: float) -> None:
        with self._lock:
            if key not in self._warm:
                self._warm.add(key)
                return
            self._seconds.setdefault(key, {}).setdefault(layout, []).append(seconds_per_step)


def _passive() -> bool:
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


class _DecodeLinear:
    """W^T (and b) of one of the decode step's matrices, for x @ W^T (+ b) (+ residual) on (B, in) rows.

    A contiguous transposed copy of W, made once per rollout, so each product is one GEMM with
    the residual added by the GEMM itself (`addmm_`). MKL's packed weights (`_mkl_linear`) are no
    faster at these row counts, and packing costs time per matrix per rollout.

    `in_scale` (in,) and `out_scale` (out,) scale W's columns and rows: the column scale is applied
    by the transposing copy itself (a multiply reading W^T, writing the contiguous copy), which costs
    no more than the copy alone, where scaling W first and copying after made two more passes.
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        *,
        in_scale: Tensor | None = None,
        out_scale: Tensor | None = None,
    ) -> None:
        out_features, in_features = weight.shape
        self.weight_t = torch.empty(in_features, out_features, dtype=weight.dtype, device=weight.device)
        if in_scale is None:
            self.weight_t.copy_(weight.t())
        else:
            torch.mul(weight.t(), in_scale[:, None], out=self.weight_t)
        if out_scale is not None:
            self.weight_t.mul_(out_scale)
            bias = None if bias is None else bias * out_scale
        self.bias = bias


@dataclass
class _DecodeLayer:
    qkv: _DecodeLinear
    qk_norm: Tensor | None  # (H + KV, D), the q rows times 1/sqrt(D)
    o: _DecodeLinear
    gate_up: _DecodeLinear
    down: _DecodeLinear

    @classmethod
    def of(cls, layer: FusedLayer, net: DecoderFunctional, *, fold: bool, norm_gain: float) -> _DecodeLayer:
        """LoRA adapters are merged into the weights. The attention scale 1/sqrt(D) goes into the q
        rows of qkv, or of the per-head q norm after it when there is one (RMSNorm would undo it).
        With `fold`, the RMSNorm weights (times `norm_gain`) scale the columns of the matrices that
        follow them: RMSNorm(x) @ W^T == (x * rstd(x)) @ (W * g)^T."""
        qkv = layer.qkv.merged_weight()
        qk_norm = row_scale = None
        if layer.qk_norm is None:
            row_scale = torch.ones(qkv.shape[0], dtype=qkv.dtype, device=qkv.device)
            row_scale[: net.num_heads * net.head_dim] = net.head_dim**-0.5
        else:
            head_scale = torch.ones(layer.qk_norm.shape[0], 1, dtype=qkv.dtype, device=qkv.device)
            head_scale[: net.num_heads] = net.head_dim**-0.5
            qk_norm = layer.qk_norm * head_scale
        return cls(
            _DecodeLinear(
                qkv,
                layer.qkv.bias,
                in_scale=layer.input_norm * norm_gain if fold else None,
                out_scale=row_scale,
            ),
            qk_norm,
            _DecodeLinear(layer.o.merged_weight(), layer.o.bias),
            _DecodeLinear(
                layer.gate_up.merged_weight(),
                layer.gate_up.bias,
                in_scale=layer.post_norm * norm_gain if fold else None,
            ),
            _DecodeLinear(layer.down.merged_weight(), layer.down.bias),
        )
