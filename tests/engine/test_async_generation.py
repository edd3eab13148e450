"""Asynchronous generation (worker.grpo.async_rollout) on the tiny model: max_staleness 0 is the synchronous
trainer bit for bit, no batch trains staler than max_staleness, and the weight-sync check catches a sampler
left on old weights."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.trainer_helpers import small_config, spread_reward, trainer_kwargs, word_rows
from worker.grpo.async_rollout import PolicyCopy, Produced, RolloutProducer
from worker.grpo.batch import Generated, Scored
from worker.grpo.trainer import GRPOTrainer


def _train(tmp_path: Path, models_dir: Path, name: str, *, backend: str = "auto",
           on_metrics: Any = None, **overrides: Any) -> GRPOTrainer:
    kwargs = trainer_kwargs(tmp_path / name, models_dir)
    trainer = GRPOTrainer(
        small_config(**overrides), train_rows=word_rows(), reward=spread_reward(), backend=backend,  # type: ignore[arg-type]
        on_metrics=on_metrics, **kwargs,
    )
    trainer.train()
    return trainer


def _weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.models.policy.named_parameters()}


@pytest.mark.parametrize("backend", ["hf", "fused"])
def test_max_staleness_0_is_the_synchronous_trainer_bit_for_bit(
    tmp_path: Path, tiny_model_dir: Path, backend: str
) -> None:
    common = {"max_steps": 3, "sync_check_every": None}
    sync = _train(tmp_path, tiny_model_dir, "sync", backend=backend, **common)
    pipelined = _train(
        tmp_path, tiny_model_dir, "async", backend=backend, async_generation=True, max_staleness=0, **common
    )
    assert [m["reward/mean"] for m in pipelined.history] == [m["reward/mean"] for m in sync.history]
    assert all(m["async/staleness_max"] == 0 for m in pipelined.history)
    ours, theirs = _weights(pipelined), _weights(sync)
    moved = max(float((theirs[n] - p.detach()).abs().max()) for n, p in _initial(tiny_model_dir).items())
    assert moved > 1e-4  # the runs trained: equal weights are not the untouched model's
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def _initial(models_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models_dir)
    return dict(model.named_parameters())


def test_no_batch_trains_staler_than_max_staleness(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A slow trainer (each step's report sleeps) and a fast producer: the producer runs ahead, but never by more
    than max_staleness versions, and never holds more than steps_ahead batches."""
    seen: list[dict[str, float]] = []
    versions: dict[int, set[int]] = {}  # step -> policy versions its logged samples record

    def slow(step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
        seen.append(metrics)
        versions[step] = {sample["policy_version"] for sample in samples}
        time.sleep(0.3)

    trainer = _train(
        tmp_path, tiny_model_dir, "run", on_metrics=slow, max_steps=7, async_generation=True, max_staleness=2,
        max_inflight_tasks=8 * 8, sync_check_every=None,  # room for 8 steps ahead: staleness is what holds it
        log_completions_every=1,
    )
    assert all(len(v) == 1 and 0 <= (step - 1) - min(v) <= 2 for step, v in versions.items()), versions
    staleness = [m["async/staleness_max"] for m in seen]
    assert staleness == [float((step - 1) - min(versions[step])) for step in range(1, 8)]
    assert max(staleness) == 2, staleness  # it did run ahead, as far as allowed
    assert all(0 <= s <= 2 for s in staleness)
    assert trainer.config.steps_ahead == 8
    # Staleness holds the queue, not steps_ahead: before step t's push, batches t+1 and t+2 at most; the depth is
    # read after the push, by when the producer may have queued t+3, which the new weights allow.
    assert all(m["async/queue_depth"] <= 3 for m in seen)
    assert all(m["async/dropped"] == 0 for m in seen)
    assert staleness[0] == 0  # step 1 is sampled by the initial weights, which the trainer also holds


def test_a_stale_batch_is_dropped_and_regenerated() -> None:
    """The trainer-side guard: a batch older than max_staleness that reaches take() is dropped, counted, and made
    again from the prompt cursor it started at (pure logic: a fake sampler and batches)."""

    class Engine:
        version = 5
        lock = threading.Lock()

    made: list[tuple[int, int]] = []
    rewound: list[dict[str, int]] = []

    def make(step: int) -> Produced:
        lie = len(made) == 0  # the first batch claims to come from version 0: staleness 5 at step 6
        version = 0 if lie else Engine.version
        made.append((step, version))
        done: Future[Scored] = Future()
        generated = Generated(rollout=None, rows=[], prompts=[])  # type: ignore[arg-type]
        return Produced(step, version, generated, done, {"position": step - 1}, {"position": step})

    producer = RolloutProducer(
        make, Engine(), first_step=6, last_step=7, max_staleness=1, steps_ahead=1, rewind=rewound.append,  # type: ignore[arg-type]  # a fake: the version and lock the producer reads
    )
    with producer:
        first = producer.take(6)
        second = producer.take(7)
    assert (first.step, first.version) == (6, 5)
    assert second.step == 7
    assert producer.dropped == 1
    assert rewound == [{"position": 5}]
    assert made[:2] == [(6, 0), (6, 5)]


def test_the_last_batch_dropped_is_made_again() -> None:
    """A drop can send the producer back after it made the run's last batch: it must still be there to make it."""

    class Engine:
        version = 3
        lock = threading.Lock()

    made: list[int] = []

    def make(step: int) -> Produced:
        made.append(step)
        done: Future[Scored] = Future()
        generated = Generated(rollout=None, rows=[], prompts=[])  # type: ignore[arg-type]
        version = 0 if len(made) == 1 else Engine.version  # the first one lies: staleness 3 at step 4
        return Produced(step, version, generated, done, {}, {})

    producer = RolloutProducer(
        make, Engine(), first_step=4, last_step=4, max_staleness=1, steps_ahead=2, rewind=lambda _: None,  # type: ignore[arg-type]  # a fake, as above
    )
    taken: list[Produced] = []
    with producer:
        time.sleep(0.5)  # the producer has made the last batch and has room for more: it is past the last step
        taker = threading.Thread(target=lambda: taken.append(producer.take(4)), daemon=True)
        taker.start()
        taker.join(timeout=10)
    assert taken and taken[0].version == 3, "the trainer waited for a batch the producer never made again"
    assert made == [4, 4] and producer.dropped == 1


def test_the_sync_check_catches_a_sampler_on_stale_weights(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: the native sampler's push forgets to copy the weights. The check (every 2 steps) raises
    stale_sampler within 2 checks and pauses the run; without the bug the gap is rounding."""
    common: dict[str, Any] = {
        "max_steps": 6, "async_generation": True, "max_staleness": 1, "sync_check_every": 2,
        "sync_check_samples": 4, "on_unhealthy": "pause", "learning_rate": 1e-2,
        "health": {"patience": 100},  # the other detectors stay quiet on this toy task
    }
    healthy = _train(tmp_path, tiny_model_dir, "healthy", **common)
    gaps = [m["sync/logprob_gap"] for m in healthy.history if "sync/logprob_gap" in m]
    assert len(gaps) == 3 and max(gaps) < 1e-4, gaps
    assert healthy.unhealthy is None

    def forget(self: PolicyCopy, version: int) -> None:
        self.version = version  # the version moves on, the weights do not

    monkeypatch.setattr(PolicyCopy, "push", forget)
    broken = _train(tmp_path, tiny_model_dir, "broken", **common)
    assert broken.unhealthy is not None and broken.unhealthy.kind == "stale_sampler"
    assert broken.unhealthy.step <= 4  # the first or second check
    assert broken.step == broken.unhealthy.step  # paused there


def test_vllm_async_run_and_a_sampler_that_keeps_old_weights(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM as the asynchronous sampler, one run (one engine): the batches stay within max_staleness and the check
    sees rounding only; then the planted bug (the engine's weight sync does nothing from then on) is caught within
    2 checks and pauses the run."""
    pytest.importorskip("vllm")
    from worker.grpo.vllm_rollout import VLLMRollout

    healthy_steps = 4  # two checks on an engine that takes every push
    frozen = threading.Event()
    real_sync = VLLMRollout.sync_weights

    def sync_until_frozen(self: VLLMRollout) -> None:
        if not frozen.is_set():
            real_sync(self)  # the engine is built with placeholder weights: the initial load still happens

    def on_metrics(step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
        if step == healthy_steps:  # after this step's push: the engine keeps these weights from now on
            frozen.set()

    monkeypatch.setattr(VLLMRollout, "sync_weights", sync_until_frozen)
    run = _train(
        tmp_path, tiny_model_dir, "run", on_metrics=on_metrics, max_steps=healthy_steps + 4, use_vllm=True,
        async_generation=True, max_staleness=1, sync_check_every=2, on_unhealthy="pause", learning_rate=1e-2,
        health={"patience": 100},
    )
    healthy = run.history[:healthy_steps]
    gaps = [m["sync/logprob_gap"] for m in healthy if "sync/logprob_gap" in m]
    assert len(gaps) == 2 and max(gaps) < 1e-3, gaps  # float32 on both sides: kernel rounding
    assert max(m["async/staleness_max"] for m in healthy) <= 1
    assert run.unhealthy is not None and run.unhealthy.kind == "stale_sampler", run.findings
    # No false alarm while the engine took every push; caught within two checks of the freeze.
    assert healthy_steps < run.unhealthy.step <= healthy_steps + 4
    assert run.step == run.unhealthy.step  # paused there


@pytest.mark.parametrize("backend", ["hf", "fused"])
def test_sampled_logprobs_from_the_decoding_match_the_policy_forward(tiny_model_dir: Path, backend: str) -> None:
    """The native sampler's log-probs (stale batches' pi_old) come from the decoding itself: they equal the
    trainer's forward over the same tokens, after temperature and over the whole vocabulary (top-k only filters
    what is drawn), 0 after EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.grpo.backends.fused import FusedPath
    from worker.grpo.logprobs import completion_logprobs
    from worker.grpo.rollout import generate_rollout

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = small_config(temperature=0.7, top_k=20, max_completion_length=12)
    fast = FusedPath() if backend == "fused" else None
    rollout = generate_rollout(
        model, tokenizer, ["cat: ", "a longer prompt, dog: "], config, generator_seed=[3, 4], fast=fast,
        with_logprobs=True,
    )
    assert rollout.sampler_logps is not None
    with torch.no_grad():
        policy, _ = completion_logprobs(
            model, rollout.input_ids, rollout.attention_mask, rollout.completion_ids.shape[1], temperature=0.7
        )
    mask = rollout.completion_mask.bool()
    assert float((policy - rollout.sampler_logps)[mask].abs().max()) < 1e-4
    assert torch.all(rollout.sampler_logps[~mask] == 0)
    assert float(rollout.sampler_logps[mask].abs().min()) > 0  # real log-probs, not a zero tensor
