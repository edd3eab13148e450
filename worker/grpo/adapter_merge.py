"""A PEFT LoRA adapter saved without its base model (weights saved through the Tinker API) made the plain model it
computes, so that a job or an evaluation loads it as any model directory (`from_pretrained`).

Each adapted weight becomes W + its adapter's delta (worker.grpo.full_weights.merged_weights, as a LoRA job's
`merged/` checkpoint copy is written); the base's tokenizer is saved beside it. A base whose head is tied to its
embedding (SmolLM2) with an adapted head is saved untied: the head then differs from the embedding.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.grpo.full_weights import merged_weights


@torch.no_grad()
def merge_adapter(adapter_dir: Path, base_dir: str, out_dir: Path) -> Path:
    """Write into `out_dir` (replaced) the model `base_dir` plus the adapter in `adapter_dir` computes, with the
    base's tokenizer; returns `out_dir`. An adapter that does not fit the base raises ValueError."""
    base: Any = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    embedding = base.get_input_embeddings().weight
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except RuntimeError as exc:  # a tensor shape the base does not have
        raise ValueError(f"the adapter does not fit its base model: {exc}") from exc
    weights = merged_weights(model)
    plain: Any = model.get_base_model()
    head = weights.get(_head_name(plain))
    untied = head is not None and head.data_ptr() != embedding.data_ptr()
    if untied and getattr(plain.config, "tie_word_embeddings", False):
        plain.config.tie_word_embeddings = False  # the adapted head is a weight of its own now
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    plain.save_pretrained(out_dir, state_dict={name: t.contiguous() for name, t in weights.items()},
                          safe_serialization=True)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return out_dir


def _head_name(model: Any) -> str:
    """The state-dict name of the model's output projection (`lm_head.weight` in most)."""
    head = model.get_output_embeddings()
    return next((f"{name}.weight" for name, module in model.named_modules() if module is head), "lm_head.weight")
