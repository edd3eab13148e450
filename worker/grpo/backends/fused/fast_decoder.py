"""A lean functional forward of Llama-family decoders for the hot paths of a GRPO step: the weights
gathered once (`DecoderFunctional`) and the full-sequence forward the log-probs and the training
step run. Incremental decoding for the sampling loop builds on it in `worker.grpo.backends.fused.static_decoder`;
the tensor operations that need no model (RMSNorm, RoPE, the causal mask) are `worker.grpo.backends.fused.ops`.

Why: on small models `transformers`' module-per-op forward (and `generate()`'s per-token
machinery: DynamicCache concatenation, logits processors, stopping criteria) costs far more than
the arithmetic, and peft's LoRA adds a module call per adapter and projection on top. This module
runs the same computation on the model's own parameters with fewer and fused ops: one q/k/v matmul
and one gate/up matmul per layer (weights concatenated, so gradients still reach the original
parameters), LoRA adapters as one low-rank product per fused matmul (x @ W^T + s * (x @ A^T) @ B^T,
the A of q, k and v stacked and the scaled B block-diagonal), rotary embeddings as one complex
multiply (the q and k rows of each head are permuted so that RoPE's (i, i + D/2) pairs sit side by
side: attention scores are unchanged, since q and k share the permutation) and `F.rms_norm`.

Covered (`supports`): `LlamaForCausalLM` (any GQA ratio, any rope_type, attention/MLP biases),
`Qwen2ForCausalLM` (q/k/v biases), `Qwen3ForCausalLM` (per-head q/k RMSNorm) and
`MistralForCausalLM`, plain or wrapped in a peft LoRA model, without gradient checkpointing or
attention dropout in training, and with a sliding window (if any) no shorter than the sequence.
Callers fall back to the `transformers` forward otherwise. Logits equal the `transformers` ones up
to float rounding at every real (unmasked) position; padded positions attend to themselves only
(they are never read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from peft import PeftModel, PeftType
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import Tensor, nn
from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from worker.grpo.backends.fused.ops import (
    Rotary,
    causal_padding_mask,
    head_rms_norm,
    llama_rms_norm,
    pair_ordered,
    rms_norm,
)

# Activation functions the fused MLP implements (config.hidden_act -> function).
_ACTIVATIONS = {"silu": F.silu}
# The causal LM classes whose forward this module reproduces (same layer layout).
_FAMILY: tuple[type, ...] = (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM)


def supports(model: Any, max_length: int) -> bool:
    """True when this module reproduces `model` exactly on sequences of up to `max_length` tokens."""
    base = _unwrap(model)
    if base is None or type(base) not in _FAMILY:  # subclasses and other wrappers: generic path
        return False
    config = base.config
    if getattr(config, "pretraining_tp", 1) != 1 or config.hidden_act not in _ACTIVATIONS:
        return False
    # Attention dropout only matters in training mode; the functional path has none.
    if base.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return False
    # A key further back than the window is hidden; with the whole sequence inside it nothing is.
    window = getattr(config, "sliding_window", None)
    if window is not None and max_length > window:
        return False
    # Should transformers rename its checkpointing property, a class that has the new one is asked.
    if getattr(type(base), "is_activation_checkpointing", None) is not None and base.is_activation_checkpointing:
        return False
    return _plain_modules(base)


def _unwrap(model: Any) -> Any | None:
    """The transformers model inside a peft LoRA wrapper (or `model` itself); None for other peft methods."""
    if not isinstance(model, PeftModel):
        return model
    if any(config.peft_type != PeftType.LORA for config in model.peft_config.values()):
        return None
    return model.get_base_model()


def _projections(base: Any) -> list[Any]:
    """Every attention and MLP projection of every layer."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    return [
        getattr(module, name)
        for layer in base.model.layers
        for module, group in ((layer.self_attn, names), (layer.mlp, ("gate_proj", "up_proj", "down_proj")))
        for name in group
    ]


def _plain_modules(base: Any) -> bool:
    """No module checkpoints its activations, and adapters (if any) are plain LoRA on the
    projections: no DoRA or other variant, no LoRA bias, not merged, at most one active; no adapted
    embeddings, LM head or modules_to_save.

    One pass over the modules, which this runs several times per step: a LoRA model has several per
    projection (1,000+ for a 24-layer one), and transformers' `is_gradient_checkpointing` property would
    make a second pass. The flag is read from each module's own attributes, where
    `gradient_checkpointing_enable()` sets it (a class default is False)."""
    projections = {id(module) for module in _projections(base)}
    for module in base.modules():
        if vars(module).get("gradient_checkpointing"):
            return False
        if isinstance(module, AuxiliaryTrainingWrapper):
            return False
        if not isinstance(module, BaseTunerLayer):
            continue
        if type(module) is not LoraLinear or id(module) not in projections or module.merged:
            return False
        if module.fan_in_fan_out or type(module.get_base_layer()) is not nn.Linear:
            return False
        active = [name for name in module.active_adapters if name in module.lora_A]
        if len(active) > 1:
            return False
        if active and (active[0] in module.lora_variant or module.lora_bias[active[0]]):
            return False
    return True


@dataclass
class _Adapter:
    """One projection's active LoRA adapter: adds scale * B @ A @ dropout(x)."""

    a: Tensor  # (r, in)
    b: Tensor  # (out, r)
    scale: float
    dropout: float  # probability, 0 outside training mode


def _adapter(module: Any) -> _Adapter | None:
    if type(module) is not LoraLinear or module.disable_adapters:
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if not active:
        return None
    name = active[0]
    dropout = module.lora_dropout[name]
    p = float(dropout.p) if isinstance(dropout, nn.Dropout) and dropout.training else 0.0
    a, b = cast(Tensor, module.lora_A[name].weight), cast(Tensor, module.lora_B[name].weight)
    return _Adapter(a, b, float(module.scaling[name]), p)


@dataclass
class FusedLinear:
    """Several projections of the same input as one matmul, with their LoRA adapters (if any):
    y = x @ W^T + b + (x @ A^T) @ B^T, W and b the parts stacked, A the adapted parts' A stacked and
    B block-diagonal with each part's scale. Rows of some parts may be in RoPE-pair order (see
    `pair_ordered`)."""

    weight: Tensor  # (out, in)
    bias: Tensor | None  # (out,)
    a: Tensor | None  # (R, in), R the adapted parts' ranks summed
    b: Tensor | None  # (out, R)
    ranks: list[int]  # the adapted parts' ranks, in the order of a's rows
    dropouts: list[float]  # their adapter dropout probabilities

    @classmethod
    def of(
        cls, modules: list[Any], *, adapters: bool = True, paired: list[bool] | None = None, head_dim: int = 0
    ) -> FusedLinear:
        """`paired`: per module, whether its rows (heads of `head_dim` features) go in RoPE-pair order."""
        bases = [getattr(module, "base_layer", module) for module in modules]
        weight = _stacked([base.weight for base in bases], paired, head_dim)
        biases = [base.bias for base in bases]
        bias = None if biases[0] is None else _stacked(biases, paired, head_dim)
        parts = [_adapter(module) if adapters else None for module in modules]
        used = [adapter for adapter in parts if adapter is not None]
        a = b = None
        if used:
            a = torch.cat([adapter.a for adapter in used]) if len(used) > 1 else used[0].a
            # A part without an adapter contributes zero rows to B (a (out, 0) block). The scale is
            # multiplied as a Scalar: `b * scale` would wrap it in a tensor that the graph saves,
            # and several forwards sharing one net could not all run their backward through it.
            blocks = [
                base.weight.new_zeros(base.weight.shape[0], 0).to(used[0].b.dtype)
                if adapter is None
                else torch.ops.aten.mul.Scalar(adapter.b, adapter.scale)
                for base, adapter in zip(bases, parts, strict=True)
            ]
            b = torch.block_diag(*blocks) if len(blocks) > 1 else blocks[0]
            if paired is not None and any(paired):
                b = _stacked(list(b.split([block.shape[0] for block in blocks])), paired, head_dim)
        return cls(
            weight,
            bias,
            a,
            b,
            [adapter.a.shape[0] for adapter in used],
            [adapter.dropout for adapter in used],
        )

    def __call__(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.a is None or self.b is None:
            return out
        x = x.to(self.a.dtype)  # peft runs adapters in their own dtype (float32 beside bfloat16 weights)
        if any(self.dropouts):  # each part draws its own dropout mask, as peft's modules do
            low = torch.cat(
                [
                    F.linear(F.dropout(x, p) if p else x, a)
                    for a, p in zip(self.a.split(self.ranks), self.dropouts, strict=True)
                ],
                dim=-1,
            )
        else:
            low = F.linear(x, self.a)  # (..., R)
        return (out + F.linear(low, self.b)).to(out.dtype)

    def merged_weight(self) -> Tensor:
        """W + B @ A (scales inside B), in W's dtype: the same map without dropout."""
        if self.a is None or self.b is None:
            return self.weight
        return (self.weight + self.b @ self.a).to(self.weight.dtype)


@dataclass
class FusedLayer:
    input_norm: Tensor
    qkv: FusedLinear  # (H*D + 2*KV*D, E): q, k, v stacked, q and k rows pair-ordered
    qk_norm: Tensor | None  # (H + KV, D) per-head q/k RMSNorm weights, pair-ordered (Qwen3), else None
    o: FusedLinear
    post_norm: Tensor
    gate_up: FusedLinear  # (2*I, E): gate then up
    down: FusedLinear


class DecoderFunctional:
    """The model's weights gathered for the functional forward. Build a fresh one after each
    optimiser step that should be visible (concatenated weights are copies; under autograd the
    concatenation is part of the graph, so gradients flow to the original parameters). With a
    peft model, the adapters active at construction time are applied (none inside
    `disable_adapter()`, or with `adapters=False`: the base model, without toggling the shared
    model's state, so that it may run beside a forward of the adapted model)."""

    def __init__(self, model: Any, *, adapters: bool = True) -> None:
        base = _unwrap(model)
        if base is None:
            raise ValueError("only LoRA adapters take the functional path (see supports)")
        config = base.config
        self.model = base
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.eps = float(config.rms_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]
        self.intermediate = int(config.intermediate_size)
        self.hidden = int(config.hidden_size)
        core = base.model
        self.embed = core.embed_tokens.weight
        # nn.Embedding's padding_idx: that row gets no gradient (a sampled pad token is a real input).
        self.padding_idx = core.embed_tokens.padding_idx
        self.final_norm = core.norm.weight
        self.lm_head = base.lm_head.weight
        self.lm_head_bias = base.lm_head.bias
        self.rotary_emb = core.rotary_emb
        self.layers = [self._layer(layer, adapters) for layer in core.layers]

    def _layer(self, layer: Any, adapters: bool) -> FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qk_norm = None
        q_norm = getattr(attn, "q_norm", None)
        if q_norm is not None:
            # Pair order within a head as a view (no index): the graph of a net's weights keeps no
            # tensors, so several forwards may share one net and run their backwards through it.
            qk_norm = torch.cat(
                [
                    pair_ordered(q_norm.weight).expand(self.num_heads, -1),
                    pair_ordered(attn.k_norm.weight).expand(self.num_kv_heads, -1),
                ]
            )
        return FusedLayer(
            input_norm=layer.input_layernorm.weight,
            # q and k rows in RoPE-pair order (see `pair_ordered`); v keeps the model's order.
            qkv=FusedLinear.of(
                [attn.q_proj, attn.k_proj, attn.v_proj],
                adapters=adapters,
                paired=[True, True, False],
                head_dim=self.head_dim,
            ),
            qk_norm=qk_norm,
            o=FusedLinear.of([attn.o_proj], adapters=adapters),
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=FusedLinear.of([mlp.gate_proj, mlp.up_proj], adapters=adapters),
            down=FusedLinear.of([mlp.down_proj], adapters=adapters),
        )

    # --- building blocks ---------------------------------------------------------------------

    def embed_ids(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.embed, self.padding_idx)

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """LlamaRMSNorm: normalise in float32, cast back, then scale (same order as transformers)."""
        if x.dtype == torch.float32:
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return rms_norm(x, weight, self.eps)
        return llama_rms_norm(x, weight, self.eps)

    def rotary(self, position_ids: Tensor, dtype: torch.dtype) -> Rotary:
        """The model's own RoPE (any rope_type) at `position_ids` (B, T), for pair-ordered q/k rows."""
        probe = torch.empty(0, dtype=dtype, device=position_ids.device)
        cos, sin = self.rotary_emb(probe, position_ids)  # (B, T, D): the D/2 frequencies twice
        half = self.head_dim // 2
        return Rotary.of(cos[..., :half], sin[..., :half])

    def head_norm(self, qk: Tensor, weight: Tensor) -> Tensor:
        """Qwen3's per-head RMSNorm of q and k: (..., H+KV, D) with (H+KV, D) weights, rounded like `norm`."""
        return head_rms_norm(qk, weight, self.eps)

    def qkv(self, layer: FusedLayer, h: Tensor, rotary: Rotary) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, E) normalised input -> q (B, H, T, D), k and v (B, KV, T, D), RoPE applied."""
        batch, length, _ = h.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        fused = layer.qkv(h).view(batch, length, heads + 2 * kv_heads, dim)  # (B, T, H+2KV, D)
        qk, v = fused.split([heads + kv_heads, kv_heads], dim=2)
        if layer.qk_norm is not None:
            qk = self.head_norm(qk, layer.qk_norm)
        # One RoPE for q and k together; the (B, T) tables broadcast over heads.
        qk = rotary.unsqueeze(1).apply(qk.transpose(1, 2))  # (B, H+KV, T, D)
        return qk[:, :heads], qk[:, heads:], v.transpose(1, 2)

    def attention_out(self, layer: FusedLayer, attn: Tensor) -> Tensor:
        """(B, H, T, D) -> (B, T, E) through o_proj."""
        batch, _, length, _ = attn.shape
        merged = attn.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return layer.o(merged)

    def mlp(self, layer: FusedLayer, x: Tensor) -> Tensor:
        gate, up = layer.gate_up(self.norm(x, layer.post_norm)).split(self.intermediate, dim=-1)
        return layer.down(self.act(gate) * up)

    def logits(self, hidden: Tensor) -> Tensor:
        """Final-norm hidden states (..., E) -> logits (..., V)."""
        return F.linear(hidden, self.lm_head, self.lm_head_bias)

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
        )

    # --- whole-sequence forward (log-probs, with or without grad) ------------------------------

    def forward_hidden(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: slice
    ) -> Tensor:
        """Final-norm hidden states (B, K, E) at positions `keep` of a causal forward over (B, T) tokens."""
        mask = causal_padding_mask(attention_mask)  # (B, 1, T, T) bool
        rotary = self.rotary(position_ids, self.embed.dtype)
        x = self.embed_ids(input_ids)  # (B, T, E)
        for layer in self.layers:
            q, k, v = self.qkv(layer, self.norm(x, layer.input_norm), rotary)
            x = x + self.attention_out(layer, self.sdpa(q, k, v, mask))
            x = x + self.mlp(layer, x)
        return self.norm(x[:, keep], self.final_norm)

    def completion_logits(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, completion_length: int
    ) -> Tensor:
        """Logits (N, C, V) predicting the last C tokens of (N, P + C) rows (see `completion_hidden`)."""
        return self.logits(self.completion_hidden(input_ids, attention_mask, position_ids, completion_length))

    def completion_hidden(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, completion_length: int
    ) -> Tensor:
        """Final-norm hidden states (N, C, E) predicting the last C tokens of (N, P + C) rows: the
        LM head's input, so that a caller can apply it in chunks.

        GRPO rows come in groups that share a prompt: consecutive rows with identical prompt
        ids and mask run the prompt positions once per group and expand its keys/values (the
        prompt's states do not depend on what follows it, so this is the same function, and its
        gradient sums over the group). Saves (G - 1) / G of the prompt's share of the compute.

        The last token predicts nothing scored and no earlier position attends to it: it is left
        out of the forward (one position per row less to compute).
        """
        prompt_length = input_ids.shape[1] - completion_length
        keys = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length]], dim=1)
        _, counts = torch.unique_consecutive(keys, dim=0, return_counts=True)
        scored = slice(None, -1)  # every position but the last
        if counts.shape[0] == input_ids.shape[0] or completion_length == 1:  # nothing shared, or nothing after it
            total = input_ids.shape[1]
            return self.forward_hidden(
                input_ids[:, scored],
                attention_mask[:, scored],
                position_ids[:, scored],
                slice(prompt_length - 1, total - 1),
            )
        firsts = torch.cumsum(counts, 0) - counts  # first row of each group
        return self._shared_prompt_hidden(
            input_ids[:, scored],
            attention_mask[:, scored],
            position_ids[:, scored],
            prompt_length,
            firsts,
            counts,
        )

    def _shared_prompt_hidden(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prompt_length: int,
        firsts: Tensor,
        counts: Tensor,
    ) -> Tensor:
        """Prompt rows (one per group, n x P) and completion rows (N x C) stacked into one (R, E)
        matrix, so norms, projections and MLPs run once over both; only attention is split. The rows
        end before the sequence's last token: the hidden states (N, C + 1, E) predict the C + 1 tokens
        after position P - 1.

        Completion positions after a row's EOS (attention mask 0) are left out of the stacked
        matrix when they are a noticeable share: no real position attends to them and no loss
        reads their outputs, so only attention sees them, as zeros in the padded layout.
        """
        p = prompt_length
        groups, rows, completion = firsts.shape[0], input_ids.shape[0], input_ids.shape[1] - p
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        full_mask = causal_padding_mask(attention_mask)  # (N, 1, T, T)
        prompt_mask = full_mask[firsts, :, :p, :p]  # (n, 1, P, P)
        completion_mask = full_mask[:, :, p:, :]  # (N, 1, C, T)
        kept = _kept_completion_positions(attention_mask[:, p:])  # (K,) flat indices into N*C, or None
        completion_positions = position_ids[:, p:].reshape(-1)
        completion_ids = input_ids[:, p:].reshape(-1)
        if kept is not None:
            completion_positions, completion_ids = completion_positions[kept], completion_ids[kept]
        # (R, 1, D/2) tables in the stacked row order: each group's prompt once, then the completions.
        stacked_positions = torch.cat([position_ids[firsts, :p].reshape(-1), completion_positions])
        rotary = self.rotary(stacked_positions[None], self.embed.dtype).squeeze(0).unsqueeze(1)
        x = self.embed_ids(torch.cat([input_ids[firsts, :p].reshape(-1), completion_ids]))  # (R, E)
        split = groups * p
        group = rows // groups if bool((counts == rows // groups).all()) else None  # one size for every group
        for layer in self.layers:
            fused = layer.qkv(self.norm(x, layer.input_norm))
            fused = fused.view(-1, heads + 2 * kv_heads, dim)  # (R, H+2KV, D)
            # split() rather than slicing: its backward is one cat, where each slice's backward
            # would zero-fill and accumulate a full-size gradient.
            qk, v = fused.split([heads + kv_heads, kv_heads], dim=1)
            if layer.qk_norm is not None:
                qk = self.head_norm(qk, layer.qk_norm)
            qk = rotary.apply(qk)  # RoPE on q and k at once
            qk_p, qk_c = qk.split([split, qk.shape[0] - split])
            v_p, v_c = v.split([split, v.shape[0] - split])
            if kept is not None:  # back to the padded (N*C) layout for attention
                qk_c, v_c = _unpack(qk_c, kept, rows * completion), _unpack(v_c, kept, rows * completion)
            qp, kp = qk_p.view(groups, p, -1, dim).transpose(1, 2).split([heads, kv_heads], dim=1)
            qc, kc = qk_c.view(rows, completion, -1, dim).transpose(1, 2).split([heads, kv_heads], dim=1)
            vp = v_p.view(groups, p, kv_heads, dim).transpose(1, 2)  # (n, KV, P, D)
            vc = v_c.view(rows, completion, kv_heads, dim).transpose(1, 2)  # (N, KV, C, D)
            keys, values = _after_prompt(kp, kc, counts, group), _after_prompt(vp, vc, counts, group)
            attn_p = self.sdpa(qp, kp, vp, prompt_mask)  # (n, H, P, D)
            attn_c = self.sdpa(qc, keys, values, completion_mask)  # (N, H, C, D)
            attn_c = attn_c.transpose(1, 2).reshape(rows * completion, -1)
            if kept is not None:
                attn_c = attn_c.index_select(0, kept)
            attn = torch.cat([attn_p.transpose(1, 2).reshape(split, -1), attn_c])  # (R, H*D)
            x = x + layer.o(attn)
            x = x + self.mlp(layer, x)
        # Position P-1 (the prompt's last token) predicts the first completion token.
        x_prompt, x_completion = x.split([split, x.shape[0] - split])
        if kept is not None:
            x_completion = _unpack(x_completion, kept, rows * completion)
        last_prompt = x_prompt.view(groups, p, -1)[:, -1:].repeat_interleave(counts, dim=0)  # (N, 1, E)
        hidden = torch.cat([last_prompt, x_completion.view(rows, completion, -1)], dim=1)  # (N, C + 1, E)
        return self.norm(hidden, self.final_norm)


# Leaving masked completion positions out costs a scatter and a gather per layer: below this
# share of the completion positions that costs more than it saves.
_MIN_SKIPPED_SHARE = 0.05


def _kept_completion_positions(completion_mask: Tensor) -> Tensor | None:
    """Flat indices (into N*C) of the unmasked completion positions, or None to keep them all."""
    flat = completion_mask.reshape(-1).bool()
    skipped = flat.numel() - int(flat.sum())
    if skipped < _MIN_SKIPPED_SHARE * flat.numel():
        return None
    return flat.nonzero().squeeze(1)


def _stacked(parts: list[Tensor], paired: list[bool] | None, head_dim: int) -> Tensor:
    """Row blocks (rows, ...) stacked into one tensor, the rows of each block marked in `paired` in
    RoPE-pair order (see `pair_ordered`). The reordering is a view (within a head, (2, D/2) ->
    (D/2, 2)) inside the one copy the concatenation makes, so the gradient flows back through views
    rather than an index scatter into a zero-filled tensor."""
    if paired is None or not any(paired):
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    half = head_dim // 2
    views = [
        part.view(-1, 2, half, *part.shape[1:]).transpose(1, 2)
        if pair
        else part.view(-1, half, 2, *part.shape[1:])
        for part, pair in zip(parts, paired, strict=True)
    ]
    return torch.cat(views).view(-1, *parts[0].shape[1:])


def _after_prompt(prompt: Tensor, completion: Tensor, counts: Tensor, group: int | None) -> Tensor:
    """Each row's keys or values over the whole sequence, (N, KV, P + C, D): its group's prompt part
    (n, KV, P, D) then its own completion part (N, KV, C, D). With groups of one size the prompt part
    is broadcast over the group (one copy, and its gradient a sum over the group's rows)."""
    if group is None:
        return torch.cat([prompt.repeat_interleave(counts, dim=0), completion], dim=2)
    groups, kv_heads, length, dim = prompt.shape
    shared = prompt.unsqueeze(1).expand(groups, group, kv_heads, length, dim)
    together = torch.cat([shared, completion.view(groups, group, kv_heads, -1, dim)], dim=3)
    return together.view(groups * group, kv_heads, -1, dim)


def _unpack(kept_rows: Tensor, kept: Tensor, total: int) -> Tensor:
    """(K, ...) rows -> (total, ...) with them at `kept` and zeros elsewhere (differentiable)."""
    padded = kept_rows.new_zeros((total, *kept_rows.shape[1:]))
    return padded.index_copy(0, kept, kept_rows)
