"""One resident base model serving several primitive-API clients (worker.grpo.resident): tenant isolation,
exact save/load, gradient accumulation, batching, validation, sampling and a small learning check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from worker.grpo.primitive_errors import PrimitiveConflict, PrimitiveInputError, PrimitiveNotFound
from worker.grpo.resident import AdamSettings, Datum, LoraSpec, ResidentBase

ADAM = AdamSettings(learning_rate=1e-2)


@pytest.fixture
def base(tiny_model_dir: Path) -> ResidentBase:
    return ResidentBase(tiny_model_dir)


def ids(base: ResidentBase, text: str) -> list[int]:
    return list(base.tokenizer(text, add_special_tokens=False)["input_ids"])


def rl_datum(base: ResidentBase, prompt: str, completion: str, advantage: float, logprob: float = -2.0) -> Datum:
    """prompt + completion shifted by one, the completion's positions carrying `advantage` (Tinker's layout)."""
    full = [base.tokenizer.bos_token_id, *ids(base, prompt), *ids(base, completion)]
    n_prompt = 1 + len(ids(base, prompt))
    n = len(full) - 1
    on_completion = np.arange(n) >= n_prompt - 1
    return Datum(
        full[:-1],
        {
            "target_tokens": np.array(full[1:], dtype=np.int64),
            "logprobs": np.where(on_completion, logprob, 0.0).astype(np.float32),
            "advantages": np.where(on_completion, advantage, 0.0).astype(np.float32),
        },
    )


def weights(base: ResidentBase, client_id: str, directory: Path) -> dict[str, torch.Tensor]:
    base.save_state(client_id, directory, optimizer=False)
    return load_file(str(directory / "adapter_model.safetensors"))


def assert_same_weights(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


def test_clients_sharing_a_base_match_each_client_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec_a = LoraSpec(rank=4, seed=7)
    solo = ResidentBase(tiny_model_dir)
    data_a = [rl_datum(solo, "2+2=", "4", 1.0), rl_datum(solo, "2+2=", "5", -1.0)]
    solo.add_client("a", spec_a)
    solo_logprobs = []
    for _ in range(2):
        solo_logprobs.append(solo.forward_backward("a", data_a, "importance_sampling").outputs)
        solo.optim_step("a", ADAM)
    solo_weights = weights(solo, "a", tmp_path / "solo")

    shared = ResidentBase(tiny_model_dir)
    shared.add_client("b", LoraSpec(rank=2, seed=3, train_mlp=False))  # b exists before a: a's init ignores it
    shared.add_client("a", spec_a)
    shared.add_client("c", LoraSpec(rank=8, seed=11, train_unembed=False))
    data_b = [rl_datum(shared, "hello", " world", 1.0)]
    for step in range(2):  # the others step and sample while a's gradients wait for its own step
        shared.forward_backward("b", data_b, "ppo")
        outputs = shared.forward_backward("a", data_a, "importance_sampling").outputs
        shared.forward_backward("c", data_a, "dro")
        shared.sample("b", [1, 5, 6], max_tokens=4, seed=step)
        shared.optim_step("c", AdamSettings(learning_rate=2e-2, weight_decay=0.1))
        shared.forward_backward("b", data_b, "ppo")  # b accumulates over two calls meanwhile
        shared.optim_step("b", AdamSettings(learning_rate=5e-2, grad_clip_norm=0.5))
        shared.sample("a", [1, 5, 6], max_tokens=4, seed=step)
        shared.optim_step("a", ADAM)
        for got, want in zip(outputs, solo_logprobs[step], strict=True):
            np.testing.assert_array_equal(got.logprobs, want.logprobs)
            np.testing.assert_array_equal(got.elementwise_loss, want.elementwise_loss)
    assert_same_weights(weights(shared, "a", tmp_path / "shared"), solo_weights)
    assert any(tensor.any() for name, tensor in solo_weights.items() if "lora_B" in name)  # it did train


def test_a_seed_gives_one_adapter(base: ResidentBase, tmp_path: Path) -> None:
    base.add_client("x", LoraSpec(rank=4, seed=5))
    base.add_client("y", LoraSpec(rank=4, seed=5))
    base.add_client("z", LoraSpec(rank=4, seed=6))
    x, y, z = (weights(base, name, tmp_path / name) for name in "xyz")
    assert_same_weights(x, y)
    lora_a = next(name for name in x if "lora_A" in name)
    assert not torch.equal(x[lora_a], z[lora_a])
    assert all(not tensor.any() for name, tensor in x.items() if "lora_B" in name)  # B = 0: the base exactly
    assert base.add_client("fresh", LoraSpec(rank=2)).seed is not None


def test_save_then_load_gives_the_same_next_step(base: ResidentBase, tmp_path: Path) -> None:
    data = [rl_datum(base, "1+1=", "2", 1.0), rl_datum(base, "1+1=", "3", -1.0)]
    base.add_client("a", LoraSpec(rank=4, seed=1))
    for _ in range(2):
        base.forward_backward("a", data, "ppo")
        base.optim_step("a", ADAM)
    base.save_state("a", tmp_path / "saved")
    base.forward_backward("a", data, "ppo")
    base.optim_step("a", ADAM)
    after_save = weights(base, "a", tmp_path / "first")

    base.forward_backward("a", data, "ppo")  # another step and pending gradients, both undone by the load
    base.optim_step("a", ADAM)
    base.forward_backward("a", data, "ppo")
    base.load_state("a", tmp_path / "saved")
    base.forward_backward("a", data, "ppo")
    base.optim_step("a", ADAM)
    assert_same_weights(weights(base, "a", tmp_path / "second"), after_save)

    other = ResidentBase(base.base_model_dir)  # another process's base: load_state creates the client
    assert other.load_state("restored", tmp_path / "saved") == base.client_spec("a")
    other.forward_backward("restored", data, "ppo")
    other.optim_step("restored", ADAM)
    assert_same_weights(weights(other, "restored", tmp_path / "third"), after_save)


def test_load_without_optimizer_starts_a_fresh_adamw(base: ResidentBase, tmp_path: Path) -> None:
    data = [rl_datum(base, "a", "b", 1.0)]
    base.add_client("a", LoraSpec(rank=4, seed=1))
    base.save_state("a", tmp_path / "init", optimizer=False)
    base.add_client("fresh", LoraSpec(rank=4, seed=1))
    for client in ("a", "fresh"):
        base.forward_backward(client, data, "importance_sampling")
        base.optim_step(client, ADAM)
    base.load_state("a", tmp_path / "init", optimizer=False)
    with pytest.raises(PrimitiveInputError):
        base.load_state("a", tmp_path / "init", optimizer=True)  # no optimizer state there
    base.load_state("fresh", tmp_path / "init", optimizer=False)
    for client in ("a", "fresh"):
        base.forward_backward(client, data, "importance_sampling")
        base.optim_step(client, ADAM)
    assert_same_weights(weights(base, "a", tmp_path / "a"), weights(base, "fresh", tmp_path / "f"))


def test_gradients_accumulate_until_the_step(base: ResidentBase, tmp_path: Path) -> None:
    d1, d2 = rl_datum(base, "3*3=", "9", 1.0), rl_datum(base, "3*3=", "6", -1.0)
    base.add_client("two_calls", LoraSpec(rank=4, seed=2))
    base.add_client("one_call", LoraSpec(rank=4, seed=2))
    first = base.forward_backward("two_calls", [d1], "importance_sampling")
    second = base.forward_backward("two_calls", [d2], "importance_sampling")
    both = base.forward_backward("one_call", [d1, d2], "importance_sampling")
    summed = first.metrics["loss:sum"] + second.metrics["loss:sum"]
    assert both.metrics["loss:sum"] == pytest.approx(summed, rel=1e-5)
    norms = [base.optim_step(client, ADAM)["grad_norm:mean"] for client in ("two_calls", "one_call")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[0] > 0
    got, want = weights(base, "two_calls", tmp_path / "t"), weights(base, "one_call", tmp_path / "o")
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6)
    # The step zeroed them: a step with no new gradient leaves a weight-decay-free adapter as it is.
    base.optim_step("one_call", ADAM)
    assert_same_weights(weights(base, "one_call", tmp_path / "again"), want)
    base.forward_backward("one_call", [d1], "importance_sampling", forward_only=True)  # no gradient either
    assert base.optim_step("one_call", ADAM)["grad_norm:mean"] == 0.0


def test_padded_batches_match_one_datum_at_a_time(tiny_model_dir: Path) -> None:
    # One padded batch; then at most 20 positions a batch: the first two padded together, the long one alone.
    for budget in (16384, 20):
        base = ResidentBase(tiny_model_dir, max_batch_tokens=budget)
        base.add_client("a", LoraSpec(rank=4, seed=3))
        data = [
            rl_datum(base, "x", "yz", 1.0),
            rl_datum(base, "mid", "dle", 2.0),
            rl_datum(base, "a much longer prompt", " and its answer", -0.5),
        ]
        together = base.forward_backward("a", data, "cispo", forward_only=True)
        alone = [base.forward_backward("a", [d], "cispo", forward_only=True) for d in data]
        assert together.metrics["loss:sum"] == pytest.approx(sum(r.metrics["loss:sum"] for r in alone), rel=1e-5)
        for got, single, datum in zip(together.outputs, alone, data, strict=True):
            assert got.logprobs.dtype == np.float32 and got.logprobs.shape == (len(datum.tokens),)
            np.testing.assert_allclose(got.logprobs, single.outputs[0].logprobs, rtol=0, atol=1e-5)
            np.testing.assert_allclose(got.elementwise_loss, single.outputs[0].elementwise_loss, rtol=0, atol=1e-5)


def test_bad_requests_name_what_is_wrong(base: ResidentBase) -> None:
    base.add_client("a", LoraSpec(rank=2, seed=0))
    good = rl_datum(base, "ab", "c", 1.0)
    n = len(good.tokens)

    def field_of(data: list[Datum], loss_fn: str = "ppo") -> str:
        with pytest.raises(PrimitiveInputError) as caught:
            base.forward_backward("a", data, loss_fn)
        return caught.value.field

    outside = [*good.tokens[:2], base.vocab_size, *good.tokens[3:]]
    assert field_of([good, Datum(outside, good.loss_fn_inputs)]) == "data[1].model_input[2]"
    bad_target = {**good.loss_fn_inputs, "target_tokens": np.full(n, base.vocab_size)}
    assert field_of([Datum(good.tokens, bad_target)]) == "data[0].loss_fn_inputs.target_tokens[0]"
    short = {**good.loss_fn_inputs, "advantages": np.ones(n - 1, dtype=np.float32)}
    assert field_of([good, good, Datum(good.tokens, short)]) == "data[2].loss_fn_inputs.advantages"
    assert field_of([good], "cross_entropy") == "data[0].loss_fn_inputs.weights"
    assert field_of([good], "sft") == "loss_fn"
    assert field_of([]) == "data"
    assert field_of([Datum([], {})]) == "data[0].model_input"
    with pytest.raises(PrimitiveInputError) as caught:
        base.optim_step("a", AdamSettings(beta2=1.0))
    assert caught.value.field == "adam_params.beta2"
    with pytest.raises(PrimitiveInputError):
        base.add_client("b", LoraSpec(rank=0))
    with pytest.raises(PrimitiveInputError):
        base.add_client("b", LoraSpec(rank=2, train_attn=False, train_mlp=False, train_unembed=False))
    with pytest.raises(PrimitiveNotFound):
        base.forward_backward("nobody", [good], "ppo")
    with pytest.raises(PrimitiveConflict):
        base.add_client("a", LoraSpec(rank=2))
    base.remove_client("a")
    with pytest.raises(PrimitiveNotFound):
        base.optim_step("a", ADAM)
    base.add_client("a", LoraSpec(rank=2, seed=0))  # the id is free again


def test_sampling_is_seeded_and_its_logprobs_are_the_models(base: ResidentBase) -> None:
    base.add_client("a", LoraSpec(rank=4, seed=0))
    base.forward_backward("a", [rl_datum(base, "q", "rs", 1.0)], "importance_sampling")
    base.optim_step("a", AdamSettings(learning_rate=0.1))  # an adapter that differs from the base
    prompt = [base.tokenizer.bos_token_id, *ids(base, "The")]
    first = base.sample("a", prompt, num_samples=3, max_tokens=8, seed=4, stop=[])
    again = base.sample("a", prompt, num_samples=3, max_tokens=8, seed=4, stop=[])
    other = base.sample("a", prompt, num_samples=3, max_tokens=8, seed=5, stop=[])
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert [s.logprobs for s in first] == [s.logprobs for s in again]
    assert [s.tokens for s in first] != [s.tokens for s in other]
    assert all(s.stop_reason == "length" and len(s.tokens) == 8 for s in first)
    for sequence in first:  # at temperature 1 the sampled log-probs are forward_backward's for the same tokens
        full = prompt + sequence.tokens
        datum = Datum(full[:-1], {"target_tokens": np.array(full[1:]), "weights": np.ones(len(full) - 1)})
        scored = base.forward_backward("a", [datum], "cross_entropy", forward_only=True).outputs[0].logprobs
        np.testing.assert_allclose(sequence.logprobs, scored[len(prompt) - 1 :], rtol=0, atol=1e-4)
    hot = base.sample("a", prompt, max_tokens=8, seed=4, stop=[], temperature=0.5)[0]
    assert hot.tokens != first[0].tokens or hot.logprobs != first[0].logprobs


def test_stop_sequences_end_a_sample_and_are_kept(base: ResidentBase) -> None:
    prompt = [base.tokenizer.bos_token_id, *ids(base, "Hi")]
    greedy = base.sample(None, prompt, max_tokens=10, temperature=0.0, stop=[])[0].tokens
    assert len(greedy) == 10
    stopped = base.sample(None, prompt, max_tokens=10, temperature=0.0, stop=[greedy[3:5], [base.vocab_size - 1]])
    end = next(i for i in range(1, 10) if greedy[i - 1 : i + 1] == greedy[3:5]) + 1  # its first occurrence
    assert stopped[0].tokens == greedy[:end] and stopped[0].stop_reason == "stop"
    assert len(stopped[0].logprobs) == end
    with pytest.raises(PrimitiveInputError) as caught:
        base.sample(None, prompt, max_tokens=4, stop=[[0, base.vocab_size]])
    assert caught.value.field == "sampling_params.stop[0][1]"
    with pytest.raises(PrimitiveNotFound):
        base.sample("nobody", prompt, max_tokens=4)


def test_eos_stops_by_default_and_samplers_load_saved_adapters(base: ResidentBase, tmp_path: Path) -> None:
    """Teach a client to answer EOS at once (cross_entropy), then sample it live and as a saved sampler."""
    eos = base.tokenizer.eos_token_id
    prompt = [base.tokenizer.bos_token_id, *ids(base, "stop")]
    datum = Datum(prompt, {"target_tokens": np.array([*prompt[1:], eos]), "weights": np.eye(len(prompt))[-1]})
    base.add_client("a", LoraSpec(rank=8, seed=0))
    for _ in range(15):
        base.forward_backward("a", [datum], "cross_entropy")
        base.optim_step("a", AdamSettings(learning_rate=0.05))
    live = base.sample("a", prompt, num_samples=2, max_tokens=6, temperature=0.0)
    assert [(s.tokens, s.stop_reason) for s in live] == [([eos], "stop")] * 2
    base.save_state("a", tmp_path / "trained", optimizer=False)
    base.add_sampler("s", tmp_path / "trained")
    assert base.sample("s", prompt, num_samples=2, max_tokens=6, temperature=0.0) == live
    base.remove_client("a")  # the sampler is a copy
    assert base.sample("s", prompt, max_tokens=6, temperature=0.0)[0].tokens == [eos]
    untrained = base.sample(None, prompt, max_tokens=6, seed=1)
    base.add_client("new", LoraSpec(rank=2, seed=9))  # B = 0: a new client samples as the base does
    assert base.sample("new", prompt, max_tokens=6, seed=1) == untrained
    base.remove_sampler("s")
    with pytest.raises(PrimitiveNotFound):
        base.sample("s", prompt, max_tokens=2)


def test_importance_sampling_raises_the_rewarded_continuation(base: ResidentBase) -> None:
    base.add_client("rl", LoraSpec(rank=8, seed=0))
    prompt, chosen, others = "Q:", "yes", ["no!", "hmm"]

    def continuation_logprob(completion: str) -> float:
        datum = rl_datum(base, prompt, completion, 1.0)
        out = base.forward_backward("rl", [datum], "importance_sampling", forward_only=True).outputs[0]
        return float(out.logprobs[datum.loss_fn_inputs["advantages"] != 0].sum())

    before = continuation_logprob(chosen)
    for _ in range(8):
        data = [rl_datum(base, prompt, c, 1.0 if c == chosen else -1.0) for c in [chosen, *others]]
        on_policy = base.forward_backward("rl", data, "importance_sampling", forward_only=True).outputs
        data = [  # the sampler's log-probs: the policy's own (ratio 1)
            Datum(d.tokens, {**d.loss_fn_inputs, "logprobs": out.logprobs})
            for d, out in zip(data, on_policy, strict=True)
        ]
        base.forward_backward("rl", data, "importance_sampling")
        base.optim_step("rl", AdamSettings(learning_rate=3e-2))
    after = continuation_logprob(chosen)
    assert after > before + 3.0, (before, after)
    assert all(continuation_logprob(c) < continuation_logprob(chosen) for c in others)
