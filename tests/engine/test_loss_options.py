"""TRL 1.16's loss options, each against values worked out by hand from the papers' definitions.

The batch is the one of test_loss.py: two completions of 3 slots, the second with a pad slot,
    row 0, A = +1:   logp = -1, -2, -0.5   ratio r = 1.5, 1.0, 0.9
    row 1, A = -0.5: logp = -1.5, -0.7     ratio r = 0.5, 1.1   (pad: logp -3, r 3, ignored)
with epsilon 0.2 and epsilon_high 0.28 unless said otherwise.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from contract.reward_types import RewardInput
from tests.engine.test_loss import EPS, EPS_HIGH, HAND, batch
from tests.engine.trainer_helpers import small_config, spread_reward, trainer_kwargs, word_rows
from worker.grpo.checkpoint import latest_checkpoint, load_checkpoint
from worker.grpo.local import EXIT_OK, run_local
from worker.grpo.loss import AdaptiveEntropy, LossSettings, grpo_loss
from worker.grpo.rewards import CompositeReward, FunctionSource
from worker.grpo.trainer import GRPOTrainer

# The clipped surrogate's per-token values at token level (test_loss.HAND's derivation).
CLIPPED = [[-1.28, -1.0, -0.9], [0.4, 0.55]]
ENTROPIES = torch.tensor([[0.1, 0.9, 0.5], [0.3, 0.7, 99.0]])  # 99 sits in the pad slot


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def run(loss_type: str, *, advantages: list[float] | None = None, **fields: Any) -> tuple[torch.Tensor, dict]:
    """grpo_loss on batch() with `fields` for LossSettings (plus the call's own keywords), and a
    logps tensor that records its gradient (returned in stats["grad"])."""
    inputs = batch()
    logps = inputs["logps"].clone().requires_grad_(True)
    call = {k: fields.pop(k) for k in ("step_tokens", "num_mini_batches", "entropies", "entropy_coef", "ref") if k in fields}
    settings = LossSettings(
        loss_type=loss_type,  # type: ignore[arg-type]
        **{"epsilon": EPS, "epsilon_high": EPS_HIGH, "max_completion_length": 4, **fields},
    )
    loss, stats = grpo_loss(
        logps,
        inputs["old_logps"],
        call.pop("ref", None),
        torch.tensor(advantages) if advantages is not None else inputs["advantages"],
        inputs["mask"],
        settings,
        **call,
    )
    loss.backward()
    stats["grad"] = logps.grad
    return loss, stats


class TestSequenceLevel:
    """GSPO: one ratio per completion, w = exp(mean_t log r_t)."""

    W0 = (1.5 * 1.0 * 0.9) ** (1 / 3)  # 1.1052: inside [0.8, 1.28], A > 0 -> term -w0
    W1 = (0.5 * 1.1) ** (1 / 2)  # 0.7416: below 0.8 with A < 0 -> clipped: -(-0.5 * 0.8) = 0.4

    def test_grpo_value_gradient_and_clip_stats(self) -> None:
        loss, stats = run("grpo", importance_sampling_level="sequence")
        assert loss.item() == pytest.approx((-self.W0 + 0.4) / 2, abs=1e-6)
        # d/dlogp_t of -w0 (mean over 3 tokens, then over 2 sequences): -w0 * (1/3) / 2 on each token.
        grad = stats["grad"]
        assert grad[0].tolist() == pytest.approx([-self.W0 / 6] * 3, abs=1e-6)
        assert grad[1, :2].tolist() == [0.0, 0.0]  # row 1 is clipped as a whole
        assert stats["clip_ratio/low"] == pytest.approx(1 / 2)  # a share of sequences, not tokens
        assert stats["clip_ratio/high"] == 0.0

    def test_luspo_sums_each_sequence(self) -> None:
        loss, _ = run("luspo", importance_sampling_level="sequence")
        assert loss.item() == pytest.approx((3 * -self.W0 + 2 * 0.4) / 2, abs=1e-6)

    def test_token_level_is_unchanged(self) -> None:
        loss, _ = run("grpo", importance_sampling_level="token")
        assert loss.item() == pytest.approx(HAND["grpo"], abs=1e-6)


class TestClipExtremes:
    def test_per_sequence_min_and_max(self) -> None:
        # High clips (A > 0, r > 1.28): row 0 one of 3 tokens; row 1 none. Low clips (A < 0, r < 0.8):
        # row 0 none, row 1 one of 2 -> min over rows 0.
        _, stats = run("bnpo")
        assert stats["clip_ratio/high_max"] == pytest.approx(1 / 3)
        assert stats["clip_ratio/low_min"] == 0.0

    def test_pad_does_not_count(self) -> None:
        # A > 0 on both rows: row 1's pad slot holds r = 3 (> 1.28); were it counted, row 1 would read 1/3.
        _, stats = run("bnpo", advantages=[1.0, 1.0])
        assert stats["clip_ratio/high_max"] == pytest.approx(1 / 3)

    def test_low_min_when_every_sequence_clips(self) -> None:
        # A < 0 on both rows, epsilon 0.05 (lower bound 0.95): row 0 clips r = 0.9 (1 of 3 tokens),
        # row 1 clips r = 0.5 (1 of 2) -> min 1/3.
        _, stats = run("bnpo", advantages=[-1.0, -1.0], epsilon=0.05)
        assert stats["clip_ratio/low_min"] == pytest.approx(1 / 3)
        assert stats["clip_ratio/low"] == pytest.approx(2 / 5)


class TestDelta:
    def test_caps_the_unclipped_ratio_for_negative_advantages(self) -> None:
        # A = -1 on row 0: r = 1.5 would cost 1.5; with delta 1.3 it costs min(r, delta) = 1.3.
        # row 0: 1.3, 1.0, 0.9; row 1 (A = +0.5): -min(0.25, 0.4) = -0.25, -0.55.
        loss, stats = run("bnpo", advantages=[-1.0, 0.5], delta=1.3)
        assert loss.item() == pytest.approx((1.3 + 1.0 + 0.9 - 0.25 - 0.55) / 5, abs=1e-6)
        assert stats["grad"][0, 0].item() == 0.0  # capped: no gradient
        assert stats["grad"][0, 1].item() == pytest.approx(1.0 / 5)  # d(-r A)/dlogp / 5 = r / 5

    def test_no_delta_is_the_plain_clip(self) -> None:
        loss, _ = run("bnpo", advantages=[-1.0, 0.5])
        assert loss.item() == pytest.approx((1.5 + 1.0 + 0.9 - 0.25 - 0.55) / 5, abs=1e-6)


class TestCispo:
    def test_clipped_weight_times_advantage_times_logp(self) -> None:
        # -min(r, 1.2) A logp: row 0: -(1.2)(1)(-1) = 1.2, -(1)(1)(-2) = 2, -(0.9)(1)(-0.5) = 0.45
        #                      row 1: -(0.5)(-0.5)(-1.5) = -0.375, -(1.1)(-0.5)(-0.7) = -0.385
        loss, stats = run("cispo", epsilon_high=1.2)
        assert loss.item() == pytest.approx((1.2 + 2 + 0.45 - 0.375 - 0.385) / 5, abs=1e-6)
        # The weight is a constant: d/dlogp = -min(r, 1.2) A / 5, nonzero even where r is capped.
        assert stats["grad"][0].tolist() == pytest.approx([-1.2 / 5, -1.0 / 5, -0.9 / 5], abs=1e-6)
        assert stats["grad"][1, :2].tolist() == pytest.approx([0.5 * 0.5 / 5, 1.1 * 0.5 / 5], abs=1e-6)
        assert stats["cispo_clip_ratio"] == pytest.approx(1 / 5)
        assert "clip_ratio/region" not in stats

    def test_normalised_by_the_steps_tokens(self) -> None:
        loss, _ = run("cispo", epsilon_high=1.2, step_tokens=10, num_mini_batches=2)
        assert loss.item() == pytest.approx((1.2 + 2 + 0.45 - 0.375 - 0.385) / 10, abs=1e-6)


class TestSapo:
    def test_soft_gate_by_advantage_sign(self) -> None:
        def term(r: float, a: float) -> float:
            tau = 1.0 if a > 0 else 1.05
            return -(4 / tau) * sigmoid(tau * (r - 1)) * a

        row0 = [term(r, 1.0) for r in (1.5, 1.0, 0.9)]
        row1 = [term(r, -0.5) for r in (0.5, 1.1)]
        loss, stats = run("sapo")
        assert loss.item() == pytest.approx((sum(row0) / 3 + sum(row1) / 2) / 2, abs=1e-6)
        # d/dlogp of -(4/tau) sigmoid(tau (r - 1)) A = -4 A s (1 - s) r, s the sigmoid; /3 tokens /2 rows.
        s = sigmoid(0.5)
        assert stats["grad"][0, 0].item() == pytest.approx(-4 * s * (1 - s) * 1.5 / 6, abs=1e-6)

    def test_temperatures(self) -> None:
        loss, _ = run("sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5)
        row0 = [-(4 / 2.0) * sigmoid(2.0 * (r - 1)) for r in (1.5, 1.0, 0.9)]
        row1 = [-(4 / 0.5) * sigmoid(0.5 * (r - 1)) * -0.5 for r in (0.5, 1.1)]
        assert loss.item() == pytest.approx((sum(row0) / 3 + sum(row1) / 2) / 2, abs=1e-6)


class TestVespo:
    @staticmethod
    def phi(w: float, k: float, lam: float) -> float:
        return math.exp(lam) * w**k * math.exp(-lam * w)

    def test_gamma_weight_of_the_sequence_ratio(self) -> None:
        phi0 = self.phi(1.5 * 1.0 * 0.9, k=2.0, lam=3.0)  # A >= 0: k_pos, lambda_pos
        phi1 = self.phi(0.5 * 1.1, k=3.0, lam=2.0)  # A < 0: k_neg, lambda_neg
        # -phi A logp summed: row 0: -phi0 (1)(-3.5) = 3.5 phi0; row 1: -phi1 (-0.5)(-2.2) = -1.1 phi1.
        loss, stats = run("vespo")
        assert loss.item() == pytest.approx((3.5 * phi0 - 1.1 * phi1) / 5, abs=1e-6)
        assert stats["grad"][0].tolist() == pytest.approx([-phi0 / 5] * 3, abs=1e-6)  # phi is a constant
        assert stats["vespo/phi_seq_mean"] == pytest.approx((phi0 + phi1) / 2, abs=1e-6)

    def test_phi_is_one_on_policy(self) -> None:
        inputs = batch()
        loss, stats = grpo_loss(
            inputs["logps"], None, None, inputs["advantages"], inputs["mask"], LossSettings(loss_type="vespo")
        )
        assert stats["vespo/phi_seq_mean"] == pytest.approx(1.0)
        # -A logp token mean: row 0: 3.5, row 1: -0.5 * 2.2 = -1.1.
        assert loss.item() == pytest.approx((3.5 - 1.1) / 5, abs=1e-6)


class TestOffPolicyMask:
    # Mean per-token log(pi_old / pi) = -mean log r: row 0: -ln(1.35)/3 = -0.100, row 1: -ln(0.55)/2 = 0.299.

    def test_drops_a_drifted_negative_advantage_sequence(self) -> None:
        loss, stats = run("bnpo", off_policy_mask_threshold=0.2)
        assert loss.item() == pytest.approx(sum(CLIPPED[0]) / 5, abs=1e-6)  # still / 5 tokens
        assert stats["off_policy/masked_fraction"] == pytest.approx(0.5)
        assert stats["grad"][1].abs().sum().item() == 0.0

    def test_keeps_it_below_the_threshold(self) -> None:
        loss, stats = run("bnpo", off_policy_mask_threshold=0.3)
        assert loss.item() == pytest.approx(HAND["bnpo"], abs=1e-6)
        assert stats["off_policy/masked_fraction"] == 0.0

    def test_keeps_positive_advantages_however_far(self) -> None:
        loss, stats = run("bnpo", advantages=[1.0, 0.5], off_policy_mask_threshold=0.01)
        assert stats["off_policy/masked_fraction"] == 0.0

    def test_the_kl_term_is_not_masked(self) -> None:
        inputs = batch()
        ref = inputs["logps"] - 0.5  # k3 at ref - logp = -0.5 on each of the 5 tokens
        kl = math.exp(-0.5) + 0.5 - 1
        loss, _ = run("bnpo", off_policy_mask_threshold=0.2, beta=0.1, ref=ref, use_bias_correction_kl=False)
        assert loss.item() == pytest.approx((sum(CLIPPED[0]) + 0.1 * 5 * kl) / 5, abs=1e-6)


class TestBiasCorrectionKL:
    """use_bias_correction_kl: KL_t times the ratio r_t (differentiable). ref - logp = ln 2, 0, -ln 2 on
    row 0 and 0, ln 2 on row 1 give k3 = A, 0, B and 0, A with A = 1 - ln 2, B = ln 2 - 1/2."""

    A, B = 1 - math.log(2), math.log(2) - 0.5
    D = torch.tensor([[math.log(2), 0.0, -math.log(2)], [0.0, math.log(2), 50.0]])  # 50 in the pad slot

    def kl_run(self, loss_type: str = "bnpo", **fields: Any) -> tuple[torch.Tensor, dict]:
        return run(loss_type, beta=0.1, ref=batch()["logps"] + self.D, **fields)

    def test_each_tokens_kl_is_weighted_by_its_ratio(self) -> None:
        # r = 1.5, 1.0, 0.9 / 0.5, 1.1: 1.5 A + 0.9 B + 1.1 A over 5 tokens (plain k3: 2 A + B).
        corrected = (2.6 * self.A + 0.9 * self.B) / 5
        loss, stats = self.kl_run()
        assert stats["kl"] == pytest.approx(corrected, abs=1e-6)
        assert loss.item() == pytest.approx(sum(map(sum, CLIPPED)) / 5 + 0.1 * corrected, abs=1e-6)
        plain, plain_stats = self.kl_run(use_bias_correction_kl=False)
        assert plain_stats["kl"] == pytest.approx((2 * self.A + self.B) / 5, abs=1e-6)

    def test_gradient_on_policy_gains_the_kl_value(self) -> None:
        # r = 1 in value; d(r k3)/dlogp = k3 + (1 - e^d) against the plain 1 - e^d, e^d = 2, 1, 1/2.
        inputs = batch()
        on_policy = {"step_tokens": 5}
        for correction, extra in ((True, [self.A, 0.0, self.B, 0.0, self.A]), (False, [0.0] * 5)):
            logps = inputs["logps"].clone().requires_grad_(True)
            settings = LossSettings(loss_type="bnpo", beta=0.1, use_bias_correction_kl=correction)
            loss, stats = grpo_loss(
                logps, None, inputs["logps"] + self.D, inputs["advantages"], inputs["mask"], settings, **on_policy
            )
            loss.backward()
            assert logps.grad is not None
            grad = logps.grad[inputs["mask"].bool()].tolist()
            # policy: -A_i r / 5 (on-policy nothing clips): -1/5 on row 0, +0.5/5 on row 1.
            policy = [-0.2, -0.2, -0.2, 0.1, 0.1]
            kl = [(1 - e) + x for e, x in zip([2.0, 1.0, 0.5, 1.0, 2.0], extra, strict=True)]
            assert grad == pytest.approx([p + 0.1 * k / 5 for p, k in zip(policy, kl, strict=True)], abs=1e-6)
            assert stats["kl"] == pytest.approx((2 * self.A + self.B) / 5, abs=1e-6)  # r = 1: same value

    def test_sequence_level_weights_every_token_by_the_sequence_ratio(self) -> None:
        w0, w1 = TestSequenceLevel.W0, TestSequenceLevel.W1
        loss, stats = self.kl_run("grpo", importance_sampling_level="sequence")
        kl = (w0 * (self.A + self.B) / 3 + w1 * self.A / 2) / 2  # per-sequence means, then the mean
        assert loss.item() == pytest.approx((-w0 + 0.4) / 2 + 0.1 * kl, abs=1e-6)
        assert stats["kl"] == pytest.approx((w0 * (self.A + self.B) + w1 * self.A) / 5, abs=1e-6)

    def test_the_weight_is_the_ratio_before_deltas_cap(self) -> None:
        # A = -1 on row 0: delta 1.3 caps the policy term's r = 1.5, not the KL weight.
        loss, _ = self.kl_run(advantages=[-1.0, 0.5], delta=1.3)
        policy = 1.3 + 1.0 + 0.9 - 0.25 - 0.55
        assert loss.item() == pytest.approx((policy + 0.1 * (2.6 * self.A + 0.9 * self.B)) / 5, abs=1e-6)


class TestTopEntropyQuantile:
    # Masked-in entropies 0.1, 0.9, 0.5, 0.3, 0.7 (the pad's 99 is not one of them).

    def test_keeps_the_top_share_of_tokens(self) -> None:
        # rho = 0.4: threshold = 60th percentile of [0.1, 0.3, 0.5, 0.7, 0.9] (linear) = 0.5 + 0.4 * 0.2 = 0.58
        # -> keeps 0.9 (row 0, token 1, term -1.0) and 0.7 (row 1, token 1, term 0.55).
        loss, stats = run("bnpo", top_entropy_quantile=0.4, entropies=ENTROPIES)
        assert loss.item() == pytest.approx((-1.0 + 0.55) / 5, abs=1e-6)
        assert stats["entropy_mask/kept_fraction"] == pytest.approx(2 / 5)
        grad = stats["grad"]
        assert grad[0, 0].item() == 0.0 and grad[0, 2].item() == 0.0 and grad[1, 0].item() == 0.0

    def test_zero_keeps_only_the_highest(self) -> None:
        loss, _ = run("bnpo", top_entropy_quantile=0.0, entropies=ENTROPIES)
        assert loss.item() == pytest.approx(-1.0 / 5, abs=1e-6)

    def test_one_keeps_every_token(self) -> None:
        loss, _ = run("bnpo", top_entropy_quantile=1.0, entropies=ENTROPIES)
        assert loss.item() == pytest.approx(HAND["bnpo"], abs=1e-6)

    def test_needs_entropies(self) -> None:
        with pytest.raises(ValueError, match="entropies"):
            run("bnpo", top_entropy_quantile=0.5)


class TestEntropyBonus:
    def test_subtracts_coef_times_mean_entropy(self) -> None:
        entropies = ENTROPIES.clone().requires_grad_(True)
        loss, stats = run("bnpo", entropy_bonus=True, entropies=entropies, entropy_coef=0.1)
        mean_entropy = (0.1 + 0.9 + 0.5 + 0.3 + 0.7) / 5
        assert loss.item() == pytest.approx(HAND["bnpo"] - 0.1 * mean_entropy, abs=1e-6)
        assert stats["policy_loss"] == pytest.approx(HAND["bnpo"], abs=1e-6)
        assert entropies.grad is not None
        assert entropies.grad.flatten().tolist() == pytest.approx([-0.02] * 5 + [0.0])
        assert stats["entropy/bonus_sum"] == pytest.approx(2.5)
        assert stats["entropy/bonus_tokens"] == 5.0

    def test_acts_on_the_high_entropy_tokens_only(self) -> None:
        # Kept tokens (see TestTopEntropyQuantile): entropies 0.9 and 0.7, mean 0.8; split over 2 mini-batches.
        loss, stats = run(
            "bnpo",
            entropy_bonus=True,
            top_entropy_quantile=0.4,
            entropies=ENTROPIES,
            entropy_coef=0.1,
            num_mini_batches=2,
        )
        assert loss.item() == pytest.approx(((-1.0 + 0.55) / 5 - 0.1 * 0.8) / 2, abs=1e-6)
        assert stats["entropy/bonus_tokens"] == 2.0

    def test_same_meaning_for_every_loss_type(self) -> None:
        # dapo normalises its policy term by the step's tokens, but the bonus stays a plain token mean.
        loss, _ = run("dapo", entropy_bonus=True, entropies=ENTROPIES, entropy_coef=0.1, step_tokens=10)
        assert loss.item() == pytest.approx((sum(CLIPPED[0]) + sum(CLIPPED[1])) / 10 - 0.1 * 0.5, abs=1e-6)


class TestAdaptiveEntropy:
    def test_controller_by_hand(self) -> None:
        control = AdaptiveEntropy(0.01, adaptive=True, target=0.5, delta=0.005, low=0.0, high=0.012)
        assert control.coef_to_apply() == 0.0  # nothing measured yet
        control.update(0.4)  # at or below target: more bonus, capped at high
        assert control.coef == pytest.approx(0.012) and control.coef_to_apply() == pytest.approx(0.012)
        control.update(0.6)  # above target: less bonus, and none applied
        assert control.coef == pytest.approx(0.007) and control.coef_to_apply() == 0.0
        control.update(0.6)
        control.update(0.6)  # 0.002 - 0.005 -> floored at low
        assert control.coef == 0.0
        control.update(0.5)  # exactly the target counts as collapse
        assert control.coef == pytest.approx(0.005) and control.coef_to_apply() == pytest.approx(0.005)

    def test_state_round_trip(self) -> None:
        control = AdaptiveEntropy(0.01, adaptive=True, target=0.5, delta=0.005, low=0.0, high=1.0)
        control.update(0.3)
        restored = AdaptiveEntropy(0.01, adaptive=True, target=0.5, delta=0.005, low=0.0, high=1.0)
        restored.load_state_dict(control.state_dict())
        assert restored.coef_to_apply() == pytest.approx(0.015)

    def test_static_coefficient_always_applies(self) -> None:
        control = AdaptiveEntropy(0.03, adaptive=False, target=0.5, delta=0.005, low=0.0, high=1.0)
        control.update(0.1)
        assert control.coef_to_apply() == 0.03


# --- in the trainer ----------------------------------------------------------------------------------

TRAINER_CASES: dict[str, tuple[dict[str, Any], set[str]]] = {
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence"}, {"clip_ratio/region"}),
    "delta": ({"delta": 1.5, "num_iterations": 2}, {"clip_ratio/region"}),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 5.0}, {"cispo_clip_ratio"}),
    "sapo": ({"loss_type": "sapo"}, set()),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, {"clip_ratio/region"}),
    "vespo": ({"loss_type": "vespo"}, {"vespo/phi_seq_mean"}),
    "off_policy": ({"off_policy_mask_threshold": 0.01, "num_iterations": 2}, {"off_policy/masked_fraction"}),
    "top_entropy": ({"top_entropy_quantile": 0.2}, {"entropy_mask/kept_fraction"}),
    "entropy_bonus": ({"entropy_coef": 0.01}, {"policy_loss", "entropy_coef"}),
    "adaptive": ({"use_adaptive_entropy": True, "entropy_target": 100.0}, {"policy_loss", "entropy_coef"}),
    "gdpo": ({"multi_objective_aggregation": "normalize_then_sum"}, set()),
    "bias_correction_kl": ({"beta": 0.04, "use_bias_correction_kl": True, "num_iterations": 2}, {"kl"}),
}


@pytest.fixture
def models_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir.parent


@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_each_option_trains_a_step_and_reports_its_metrics(tmp_path: Path, models_dir: Path, case: str) -> None:
    options, metrics = TRAINER_CASES[case]
    two_sources = CompositeReward(
        [
            (FunctionSource("spread", lambda item: float(sum(item.completion_ids) % 17)), 1.0),
            (FunctionSource("length", lambda item: float(len(item.completion))), 0.5),
        ]
    )
    trainer = GRPOTrainer(
        small_config(max_steps=2, mini_batch_size=4, **options),
        train_rows=word_rows(),
        reward=two_sources,
        **trainer_kwargs(tmp_path, models_dir),
    )
    before = {name: p.detach().clone() for name, p in trainer.models.policy.named_parameters()}
    result = trainer.train()
    for step in result.history:
        assert metrics <= step.keys(), sorted(step)
        assert all(math.isfinite(step[name]) for name in metrics | {"loss", "grad_norm", "entropy"})
    assert "entropy/bonus_sum" not in result.history[0]
    changed = [n for n, p in trainer.models.policy.named_parameters() if not torch.equal(p, before[n])]
    assert changed


def test_adaptive_coefficient_rises_below_target_and_resumes(tmp_path: Path, models_dir: Path) -> None:
    # Any real entropy is below a target of 100 nats: +0.005 per optimiser update (2 per step here).
    config = small_config(
        max_steps=2, num_iterations=2, use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=100.0
    )
    kwargs = {"train_rows": word_rows(), "reward": spread_reward(), **trainer_kwargs(tmp_path, models_dir)}
    result = GRPOTrainer(config, **kwargs).train()
    assert [m["entropy_coef"] for m in result.history] == pytest.approx([0.02, 0.03])
    resumed = GRPOTrainer(config.model_copy(update={"max_steps": 3}), resume_from=result.last_checkpoint, **kwargs)
    assert resumed.entropy_control.coef_to_apply() == pytest.approx(0.03)
    assert resumed.train().history[-1]["entropy_coef"] == pytest.approx(0.04)


# --- learning: `grpo train` on the examples/ vowel task ---------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]
# Options that act only off-policy (ratio != 1) run two passes per batch; on-policy with one pass
# cispo, sapo, vespo and GSPO give exactly the dapo / grpo gradient.
LEARNING_CASES: dict[str, dict[str, Any]] = {
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "num_iterations": 2},
    "delta": {"delta": 1.5, "num_iterations": 2},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.2, "num_iterations": 2},
    "sapo": {"loss_type": "sapo", "num_iterations": 2},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo", "num_iterations": 2},
    "off_policy_mask": {"off_policy_mask_threshold": 0.05, "num_iterations": 2},
    # Only the top half of tokens by entropy train: the answer's first token drops out as it sharpens.
    # Without the KL (beta 0, TRL's default): its bias-corrected gradient acts on every token, and on
    # the tokens out of the policy loss it only pulls them back to the reference (it stalled this run).
    "top_entropy_quantile": {"top_entropy_quantile": 0.5, "max_steps": 30, "beta": 0.0},
    "entropy_coef": {"entropy_coef": 0.01},
    # The bonus, on from the second update, slows the climb (+0.28 in 16 steps on an AMD EPYC VM).
    "adaptive_entropy": {
        "max_steps": 24,
        "use_adaptive_entropy": True,
        "entropy_coef": 0.01,
        "entropy_target": 10.0,  # above the tiny model's ~4.6 nats: the bonus is on from the second update
        "entropy_coef_max": 0.03,
    },
    "normalize_then_sum": {"multi_objective_aggregation": "normalize_then_sum"},
    # beta 0.04 (examples/tiny.yaml); a second pass so the ratio that weights the KL moves off 1.
    "bias_correction_kl": {"use_bias_correction_kl": True, "num_iterations": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LEARNING_CASES))
def test_grpo_train_learns_the_vowel_task_with_each_option(tmp_path: Path, case: str) -> None:
    """examples/tiny.yaml cut to 16 steps (chance ~0.05; the plain run reaches ~0.7), through
    `grpo train`'s entry point in-process; a second reward source for the multi-objective case."""
    spec = yaml.safe_load((REPO_ROOT / "examples" / "tiny.yaml").read_text(encoding="utf-8"))
    spec["train_dataset"] = str(REPO_ROOT / "examples" / "data" / "vowel_train.jsonl")
    for key in ("eval_dataset", "output_dir"):
        spec.pop(key)
    options = LEARNING_CASES[case]
    if "multi_objective_aggregation" in options:
        spec["rewards"].append(
            {"type": "builtin", "name": "length_penalty", "weight": 0.5, "params": {"target_length": 3}}
        )
    spec["hyperparameters"].update(
        {"max_steps": 16, "eval_every": None, "checkpoint_every": 1000, "log_completions_every": 1000, **options}
    )
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(spec), encoding="utf-8")
    assert run_local(config, tmp_path / "out") == EXIT_OK
    checkpoint = latest_checkpoint(tmp_path / "out")
    assert checkpoint is not None
    vowel = [m["reward/regex_match/mean"] for m in load_checkpoint(checkpoint).trainer_state["history"]]
    first, last = sum(vowel[:4]) / 4, sum(vowel[-4:]) / 4
    print(f"{case}: vowel reward first 4 steps {first:.3f}, last 4 steps {last:.3f}")
    assert last > first + 0.3, vowel


def test_normalize_then_sum_reaches_the_trained_batch(tmp_path: Path, models_dir: Path) -> None:
    """The advantages the trainer uses are GDPO's, recomputed here from the logged completions."""

    def length(text: str) -> float:
        return float(len(text))

    def a_count(text: str) -> float:
        return float(text.count("a"))

    reward = CompositeReward(
        [
            (FunctionSource("length", lambda item: length(item.completion)), 1.0),
            (FunctionSource("a_count", lambda item: a_count(item.completion)), 2.0),
        ]
    )
    samples: list[dict[str, Any]] = []
    config = small_config(
        max_steps=1,
        multi_objective_aggregation="normalize_then_sum",
        advantage_std="unbiased",
        log_completions_every=1,
        log_completions_count=8,  # every completion: 2 prompts x 4
    )
    GRPOTrainer(
        config,
        train_rows=word_rows(),
        reward=reward,
        on_metrics=lambda step, metrics, logged: samples.extend(logged),
        **trainer_kwargs(tmp_path, models_dir),
    ).train()
    texts = [s["completion"] for s in samples]
    summed = [0.0] * len(texts)
    for source, weight in ((length, 1.0), (a_count, 2.0)):
        for start in range(0, len(texts), 4):
            group = [source(t) for t in texts[start : start + 4]]
            mean, std = statistics.mean(group), statistics.stdev(group)
            for i, value in enumerate(group):
                summed[start + i] += 0.0 if std == 0 else weight * (value - mean) / (std + 1e-4)
    mean, std = statistics.mean(summed), statistics.stdev(summed)
    assert std > 0, texts
    expected = [(x - mean) / (std + 1e-4) for x in summed]
    assert [s["advantage"] for s in samples] == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(
    "options",
    [{"multi_objective_aggregation": "normalize_then_sum"}, {"scale_rewards": "batch"}],
    ids=["normalize_then_sum", "scale_rewards_batch"],
)
def test_dynamic_sampling_fillers_stay_out_of_the_batch_statistics(
    tmp_path: Path, models_dir: Path, options: dict[str, Any]
) -> None:
    """The first round's group 0 is flat on both sources (a filler: no refill round), group 1 has
    spread: the trained advantages are those of group 1 alone, the filler's are 0."""

    def spread(item: RewardInput) -> float:
        return 3.0 if item.group_id == 0 else float(sum(map(ord, item.completion)) % 17)

    def length(item: RewardInput) -> float:
        return 1.0 if item.group_id == 0 else float(len(item.completion))

    reward = CompositeReward([(FunctionSource("spread", spread), 1.0), (FunctionSource("length", length), 0.5)])
    samples: list[dict[str, Any]] = []
    config = small_config(
        max_steps=1, dynamic_sampling=True, max_resample_rounds=0, advantage_std="unbiased",
        log_completions_every=1, log_completions_count=8, **options,
    )
    GRPOTrainer(
        config,
        train_rows=word_rows(),
        reward=reward,
        on_metrics=lambda step, metrics, logged: samples.extend(logged),
        **trainer_kwargs(tmp_path, models_dir),
    ).train()
    live, filler = samples[:4], samples[4:]  # groups with spread come first in the trained batch
    assert [s["reward"] for s in filler] == [3.5] * 4
    assert [s["advantage"] for s in filler] == [0.0] * 4
    texts = [s["completion"] for s in live]
    if "scale_rewards" in options:
        totals = [s["reward"] for s in live]
        centred = [t - statistics.mean(totals) for t in totals]
        summed, batch_std = centred, statistics.stdev(totals)  # the batch is this one group
    else:
        summed = [0.0] * 4
        for values, weight in (([float(sum(map(ord, t)) % 17) for t in texts], 1.0), ([float(len(t)) for t in texts], 0.5)):
            mean, std = statistics.mean(values), statistics.stdev(values)
            summed = [x + (0.0 if std == 0 else weight * (v - mean) / (std + 1e-4)) for x, v in zip(summed, values, strict=True)]
        centred = [x - statistics.mean(summed) for x in summed]
        batch_std = statistics.stdev(summed)
    assert batch_std > 0, texts
    assert [s["advantage"] for s in live] == pytest.approx([c / (batch_std + 1e-4) for c in centred], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.1])
def test_the_entropy_bonus_alone_moves_the_policy(tmp_path: Path, models_dir: Path, entropy_coef: float) -> None:
    """A constant reward gives zero advantages: only the bonus's gradient can change the weights."""
    trainer = GRPOTrainer(
        small_config(max_steps=1, entropy_coef=entropy_coef),
        train_rows=word_rows(),
        reward=CompositeReward([(FunctionSource("constant", lambda item: 1.0), 1.0)]),
        **trainer_kwargs(tmp_path, models_dir),
    )
    before = {name: p.detach().clone() for name, p in trainer.models.policy.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.models.policy.named_parameters() if not torch.equal(p, before[n])]
    assert bool(changed) == (entropy_coef > 0)
