"""How the `hf` backend runs a model's module forward: bf16 mixed precision and per-layer `torch.compile`.

- `bf16` (TRL's `bf16`): the weights and the optimiser state stay in the job's `dtype`; every call of the model's
  forward (sampling, log-probs with and without gradient, evaluation) runs under `torch.autocast(bfloat16)`, so
  its matmuls run in bf16 and accumulate in float32 where the kernels do. The forward is wrapped on the model
  instance, as accelerate does, so every caller and every thread gets it. The log-probs stay float32: the LM
  head's log-softmax (`worker.grpo.logprobs.head_logprobs`) runs outside the forward, on its float32 input.
- `torch_compile`: each decoder layer's forward is compiled (`torch.compile`, dynamic shapes: prompt and
  completion lengths change every step), the granularity torchtitan and TRL's FSDP2 recipes use. The whole model
  is not: the log-prob forward stops at the LM head by raising from a hook (`module_logprobs`), which a compiled
  graph would break on, and one graph per layer serves every layer of the same shape. That holds where the layers
  run without a KV cache: the training and log-prob forwards, where the compute is. Decoding runs them eagerly:
  each layer reads its own entry of the cache (`past_key_values.layers[layer_idx]`), which dynamo guards on, so
  every layer would compile a graph of its own and, past dynamo's recompile limit, run eagerly all the same.

Neither applies to the `fused` backend, which reads the weights directly: `backends.fused_applies` sends such
jobs to `hf`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def apply_module_options(model: Any, *, bf16: bool, compile_layers: bool) -> None:
    """Set up `model` (a transformers causal LM, or a peft model around one) as the job asks; in place."""
    if compile_layers:
        for layer in decoder_layers(model):
            compile_without_cache(layer)
    if bf16:
        autocast_forward(model, torch.bfloat16)


def compile_without_cache(layer: torch.nn.Module) -> None:
    """`layer`'s forward compiled, except where it is given a KV cache (decoding): the module docstring says why.
    transformers' models pass the cache to their decoder layers by name (`past_key_values=`)."""
    eager = layer.forward
    compiled = torch.compile(eager, dynamic=True)

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("past_key_values") is not None:
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    layer.forward = forward


def autocast_forward(model: Any, dtype: torch.dtype) -> None:
    """Every call of `model`'s forward runs under torch.autocast(`dtype`) on the model's device type."""
    forward = model.forward
    device_type = next(model.parameters()).device.type

    @functools.wraps(forward)
    def autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The repeated decoder layers of a causal LM (through a peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"torch_compile: {type(base).__name__} has no decoder layers to compile")
    return layers
