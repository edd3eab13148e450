"""The importance-sampling correction for vLLM rollouts (pure tensor logic) and its config checks."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests.engine.trainer_helpers import small_config
from worker.grpo.sampling_correction import SamplingCorrection

# Two completions of three tokens; the second has one padded position.
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -0.5], [-1.0, -3.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# log ratios trainer - sampler on real tokens: [0.5, -1.0, 0.0] and [0.0, 2.0, (pad)].


def _correction(mode: str, low: float | None = None, high: float | None = 3.0) -> SamplingCorrection:
    config = small_config(
        use_vllm=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high,
    )
    correction = SamplingCorrection.from_config(config)
    assert correction is not None
    return correction


def test_token_truncate_clips_each_token_ratio() -> None:
    weights = _correction("token_truncate", low=0.5).weights(TRAINER, SAMPLER, MASK)
    expected = torch.tensor([[math.exp(0.5), 0.5, 1.0], [1.0, 3.0, 1.0]])  # e^-1 -> 0.5, e^2 -> 3
    torch.testing.assert_close(weights, expected)


def test_token_mask_zeroes_tokens_outside_the_bounds() -> None:
    weights = _correction("token_mask", low=0.5).weights(TRAINER, SAMPLER, MASK)
    expected = torch.tensor([[math.exp(0.5), 0.0, 1.0], [1.0, 0.0, 1.0]])
    torch.testing.assert_close(weights, expected)


def test_sequence_modes_use_the_product_of_the_token_ratios() -> None:
    truncated = _correction("sequence_truncate").weights(TRAINER, SAMPLER, MASK)
    torch.testing.assert_close(truncated, torch.tensor([[math.exp(-0.5)], [3.0]]))
    masked = _correction("sequence_mask").weights(TRAINER, SAMPLER, MASK)
    torch.testing.assert_close(masked, torch.tensor([[math.exp(-0.5)], [0.0]]))


def test_nan_sampler_logprob_means_no_correction_for_that_token() -> None:
    sampler = SAMPLER.clone()
    sampler[0, 1] = math.nan
    weights = _correction("token_truncate").weights(TRAINER, sampler, MASK)
    assert weights[0, 1] == 1.0


def test_metrics_follow_trl_names() -> None:
    metrics = _correction("sequence_mask").metrics(TRAINER, SAMPLER, MASK)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.0 + 2.0) / 5)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)
    assert metrics["sampling/importance_sampling_ratio/min"] == 0.0
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(-0.5))
    assert metrics["sampling/importance_sampling_masked_fraction"] == 0.5


def test_correction_is_off_without_vllm_or_when_disabled() -> None:
    assert SamplingCorrection.from_config(small_config()) is None
    assert SamplingCorrection.from_config(small_config(use_vllm=True, vllm_importance_sampling_correction=False)) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"generation": "beam"}, "generation must be 'sample'"),
        ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.0}, "clip_min"),
        ({"loss_type": "vespo"}, "vllm_importance_sampling_correction"),
        ({"max_prompt_length": 100, "vllm_max_model_length": 50}, "vllm_max_model_length"),
    ],
)
def test_contradicting_vllm_options_are_refused_naming_the_field(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        small_config(use_vllm=True, **overrides)


def test_weights_scale_the_policy_term_not_the_kl() -> None:
    """grpo_loss(is_weights=w): the per-token policy term is multiplied by w (as TRL), the KL term is not."""
    from worker.grpo.loss import LossSettings, grpo_loss

    logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.2, -0.3, -0.7]], requires_grad=True)
    ref = torch.tensor([[-1.1, -1.8, -0.6], [-1.0, -0.5, -0.9]])
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights = torch.tensor([[0.5, 2.0, 0.0], [1.0, 0.25, 3.0]])

    def loss(beta: float, is_weights: torch.Tensor | None) -> torch.Tensor:
        settings = LossSettings(loss_type="dapo", epsilon=0.2, epsilon_high=0.2, beta=beta, max_completion_length=3)
        value, _ = grpo_loss(logps, None, ref, advantages, mask, settings, is_weights=is_weights)
        return value

    # On-policy (ratio 1): the policy term per token is -A, so the weighted loss is -sum(A w) / tokens.
    expected = -(1.0 * (0.5 + 2.0 + 0.0) - 1.0 * (1.0 + 0.25)) / 5
    assert float(loss(0.0, weights)) == pytest.approx(expected)
    kl_only = float(loss(0.04, None)) - float(loss(0.0, None))
    assert float(loss(0.04, weights)) == pytest.approx(expected + kl_only)


def test_local_run_without_vllm_names_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`grpo train` with use_vllm where vLLM is not installed: exit 2 naming hyperparameters.use_vllm."""
    from worker.grpo.local import EXIT_BAD_INPUT, run_local

    (tmp_path / "train.jsonl").write_text('{"prompt": "hi"}\n', encoding="utf-8")
    (tmp_path / "job.yaml").write_text(
        "base_model: builtin:tiny\ntrain_dataset: train.jsonl\n"
        "rewards: [{type: builtin, name: regex_match, params: {pattern: '^a'}}]\n"
        "hyperparameters: {max_steps: 1, num_generations: 2, prompts_per_step: 1, use_vllm: true}\n",
        encoding="utf-8",
    )
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an interpreter without the package reports
    assert run_local(tmp_path / "job.yaml", tmp_path / "out") == EXIT_BAD_INPUT
    assert "hyperparameters.use_vllm" in capsys.readouterr().out
