"""The training-health guard on recorded runs (tests/engine/fixtures/health/record.py wrote them) and its rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.grpo.evaluation import greedy_metrics, pass_at_k
from worker.grpo.health import Finding, HealthConfig, HealthGuard, dominated_fraction

FIXTURES = Path(__file__).parent / "fixtures" / "health"


def _replay(name: str, config: HealthConfig | None = None) -> list[Finding]:
    guard = HealthGuard(config)
    steps = json.loads((FIXTURES / f"{name}.json").read_text())["steps"]
    return [finding for entry in steps for finding in guard.observe(entry["step"], entry["metrics"])]


def _warnings(findings: list[Finding]) -> dict[str, Finding]:
    return {f.kind: f for f in findings if f.severity == "warning"}


def test_old_demo_collapse_trips_the_guard() -> None:
    """The demo's former config (random model, partial-credit vowel reward, lr 3e-3): KL past 2 within 15 steps."""
    found = _warnings(_replay("old_demo_collapse"))
    assert "kl_blowup" in found, found
    assert found["kl_blowup"].step <= 20
    assert found["kl_blowup"].evidence["kl"] > 2.0


def test_exact_task_on_a_random_model_is_stuck_at_zero() -> None:
    found = _warnings(_replay("random_exact_stuck"))
    assert "zero_variance_stuck" in found
    assert found["zero_variance_stuck"].step == 3  # fires after `patience` steps, once
    assert found["zero_variance_stuck"].evidence["reward/mean"] == 0.0
    assert sum(f.kind == "zero_variance_stuck" for f in _replay("random_exact_stuck")) == 1


def test_healthy_warm_run_stays_quiet() -> None:
    findings = _replay("warm_healthy")
    assert _warnings(findings) == {}, [f.message for f in findings]


def test_each_detector_fires_on_its_condition() -> None:
    guard = HealthGuard(HealthConfig(patience=2))
    base = {"reward/mean": 0.3, "entropy": 1.0, "kl": 0.1, "completion_length/mean": 3.0, "truncated_fraction": 0.0,
            "frac_zero_std_groups": 0.0, "groups/dominated_frac": 0.0}
    cases = {
        "entropy_collapse": {"entropy": 0.01},
        "kl_blowup": {"kl": 5.0},
        "length_collapse": {"completion_length/mean": 1.0},
        "zero_variance_stuck": {"frac_zero_std_groups": 1.0, "reward/mean": 0.0},
        "zero_variance_graduated": {"frac_zero_std_groups": 1.0, "reward/mean": 1.0},
        "dominant_completion": {"groups/dominated_frac": 1.0},
    }
    for kind, change in cases.items():
        guard = HealthGuard(HealthConfig(patience=2))
        assert guard.observe(1, {**base, **change}) == []  # patience: not yet
        fired = guard.observe(2, {**base, **change})
        assert [f.kind for f in fired] == [kind], (kind, fired)
        assert guard.observe(3, {**base, **change}) == []  # once per episode
        assert guard.observe(4, base) == []
    assert HealthGuard().observe(1, base) == []


def test_solved_prompts_are_not_a_collapse() -> None:
    guard = HealthGuard(HealthConfig(patience=1))
    solved = {"reward/mean": 0.95, "entropy": 0.001, "groups/dominated_frac": 0.0, "frac_zero_std_groups": 1.0}
    fired = guard.observe(1, solved)
    assert [(f.kind, f.severity) for f in fired] == [("zero_variance_graduated", "info")]


def test_reward_hacking_needs_train_up_and_eval_down() -> None:
    guard = HealthGuard()
    guard.observe(0, {"eval/reward/mean": 0.5})
    for step in range(1, 11):
        guard.observe(step, {"reward/mean": 0.3})
    assert guard.observe(10, {"eval/reward/mean": 0.5}) == []  # first comparable eval
    for step in range(11, 21):
        guard.observe(step, {"reward/mean": 0.8})
    fired = guard.observe(20, {"eval/reward/mean": 0.3})
    assert [f.kind for f in fired] == ["reward_hacking"]
    assert fired[0].evidence["eval_reward"] == [0.5, 0.3]


def test_forgetting_compares_with_the_first_retain_eval() -> None:
    guard = HealthGuard()
    assert guard.observe(0, {"eval/retain/reward/mean": 0.9}) == []
    assert guard.observe(10, {"eval/retain/reward/mean": 0.75}) == []
    fired = guard.observe(20, {"eval/retain/reward/mean": 0.6})
    assert [f.kind for f in fired] == ["forgetting"]


def test_dominated_fraction_counts_groups_taken_over_by_a_wrong_answer() -> None:
    texts = ["uuuu"] * 8 + ["a", "b", "c", "d", "a", "a", "b", "c"]
    assert dominated_fraction(texts, [0.2] * 16, 8, 0.75, 0.9) == 0.5
    assert dominated_fraction(["x"] * 6 + ["y", "z"], [0.0] * 8, 8, 0.75, 0.9) == 1.0
    assert dominated_fraction(["7"] * 7 + ["3"], [1.0] * 7 + [0.0], 8, 0.75, 0.9) == 0.0  # solved, not collapsed


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [([1.0, 0.0, 1.0, 1.0], {"eval/reward/mean": 0.75, "eval/accuracy": 0.75}), ([0.5, 1.0], {"eval/reward/mean": 0.75})],
)
def test_greedy_metrics(rewards: list[float], expected: dict[str, float]) -> None:
    assert greedy_metrics(rewards) == expected


def test_pass_at_k_counts_groups_with_any_right_answer() -> None:
    assert pass_at_k([0, 0, 1, 0, 0, 0], 3) == {"eval/pass@3": 0.5}
    assert pass_at_k([0.5, 0, 1, 0], 2) == {}  # not a binary reward
