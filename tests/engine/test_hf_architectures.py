"""Architectures only the `hf` backend serves train through it: Gemma 3, Phi-3 and a Qwen2.5-shaped model (random
weights, built here with the character tokenizer), full and LoRA, one GRPO step each. Their log-probs equal the
plain transformers forward's (tests/engine/test_module_logprobs.py); here the whole loop runs on them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig

from tests.engine.trainer_helpers import small_config, spread_reward, word_rows
from worker.grpo.tiny import build_tokenizer, save_model_atomically
from worker.grpo.trainer import GRPOTrainer

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}
LORA_TARGETS = {"gemma3": ["q_proj", "v_proj"], "phi3": ["qkv_proj", "o_proj"], "qwen2": ["q_proj", "v_proj"]}


def build(arch: str, out_dir: Path, *, layers: int = 2) -> Path:
    """A random model of `arch` with the character tokenizer, saved to `out_dir`."""
    import transformers as tf

    tokenizer = build_tokenizer()
    ids = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
           "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    shape = SHAPE | ids | {"num_hidden_layers": layers}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if arch == "gemma3":
            model: Any = tf.Gemma3ForCausalLM(
                tf.Gemma3TextConfig(**shape, head_dim=16, sliding_window=64, query_pre_attn_scalar=16)
            )
        elif arch == "phi3":
            model = tf.Phi3ForCausalLM(tf.Phi3Config(**shape))
        else:  # Qwen2.5: the Qwen2 architecture with tied embeddings and q/k/v biases
            model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**shape, tie_word_embeddings=True))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return save_model_atomically(model, tokenizer, out_dir)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen2"])
def test_one_step_trains_through_the_module_forward(tmp_path: Path, arch: str, lora: bool) -> None:
    extra: dict[str, Any] = {"lora": {"r": 4, "alpha": 8, "target_modules": LORA_TARGETS[arch]}} if lora else {}
    trainer = GRPOTrainer(
        small_config(max_steps=1, beta=0.04, **extra),
        base_model=str(build(arch, tmp_path / arch)),
        train_rows=word_rows(),
        reward=spread_reward(),
        output_dir=tmp_path / "run",
        model_cache_dir=tmp_path / "models",
        backend="hf" if arch == "qwen2" else "auto",  # qwen2 alone is a family the fused path covers
    )
    assert trainer.backend.name == "hf"
    policy = trainer.models.policy
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    metrics = trainer.train().history[0]
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["kl"]) and metrics["grad_norm"] > 0
    changed = {n for n, p in policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    # lora_B starts at 0: lora_A only gets a gradient from the second step on
    assert changed == ({n for n in before if "lora_B" in n} if lora else set(before))
