"""The policy's full weights, one decoder layer at a time, LoRA adapters merged: what a vLLM engine is fed after
every step (worker.grpo.vllm_rollout) and what a sharded job's consolidated checkpoint is written from
(worker.grpo.consolidated). Under fsdp each unit (a decoder layer, then the root) is gathered while it is read
and freed after, so no rank ever holds the whole policy; elsewhere the policy is read as it is."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import Tensor

from worker.grpo.modeling import ModelBundle
from worker.grpo.module_options import decoder_layers

Gathering = Callable[[torch.nn.Module], AbstractContextManager[Any]]


@dataclass(frozen=True)
class UnitWeights:
    """One unit's weights under the base model's names: `merged` (adapters added to their base weights, as a
    plain model holds them) and `adapters` (the LoRA tensors themselves, e.g. `...q_proj.lora_A.default.weight`)."""

    merged: dict[str, Tensor]
    adapters: dict[str, Tensor]


@contextmanager
def gathered_layer(layer: torch.nn.Module) -> Iterator[None]:
    """An FSDP unit's full parameters, in place, for the duration (fsdp: each decoder layer is one)."""
    layer.unshard()  # type: ignore[operator]  # FSDPModule's, mixed in by fully_shard
    try:
        yield
    finally:
        layer.reshard()  # type: ignore[operator]


def base_model(models: ModelBundle) -> Any:
    """The transformers model under a peft wrapper (or the policy itself)."""
    return models.policy.get_base_model() if models.is_lora else models.policy


def unit_count(models: ModelBundle) -> int:
    """How many units `unit_weights` yields: the decoder layers, then the rest."""
    return len(decoder_layers(base_model(models))) + 1


@torch.no_grad()
def unit_weights(models: ModelBundle, *, gathered: Gathering | None = None) -> Iterator[UnitWeights]:
    """The policy's weights, one decoder layer at a time, then what no layer holds (embeddings, final norm,
    head), each read inside `gathered(layer)` (fsdp: the layer's shards gathered for it, then freed; the
    caller gathers the root). A LoRA layer's merged weight is W + its active adapter's delta (peft's
    `get_delta_weight`, on every layer kind); the policy keeps its adapters. A head tied to the embedding comes
    under both names, as in a state dict. With fsdp a collective: every rank iterates to the end; a unit's
    tensors are valid until the next is asked for (its layer is then resharded: copy what you keep)."""
    base = base_model(models)
    adapter = models.policy.active_adapter if models.is_lora else None
    layers = decoder_layers(base)
    names = {id(module): name for name, module in base.named_modules()}
    for layer in layers:
        with (gathered or nullcontext)(layer):
            yield _unit(layer, names[id(layer)], adapter, skip=set())
    yield _unit(base, "", adapter, skip={id(layer) for layer in layers})


def policy_weights(models: ModelBundle, *, gathered: Gathering | None = None) -> Iterator[tuple[str, Tensor]]:
    """`unit_weights`' merged weights as (name, tensor) pairs."""
    for unit in unit_weights(models, gathered=gathered):
        yield from unit.merged.items()


def merged_weights(model: Any) -> dict[str, Tensor]:
    """A whole (unsharded) peft LoRA model's weights as the plain model it computes holds them: each adapted
    weight is W + its active adapter's delta, under the base model's names; `model` is left untouched."""
    return _unit(model.get_base_model(), "", model.active_adapter, skip=set()).merged


def _unit(scope: torch.nn.Module, prefix: str, adapter: str | None, skip: set[int]) -> UnitWeights:
    """The parameters of `scope` (named from `prefix`) outside the modules in `skip`."""
    merged: dict[str, Tensor] = {}
    adapters: dict[str, Tensor] = {}
    deltas: dict[str, Tensor] = {}
    for name, module in _modules_outside(scope, prefix, skip):
        for leaf, tensor in module.named_parameters(recurse=False):
            full = f"{name}.{leaf}" if name else leaf
            if ".lora_" in full:
                adapters[full] = tensor.detach()
            else:
                merged[full.replace(".base_layer.", ".")] = tensor.detach()
        if adapter is not None and isinstance(module, LoraLayer) and _adapts(module, adapter):
            deltas[f"{name}.weight"] = module.get_delta_weight(adapter)  # type: ignore[operator]  # on every layer kind
    for key, delta in deltas.items():
        merged[key] = merged[key] + delta.to(merged[key].dtype)
    return UnitWeights(merged, adapters)


def _adapts(module: LoraLayer, adapter: str) -> bool:
    """Whether `adapter` adapts this layer: linear and convolution layers keep it in lora_A, embeddings in
    lora_embedding_A."""
    return adapter in module.lora_A or adapter in module.lora_embedding_A


def _modules_outside(module: torch.nn.Module, prefix: str, skip: set[int]) -> Iterator[tuple[str, torch.nn.Module]]:
    """`module` and its submodules (with their names), not descending into those in `skip`."""
    yield prefix, module
    for name, child in module.named_children():
        if id(child) not in skip:
            yield from _modules_outside(child, f"{prefix}.{name}" if prefix else name, skip)
