"""Rollouts (acceptance item 3): contiguous groups, EOS-terminated masks, truncation, beams, seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from contract.config import GRPOConfig
from worker.grpo.rollout import (
    Rollout,
    completion_mask_after_eos,
    generate_rollout,
    render_prompt,
    tokenize_prompts,
)

PROMPTS = ["The answer is", "abc", "Copy the digit 7:", "x"]
G = 4
MAX_NEW = 40


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def make_config(**overrides: object) -> GRPOConfig:
    return GRPOConfig.model_validate(
        {"max_steps": 1, "num_generations": G, "max_completion_length": MAX_NEW, **overrides}
    )


@pytest.fixture(scope="module")
def sampled(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Rollout:
    return generate_rollout(model, tokenizer, PROMPTS, make_config(), generator_seed=1234)


class TestSampling:
    def test_groups_are_contiguous_and_share_the_prompt(
        self, sampled: Rollout, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        n = len(PROMPTS) * G
        assert sampled.prompt_ids.shape[0] == n and sampled.completion_ids.shape[0] == n
        assert sampled.group_size == G and len(sampled.completion_texts) == n
        for index, prompt in enumerate(PROMPTS):
            rows = slice(index * G, (index + 1) * G)
            group_ids = sampled.prompt_ids[rows]
            assert (group_ids == group_ids[0]).all()
            real = group_ids[0][sampled.prompt_mask[index * G].bool()]
            assert tokenizer.decode(real, skip_special_tokens=True) == prompt
            assert real[0].item() == tokenizer.bos_token_id

    def test_prompts_are_left_padded(self, sampled: Rollout, tokenizer: PreTrainedTokenizerBase) -> None:
        assert (sampled.prompt_mask[:, -1] == 1).all()
        short = sampled.prompt_mask[-1]  # "x": BOS + 1 char
        assert (
            short.sum().item() == 2 and (sampled.prompt_ids[-1][short == 0] == tokenizer.pad_token_id).all()
        )

    def test_completion_mask_ends_at_the_first_eos(
        self, sampled: Rollout, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        assert sampled.completion_ids.shape[1] <= MAX_NEW
        ended = truncated = 0
        for ids, mask, is_truncated, text in zip(
            sampled.completion_ids.tolist(),
            sampled.completion_mask.tolist(),
            sampled.is_truncated.tolist(),
            sampled.completion_texts,
            strict=True,
        ):
            if eos in ids:
                first = ids.index(eos)
                assert mask == [1] * (first + 1) + [0] * (len(ids) - first - 1)
                assert ids[first + 1 :] == [pad] * (len(ids) - first - 1)
                assert not is_truncated
                ended += 1
            else:
                assert mask == [1] * len(ids)
                assert is_truncated and len(ids) == MAX_NEW
                truncated += 1
            kept = [t for t, m in zip(ids, mask, strict=True) if m]
            assert text == tokenizer.decode(kept, skip_special_tokens=True)
        # The untrained model emits EOS now and then: both kinds occur at this seed.
        assert ended > 0 and truncated > 0, (ended, truncated)

    def test_input_ids_and_attention_mask_concatenate(self, sampled: Rollout) -> None:
        p = sampled.prompt_ids.shape[1]
        assert torch.equal(sampled.input_ids[:, :p], sampled.prompt_ids)
        assert torch.equal(sampled.input_ids[:, p:], sampled.completion_ids)
        assert torch.equal(sampled.attention_mask[:, p:], sampled.completion_mask)
        assert torch.equal(sampled.completion_lengths, sampled.completion_mask.sum(1))

    def test_same_seed_same_rollout_and_global_rng_untouched(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sampled: Rollout
    ) -> None:
        state = torch.get_rng_state()
        again = generate_rollout(model, tokenizer, PROMPTS, make_config(), generator_seed=1234)
        assert torch.equal(torch.get_rng_state(), state)
        assert torch.equal(again.completion_ids, sampled.completion_ids)
        other = generate_rollout(model, tokenizer, PROMPTS, make_config(), generator_seed=99)
        assert not torch.equal(other.completion_ids[:, :5], sampled.completion_ids[:, :5])

    def test_samples_within_a_group_differ(self, sampled: Rollout) -> None:
        for index in range(len(PROMPTS)):
            group = sampled.completion_ids[index * G : (index + 1) * G, :5].tolist()
            assert len({tuple(row) for row in group}) > 1

    def test_model_mode_is_restored(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        model.train()
        generate_rollout(model, tokenizer, ["a"], make_config(max_completion_length=2), generator_seed=0)
        assert model.training
        model.eval()


class TestBeam:
    def test_beam_mode_returns_g_distinct_sequences_per_prompt(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        prompts = PROMPTS[:2]
        rollout = generate_rollout(
            model, tokenizer, prompts, make_config(generation="beam", max_completion_length=12)
        )
        assert rollout.completion_ids.shape[0] == len(prompts) * G
        for index in range(len(prompts)):
            rows = slice(index * G, (index + 1) * G)
            assert (rollout.prompt_ids[rows] == rollout.prompt_ids[index * G]).all()
            sequences = {
                tuple(t for t, m in zip(ids, mask, strict=True) if m)
                for ids, mask in zip(
                    rollout.completion_ids[rows].tolist(), rollout.completion_mask[rows].tolist(), strict=True
                )
            }
            assert len(sequences) == G


class TestHelpers:
    def test_completion_mask_after_eos_by_hand(self) -> None:
        eos = 2
        ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0], [5, 6, 7, 2]])
        mask, truncated = completion_mask_after_eos(ids, eos)
        assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
        assert truncated.tolist() == [False, True, False, False]
        # Several EOS ids (e.g. <|im_end|> and <|endoftext|>): the first of any ends the completion.
        mask, truncated = completion_mask_after_eos(ids, [eos, 7])
        assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 0]]
        assert truncated.tolist() == [False, False, False, False]

    def test_prompts_are_truncated_from_the_left(self, tokenizer: PreTrainedTokenizerBase) -> None:
        ids, mask = tokenize_prompts(tokenizer, ["abcdefgh", "xy"], max_prompt_length=4)
        assert ids.shape == (2, 4)
        assert tokenizer.decode(ids[0]) == "efgh"
        assert mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]]

    def test_render_prompt(self, tokenizer: PreTrainedTokenizerBase) -> None:
        assert render_prompt(tokenizer, "plain text") == "plain text"
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
        assert render_prompt(tokenizer, messages) == "system: Be brief.\nuser: 2+2?\nassistant: "

    def test_no_prompts_is_an_error(self, tokenizer: PreTrainedTokenizerBase) -> None:
        with pytest.raises(ValueError, match="no prompts"):
            tokenize_prompts(tokenizer, [], max_prompt_length=None)
