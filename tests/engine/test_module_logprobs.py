"""Log-probs through the model's own module forward (`worker.grpo.logprobs.module_logprobs`), the path of every
architecture the fast path does not cover: where the forward stops at the LM head's input and the head runs chunk by
chunk over the vocabulary, the log-probs and their gradients equal the plain transformers forward's, full and LoRA,
for Gemma 3, Phi-3 and Qwen2.5 shaped models (random weights); a model whose logits are soft-capped (Gemma 2) keeps
the model's own logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from worker.grpo import logprobs
from worker.grpo.logprobs import module_logprobs

VOCAB = 1000
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 256}


def build(arch: str, dtype: torch.dtype) -> Any:
    import transformers as tf

    torch.manual_seed(0)
    if arch == "gemma3":
        config = tf.Gemma3TextConfig(**SHAPE, head_dim=16, sliding_window=64, query_pre_attn_scalar=16)
        model = tf.Gemma3ForCausalLM(config)
    elif arch == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**SHAPE, pad_token_id=0))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SHAPE, tie_word_embeddings=True))
    else:
        config = tf.Gemma2Config(**SHAPE, head_dim=16, final_logit_softcapping=30.0, query_pre_attn_scalar=16)
        model = tf.Gemma2ForCausalLM(config)
    return model.to(dtype).eval()


def with_lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    targets = ["qkv_proj", "o_proj"] if model.config.model_type == "phi3" else ["q_proj", "v_proj"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (4, 20), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding on one row
    mask[1, -3:] = 0  # a completion that ended early
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions, ids[:, -8:]


def reference(model: Any, ids: Tensor, mask: Tensor, positions: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """The plain forward: every position's logits, float32 log-softmax, the targets gathered."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    logits = logits[:, -targets.shape[1] - 1 : -1, :] / temperature
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def gradients(model: Any, logps: Tensor, mask: Tensor) -> list[Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad((logps * mask).sum(), params))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen2", "gemma2-softcapped"])
def test_equals_the_plain_forward_fp32(arch: str, lora: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", VOCAB * 7)  # several chunks over the 32 rows
    model = build(arch, torch.float32)
    model = with_lora(model) if lora else model
    ids, mask, positions, targets = batch()
    completion_mask = mask[:, -targets.shape[1]:].float()
    expected = reference(model, ids, mask, positions, targets, 0.7)
    got, entropy = module_logprobs(model, ids, mask, positions, targets, temperature=0.7, with_entropy=True)
    assert got.dtype == torch.float32 and entropy is not None
    torch.testing.assert_close(got * completion_mask, expected * completion_mask, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(gradients(model, got, completion_mask), gradients(model, expected, completion_mask),
                            strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen2"])
def test_stops_at_the_head_and_never_makes_the_full_logits(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's own forward never runs (the log-probs come from its input)."""
    model = build(arch, torch.float32)
    calls: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    ids, mask, positions, targets = batch()
    module_logprobs(model, ids, mask, positions, targets, temperature=1.0)
    assert calls == []


def test_a_soft_capped_model_keeps_its_own_logits() -> None:
    model = build("gemma2-softcapped", torch.float32)
    calls: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    ids, mask, positions, targets = batch()
    module_logprobs(model, ids, mask, positions, targets, temperature=1.0)
    assert calls == [1]


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen2"])
def test_bf16_within_rounding_of_the_plain_forward(arch: str) -> None:
    model = build(arch, torch.bfloat16)
    ids, mask, positions, targets = batch()
    completion_mask = mask[:, -targets.shape[1]:].float()
    expected = reference(model, ids, mask, positions, targets, 1.0)
    got, _ = module_logprobs(model, ids, mask, positions, targets, temperature=1.0)
    torch.testing.assert_close(got * completion_mask, expected * completion_mask, atol=2e-2, rtol=2e-2)
