"""The backend boundary (worker.grpo.backends): the choice is made once, the module-level paths follow it, and
both backends train the same model to the same step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_trainer import _capture_gradients
from tests.engine.trainer_helpers import small_config, spread_reward, trainer_kwargs, word_rows
from worker.grpo.backends import FusedBackend, FusedPath, ModuleBackend
from worker.grpo.backends.fused import fast_decoder, static_decoder
from worker.grpo.trainer import GRPOTrainer


@pytest.fixture
def models_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir.parent


def trainer(tmp_path: Path, models_dir: Path, backend: Any, **overrides: Any) -> GRPOTrainer:
    return GRPOTrainer(
        small_config(**({"max_steps": 1, "beta": 0.04} | overrides)),
        train_rows=word_rows(),
        reward=spread_reward(),
        backend=backend,
        **trainer_kwargs(tmp_path / str(backend), models_dir),
    )


def test_auto_picks_the_fast_path_for_the_llama_family_on_a_cpu(tmp_path: Path, models_dir: Path) -> None:
    chosen = trainer(tmp_path, models_dir, "auto")
    assert type(chosen.backend) is FusedBackend and isinstance(chosen.models.fast, FusedPath)


def test_the_module_backend_never_takes_the_fast_path(
    tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `hf`, a model the fast path supports still samples and scores through its module forward."""
    run = trainer(tmp_path, models_dir, "hf")
    assert type(run.backend) is ModuleBackend and run.models.fast is None

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("the fast path ran under the hf backend")

    monkeypatch.setattr(fast_decoder.DecoderFunctional, "__init__", refuse)
    monkeypatch.setattr(static_decoder.StaticDecoder, "__init__", refuse)
    result = run.train()
    assert result.step == 1 and result.history[0]["loss"] == result.history[0]["loss"]  # finite, not NaN


def test_the_fused_backend_samples_and_scores_through_its_fast_path(
    tmp_path: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `fused`, sampling, the reference and the policy's log-probs all take the fast path that the generic
    paths were handed (a LoRA policy: its reference is the base weights read without switching adapters off)."""
    run = trainer(tmp_path, models_dir, "fused", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    calls: list[str] = []
    for name in ("completion_logprobs", "decoders"):
        original = getattr(FusedPath, name)

        def spy(self: FusedPath, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name if kwargs.get("adapters", True) else "reference")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(FusedPath, name, spy)
    result = run.train()
    assert result.step == 1
    assert {"decoders", "reference", "completion_logprobs"} <= set(calls), calls


def test_both_backends_compute_the_same_step(tmp_path: Path, models_dir: Path) -> None:
    """Same seed, same model: the same samples, rewards, loss and gradients up to float rounding."""
    runs = {}
    for backend in ("fused", "hf"):
        run = trainer(tmp_path, models_dir, backend, prompts_per_step=4)
        grads = _capture_gradients(run)
        runs[backend] = (run.train().history[0], grads)
    (fused, fused_grads), (module, module_grads) = runs["fused"], runs["hf"]
    assert fused["reward/mean"] == module["reward/mean"]  # the same completions were sampled
    assert fused["completion_length/mean"] == module["completion_length/mean"]
    for key in ("loss", "kl", "entropy"):
        assert fused[key] == pytest.approx(module[key], rel=1e-4, abs=1e-6), key
    for index, grad in fused_grads.items():
        torch.testing.assert_close(grad, module_grads[index], atol=1e-5, rtol=1e-3, msg=str(index))
