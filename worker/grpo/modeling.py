"""Model plumbing for the trainer: policy, reference, tokenizer, optimiser, scheduler; rollout helpers.

- Full fine-tuning: the policy is the base model; with beta > 0 a frozen second copy (loaded from
  the same path) is the reference. With beta == 0 no reference exists at all.
- LoRA (peft): the policy is the base model with adapters; the reference is the same model with
  the adapters disabled, so no second copy is held.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from contract.config import GRPOConfig
from worker.grpo.fastpath import FastPath
from worker.grpo.logprobs import completion_logprobs
from worker.grpo.model_paths import resolve_model_path
from worker.grpo.module_options import apply_module_options
from worker.grpo.rollout import Rollout, completion_mask_after_eos, tokenize_prompts

_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (initialisation of LoRA weights, dropout)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class ModelBundle:
    """Everything with weights or optimiser state."""

    policy: Any  # a transformers causal LM, or a peft model wrapping one
    tokenizer: Any
    reference: Any | None  # frozen copy (full fine-tuning with beta > 0), else None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    is_lora: bool
    # The backend's fast path for these models, if it has one (worker.grpo.backends decides, once).
    fast: FastPath | None = None

    def fast_covers(self, length: int) -> bool:
        """Whether the fast path computes the policy's forward over sequences of `length` tokens."""
        return self.fast is not None and self.fast.covers(self.policy, length)

    @property
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def _reference_model(self) -> tuple[Any, AbstractContextManager[Any]]:
        if self.is_lora:
            return self.policy, self.policy.disable_adapter()  # the base weights, adapters off
        if self.reference is None:
            raise RuntimeError("no reference model: beta == 0")
        return self.reference, nullcontext()

    def reference_runs_beside_policy(self, max_length: int) -> bool:
        """Whether reference log-probs over sequences of `max_length` may run while the policy runs
        a forward: a reference model of its own, or a LoRA policy whose base weights the fast path
        reads without switching the adapters off (peft's disable_adapter() would change the policy)."""
        return not self.is_lora or self.fast_covers(max_length)

    @torch.no_grad()
    def reference_logps(
        self, input_ids: Tensor, attention_mask: Tensor, completion_length: int, *, temperature: float
    ) -> Tensor:
        """(N, C) log-probs of the completion tokens under the reference policy."""
        if self.is_lora and self.fast_covers(input_ids.shape[1]):
            logps, _ = completion_logprobs(
                self.policy, input_ids, attention_mask, completion_length,
                temperature=temperature, adapters=False, fast=self.fast,
            )
            return logps
        model, context = self._reference_model()
        with context:
            logps, _ = completion_logprobs(
                model, input_ids, attention_mask, completion_length, temperature=temperature, fast=self.fast
            )
        return logps


def build_model_bundle(
    base_model: str,
    config: GRPOConfig,
    *,
    cache_dir: Path,
    total_updates: int,
    device: str | None = None,
    resume_dir: Path | None = None,
) -> ModelBundle:
    """Load the policy (from `resume_dir` when resuming), the reference, tokenizer, optimiser, scheduler."""
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base_path = resolve_model_path(base_model, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # generation and batching need a pad id
    policy = _load_policy(base_path, config, resume_dir).to(target)
    policy.train()
    apply_module_options(policy, bf16=config.bf16, compile_layers=config.torch_compile)
    reference = None
    if config.beta > 0 and config.lora is None:
        reference = _load_causal_lm(base_path, config).to(target).eval().requires_grad_(False)
        apply_module_options(reference, bf16=config.bf16, compile_layers=config.torch_compile)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable,
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
        # One fused kernel over all tensors instead of ~10 small ops per parameter (TRL's default
        # is adamw_torch_fused too); foreach where the fused kernel does not apply.
        **_adamw_kernel(trainable),
    )
    scheduler = build_scheduler(optimizer, config, total_updates)
    return ModelBundle(policy, tokenizer, reference, optimizer, scheduler, is_lora=config.lora is not None)


def _adamw_kernel(params: list[torch.nn.Parameter]) -> dict[str, bool]:
    fusable = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return {"fused": True} if fusable else {"foreach": True}


def _load_causal_lm(path: str | Path, config: GRPOConfig) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[config.dtype])


def _load_policy(base_path: str, config: GRPOConfig, resume_dir: Path | None) -> Any:
    if config.lora is None:
        model = _load_causal_lm(resume_dir or base_path, config)
    else:
        base = _load_causal_lm(base_path, config)
        if resume_dir is not None:
            model = PeftModel.from_pretrained(base, resume_dir, is_trainable=True)
        else:
            lora = config.lora
            model = get_peft_model(
                base,
                LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=lora.target_modules,
                    task_type="CAUSAL_LM",
                ),
            )
    if config.gradient_checkpointing:
        # transformers 5 renamed gradient checkpointing to activation checkpointing (old name deprecated).
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable({"use_reentrant": False})
    return model


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: GRPOConfig, total_updates: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 over warmup_steps, then constant, linear to 0, or cosine to 0."""
    warmup = config.warmup_steps
    decay_updates = max(1, total_updates - warmup)
    kind = config.lr_scheduler

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / (warmup + 1)
        progress = min(1.0, (update - warmup) / decay_updates)
        if kind == "linear":
            return 1.0 - progress
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --- rollout helpers -------------------------------------------------------------------------


def _group_rows(rollout: Rollout, group: int) -> slice:
    return slice(group * rollout.group_size, (group + 1) * rollout.group_size)


def _pad_to(tensor: Tensor, width: int, value: int, *, left: bool) -> Tensor:
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    padding = tensor.new_full((tensor.shape[0], missing), value)
    return torch.cat([padding, tensor] if left else [tensor, padding], dim=1)


def merge_groups(parts: list[tuple[Rollout, int]], pad_id: int) -> Rollout:
    """One Rollout from (rollout, group index) pairs: prompts re-padded on the left, completions on the right."""
    if not parts:
        raise ValueError("nothing to merge")
    prompt_width = max(r.prompt_ids.shape[1] for r, _ in parts)
    completion_width = max(r.completion_ids.shape[1] for r, _ in parts)

    def gather(name: str, width: int, value: int, left: bool) -> Tensor:
        return torch.cat(
            [_pad_to(getattr(r, name)[_group_rows(r, g)], width, value, left=left) for r, g in parts]
        )

    return Rollout(
        prompt_ids=gather("prompt_ids", prompt_width, pad_id, True),
        prompt_mask=gather("prompt_mask", prompt_width, 0, True),
        completion_ids=gather("completion_ids", completion_width, pad_id, False),
        completion_mask=gather("completion_mask", completion_width, 0, False),
        is_truncated=torch.cat([r.is_truncated[_group_rows(r, g)] for r, g in parts]),
        completion_texts=[text for r, g in parts for text in r.completion_texts[_group_rows(r, g)]],
        group_size=parts[0][0].group_size,
        sampler_logps=(
            None if parts[0][0].sampler_logps is None else gather("sampler_logps", completion_width, 0, False)
        ),
        tool_mask=None if parts[0][0].tool_mask is None else gather("tool_mask", completion_width, 0, False),
        episodes=(
            None if parts[0][0].episodes is None
            else [e for r, g in parts for e in (r.episodes or [])[_group_rows(r, g)]]
        ),
    )


@torch.no_grad()
def greedy_generate(
    model: Any, tokenizer: Any, prompts: list[str], config: GRPOConfig, *, synced: bool = False
) -> Rollout:
    """One greedy completion per prompt (evaluation), as a Rollout with group_size 1. `synced`: the model's
    forwards are collectives (a sharded model), so generate() steps until every rank is done (`synced_gpus`)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, config.max_prompt_length)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    generation_config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=config.max_completion_length,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    was_training = model.training
    model.eval()
    try:
        sequences = model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=generation_config,
            synced_gpus=synced,
        )
    finally:
        model.train(was_training)
    completion_ids = sequences[:, prompt_ids.shape[1] :]
    completion_mask, is_truncated = completion_mask_after_eos(completion_ids, int(tokenizer.eos_token_id))
    completion_ids = completion_ids.masked_fill(completion_mask == 0, int(tokenizer.pad_token_id))
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        is_truncated=is_truncated,
        completion_texts=list(tokenizer.batch_decode(completion_ids, skip_special_tokens=True)),
        group_size=1,
    )


def iter_chunks(total: int, size: int) -> Iterator[slice]:
    """Consecutive slices of at most `size` covering range(total)."""
    for start in range(0, total, size):
        yield slice(start, min(start + size, total))
