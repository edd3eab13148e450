"""An adapter saved by a resident base (worker.grpo.resident) merged into a plain model (worker.grpo.adapter_merge)
computes what the adapter computed: the same log-probs, with the head untied from the embedding when the base
ties them and the adapter trains the head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from worker.grpo.adapter_merge import merge_adapter
from worker.grpo.resident import AdamSettings, Datum, LoraSpec, ResidentBase
from worker.grpo.tiny import build_tokenizer, model_config, save_model_atomically


def _base(directory: Path, *, tied: bool) -> Path:
    config = model_config("tiny")
    config.tie_word_embeddings = tied
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return save_model_atomically(model, build_tokenizer(), directory)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_merged_model_computes_what_the_adapter_did(tmp_path: Path, tied: bool) -> None:
    base_dir = _base(tmp_path / "base", tied=tied)
    resident = ResidentBase(base_dir)
    resident.add_client("c", LoraSpec(rank=4, seed=1))  # trains attention, MLP and the head
    tokens = list(resident.tokenizer("Say yes: yes", add_special_tokens=False)["input_ids"])
    datum = Datum(tokens[:-1], {"target_tokens": np.array(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)})
    for _ in range(3):
        resident.forward_backward("c", [datum], "cross_entropy")
        resident.optim_step("c", AdamSettings(learning_rate=5e-2))
    adapted = resident.forward_backward("c", [datum], "cross_entropy", forward_only=True).outputs[0].logprobs
    resident.save_state("c", tmp_path / "state")

    merged = merge_adapter(tmp_path / "state", str(base_dir), tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(torch.tensor([tokens[:-1]])).logits[0]
    assert np.allclose(logprobs, adapted, atol=1e-5)
    assert not np.allclose(torch.log_softmax(base_logits, -1).gather(
        -1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy(), adapted, atol=1e-2)  # the adapter changed the model
    assert model.config.tie_word_embeddings is False  # an adapted head is its own weight
    assert (merged / "tokenizer.json").is_file()
