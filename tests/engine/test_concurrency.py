"""The side lane (worker.grpo.concurrency): work moved beside the caller gives what it gives inline.

The engine tests run on one torch thread (conftest), where no side lane is used; these set two.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from contract.config import GRPOConfig
from tests.engine.test_trainer import _capture_gradients
from tests.engine.trainer_helpers import small_config, spread_reward, trainer_kwargs, word_rows
from worker.grpo import concurrency, rollout
from worker.grpo.backends import FusedBackend, FusedPath
from worker.grpo.backends.fused import fast_decoder, static_decoder
from worker.grpo.concurrency import SideThread
from worker.grpo.modeling import ModelBundle
from worker.grpo.trainer import GRPOTrainer

SIDE = "grpo-side_0"


@pytest.fixture
def two_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def side(two_threads: None) -> Iterator[SideThread]:
    lane = SideThread()
    try:
        yield lane
    finally:
        lane.close()


@pytest.fixture
def model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def record_threads(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[str]:
    """Names of the threads that call owner.name from now on."""
    seen: list[str] = []
    original: Callable[..., Any] = getattr(owner, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen


def test_side_thread_runs_on_one_thread_and_leaves_the_callers_count(side: SideThread) -> None:
    assert side.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == 2
    assert side.submit(lambda: threading.current_thread().name).result() == SIDE


def test_decode_lanes_only_split_single_threaded_decoding_with_halves_worth_a_core(
    model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    # The tiny preset's largest decode matmul is 2 * 128 * 512 FLOP per row.
    net = fast_decoder.DecoderFunctional(model)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert static_decoder.decode_lanes(net, 8) == 1  # 4-row halves: the hand-offs would cost more
    assert static_decoder.decode_lanes(net, 32) == 2
    assert static_decoder.decode_lanes(net, 1024) == 1  # decoding already uses both threads
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert static_decoder.decode_lanes(net, 64) == 1  # a spinning pool decodes on both threads
    torch.set_num_threads(1)
    assert static_decoder.decode_lanes(net, 64) == 1


def test_decode_layouts_to_try_put_the_rule_of_thumb_first(
    model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    net = fast_decoder.DecoderFunctional(model)
    layout = static_decoder.DecodeLayout
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert static_decoder.layout_candidates(net, 8, two_lanes=True) == [
        layout(1, 1),
        layout(1, 2),
        layout(2, 1),
    ]
    assert static_decoder.layout_candidates(net, 64, two_lanes=True) == [
        layout(2, 1),
        layout(1, 1),
        layout(1, 2),
    ]
    assert static_decoder.layout_candidates(net, 64, two_lanes=False) == [layout(1, 1), layout(1, 2)]
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a spinning pool: every thread, no choice
    assert static_decoder.layout_candidates(net, 64, two_lanes=True) == [layout(1, 2)]
    torch.set_num_threads(1)
    assert static_decoder.layout_candidates(net, 64, two_lanes=True) == [layout(1, 1)]


def test_layout_chooser_warms_up_tries_each_layout_then_keeps_the_fastest() -> None:
    a, b, c = (static_decoder.DecodeLayout(*shape) for shape in ((1, 1), (1, 2), (2, 1)))
    chooser = static_decoder.LayoutChooser(trials=2)
    seconds = {a: 3.0, b: 2.0, c: 4.0}
    chosen = []
    for _ in range(9):
        layout = chooser.choose("key", [a, b, c])
        chosen.append(layout)
        chooser.record("key", layout, seconds[layout])
    # warm-up (not kept), then a, b, c twice in turn, then the fastest
    assert chosen == [a, a, b, c, a, b, c, b, b]
    assert chooser.choose("other key", [c, a]) == c  # keys are measured apart
    for _ in range(5):  # b slows down: its median (over 4 + 5 timings) passes a's
        chooser.record("key", b, 100.0)
    assert chooser.choose("key", [a, b, c]) == a


def test_measured_decode_layouts_sample_the_same_tokens_and_follow_the_timings(
    model: PreTrainedModel,
    tiny_model_dir: Path,
    side: SideThread,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, mask = rollout.tokenize_prompts(tokenizer, ["a", "bb: ", "ccc: 12", "dddd"], None)
    ids, mask = ids.repeat_interleave(8, dim=0), mask.repeat_interleave(8, dim=0)
    config = GRPOConfig.model_validate({"max_steps": 1, "num_generations": 8, "max_completion_length": 16})
    eos = rollout.eos_token_ids(model, tokenizer)
    chooser = static_decoder.LayoutChooser(trials=1)
    used: list[tuple[str, int]] = []  # (thread, intra-op threads) of each lane
    original = rollout._sample_lane

    def spy(decoder: Any, *args: Any) -> Any:
        used.append((threading.current_thread().name, decoder.threads))
        return original(decoder, *args)

    monkeypatch.setattr(rollout, "_sample_lane", spy)

    def sample() -> torch.Tensor:
        used.clear()
        generator = torch.Generator().manual_seed(5)
        return rollout.sample_completions(model, ids, mask, config, eos, 0, generator, side, fast=FusedPath(chooser))[0]

    tokens = [sample() for _ in range(4)]  # warm-up, then each of the three layouts once
    assert all(torch.equal(tokens[0], other) for other in tokens[1:])
    key = next(iter(chooser._seconds))
    assert {(layout.lanes, layout.threads) for layout in chooser._seconds[key]} == {(1, 1), (1, 2), (2, 1)}
    for fastest, lanes in (
        (static_decoder.DecodeLayout(2, 1), ["MainThread", SIDE]),
        (static_decoder.DecodeLayout(1, 2), ["MainThread"]),
    ):
        chooser._seconds[key] = {layout: [1.0] for layout in chooser._seconds[key]} | {fastest: [0.5]}
        assert torch.equal(sample(), tokens[0])
        assert sorted(name for name, _ in used) == lanes
        assert {threads for _, threads in used} == {fastest.threads}


def test_two_decode_lanes_sample_the_tokens_one_lane_samples(
    model: PreTrainedModel,
    tiny_model_dir: Path,
    side: SideThread,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["a", "bb: ", "ccc: 12", "dddd", "e: 3", "ff", "g g g g", "h"]  # left padding differs
    ids, mask = rollout.tokenize_prompts(tokenizer, prompts, None)
    ids, mask = ids.repeat_interleave(8, dim=0), mask.repeat_interleave(8, dim=0)  # 64 rows: two lanes
    config = GRPOConfig.model_validate({"max_steps": 1, "num_generations": 8, "max_completion_length": 16})
    eos = rollout.eos_token_ids(model, tokenizer)
    lanes = record_threads(monkeypatch, rollout, "_sample_lane")

    def sample(lane: SideThread | None) -> torch.Tensor:
        generator = torch.Generator().manual_seed(11)
        return rollout.sample_completions(model, ids, mask, config, eos, 0, generator, lane, fast=FusedPath())[0]

    one = sample(None)
    assert lanes == ["MainThread"]
    two = sample(side)
    assert sorted(lanes[1:]) == ["MainThread", SIDE]
    assert torch.equal(one, two)
    assert (one == 0).any()  # some rows ended early: lanes of different lengths were padded back
    assert not two.is_inference()  # usable as input of a forward that saves it for backward


@pytest.fixture
def models_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir.parent


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}], ids=["full", "lora"])
def test_reference_forward_beside_the_policy_gives_the_same_update(
    tmp_path: Path,
    models_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    two_threads: None,
    lora: dict[str, int] | None,
) -> None:
    """A LoRA reference on the fast path reads the base weights without switching the adapters
    off, so it too runs beside the policy's forward."""
    reference_threads = record_threads(monkeypatch, ModelBundle, "reference_logps")
    runs = []
    for lane in ("side", "inline"):
        if lane == "inline":
            monkeypatch.setattr(concurrency, "side_thread_helps", lambda device: False)
        run = GRPOTrainer(
            small_config(max_steps=1, beta=0.04, lora=lora),
            train_rows=word_rows(),
            reward=spread_reward(),
            **trainer_kwargs(tmp_path / lane, models_dir),
        )
        grads = _capture_gradients(run)
        result = run.train()
        runs.append((grads, result.history[0]))
    assert reference_threads == [SIDE, "MainThread"]
    (side_grads, side_metrics), (inline_grads, inline_metrics) = runs
    assert side_metrics["kl"] == pytest.approx(inline_metrics["kl"], rel=1e-4, abs=1e-7)
    assert side_metrics["loss"] == pytest.approx(inline_metrics["loss"], rel=1e-4, abs=1e-7)
    for index, grad in side_grads.items():
        torch.testing.assert_close(grad, inline_grads[index], atol=1e-6, rtol=1e-4, msg=str(index))


def test_lora_outside_the_fast_path_keeps_the_reference_forward_inline(
    tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    """There the reference is the policy with its adapters switched off: not beside the policy."""
    monkeypatch.setattr(fast_decoder, "supports", lambda model, max_length: False)
    reference_threads = record_threads(monkeypatch, ModelBundle, "reference_logps")
    GRPOTrainer(
        small_config(max_steps=1, beta=0.04, lora={"r": 4, "alpha": 8}),
        train_rows=word_rows(),
        reward=spread_reward(),
        **trainer_kwargs(tmp_path, models_dir),
    ).train()
    assert reference_threads == ["MainThread"]


def _grad_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads that call torch.autograd.grad from now on."""
    return record_threads(monkeypatch, torch.autograd, "grad")


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_backward_in_halves_runs_beside_and_gives_the_whole_batch_gradient(
    tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch, two_threads: None, beta: float
) -> None:
    """With a side lane the first pass's backward runs as two halves of the groups, the second on
    the side thread; the gradients are those of one backward over every row."""
    grad_threads = _grad_threads(monkeypatch)
    runs = []
    for lane in ("halves", "whole"):
        if lane == "whole":
            monkeypatch.setattr(FusedBackend, "_halves", lambda self, rollout: None)
        run = GRPOTrainer(
            small_config(max_steps=1, beta=beta, prompts_per_step=4),
            train_rows=word_rows(),
            reward=spread_reward(),
            **trainer_kwargs(tmp_path / lane, models_dir),
        )
        grads = _capture_gradients(run)
        result = run.train()
        runs.append((grads, result.history[0]))
        if lane == "halves":
            # the loss's gradient here, then one half here and the other beside
            assert sorted(grad_threads) == ["MainThread", "MainThread", SIDE]
    (half_grads, half_metrics), (whole_grads, whole_metrics) = runs
    assert half_metrics["loss"] == pytest.approx(whole_metrics["loss"], rel=1e-4, abs=1e-7)
    assert half_metrics["entropy"] == pytest.approx(whole_metrics["entropy"], rel=1e-4)
    for index, grad in half_grads.items():
        torch.testing.assert_close(grad, whole_grads[index], atol=1e-6, rtol=1e-4, msg=str(index))


def test_backward_in_halves_is_reproducible_bit_for_bit(
    tmp_path: Path, models_dir: Path, two_threads: None
) -> None:
    """The halves' gradients are added in a fixed order, whichever lane finishes first."""
    weights = []
    for run in ("first", "second"):
        trainer = GRPOTrainer(
            small_config(max_steps=3, beta=0.04, prompts_per_step=4),
            train_rows=word_rows(),
            reward=spread_reward(),
            **trainer_kwargs(tmp_path / run, models_dir),
        )
        trainer.train()
        weights.append([param.detach().clone() for param in trainer.models.trainable_parameters])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_iterations": 2}, {"mini_batch_size": 8}, {"prompts_per_step": 1}],
    ids=["one-pass", "mu-2", "mini-batches", "one-group"],
)
def test_halves_only_for_one_pass_over_one_mini_batch_of_several_groups(
    tmp_path: Path, models_dir: Path, two_threads: None, overrides: dict[str, int]
) -> None:
    trainer = GRPOTrainer(
        small_config(**({"max_steps": 1, "prompts_per_step": 4} | overrides)),
        train_rows=word_rows(),
        reward=spread_reward(),
        **trainer_kwargs(tmp_path, models_dir),
    )
    assert isinstance(trainer.backend, FusedBackend)
    with trainer.backend:
        generated = trainer._generate(1, 0, trainer.config.prompts_per_step, {"time/generate_s": 0.0})
        halves = trainer.backend._halves(generated.rollout)
    if overrides:
        assert halves is None
    else:
        assert halves == (slice(0, 8), slice(8, 16))  # two groups of 4 each
