"""The functional Llama fast path reproduces the transformers module forward (logits, gradients,
cached decoding) and the sampling loop reproduces generate()'s sampling rules."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from contract.config import GRPOConfig
from worker.grpo import rollout
from worker.grpo.backends.fused import FusedPath, fast_decoder, ops, static_decoder
from worker.grpo.concurrency import intra_op_threads
from worker.grpo.logprobs import completion_logprobs

P, C = 9, 11  # prompt and completion lengths of the hand-made batch


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


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
    ids[1, P + 2] = 0  # a sampled pad id inside a completion is a real token
    return ids, mask


def reference_logits(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=C + 1)
    return out.logits[:, :-1]


def assert_decoder_matches(
    model: PreTrainedModel,
    ids: torch.Tensor,
    mask: torch.Tensor,
    close: Callable[[torch.Tensor, torch.Tensor], bool],
    steps: int = 4,
) -> None:
    """StaticDecoder's prefill and first `steps` decode steps give the module's logits (DynamicCache)."""
    prompt, prompt_mask = ids[:, :P], mask[:, :P]
    hf_positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 1)
    with torch.inference_mode():
        decoder = static_decoder.StaticDecoder(fast_decoder.DecoderFunctional(model), prompt_mask, C)
        cache = DynamicCache(config=model.config)
        ours = decoder.prefill(prompt)
        theirs = model(
            input_ids=prompt, attention_mask=prompt_mask, position_ids=hf_positions, past_key_values=cache
        ).logits[:, -1]
        assert close(ours, theirs)
        attention = prompt_mask
        for t in range(steps):
            token = ids[:, P + t]
            attention = torch.cat([attention, torch.ones(ids.shape[0], 1, dtype=torch.long)], dim=1)
            ours = decoder.step(token)
            theirs = model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=hf_positions[:, -1:] + t + 1,
                past_key_values=cache,
            ).logits[:, -1]
            assert close(ours, theirs), t


def _grad(parameter: torch.nn.Parameter) -> torch.Tensor:
    assert parameter.grad is not None
    return parameter.grad.clone()


def test_supports_plain_llama_only(model: PreTrainedModel) -> None:
    assert fast_decoder.supports(model, P + C)
    assert not fast_decoder.supports(torch.nn.Linear(2, 2), P + C)


@pytest.mark.parametrize("uneven", [False, True])
@pytest.mark.parametrize("skip_masked", [True, False])
def test_completion_logits_and_gradients_match_the_module_forward(
    model: PreTrainedModel, skip_masked: bool, uneven: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the masked completion positions left out of the stacked rows (row 5's tail is 10 % of the
    completion positions) and with every position kept; with groups of one size (2, 2, 2) and of
    several (1, 2, 2)."""
    monkeypatch.setattr(fast_decoder, "_MIN_SKIPPED_SHARE", 0.05 if skip_masked else 1.01)
    ids, mask = grouped_batch()
    if uneven:
        ids, mask = ids[1:], mask[1:]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask[:, P - 1 : -1].bool()  # query positions that predict a completion token
    model.zero_grad()
    ours = fast_decoder.DecoderFunctional(model).completion_logits(ids, mask, positions, C)
    (ours.logsumexp(-1) * real).sum().backward()
    ours_grads = {name: _grad(p) for name, p in model.named_parameters()}
    model.zero_grad()
    theirs = reference_logits(model, ids, mask)
    (theirs.logsumexp(-1) * real).sum().backward()
    assert torch.allclose(ours[real], theirs[real], atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(ours_grads[name], _grad(p), atol=1e-5, rtol=1e-4), name
    model.zero_grad()


def test_no_shared_prompt_path_matches_too(model: PreTrainedModel) -> None:
    ids, mask = grouped_batch()
    ids, mask = ids[::2], mask[::2]  # one row per prompt: nothing to share
    with torch.no_grad():
        logps, _ = completion_logprobs(model, ids, mask, C, temperature=0.7, fast=FusedPath())
        expected, _ = completion_logprobs(model, ids, mask, C, temperature=0.7)
    real = mask[:, P:].bool()
    assert torch.allclose(logps[real], expected[real], atol=1e-5)


def test_one_token_completions_of_shared_prompts_match_the_module_forward(model: PreTrainedModel) -> None:
    """With one completion token nothing follows the shared prompt once the last token is left out."""
    ids, mask = grouped_batch()
    ids, mask = ids[:, : P + 1], mask[:, : P + 1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = fast_decoder.DecoderFunctional(model).completion_logits(ids, mask, positions, 1)
        theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -2:-1]
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_decoder_matches_the_module_with_a_dynamic_cache(model: PreTrainedModel) -> None:
    ids, mask = grouped_batch()
    assert_decoder_matches(model, ids, mask, lambda ours, theirs: torch.allclose(ours, theirs, atol=1e-5))


def test_fast_and_generic_decoders_sample_the_same_tokens(model: PreTrainedModel) -> None:
    ids, mask = grouped_batch()
    config = GRPOConfig.model_validate(
        {"max_steps": 1, "num_generations": 2, "max_completion_length": 12, "top_k": 20, "top_p": 0.9}
    )

    def sample(fast: FusedPath | None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        return rollout.sample_completions(model, ids[:, :P], mask[:, :P], config, [2], 0, generator, fast=fast)[0]

    fast, generic = sample(FusedPath()), sample(None)
    assert torch.equal(fast, generic)
    assert not fast.is_inference()  # usable as input of a forward that saves it for backward


@pytest.mark.parametrize(("top_k", "top_p"), [(10, 0.8), (0, 0.8), (10, 1.0), (3, 0.3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filter_logits_matches_transformers_warpers(top_k: int, top_p: float, dtype: torch.dtype) -> None:
    """bfloat16 logits have ties (few distinct values): ties with the k-th value stay in."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = rollout.filter_logits(logits.clone(), temperature=0.5, top_k=top_k, top_p=top_p)
    theirs = logits.float() / 0.5
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.allclose(ours[~ours.isinf()], theirs[~theirs.isinf()])
    if dtype == torch.bfloat16 and (top_k, top_p) == (10, 1.0):
        assert int((~ours.isinf()).sum(-1).max()) > top_k  # the data does have ties at the k-th value


def test_sample_tokens_follows_the_distribution_and_skips_masked_tokens() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.0, 0.6, 0.3]])).repeat(20000, 1)
    tokens = rollout.sample_tokens(logits, torch.rand(20000, generator=torch.Generator().manual_seed(3)))
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    assert freq[1] == 0
    assert torch.allclose(freq, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.015)


def _variant(dtype: torch.dtype) -> PreTrainedModel:
    """Grouped-query attention with q/k/v/o biases, in `dtype`: the permuted-RoPE rows and biases."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        max_position_embeddings=64,
        initializer_range=0.25,  # peaked attention: a RoPE or q/k row mistake moves the logits visibly
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)  # non-zero biases, so a misplaced bias row shows
    return model.to(dtype)


@pytest.mark.parametrize(
    ("dtype", "rtol"), [(torch.float32, 1e-5), (torch.float64, 1e-10), (torch.bfloat16, 0.1)]
)
def test_gqa_with_biases_matches_in_every_dtype(dtype: torch.dtype, rtol: float) -> None:
    model = _variant(dtype)

    def close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
        """Equal up to `rtol` of the logits' scale (bfloat16 drifts by up to ~5 % over a few decode steps)."""
        ours, theirs = ours.double(), theirs.double()
        return bool((ours - theirs).abs().max() <= rtol * theirs.abs().max())

    assert fast_decoder.supports(model, P + C)
    ids, mask = grouped_batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask[:, P - 1 : -1].bool()
    with torch.no_grad():
        ours = fast_decoder.DecoderFunctional(model).completion_logits(ids, mask, positions, C)
        theirs = reference_logits(model, ids, mask)
    assert close(ours[real], theirs[real])
    assert_decoder_matches(model, ids, mask, close)


def test_passive_openmp_decodes_small_models_on_one_thread(
    model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = fast_decoder.DecoderFunctional(model)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        assert static_decoder.decode_threads(net, 32) == 1
        assert static_decoder.decode_threads(net, 10_000) == 2  # large matmuls: both threads pay off
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        assert static_decoder.decode_threads(net, 32) == 2
        with intra_op_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("shape", [(7, 16), (3, 5, 32)])
def test_rms_norm_matches_autograd_of_the_composite(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen) * 2
    weight = torch.randn(shape[-1], generator=gen)
    grad = torch.randn(*shape, generator=gen)
    ours_x, ours_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    theirs_x, theirs_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = ops.rms_norm(ours_x, ours_w, 1e-6)
    theirs = theirs_x * torch.rsqrt(theirs_x.pow(2).mean(-1, keepdim=True) + 1e-6) * theirs_w
    ours.backward(grad)
    theirs.backward(grad)
    assert ours_x.grad is not None and ours_w.grad is not None
    assert theirs_x.grad is not None and theirs_w.grad is not None
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.allclose(ours_x.grad, theirs_x.grad, atol=1e-5)
    assert torch.allclose(ours_w.grad, theirs_w.grad, atol=1e-5)


def test_rms_norm_without_the_fused_kernel_gives_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch releases before the fused kernel take the composite forward."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    weight = torch.randn(16, generator=torch.Generator().manual_seed(2))
    fused = ops.rms_norm(x, weight, 1e-6)
    monkeypatch.setattr(ops, "_FUSED_RMS_NORM", False)
    assert torch.allclose(ops.rms_norm(x, weight, 1e-6), fused, atol=1e-6)
