"""Per-token log-probs: the chunked selective log-softmax and the completion forward pass."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from worker.grpo import logprobs
from worker.grpo.logprobs import completion_logprobs, entropy_from_logits, selective_log_softmax


class TestSelectiveLogSoftmax:
    @pytest.mark.parametrize("chunk_rows", [1, 7, 1024])
    def test_equals_log_softmax_gather(self, monkeypatch: pytest.MonkeyPatch, chunk_rows: int) -> None:
        monkeypatch.setattr(logprobs, "CHUNK_ROWS", chunk_rows)
        generator = torch.Generator().manual_seed(0)
        logits = (torch.randn(3, 5, 50, generator=generator) * 4).requires_grad_(True)
        index = torch.randint(0, 50, (3, 5), generator=generator)
        ours = selective_log_softmax(logits, index)
        naive = torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(ours, naive)
        # Same gradient too: the loss backpropagates through it.
        (ours_grad,) = torch.autograd.grad(ours.sum(), logits)
        (naive_grad,) = torch.autograd.grad(naive.sum(), logits)
        torch.testing.assert_close(ours_grad, naive_grad)

    def test_low_precision_logits_give_float32(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(logprobs, "CHUNK_ROWS", 4)
        logits = torch.randn(2, 6, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        index = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2))
        ours = selective_log_softmax(logits, index)
        assert ours.dtype == torch.float32
        naive = torch.log_softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(ours, naive)

    def test_shape_mismatch_is_refused(self) -> None:
        with pytest.raises(ValueError, match="index shape"):
            selective_log_softmax(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))

    def test_entropy(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(logprobs, "CHUNK_ROWS", 3)
        logits = torch.randn(2, 5, 30, generator=torch.Generator().manual_seed(3))
        naive = torch.distributions.Categorical(logits=logits).entropy()
        torch.testing.assert_close(entropy_from_logits(logits), naive)


Batch = tuple[PreTrainedModel, torch.Tensor, torch.Tensor, list[list[int]]]


@pytest.fixture(scope="module")
def model_and_batch(tiny_model_dir: Path) -> Batch:
    """The tiny model and a left-padded batch: prompts of different lengths, each followed by 6 tokens."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [tokenizer(text)["input_ids"] for text in ("hi there", "a", "what is 2+2? 4", "xyz")]
    completion = torch.randint(4, len(tokenizer), (len(rows), 6), generator=torch.Generator().manual_seed(0))
    sequences = [prompt + completion[i].tolist() for i, prompt in enumerate(rows)]
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, seq in enumerate(sequences):
        input_ids[i, width - len(seq) :] = torch.tensor(seq)
        mask[i, width - len(seq) :] = 1
    return model, input_ids, mask, sequences


class TestCompletionLogprobs:
    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_equals_naive_full_forward(self, model_and_batch: Batch, temperature: float) -> None:
        model, input_ids, mask, _ = model_and_batch
        with torch.no_grad():
            ours, entropy = completion_logprobs(
                model, input_ids, mask, 6, temperature=temperature, with_entropy=True
            )
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions).logits
            naive_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # (N, T-1, V)
            naive = naive_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)[:, -6:]
        assert ours.shape == (4, 6) and ours.dtype == torch.float32
        torch.testing.assert_close(ours, naive)
        assert entropy is not None
        naive_entropy = -(naive_all.exp() * naive_all).sum(-1)[:, -6:]
        torch.testing.assert_close(entropy, naive_entropy)

    def test_left_padding_does_not_change_the_result(self, model_and_batch: Batch) -> None:
        model, input_ids, mask, sequences = model_and_batch
        with torch.no_grad():
            batched, no_entropy = completion_logprobs(model, input_ids, mask, 6, temperature=1.0)
            for row, seq in enumerate(sequences):
                alone = torch.tensor([seq])
                single, _ = completion_logprobs(model, alone, torch.ones_like(alone), 6, temperature=1.0)
                torch.testing.assert_close(batched[row : row + 1], single, atol=1e-5, rtol=1e-5)
        assert no_entropy is None

    def test_gradient_reaches_the_model(self, model_and_batch: Batch) -> None:
        model, input_ids, mask, _ = model_and_batch
        model.zero_grad()
        logps, _ = completion_logprobs(model, input_ids, mask, 6, temperature=1.0)
        logps.sum().backward()
        assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
        model.zero_grad()

    def test_bad_completion_length(self, model_and_batch: Batch) -> None:
        model, input_ids, mask, _ = model_and_batch
        with pytest.raises(ValueError, match="completion_length"):
            completion_logprobs(model, input_ids, mask, input_ids.shape[1], temperature=1.0)


class TestChunkedHead:
    """The fused LM head + selective log-softmax, in one chunk or several (large vocabularies), equals
    torch's log_softmax through autograd, values, entropy and gradients."""

    @pytest.mark.parametrize(
        ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
    )
    @pytest.mark.parametrize("chunk_rows", [4, 100], ids=["6-chunks", "one-chunk"])
    def test_matches_log_softmax_with_gradients(
        self, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, tolerance: float, chunk_rows: int
    ) -> None:
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(3, 7, 16, generator=gen).to(dtype).requires_grad_(True)
        weight = torch.randn(50, 16, generator=gen).to(dtype).requires_grad_(True)
        bias = torch.randn(50, generator=gen).to(dtype).requires_grad_(True)
        targets = torch.randint(0, 50, (3, 7), generator=gen)
        upstream = torch.randn(3, 7, generator=gen)  # a loss that weighs every token differently

        def run() -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
            logps, entropy = logprobs.head_logprobs(
                hidden, weight, bias, targets, temperature=0.7, with_entropy=True
            )
            grads = torch.autograd.grad((logps * upstream).sum(), [hidden, weight, bias])
            return logps, entropy, list(grads)

        def reference() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
            logp_all = torch.log_softmax((hidden @ weight.T + bias).div(0.7).float(), dim=-1)  # (3, 7, 50)
            logps = logp_all.gather(-1, targets[..., None]).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
            grads = torch.autograd.grad((logps * upstream).sum(), [hidden, weight, bias])
            return logps, entropy, list(grads)

        monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", 50 * chunk_rows)
        chunked = run()
        whole = reference()
        torch.testing.assert_close(chunked[0], whole[0], atol=tolerance, rtol=tolerance)
        assert chunked[1] is not None and whole[1] is not None
        torch.testing.assert_close(chunked[1], whole[1], atol=tolerance, rtol=tolerance)
        for ours, theirs in zip(chunked[2], whole[2], strict=True):
            scale = float(theirs.abs().max())
            torch.testing.assert_close(ours.float(), theirs.float(), atol=tolerance * scale, rtol=0)

    def test_frozen_head_gets_no_gradient_but_hidden_does(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", 40)
        hidden = torch.randn(10, 8, requires_grad=True)
        weight = torch.randn(20, 8)  # LoRA: the LM head is frozen
        logps, _ = logprobs.head_logprobs(hidden, weight, None, torch.randint(0, 20, (10,)), temperature=1.0)
        logps.sum().backward()
        assert hidden.grad is not None and weight.grad is None


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the block (alive at the same time)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}  # storage address -> tensors created here that use it

    def _release(self, key: int, nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if key not in self._refs:
                    self._refs[key] = 0
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self._refs[key] += 1
                weakref.finalize(tensor, self._release, key, nbytes)
        return out


def test_peak_memory_of_a_32k_vocabulary_step_does_not_grow_with_completion_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forward and backward of the completion log-probs on a 32k-token vocabulary: 4x the completion
    length adds less than one chunk of logits to the peak (the whole logits would add 24 MiB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    chunk_elements = 2**20  # 4 MiB of float32 logits
    monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)

    def peak(completion_length: int) -> int:
        ids = torch.randint(0, 32_000, (8, 4 + completion_length), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        model.zero_grad(set_to_none=True)
        with PeakMemory() as memory:
            logps, _ = completion_logprobs(model, ids, mask, completion_length, temperature=0.9)
            logps.sum().backward()
        return memory.peak

    short, long = peak(16), peak(64)
    assert long - short < chunk_elements * 4, (short, long)
