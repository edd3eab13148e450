"""The generic decoding path (any causal LM the fast path does not cover), on every supported transformers.

GPT-2 stands for such a model. Its cache must really be used (a keyword the installed transformers
does not know would be swallowed by the forward's **kwargs and decode without one), and no argument
that transformers deprecates may be passed (they are removed a few releases later).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from contract.config import GRPOConfig
from worker.grpo.rollout import generate_rollout
from worker.grpo.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def gpt2(tokenizer: PreTrainedTokenizerFast) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,  # peaked distributions: greedy picks are far from ties
    )
    return GPT2LMHeadModel(config).eval()


PROMPTS = ["Repeat the digit 7: ", "Spell cat:"]  # different lengths: left padding


def test_greedy_generic_decoding_equals_generate(
    gpt2: GPT2LMHeadModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    """top_k=1 makes our sampling loop greedy: it must pick what `generate()` picks, token for token."""
    config = GRPOConfig.model_validate(
        {"max_steps": 1, "num_generations": 2, "max_completion_length": 16, "top_k": 1}
    )
    ours = generate_rollout(gpt2, tokenizer, PROMPTS, config, generator_seed=0)
    reference = gpt2.generate(
        input_ids=ours.prompt_ids,
        attention_mask=ours.prompt_mask,
        generation_config=GenerationConfig(
            do_sample=False,
            max_new_tokens=16,
            min_new_tokens=16,  # the random model may emit EOS; compare the masked part only
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
    )[:, ours.prompt_ids.shape[1] :]
    mask = ours.completion_mask.bool()
    assert mask.sum() > 16
    assert torch.equal(ours.completion_ids[mask], reference[:, : mask.shape[1]][mask])


def test_generic_decoding_passes_no_deprecated_argument(
    gpt2: GPT2LMHeadModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    config = GRPOConfig.model_validate({"max_steps": 1, "num_generations": 2, "max_completion_length": 4})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        generate_rollout(gpt2, tokenizer, PROMPTS, config, generator_seed=0)
