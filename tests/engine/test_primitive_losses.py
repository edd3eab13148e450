"""Tinker's losses for the primitive API (worker.grpo.primitive_losses): each against its formula written out
per token with plain floats, values and gradients; config defaults and overrides; input validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from worker.grpo.primitive_errors import PrimitiveInputError
from worker.grpo.primitive_losses import (
    LOSS_FNS,
    check_inputs,
    check_loss_fn,
    elementwise_loss,
    resolve_config,
)

# Four tokens with chosen ratios r = exp(lp - q): 1.5 (above ppo's 1.2), 1.0, 0.5 (below 0.8), 1.1.
LP = [-1.0, -2.0, -0.5, -1.5]
RATIOS = [1.5, 1.0, 0.5, 1.1]
ADV = [1.0, 2.0, -0.5, -1.0]
Q = [lp - math.log(r) for lp, r in zip(LP, RATIOS, strict=True)]


def run(
    loss_fn: str, config: dict[str, float] | None = None, **extra: list[float]
) -> tuple[list[float], list[float]]:
    """The elementwise loss and its gradient with respect to the target log-probs, as lists."""
    lp = torch.tensor(LP, requires_grad=True)
    inputs = {"logprobs": torch.tensor(Q), "advantages": torch.tensor(ADV)}
    inputs.update({name: torch.tensor(values) for name, values in extra.items()})
    fn = check_loss_fn(loss_fn)
    loss = elementwise_loss(fn, lp, inputs, resolve_config(fn, config))
    loss.sum().backward()
    assert lp.grad is not None
    return loss.tolist(), lp.grad.tolist()


def clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


class TestFormulas:
    def test_cross_entropy_is_minus_weighted_logprob(self) -> None:
        weights = [0.0, 1.0, 1.0, -0.5]  # negative weights are allowed (the SDK's custom losses send them)
        lp = torch.tensor(LP, requires_grad=True)
        loss = elementwise_loss("cross_entropy", lp, {"weights": torch.tensor(weights)}, {})
        loss.sum().backward()
        assert loss.tolist() == pytest.approx([-x * w for x, w in zip(LP, weights, strict=True)])
        assert lp.grad is not None and lp.grad.tolist() == pytest.approx([-w for w in weights])

    def test_importance_sampling(self) -> None:
        loss, grad = run("importance_sampling")
        assert loss == pytest.approx([-r * a for r, a in zip(RATIOS, ADV, strict=True)], rel=1e-6)
        assert sum(loss) == pytest.approx(-2.15, rel=1e-6)  # a sum over tokens, never a mean
        assert grad == pytest.approx([-r * a for r, a in zip(RATIOS, ADV, strict=True)], rel=1e-6)  # d r / d lp = r

    def test_ppo_clips_with_the_default_thresholds(self) -> None:
        loss, grad = run("ppo")
        expected = [-min(r * a, clip(r, 0.8, 1.2) * a) for r, a in zip(RATIOS, ADV, strict=True)]
        assert loss == pytest.approx(expected, rel=1e-6)
        assert sum(loss) == pytest.approx(-1.7, rel=1e-6)
        # Tokens 0 and 2 sit on the clipped branch (no gradient); 1 and 3 on the ratio's.
        assert grad == pytest.approx([0.0, -2.0, 0.0, 1.1], rel=1e-6, abs=1e-7)

    def test_ppo_thresholds_come_from_the_config(self) -> None:
        loss, _ = run("ppo", {"clip_low_threshold": 0.4, "clip_high_threshold": 2.0})
        assert loss == pytest.approx([-r * a for r, a in zip(RATIOS, ADV, strict=True)], rel=1e-6)  # nothing clips

    def test_cispo_detaches_the_clipped_ratio(self) -> None:
        custom = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.2}
        for config, (low, high) in ((None, (0.0, 4.0)), (custom, (0.9, 1.2))):  # None: the defaults
            loss, grad = run("cispo", config)
            coefficients = [clip(r, low, high) for r in RATIOS]
            expected = [-c * x * a for c, x, a in zip(coefficients, LP, ADV, strict=True)]
            assert loss == pytest.approx(expected, rel=1e-6)
            assert grad == pytest.approx([-c * a for c, a in zip(coefficients, ADV, strict=True)], rel=1e-6)

    def test_dro_quadratic_penalty(self) -> None:
        for beta in (0.1, 0.05):  # 0.1: the default
            loss, grad = run("dro", None if beta == 0.1 else {"beta": beta})
            log_r = [math.log(r) for r in RATIOS]
            assert loss == pytest.approx(
                [-(x * a - 0.5 * beta * d * d) for x, a, d in zip(LP, ADV, log_r, strict=True)], rel=1e-6
            )
            assert grad == pytest.approx([-a + beta * d for a, d in zip(ADV, log_r, strict=True)], rel=1e-6)

    def test_gspo_carries_the_sequence_ratio_with_each_tokens_gradient(self) -> None:
        loss, grad = run("gspo")  # mask: the tokens with a nonzero advantage, all four here
        s = math.exp(sum(math.log(r) for r in RATIOS) / 4)  # geometric mean, 0.953: inside [0.8, 1.2]
        assert loss == pytest.approx([-s * a for a in ADV], rel=1e-6)
        assert grad == pytest.approx([-s * a for a in ADV], rel=1e-6)  # d r_t / d lp_t = s

    def test_gspo_mask_picks_the_ratios_tokens(self) -> None:
        loss, grad = run("gspo", sequence_ratio_mask=[1.0, 0.0, 0.0, 0.0])
        s = 1.5  # token 0's ratio alone; clipped to 1.2 where that is the minimum
        assert loss == pytest.approx([-min(s * a, clip(s, 0.8, 1.2) * a) for a in ADV], rel=1e-6)
        assert sum(loss) == pytest.approx(-1.35, rel=1e-6)
        assert grad == pytest.approx([0.0, 0.0, -s * -0.5, -s * -1.0], rel=1e-6, abs=1e-7)

    def test_gspo_zero_advantages_stay_out_of_the_default_mask(self) -> None:
        # A prompt position: advantage 0 and a placeholder sampler log-prob far from the trainer's.
        lp = torch.tensor([-3.0, *LP])
        inputs = {"logprobs": torch.tensor([0.0, *Q]), "advantages": torch.tensor([0.0, *ADV])}
        loss = elementwise_loss("gspo", lp, inputs, resolve_config("gspo", None))
        s = math.exp(sum(math.log(r) for r in RATIOS) / 4)
        assert loss.tolist() == pytest.approx([0.0, *[-s * a for a in ADV]], rel=1e-6)

    def test_a_batch_of_rows_is_each_row_alone(self) -> None:
        rows = torch.tensor([LP, [-0.2, -0.1, -3.0, -1.0]])
        q = torch.tensor([Q, [-0.3, -0.4, -2.0, -1.0]])
        adv = torch.tensor([ADV, [0.5, 0.0, -1.0, 1.0]])
        for fn in ("importance_sampling", "ppo", "cispo", "dro", "gspo"):
            settings = resolve_config(check_loss_fn(fn), None)
            batch = elementwise_loss(check_loss_fn(fn), rows, {"logprobs": q, "advantages": adv}, settings)
            for i in range(2):
                row_inputs = {"logprobs": q[i], "advantages": adv[i]}
                alone = elementwise_loss(check_loss_fn(fn), rows[i], row_inputs, settings)
                torch.testing.assert_close(batch[i], alone)


class TestConfig:
    def test_defaults(self) -> None:
        assert resolve_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
        assert resolve_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
        assert resolve_config("dro", None) == {"beta": 0.1}
        assert resolve_config("importance_sampling", None) == {}

    @pytest.mark.parametrize(
        ("loss_fn", "config", "field"),
        [
            ("ppo", {"clip_ratio": 0.2}, "loss_fn_config.clip_ratio"),
            ("importance_sampling", {"beta": 0.1}, "loss_fn_config.beta"),
            ("ppo", {"clip_low_threshold": 1.5}, "loss_fn_config"),  # low > high
            ("dro", {"beta": -1.0}, "loss_fn_config.beta"),
            ("dro", {"beta": float("nan")}, "loss_fn_config.beta"),
        ],
    )
    def test_bad_settings_name_their_field(self, loss_fn: str, config: dict[str, float], field: str) -> None:
        with pytest.raises(PrimitiveInputError) as caught:
            resolve_config(check_loss_fn(loss_fn), config)
        assert caught.value.field == field

    def test_unknown_loss(self) -> None:
        with pytest.raises(PrimitiveInputError) as caught:
            check_loss_fn("grpo")
        assert caught.value.field == "loss_fn"
        assert set(LOSS_FNS) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}


class TestInputs:
    def rl_inputs(self, n: int = 3) -> dict[str, np.ndarray]:
        return {
            "target_tokens": np.arange(n, dtype=np.int64),
            "logprobs": np.zeros(n, dtype=np.float32),
            "advantages": np.ones(n, dtype=np.float32),
        }

    def test_checked_inputs_become_tensors(self) -> None:
        tensors = check_inputs("ppo", self.rl_inputs(), 3, 10, "data[0]")
        assert tensors["target_tokens"].dtype == torch.int64
        assert tensors["advantages"].dtype == torch.float32 and tensors["advantages"].shape == (3,)

    @pytest.mark.parametrize(
        ("change", "field"),
        [
            (lambda i: i.pop("advantages"), "data[2].loss_fn_inputs.advantages"),
            (lambda i: i.update(advantages=np.ones(4)), "data[2].loss_fn_inputs.advantages"),
            (lambda i: i.update(advantages=np.ones((3, 1))), "data[2].loss_fn_inputs.advantages"),
            (lambda i: i.update(target_tokens=np.array([0, 10, 1])), "data[2].loss_fn_inputs.target_tokens[1]"),
            (lambda i: i.update(target_tokens=np.array([0, -1, 1])), "data[2].loss_fn_inputs.target_tokens[1]"),
            (lambda i: i.update(target_tokens=np.array([0.0, 1.0, 2.0])), "data[2].loss_fn_inputs.target_tokens"),
            (lambda i: i.update(logprobs=np.array([0.0, np.inf, 0.0])), "data[2].loss_fn_inputs.logprobs[1]"),
            (lambda i: i.update(weights=np.ones(3)), "data[2].loss_fn_inputs.weights"),  # not ppo's
        ],
    )
    def test_bad_inputs_name_datum_and_field(self, change: object, field: str) -> None:
        inputs = self.rl_inputs()
        change(inputs)  # type: ignore[operator]
        with pytest.raises(PrimitiveInputError) as caught:
            check_inputs("ppo", inputs, 3, 10, "data[2]")
        assert caught.value.field == field

    def test_cross_entropy_needs_weights_and_gspo_takes_its_mask(self) -> None:
        with pytest.raises(PrimitiveInputError) as caught:
            check_inputs("cross_entropy", {"target_tokens": np.zeros(2, dtype=np.int64)}, 2, 10, "data[0]")
        assert caught.value.field == "data[0].loss_fn_inputs.weights"
        inputs = {**self.rl_inputs(), "sequence_ratio_mask": np.array([0, 1, 1], dtype=np.float32)}
        assert "sequence_ratio_mask" in check_inputs("gspo", inputs, 3, 10, "data[0]")
        with pytest.raises(PrimitiveInputError):
            check_inputs("ppo", inputs, 3, 10, "data[0]")
