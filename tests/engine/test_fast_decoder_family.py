"""The functional fast path against `transformers` (and peft) on every architecture it covers:
Llama (GQA 4:1, llama3 rope scaling), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norm) and Mistral
(a sliding window longer than the sequence), plain and with LoRA adapters, in float32 and bfloat16.
Models are random small configs built here; models it does not cover take the generic path."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from contract.config import GRPOConfig
from worker.grpo import logprobs, rollout
from worker.grpo.backends.fused import FusedPath, decode_step, fast_decoder, static_decoder
from worker.grpo.logprobs import completion_logprobs

P, C = 9, 11  # prompt and completion lengths of the hand-made batch
ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral"]
# Tolerances relative to the reference's largest magnitude (logits, or each parameter's gradient).
# Measured worst cases over these models (full and LoRA): fp32 logits 2.1e-6, gradients 6.3e-6;
# bf16 logits 1.1e-2, gradients 4.5e-2 (8 bits of mantissa, and the op order differs).
TOLERANCE = {torch.float32: (1e-5, 5e-5), torch.bfloat16: (0.03, 0.1)}

_COMMON: dict[str, Any] = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,  # GQA 4:1
    "max_position_embeddings": 64,
    "initializer_range": 0.25,  # peaked attention: a RoPE or q/k row mistake moves the logits visibly
    "tie_word_embeddings": False,
}


def build(arch: str, dtype: torch.dtype = torch.float32, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(3)
    common = _COMMON | overrides
    model: PreTrainedModel
    if arch == "llama":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,  # shorter than the batch: the scaling matters
            "rope_theta": 10000.0,
        }
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))  # head_dim != hidden / heads
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=P + C))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)  # non-zero biases, so a misplaced bias row shows
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)  # non-trivial norm weights, so a misplaced one shows
    return model.to(dtype)


def with_lora(model: PreTrainedModel, target_modules: str | list[str] = "all-linear") -> Any:
    torch.manual_seed(5)
    lora = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for name, parameter in lora.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)  # peft starts B at zero: the adapter would change nothing
    return lora


def grouped_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """3 groups x 2 rows sharing prompts, left padding in one group, a completion ended early."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 100, (3, P), generator=gen).repeat_interleave(2, dim=0)
    ids = torch.cat([prompts, torch.randint(4, 100, (6, C), generator=gen)], dim=1)
    mask = torch.ones_like(ids)
    mask[2:4, :3] = 0  # group 1: left padding
    ids[2:4, :3] = 0
    mask[5, P + 4 :] = 0  # row 5: EOS at completion position 3, pad after it
    ids[5, P + 4 :] = 0
    return ids, mask


def on_device_of(model: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    device = next(model.parameters()).device
    return tuple(tensor.to(device) for tensor in tensors)


def reference_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=C + 1)
    return out.logits[:, :-1]


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).abs().max() / theirs.double().abs().max())


def trainable(model: Any) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def logits_and_grads(
    model: Any, forward: Callable[[], torch.Tensor], real: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = forward()
    # A loss that reaches every logit with a different weight.
    (logits.float().logsumexp(-1) * real).sum().backward()
    grads = {}
    for name, parameter in trainable(model).items():
        assert parameter.grad is not None, name
        grads[name] = parameter.grad.clone()
    model.zero_grad()
    return logits.detach(), grads


def assert_forward_and_gradients_match(model: Any, dtype: torch.dtype) -> None:
    logits_tol, grad_tol = TOLERANCE[dtype]
    ids, mask = on_device_of(model, *grouped_batch())
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask[:, P - 1 : -1].bool()  # query positions that predict a completion token
    assert fast_decoder.supports(model, ids.shape[1])
    ours, ours_grads = logits_and_grads(
        model,
        lambda: fast_decoder.DecoderFunctional(model).completion_logits(ids, mask, positions, C),
        real,
    )
    theirs, theirs_grads = logits_and_grads(model, lambda: reference_logits(model, ids, mask), real)
    assert relative_error(ours[real], theirs[real]) <= logits_tol
    assert ours_grads.keys() == theirs_grads.keys()
    for name, grad in theirs_grads.items():
        assert relative_error(ours_grads[name], grad) <= grad_tol, name


def assert_decoder_matches(model: Any, tolerance: float, steps: int = 4) -> None:
    """StaticDecoder's prefill and first decode steps give the module's logits (with a DynamicCache)."""
    ids, mask = on_device_of(model, *grouped_batch())
    prompt, prompt_mask = ids[:, :P], mask[:, :P]
    hf_positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1)
    with torch.inference_mode():
        decoder = static_decoder.StaticDecoder(fast_decoder.DecoderFunctional(model), prompt_mask, C)
        cache = DynamicCache(config=model.config)
        ours = decoder.prefill(prompt)
        theirs = model(
            input_ids=prompt, attention_mask=prompt_mask, position_ids=hf_positions, past_key_values=cache
        ).logits[:, -1]
        assert relative_error(ours, theirs) <= tolerance
        attention = prompt_mask
        for t in range(steps):
            token = ids[:, P + t]
            attention = torch.cat([attention, attention.new_ones(ids.shape[0], 1)], dim=1)
            ours = decoder.step(token)
            theirs = model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=hf_positions[:, -1:] + t + 1,
                past_key_values=cache,
            ).logits[:, -1]
            assert relative_error(ours, theirs) <= tolerance, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_full_model_logits_gradients_and_decoding_match_transformers(arch: str, dtype: torch.dtype) -> None:
    model = build(arch, dtype)
    assert_forward_and_gradients_match(model, dtype)
    # bfloat16 decoding drifts further over a few steps (cache values rounded each step).
    assert_decoder_matches(model, 1e-5 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lora_logits_gradients_and_decoding_match_peft(arch: str, dtype: torch.dtype) -> None:
    """Only A and B get gradients (the base weights are frozen); decoding runs on merged weights."""
    model = with_lora(build(arch, dtype))
    assert all("lora_" in name for name in trainable(model))
    assert_forward_and_gradients_match(model, dtype)
    assert_decoder_matches(model, 1e-5 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_scripted_decode_step_equals_the_python_function(arch: str, lora: bool, dtype: torch.dtype) -> None:
    """The decode step TorchScript compiles gives the Python function's logits and caches bit for bit
    (the Python function is what runs where scripting is unavailable)."""
    scripted = decode_step.scripted_decode_step()
    assert isinstance(scripted, torch.jit.ScriptFunction)  # the fallback would hide the scripted path
    model = build(arch, dtype)
    if lora:
        model = with_lora(model)
    ids, mask = grouped_batch()
    prompt, prompt_mask = ids[:, :P], mask[:, :P]
    with torch.inference_mode():
        net = fast_decoder.DecoderFunctional(model)
        weights = static_decoder.DecodeWeights.of(net)
        decoders = [static_decoder.StaticDecoder(net, prompt_mask, C, weights) for _ in range(2)]
        decoders[1]._step = decode_step.decode_step
        for decoder in decoders:
            decoder.prefill(prompt)
        for t in range(C - 1):
            ours, python = (decoder.step(ids[:, P + t]) for decoder in decoders)
            assert torch.equal(ours, python), t
        filled = decoders[0].length  # the last position of the horizon is never written
        for ours_cache, python_cache in zip(decoders[0].state.caches, decoders[1].state.caches, strict=True):
            assert torch.equal(ours_cache[..., :filled, :], python_cache[..., :filled, :])


def test_decode_step_runs_as_python_where_scripting_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_source(fn: Any) -> Any:
        raise OSError("could not get source code")  # what TorchScript raises without .py files

    monkeypatch.setattr(torch.jit, "script", no_source)
    assert decode_step.scripted_decode_step.__wrapped__() is decode_step.decode_step


def test_the_decode_step_refuses_an_activation_it_does_not_implement() -> None:
    net = fast_decoder.DecoderFunctional(build("llama"))
    net.act = torch.nn.functional.gelu  # the compiled step's MLP is SiLU's: it would decode silently wrong
    with pytest.raises(ValueError, match="SiLU"):
        static_decoder.StaticDecoder(net, torch.ones(2, 3, dtype=torch.long), 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cuda_bf16_matches_transformers(arch: str, lora: bool) -> None:
    """The same functions, unchanged, on a GPU in bfloat16."""
    model = build(arch, torch.bfloat16).to("cuda")
    if lora:
        model = with_lora(model)
    assert_forward_and_gradients_match(model, torch.bfloat16)
    assert_decoder_matches(model, 0.1)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_log_probs_with_a_chunked_head_and_tied_embeddings_match_the_generic_path(
    lora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole completion_logprobs pipeline (LM head in chunks of 8 rows) on a model whose LM head
    is its embedding matrix: log-probs and every trainable parameter's gradient."""
    monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", 8 * 100)
    model = build("qwen2", tie_word_embeddings=True)
    if lora:
        model = with_lora(model)
    ids, mask = grouped_batch()
    real = mask[:, P:].bool()
    assert fast_decoder.supports(model, ids.shape[1])

    def run(fast: FusedPath | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        logps, _ = completion_logprobs(model, ids, mask, C, temperature=0.7, fast=fast)
        (logps * real).sum().backward()
        return logps.detach(), {
            name: p.grad.clone() for name, p in trainable(model).items() if p.grad is not None
        }

    ours, ours_grads = run(FusedPath())
    theirs, theirs_grads = run(None)
    assert relative_error(ours[real], theirs[real]) <= 1e-5
    assert ours_grads.keys() == theirs_grads.keys() == trainable(model).keys()
    for name, grad in theirs_grads.items():
        assert relative_error(ours_grads[name], grad) <= 5e-5, name


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_halves_on_one_net_backpropagate_side_by_side(arch: str, lora: bool) -> None:
    """Two halves of a batch forward on one DecoderFunctional, then their backwards to the weights
    run at the same time on two threads (as the trainer's halves do): each half gets the gradients
    of a forward on a net of its own, and neither backward spends what the other needs of the
    shared weights' graph."""
    model = build(arch)
    if lora:
        model = with_lora(model)
    ids, mask = grouped_batch()
    params = list(trainable(model).values())
    halves = [slice(0, 2), slice(2, 6)]  # at a group boundary; the second has a row ended early

    def half_logps(rows: slice, net: fast_decoder.DecoderFunctional | None) -> torch.Tensor:
        logps, _ = completion_logprobs(
            model, ids[rows], mask[rows], C, temperature=1.0, fast=FusedPath(), prepared=net
        )
        return (logps * mask[rows, P:]).sum()

    expected = [torch.autograd.grad(half_logps(rows, None), params) for rows in halves]
    net = fast_decoder.DecoderFunctional(model)
    losses = [half_logps(rows, net) for rows in halves]
    results: dict[int, tuple[torch.Tensor, ...] | BaseException] = {}

    def backward(index: int) -> None:
        try:
            results[index] = torch.autograd.grad(losses[index], params)
        except BaseException as error:  # noqa: BLE001 - reported by the assertions below
            results[index] = error

    beside = threading.Thread(target=backward, args=(1,))
    beside.start()
    backward(0)
    beside.join()
    for index, grads in enumerate(expected):
        got = results[index]
        assert not isinstance(got, BaseException), f"half {index}: {got!r}"
        assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True)), index


def test_lora_on_some_projections_only() -> None:
    """peft's default for Llama adapts q and v only: k's block of the fused B stays empty."""
    model = with_lora(build("qwen2"), ["q_proj", "v_proj", "down_proj"])
    assert_forward_and_gradients_match(model, torch.float32)
    assert_decoder_matches(model, 1e-5)


def test_reference_is_the_base_model_with_adapters_off() -> None:
    base = build("qwen3")
    ids, mask = grouped_batch()
    with torch.no_grad():
        expected = reference_logits(base, ids, mask)
    model = with_lora(base)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask[:, P - 1 : -1].bool()
    with torch.no_grad():
        adapted = fast_decoder.DecoderFunctional(model).completion_logits(ids, mask, positions, C)
        with model.disable_adapter():
            reference = fast_decoder.DecoderFunctional(model).completion_logits(ids, mask, positions, C)
    assert relative_error(reference[real], expected[real]) <= 1e-5
    assert relative_error(adapted[real], expected[real]) > 1e-2  # the adapter does change the model


def test_lora_dropout_trains_on_the_fast_path_and_is_off_in_eval_mode() -> None:
    torch.manual_seed(5)
    model = get_peft_model(
        build("llama"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules="all-linear")
    )
    ids, mask = grouped_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask[:, P - 1 : -1].bool()
    assert fast_decoder.supports(model, ids.shape[1])
    model.eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
        ours = fast_decoder.DecoderFunctional(model).completion_logits(ids, mask, positions, C)
        theirs = reference_logits(model, ids, mask)
        assert relative_error(ours[real], theirs[real]) <= 1e-5
        model.train()
        noisy = fast_decoder.DecoderFunctional(model).completion_logits(ids, mask, positions, C)
    assert relative_error(noisy[real], theirs[real]) > 1e-3


def test_sliding_window_shorter_than_the_sequence_takes_the_generic_path() -> None:
    model = build("mistral")
    assert fast_decoder.supports(model, P + C)
    assert not fast_decoder.supports(model, P + C + 1)
    model.config.sliding_window = 6
    ids, mask = grouped_batch()
    assert not fast_decoder.supports(model, ids.shape[1])
    with torch.no_grad():
        logps, _ = completion_logprobs(model, ids, mask, C, temperature=1.0, fast=FusedPath())
        expected = torch.log_softmax(reference_logits(model, ids, mask).float(), -1)
    expected = expected.gather(-1, ids[:, P:, None]).squeeze(-1)
    real = mask[:, P:].bool()
    assert torch.allclose(logps[real], expected[real], atol=1e-5)


def test_other_wrappers_and_subclasses_take_the_generic_path() -> None:
    class Custom(LlamaForCausalLM):
        pass

    assert not fast_decoder.supports(Custom(build("llama").config), 8)
    assert not fast_decoder.supports(torch.nn.Linear(2, 2), 8)
    lm_head_adapter = with_lora(build("llama"), ["q_proj", "lm_head"])
    assert not fast_decoder.supports(lm_head_adapter, 8)


def test_supports_follows_checkpointing_and_adapter_state() -> None:
    """What the fast path cannot reproduce is refused, and accepted again once undone."""
    model = build("qwen2")
    model.gradient_checkpointing_enable()
    assert not fast_decoder.supports(model, 8)
    model.gradient_checkpointing_disable()
    assert fast_decoder.supports(model, 8)
    adapted = with_lora(model)
    assert fast_decoder.supports(adapted, 8)
    adapted.merge_adapter()  # the adapters are in the base weights: applying them again would be wrong
    assert not fast_decoder.supports(adapted, 8)
    adapted.unmerge_adapter()
    assert fast_decoder.supports(adapted, 8)
    dora = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    assert not fast_decoder.supports(dora, 8)
    saved = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert not fast_decoder.supports(saved, 8)


def gpt2() -> PreTrainedModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, eos_token_id=2)
    return GPT2LMHeadModel(config).eval()  # no dropout: compare deterministic forwards


def test_an_uncovered_model_gives_the_module_forward_through_the_generic_path() -> None:
    model = gpt2()
    ids, mask = grouped_batch()
    assert not fast_decoder.supports(model, ids.shape[1])
    logps, _ = completion_logprobs(model, ids, mask, C, temperature=0.7, fast=FusedPath())
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, P - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[:, P:, None]).squeeze(-1)
    real = mask[:, P:].bool()
    assert torch.allclose(logps[real], expected[real], atol=1e-5)
    # Gradients reach the model's parameters through the generic path as well.
    (logps * real).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_an_uncovered_model_decodes_like_generate() -> None:
    """top_k = 1 is greedy: the generic sampling loop must pick generate()'s tokens."""
    model = gpt2()
    ids, mask = grouped_batch()
    prompt, prompt_mask = ids[:, :P], mask[:, :P]
    config = GRPOConfig.model_validate(
        {"max_steps": 1, "num_generations": 2, "max_completion_length": 8, "top_k": 1}
    )
    ours, _ = rollout.sample_completions(
        model, prompt, prompt_mask, config, [2], 0, torch.Generator().manual_seed(1), fast=FusedPath()
    )
    with torch.no_grad():
        theirs = model.generate(
            input_ids=prompt, attention_mask=prompt_mask, do_sample=False, max_new_tokens=8, pad_token_id=0
        )[:, P:]
    produced = ours.shape[1]
    assert torch.equal(ours, theirs[:, :produced])
