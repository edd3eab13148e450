"""Analytic FLOP count of a GRPO step's training phase, and the machine's measured dense-matmul peak.

Imported by `bench/grpo_step.py` (run as a script, so this directory is on `sys.path`).

The count is the least work the step needs, the same for both frameworks: each group's shared prompt
once, every completion up to and including its EOS, the LM head over completion positions only. An
implementation that does more (every row's copy of the prompt, positions after EOS) spends the extra
time without extra credit, so the share of the peak says how far a framework is from the limit of this
machine for this step, and cannot exceed 1 at a correctly measured peak.

Per token and matmul weight, a forward costs 2 FLOPs (multiply and add); a backward 2 for the input's
gradient and 2 more for the weight's gradient when the weight is trained. Causal attention costs
4 * heads * head_dim * (position + 1) per token and layer forward (scores and the weighted sum), twice
that backward. Element-wise work (norms, RoPE, activations, softmax, optimiser) is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> ModelDims:
        """From a transformers config (Llama-family field names)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
        )

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every linear layer of one decoder layer: q, k, v, o, gate, up, down."""
        h, i, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]

    @property
    def body_weights(self) -> int:
        """Matmul weights of all decoder layers (embedding lookup and norms are not matmuls)."""
        return self.layers * sum(n_in * n_out for n_in, n_out in self.linear_shapes())

    @property
    def head_weights(self) -> int:
        return self.hidden * self.vocab

    def lora_weights(self, rank: int) -> int:
        """A (r x in) and B (out x r) of every decoder linear layer ("all-linear" leaves the LM head out)."""
        return self.layers * sum(rank * (n_in + n_out) for n_in, n_out in self.linear_shapes())


@dataclass(frozen=True)
class StepTokens:
    """One step's rows: `rows` sequences in groups of `group_size` sharing a prompt of `prompt` tokens,
    each with `completion` tokens up to and including EOS (means over the step)."""

    rows: int
    group_size: int
    prompt: float
    completion: float

    @property
    def positions(self) -> float:
        """Positions that run through the decoder layers: each group's prompt once, every completion."""
        return self.rows / self.group_size * self.prompt + self.rows * self.completion

    @property
    def attention_pairs(self) -> float:
        """(query, key) pairs of causal attention: within each group's prompt, and from every completion
        position to its prompt and the completion positions before it."""
        p, c = self.prompt, self.completion
        return self.rows / self.group_size * p * (p + 1) / 2 + self.rows * (c * p + c * (c + 1) / 2)


def _attention_forward(dims: ModelDims, tokens: StepTokens) -> float:
    return 4.0 * dims.layers * dims.heads * dims.head_dim * tokens.attention_pairs


def _linear_forward(dims: ModelDims, tokens: StepTokens) -> float:
    return 2.0 * (dims.body_weights * tokens.positions + dims.head_weights * tokens.rows * tokens.completion)


def _first_layer_qkv_inputs(dims: ModelDims) -> int:
    """Weights of layer 0's q, k and v projections: with LoRA nothing before them is trained, so the
    gradient of their input is never needed."""
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    return dims.hidden * (q + 2 * kv)


def training_phase_linear_flops(
    dims: ModelDims, tokens: StepTokens, *, lora_rank: int | None, beta: float
) -> float:
    """Matmul-with-a-weight FLOPs after generation: the reference forward (beta > 0), the policy's
    forward and backward.

    Full fine-tune: forward F, backward 2F (input and weight gradients; the embedding is trained, so
    every input gradient is needed). LoRA r: frozen weights need only input gradients, except layer 0's
    q/k/v projections, whose input depends on nothing trained; each adapter (x @ A.T) @ B.T costs
    2 r (in + out) per position forward, as much for A's and B's weight gradients, and as much again for
    the input gradients (less 2 r in on layer 0's q/k/v). The reference (LoRA: the base with the
    adapters off) is one forward F.
    """
    forward = _linear_forward(dims, tokens)
    reference = forward if beta > 0 else 0.0
    if lora_rank is None:
        return 3.0 * forward + reference
    base_backward = forward - 2.0 * _first_layer_qkv_inputs(dims) * tokens.positions
    adapters = 2.0 * dims.lora_weights(lora_rank) * tokens.positions
    first_qkv_a_inputs = 2.0 * lora_rank * 3 * dims.hidden * tokens.positions
    return forward + base_backward + 3.0 * adapters - first_qkv_a_inputs + reference


def training_phase_attention_flops(dims: ModelDims, tokens: StepTokens, *, beta: float) -> float:
    """Attention FLOPs after generation: forward A, backward 2A (q, k and v all need gradients, with
    LoRA too: layer 0's q/k/v carry adapters); the reference one more A."""
    attention = _attention_forward(dims, tokens)
    return 3.0 * attention + (attention if beta > 0 else 0.0)


def training_phase_flops(dims: ModelDims, tokens: StepTokens, *, lora_rank: int | None, beta: float) -> float:
    """FLOPs after generation: the reference forward (beta > 0) and the policy's forward and backward."""
    linear = training_phase_linear_flops(dims, tokens, lora_rank=lora_rank, beta=beta)
    return linear + training_phase_attention_flops(dims, tokens, beta=beta)


def matmul_peak_flops(*, threads: int, sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 5) -> float:
    """Best FLOP/s of a square float32 `torch.matmul` on `threads` CPU threads over a few sizes."""
    import time

    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for size in sizes:
        a, b = torch.randn(size, size), torch.randn(size, size)
        out = torch.empty(size, size)
        torch.matmul(a, b, out=out)  # warm-up: first call allocates and picks the kernel
        for _ in range(repeats):
            started = time.perf_counter()
            torch.matmul(a, b, out=out)
            best = max(best, 2.0 * size**3 / (time.perf_counter() - started))
    return best


def cuda_matmul_peak_flops(*, size: int = 8192, warmup: int = 3, repeats: int = 10) -> float:
    """Median FLOP/s of a square bfloat16 `torch.matmul` on the current CUDA device, timed with CUDA events
    on random data (zeros run faster than real data on some cards)."""
    import statistics

    import torch

    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2.0 * size**3 / statistics.median(times)
