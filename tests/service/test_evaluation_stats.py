"""Evaluation statistics (service/evaluations/stats.py): unbiased pass@k, bootstrap intervals, summaries and the
paired comparison of two evaluations. Pure functions: no database, no app."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest

from service.evaluations.stats import (
    Interval,
    ItemOutcome,
    bootstrap_mean,
    compare,
    is_binary,
    pass_at_k,
    summarize,
)


def _items(*rewards: tuple[float | None, ...]) -> list[ItemOutcome]:
    return [ItemOutcome(r) for r in rewards]


def _single(outcomes: list[float]) -> list[ItemOutcome]:
    """One sample per item."""
    return [ItemOutcome((r,)) for r in outcomes]


class TestPassAtK:
    def test_matches_brute_force_enumeration_of_k_subsets(self) -> None:
        # samples 0..c-1 are the correct ones; pass@k is the share of k-subsets holding one of them
        for n in range(1, 9):
            for c in range(n + 1):
                for k in range(1, n + 1):
                    subsets = list(itertools.combinations(range(n), k))
                    hits = sum(1 for subset in subsets if min(subset) < c)
                    expected = Fraction(hits, len(subsets))
                    assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12), (n, c, k)

    def test_matches_exact_binomials_for_large_n(self) -> None:
        for n, c, k in [(1024, 1, 1), (1024, 3, 10), (1024, 100, 100), (1024, 1000, 20), (1000, 7, 512)]:
            exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
            assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12, abs=1e-15)

    def test_known_values(self) -> None:
        for n in (1, 5, 200):
            assert pass_at_k(n, 0, 1) == 0.0
            assert pass_at_k(n, 0, n) == 0.0
            for c in range(1, n + 1):
                assert pass_at_k(n, c, n) == 1.0
        assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c / n
        assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2)
        assert pass_at_k(10, 8, 3) == 1.0  # fewer than 3 wrong: every 3-subset hits a correct one

    @pytest.mark.parametrize(
        ("n", "c", "k"), [(5, 1, 0), (5, 1, 6), (5, 1, -1), (0, 0, 1), (5, 6, 1), (5, -1, 1)]
    )
    def test_rejects_bad_arguments(self, n: int, c: int, k: int) -> None:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


class TestBootstrapMean:
    VALUES = [0.1, 0.9, 0.4, 0.75, 0.3, 0.55, 1.0, 0.0, 0.2, 0.65, 0.8, 0.35]

    def test_contains_the_sample_mean(self) -> None:
        interval = bootstrap_mean(self.VALUES, seed=0)
        assert interval.contains(sum(self.VALUES) / len(self.VALUES))
        assert interval.low < interval.high
        assert 0.0 <= interval.low and interval.high <= 1.0

    def test_narrows_as_the_sample_grows(self) -> None:
        small = bootstrap_mean([float(i % 2) for i in range(20)], seed=1, resamples=1000)
        large = bootstrap_mean([float(i % 2) for i in range(500)], seed=1, resamples=1000)
        assert large.contains(0.5) and small.contains(0.5)
        # the width goes as 1 / sqrt(n): 5x narrower for 25x the items, give or take the resampling noise
        assert (large.high - large.low) < (small.high - small.low) / 3

    def test_wider_at_a_higher_level(self) -> None:
        narrow = bootstrap_mean(self.VALUES, seed=3, level=0.5)
        wide = bootstrap_mean(self.VALUES, seed=3, level=0.99)
        assert wide.low < narrow.low and narrow.high < wide.high

    def test_deterministic_for_a_seed(self) -> None:
        assert bootstrap_mean(self.VALUES, seed=7) == bootstrap_mean(self.VALUES, seed=7)
        assert bootstrap_mean(self.VALUES, seed=7) != bootstrap_mean(self.VALUES, seed=8)

    def test_constant_data_gives_a_degenerate_interval(self) -> None:
        assert bootstrap_mean([0.1] * 37, seed=0) == Interval(0.1, 0.1)
        assert bootstrap_mean([2.5], seed=0) == Interval(2.5, 2.5)

    def test_rejects_bad_arguments(self) -> None:
        with pytest.raises(ValueError):
            bootstrap_mean([], seed=0)
        with pytest.raises(ValueError):
            bootstrap_mean([0.0, 1.0], seed=0, resamples=0)
        with pytest.raises(ValueError):
            bootstrap_mean([0.0, 1.0], seed=0, level=1.0)


class TestBasics:
    def test_is_binary(self) -> None:
        assert is_binary([0.0, 1.0, 1.0])
        assert is_binary([1])
        assert not is_binary([])
        assert not is_binary([0.0, 0.5])
        assert not is_binary([2.0])

    def test_interval(self) -> None:
        interval = Interval(-1.0, 2.0)
        assert interval.contains(-1.0) and interval.contains(2.0) and interval.contains(0.0)
        assert not interval.contains(2.0001)
        with pytest.raises(ValueError):
            Interval(1.0, 0.0)

    def test_item_outcome(self) -> None:
        item = ItemOutcome((1.0, None, 0.0, 1.0))
        assert item.score == pytest.approx(2 / 3)
        assert item.correct == 2
        assert ItemOutcome((None, None)).score is None
        assert ItemOutcome((None, None)).correct == 0
        with pytest.raises(ValueError):
            ItemOutcome(())
        with pytest.raises(ValueError):
            ItemOutcome((math.nan,))


class TestSummarize:
    def test_binary_accuracy_and_pass_at_k_by_hand(self) -> None:
        items = _items((1.0, 0.0, 1.0, 1.0), (0.0, 0.0, 0.0, 0.0), (1.0, 1.0, 1.0, 1.0), (0.0, 1.0, 0.0, 0.0))
        summary = summarize(items, k=4, seed=0)
        assert summary.binary
        assert (summary.items, summary.samples, summary.abstained, summary.k) == (4, 16, 0, 4)
        # accuracy: (3/4 + 0 + 1 + 1/4) / 4; pass@4 with all four samples: items 1, 3 and 4 have a correct one
        assert summary.accuracy == pytest.approx(0.5)
        assert summary.mean_reward == pytest.approx(0.5)
        assert summary.pass_at_k == pytest.approx(0.75)
        assert summary.accuracy_interval is not None and summary.accuracy_interval.contains(0.5)
        assert summary.pass_at_k_interval is not None and summary.pass_at_k_interval.contains(0.75)
        assert summary.mean_reward_interval == summary.accuracy_interval

    def test_pass_at_k_below_the_samples_of_a_shorter_item(self) -> None:
        # the second item lost a sample: it counts with pass@3, the first with pass@4 = 1 - C(2,4)/C(4,4) = 1
        items = _items((1.0, 1.0, 0.0, 0.0), (1.0, 0.0, 0.0))
        summary = summarize(items, k=4, seed=0)
        assert summary.pass_at_k == pytest.approx((1.0 + 1.0) / 2)
        assert summary.accuracy == pytest.approx((0.5 + 1 / 3) / 2)

    def test_non_binary_rewards(self) -> None:
        summary = summarize(_items((0.5, 1.0), (0.0, 0.25)), k=2, seed=0)
        assert not summary.binary
        assert summary.mean_reward == pytest.approx((0.75 + 0.125) / 2)
        assert summary.mean_reward_interval is not None
        assert (summary.accuracy, summary.accuracy_interval) == (None, None)
        assert (summary.pass_at_k, summary.pass_at_k_interval) == (None, None)

    def test_abstained_samples_and_items(self) -> None:
        summary = summarize(_items((None, 1.0, 0.0), (None, None, None), (1.0, 1.0, None)), k=3, seed=0)
        assert summary.abstained == 5
        assert summary.samples == 9
        # the all-abstained item has no score and is left out: (1/2 + 1) / 2
        assert summary.mean_reward == pytest.approx(0.75)
        assert not summary.binary  # 0/1 rewards, but an abstention leaves the binary metrics undefined
        assert summary.accuracy is None and summary.pass_at_k is None

    def test_nothing_scored(self) -> None:
        summary = summarize(_items((None,), (None,)), k=1, seed=0)
        assert summary.mean_reward is None and summary.mean_reward_interval is None
        assert summary.abstained == 2 and not summary.binary
        empty = summarize([], k=1, seed=0)
        assert empty.items == 0 and empty.mean_reward is None and not empty.binary

    def test_more_samples_than_k_is_an_error(self) -> None:
        with pytest.raises(ValueError):
            summarize(_items((1.0, 0.0, 1.0)), k=2, seed=0)
        with pytest.raises(ValueError):
            summarize(_items((1.0,)), k=0, seed=0)

    def test_as_dict_is_json_ready_and_deterministic(self) -> None:
        items = _items((1.0, 0.0), (1.0, 1.0), (0.0, 0.0))
        first = summarize(items, k=2, seed=5).as_dict()
        assert first == summarize(items, k=2, seed=5).as_dict()
        assert set(first["accuracy_interval"]) == {"low", "high"}
        assert json.loads(json.dumps(first)) == first
        non_binary = summarize(_items((0.5,)), k=1, seed=0).as_dict()
        assert non_binary["pass_at_k_interval"] is None
        assert non_binary["mean_reward_interval"] == {"low": 0.5, "high": 0.5}


class TestCompare:
    def test_identical_evaluations(self) -> None:
        a = _single([1.0, 0.0, 1.0, 1.0, 0.0] * 6)
        result = compare(a, list(a), seed=0)
        assert (result.metric, result.test) == ("accuracy", "mcnemar_exact")
        assert result.difference == 0.0 and result.interval.contains(0.0)
        assert result.p_value == 1.0
        assert (result.b_better, result.a_better) == (0, 0)
        graded = _items((0.2, 0.7), (0.9, 0.1), (0.5, 0.5))
        same = compare(graded, list(graded), seed=0)
        assert (same.test, same.difference, same.p_value) == ("paired_permutation", 0.0, 1.0)
        assert same.interval == Interval(0.0, 0.0)

    def test_b_clearly_better_mcnemar(self) -> None:
        a = _single([0.0] * 40)
        b = _single([1.0] * 35 + [0.0] * 5)
        result = compare(a, b, seed=0)
        assert (result.metric, result.test, result.items) == ("accuracy", "mcnemar_exact", 40)
        assert result.mean_a == 0.0 and result.mean_b == pytest.approx(35 / 40)
        assert result.difference == pytest.approx(35 / 40)
        assert not result.interval.contains(0.0) and result.interval.low > 0.0
        # discordant pairs: n01 = 35, n10 = 0; two-sided binomial test P(X <= 0) doubled, X ~ Bin(35, 1/2)
        expected = min(1.0, 2 * sum(math.comb(35, i) for i in range(0 + 1)) / 2**35)
        assert result.p_value == pytest.approx(expected, rel=1e-12)
        assert result.p_value < 0.001
        assert (result.b_better, result.a_better) == (35, 0)

    def test_mcnemar_with_discordance_both_ways(self) -> None:
        # 7 items only b solves, 2 only a solves, 11 both, 5 neither
        a = _single([0.0] * 7 + [1.0] * 2 + [1.0] * 11 + [0.0] * 5)
        b = _single([1.0] * 7 + [0.0] * 2 + [1.0] * 11 + [0.0] * 5)
        result = compare(a, b, seed=0)
        expected = 2 * sum(math.comb(9, i) for i in range(3)) / 2**9
        assert result.p_value == pytest.approx(expected, rel=1e-12)
        assert (result.b_better, result.a_better) == (7, 2)
        reverse = compare(b, a, seed=0)
        assert reverse.p_value == result.p_value and reverse.difference == -result.difference

    def test_non_binary_uses_the_paired_permutation_test(self) -> None:
        a = _single([0.1 * (i % 10) for i in range(30)])
        b = _single([min(1.0, 0.1 * (i % 10) + 0.3) for i in range(30)])
        result = compare(a, b, seed=0, resamples=2000)
        assert (result.metric, result.test) == ("mean_reward", "paired_permutation")
        assert result.p_value == pytest.approx(1 / 2001)  # no sign vector matches 30 non-negative differences
        assert result.b_better == 30 and not result.interval.contains(0.0)
        assert compare(a, b, seed=0) == compare(a, b, seed=0)

    def test_binary_with_several_samples_uses_the_permutation_test(self) -> None:
        a = _items((1.0, 0.0), (0.0, 0.0), (1.0, 1.0))
        b = _items((1.0, 1.0), (0.0, 1.0), (1.0, 1.0))
        result = compare(a, b, seed=0)
        assert (result.metric, result.test) == ("accuracy", "paired_permutation")
        assert result.difference == pytest.approx(1 / 3)

    def test_permutation_p_value_matches_exact_enumeration(self) -> None:
        differences = [0.3, -0.1, 0.25, 0.4, -0.2, 0.15, 0.05, 0.35]
        a = _single([0.5] * len(differences))
        b = _single([0.5 + d for d in differences])
        observed = abs(sum(differences))
        signs = list(itertools.product((-1, 1), repeat=len(differences)))
        extreme = sum(
            1
            for s in signs
            if abs(sum(x * d for x, d in zip(s, differences, strict=True))) >= observed - 1e-9
        )
        exact = extreme / len(signs)
        result = compare(a, b, seed=11, resamples=20000)
        assert result.p_value == pytest.approx(exact, abs=0.01)

    def test_paired_interval_cancels_the_items_difficulty(self) -> None:
        # b scores every item 0.25 above a; the items themselves range from 0 to 0.75: a paired interval is the
        # single point 0.25, while resampling a and b apart would spread by the spread of the items
        base = [0.75 * (i % 4) / 3 for i in range(40)]
        result = compare(_single(base), _single([x + 0.25 for x in base]), seed=0)
        assert result.difference == pytest.approx(0.25)
        assert result.interval.high - result.interval.low < 1e-9

    def test_items_unscored_on_either_side_are_skipped(self) -> None:
        a = _items((1.0,), (None,), (0.0,), (0.5,))
        b = _items((1.0,), (1.0,), (None,), (0.75,))
        result = compare(a, b, seed=0)
        assert result.items == 2
        assert result.mean_a == pytest.approx(0.75) and result.mean_b == pytest.approx(0.875)
        assert result.metric == "mean_reward"
        with pytest.raises(ValueError):
            compare(_items((None,), (1.0,)), _items((1.0,), (None,)), seed=0)

    def test_rejects_mismatched_or_empty_evaluations(self) -> None:
        with pytest.raises(ValueError):
            compare(_single([1.0, 0.0]), _single([1.0]), seed=0)
        with pytest.raises(ValueError):
            compare([], [], seed=0)

    def test_as_dict_is_json_ready(self) -> None:
        result = compare(_single([0.0, 1.0, 0.0]), _single([1.0, 1.0, 0.0]), seed=0).as_dict()
        assert json.loads(json.dumps(result)) == result
        assert set(result["interval"]) == {"low", "high"}
        assert result["test"] == "mcnemar_exact" and result["p_value"] == 1.0
