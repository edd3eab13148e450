"""A sharded (fsdp) job's consolidated checkpoint: the whole model as Hugging Face safetensors shards, written by
rank 0 while every rank gathers one decoder layer at a time (worker.grpo.full_weights), so no rank ever holds the
whole policy to save it.

Layout, as `save_pretrained` writes a model too large for one file: `model-0000k-of-0000n.safetensors`, one per
decoder layer and one for the rest (embeddings, final norm, head), with `model.safetensors.index.json` naming each
tensor's file, plus `config.json` and `generation_config.json`; `from_pretrained` and vLLM read it as they read any
sharded model. With LoRA that is the merged model (under `merged/`), beside the adapter as peft saves it
(`adapter_model.safetensors`, `adapter_config.json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from worker.grpo.checkpoint import MERGED_DIR
from worker.grpo.full_weights import Gathering, unit_count, unit_weights
from worker.grpo.modeling import ModelBundle

INDEX_NAME = "model.safetensors.index.json"
_PEFT_PREFIX = "base_model.model."  # a peft model's names of its base model's parameters


def write_consolidated(
    models: ModelBundle, skeleton: Any, directory: Path | None, *, gathered: Gathering | None
) -> None:
    """Write the consolidated model into `directory` (rank 0) or take part in the gathers only (None). A
    collective: every rank calls it at the same point. `skeleton`: the policy's structure (meta device), whose
    config (and with LoRA, peft's adapter config) is saved with the weights."""
    total = unit_count(models)
    weights_dir = None if directory is None else (directory / MERGED_DIR if models.is_lora else directory)
    weight_map: dict[str, str] = {}
    adapters: dict[str, Tensor] = {}
    size = 0
    for index, unit in enumerate(unit_weights(models, gathered=gathered), start=1):
        if weights_dir is None:
            continue
        weights_dir.mkdir(parents=True, exist_ok=True)
        name = f"model-{index:05d}-of-{total:05d}.safetensors"
        tensors = _untied(unit.merged)
        save_file(tensors, str(weights_dir / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        size += sum(t.numel() * t.element_size() for t in tensors.values())
        # Copies: a gathered layer's tensors are freed when it is resharded, at the next unit.
        adapters |= {key: tensor.to("cpu", copy=True) for key, tensor in unit.adapters.items()}
    if directory is None or weights_dir is None:
        return
    document = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (weights_dir / INDEX_NAME).write_text(json.dumps(document, indent=2), encoding="utf-8")
    base = skeleton.get_base_model() if models.is_lora else skeleton
    base.config.save_pretrained(weights_dir)
    if base.generation_config is not None:
        base.generation_config.save_pretrained(weights_dir)
    if models.is_lora:  # peft keeps the adapter's tensors under the wrapper's names
        skeleton.save_pretrained(directory, state_dict={_PEFT_PREFIX + k: v for k, v in adapters.items()})


def _untied(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each storage once, on the host (safetensors refuses shared tensors): a head tied to the embedding is
    saved as the embedding only, as `save_pretrained` does, and tied back on loading."""
    seen: set[tuple[int, Any]] = set()
    kept: dict[str, Tensor] = {}
    for key, tensor in tensors.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if identity not in seen:
            seen.add(identity)
            kept[key] = tensor.to("cpu").contiguous()
    return kept
