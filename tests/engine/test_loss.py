"""The GRPO loss (acceptance item 2): hand-computed values, clipping, KL, masking, gradient sign."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.grpo.logprobs import completion_logprobs
from worker.grpo.loss import LossSettings, grpo_loss

EPS, EPS_HIGH = 0.2, 0.28


def batch() -> dict[str, torch.Tensor]:
    """Two completions of 3 slots; the second has 2 real tokens and one pad.

    Ratios are chosen so each case is visible by hand:
      row 0, A = +1:   r = 1.5 (above 1 + 0.28: upper clip binds), 1.0, 0.9
      row 1, A = -0.5: r = 0.5 (below 1 - 0.2: lower clip binds), 1.1, pad (garbage r = 3)
    """
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    ratios = torch.tensor([[1.5, 1.0, 0.9], [0.5, 1.1, 3.0]])
    return {
        "logps": logps,
        "old_logps": logps - ratios.log(),
        "advantages": torch.tensor([1.0, -0.5]),
        "mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }


# -min(r A, clip(r) A) per real token, by hand:
#   row 0: -min(1.5, 1.28) = -1.28, -1.0, -0.9           sum -3.18, mean -1.06
#   row 1: -min(-0.25, -0.4) = 0.4, -min(-0.55, -0.55) = 0.55   sum 0.95, mean 0.475
HAND = {
    "grpo": (-1.06 + 0.475) / 2,
    "bnpo": (-3.18 + 0.95) / 5,
    "dr_grpo": (-3.18 + 0.95) / (2 * 4),  # max_completion_length = 4
    "dapo": (-3.18 + 0.95) / 5,
}


def run(
    loss_type: str,
    *,
    beta: float = 0.0,
    ref: torch.Tensor | None = None,
    bias_correction: bool = True,
    **overrides: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """grpo_loss on `batch()` with some inputs replaced."""
    inputs = {**batch(), **overrides}
    return grpo_loss(
        inputs["logps"],
        inputs["old_logps"],
        ref,
        inputs["advantages"],
        inputs["mask"],
        settings(loss_type, beta=beta, use_bias_correction_kl=bias_correction),
        step_tokens=overrides.get("step_tokens"),
    )


def settings(loss_type: str, **fields: Any) -> LossSettings:
    values: dict[str, Any] = {"epsilon": EPS, "epsilon_high": EPS_HIGH, "max_completion_length": 4, **fields}
    return LossSettings(loss_type=loss_type, **values)  # type: ignore[arg-type]


class TestHandComputed:
    @pytest.mark.parametrize("loss_type", sorted(HAND))
    def test_loss_value(self, loss_type: str) -> None:
        loss, _ = run(loss_type)
        assert loss.item() == pytest.approx(HAND[loss_type], abs=1e-6)

    def test_dapo_normalises_by_the_whole_steps_token_count(self) -> None:
        loss, _ = run("dapo", step_tokens=10)
        assert loss.item() == pytest.approx((-3.18 + 0.95) / 10, abs=1e-6)

    def test_stats_both_clip_sides(self) -> None:
        _, stats = run("grpo")
        assert stats["clip_ratio/low"] == pytest.approx(1 / 5)  # r = 0.5 with A < 0
        assert stats["clip_ratio/high"] == pytest.approx(1 / 5)  # r = 1.5 with A > 0
        assert stats["clip_ratio/region"] == pytest.approx(2 / 5)
        assert stats["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.9 + 0.5 + 1.1) / 5)
        assert stats["kl"] == 0.0

    def test_clipped_tokens_get_no_gradient(self) -> None:
        inputs = batch()
        logps = inputs["logps"].clone().requires_grad_(True)
        loss, _ = run("bnpo", logps=logps)
        loss.backward()
        assert logps.grad is not None
        # Both binding clips (upper for A > 0, lower for A < 0) cut the gradient ...
        assert logps.grad[0, 0].item() == 0.0
        assert logps.grad[1, 0].item() == 0.0
        # ... elsewhere d/dlogp of -r A / 5 is -r A / 5.
        assert logps.grad[0, 1].item() == pytest.approx(-1.0 * 1.0 / 5)
        assert logps.grad[0, 2].item() == pytest.approx(-0.9 * 1.0 / 5)
        assert logps.grad[1, 1].item() == pytest.approx(1.1 * 0.5 / 5)

    def test_unclipped_side_is_not_clipped(self) -> None:
        # r = 1.5 with A < 0 and r = 0.5 with A > 0: min picks the unclipped term, gradient flows.
        loss, stats = run("bnpo", advantages=torch.tensor([-1.0, 0.5]))
        assert stats["clip_ratio/region"] == 0.0
        # row 0: -min(-1.5, -1.28) = 1.5, 1.0, 0.9; row 1: -min(0.25, 0.4) = -0.25, -0.55
        assert loss.item() == pytest.approx((1.5 + 1.0 + 0.9 - 0.25 - 0.55) / 5, abs=1e-6)


class TestKL:
    def test_k3_penalty_by_hand(self) -> None:
        inputs = batch()
        # ref - logp = [ln 2, 0, -ln 2] on row 0 and [0, ln 2, anything] on row 1.
        delta = torch.tensor([[math.log(2), 0.0, -math.log(2)], [0.0, math.log(2), 50.0]])
        kl_ln2 = 2 - math.log(2) - 1  # exp(d) - d - 1 at d = ln 2
        kl_minus_ln2 = 0.5 + math.log(2) - 1
        token_kl = kl_ln2 + 0 + kl_minus_ln2 + 0 + kl_ln2
        loss, stats = run("bnpo", beta=0.1, ref=inputs["logps"] + delta, bias_correction=False)
        assert stats["kl"] == pytest.approx(token_kl / 5)
        assert loss.item() == pytest.approx(HAND["bnpo"] + 0.1 * token_kl / 5, abs=1e-6)

    def test_kl_is_zero_when_reference_equals_policy(self) -> None:
        inputs = batch()
        with_ref, stats = run("grpo", beta=0.04, ref=inputs["logps"].clone())
        without, _ = run("grpo")
        assert stats["kl"] == 0.0
        assert with_ref.item() == pytest.approx(without.item(), abs=1e-7)

    def test_beta_without_reference_is_refused(self) -> None:
        with pytest.raises(ValueError, match="ref_logps"):
            run("grpo", beta=0.1)


class TestMasking:
    @pytest.mark.parametrize("loss_type", sorted(HAND))
    def test_pad_tokens_contribute_nothing(self, loss_type: str) -> None:
        inputs = batch()
        ref = inputs["logps"] - 0.3
        loss, stats = run(loss_type, beta=0.1, ref=ref)
        # Garbage at the pad position, in every input, including a non-finite one.
        logps = inputs["logps"].clone()
        logps[1, 2] = 7.0
        logps.requires_grad_(True)
        old = inputs["old_logps"].clone()
        old[1, 2] = -40.0
        ref_garbage = ref.clone()
        ref_garbage[1, 2] = float("inf")
        garbage_loss, garbage_stats = run(loss_type, beta=0.1, ref=ref_garbage, logps=logps, old_logps=old)
        assert garbage_loss.item() == pytest.approx(loss.item(), abs=1e-6)
        assert garbage_stats == pytest.approx(stats)
        garbage_loss.backward()
        assert logps.grad is not None and logps.grad[1, 2].item() == 0.0

    def test_dapo_mini_batches_sum_to_the_full_batch(self) -> None:
        inputs = batch()
        full = inputs["logps"].clone().requires_grad_(True)
        loss, _ = run("dapo", logps=full)
        loss.backward()
        split = inputs["logps"].clone().requires_grad_(True)
        total = 0.0
        for rows in (slice(0, 1), slice(1, 2)):
            part, _ = grpo_loss(
                split[rows],
                inputs["old_logps"][rows],
                None,
                inputs["advantages"][rows],
                inputs["mask"][rows],
                settings("dapo"),
                step_tokens=int(inputs["mask"].sum()),
            )
            part.backward()
            total += part.item()
        assert total == pytest.approx(loss.item(), abs=1e-6)
        assert split.grad is not None and full.grad is not None
        torch.testing.assert_close(split.grad, full.grad)


class TestValidation:
    def test_unknown_loss_type(self) -> None:
        with pytest.raises(ValueError, match="loss_type"):
            run("ppo")

    def test_shape_mismatch(self) -> None:
        with pytest.raises(ValueError, match="shape mismatch"):
            run("grpo", advantages=torch.tensor([1.0, 2.0, 3.0]))


class TestGradientSign:
    """On a real tiny model, one SGD step on the loss moves the completion's log-prob with its advantage."""

    @pytest.mark.parametrize("advantage", [1.0, -1.0])
    def test_sgd_step_follows_the_advantage(self, tiny_model_dir: Path, advantage: float) -> None:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        ids = tokenizer(["Q: 2+2? A: 4"], return_tensors="pt")[
            "input_ids"
        ]  # completion = last 5 chars " A: 4"
        mask = torch.ones_like(ids)
        completion = 5

        def sequence_logp() -> torch.Tensor:
            logps, _ = completion_logprobs(model, ids, mask, completion, temperature=1.0)
            return logps  # (1, 5)

        before = sequence_logp()
        loss, _ = grpo_loss(
            before,
            None,  # on-policy: ratio 1, gradient of log pi
            None,
            torch.tensor([advantage]),
            torch.ones(1, completion),
            settings("grpo", max_completion_length=completion),
        )
        loss.backward()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        optimizer.step()
        with torch.no_grad():
            after = sequence_logp()
        change = (after.sum() - before.detach().sum()).item()
        assert change * advantage > 0, f"log-prob moved by {change} with advantage {advantage}"
