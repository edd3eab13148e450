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
from worker.grpo import concurrency, fast_decoder, rollout, static_decoder
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
    assert static_decoder.decode_lanes(net, 32) == 1  # 16-row halves: GIL hand-offs would cost more
    assert static_decoder.decode_lanes(net, 64) == 2
    assert static_decoder.decode_lanes(net, 1024) == 1  # decoding already uses both threads
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert static_decoder.decode_lanes(net, 64) == 1  # a spinning pool decodes on both threads
    torch.set_num_threads(1)
    assert static_decoder.decode_lanes(net, 64) == 1


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
        return rollout.sample_completions(model, ids, mask, config, eos, 0, generator, lane)

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
