"""The statistics of a model evaluation, and of the comparison of two evaluations on the same dataset.

An evaluation samples k completions (k = samples_per_item) for each of the dataset's items; each completion gets
one total reward from the reward sources, or None when every source abstained. Definitions:

- score of an item: the mean of its non-None rewards (None when all abstained).
- mean_reward: the mean over items of the item scores, items without a score left out.
- binary evaluation: every reward is 0.0 or 1.0 and none abstained. Then, with n_i samples of item i of which
  c_i have reward 1.0:
  * accuracy = mean_i c_i / n_i, which is the unbiased estimate of pass@1;
  * pass@k = mean_i (1 - C(n_i - c_i, k) / C(n_i, k)), the unbiased estimator of the probability that at least
    one of k samples is correct (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
    arXiv:2107.03374, section 2.1), computed in its numerically stable product form
    1 - prod_{j = n-c+1}^{n} (1 - k / j).
- confidence intervals: the percentile bootstrap (Efron 1979, "Bootstrap Methods: Another Look at the Jackknife";
  Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13): the items are resampled with
  replacement, the statistic is recomputed on each resample, and the interval is the (1 - level) / 2 and
  (1 + level) / 2 percentiles of those replicates. Items, not samples, are resampled: the k samples of an item
  are not independent of each other.
- comparison of evaluations a and b (item i of a and of b is the same dataset item): the difference of the means
  over the items both scored, with a paired bootstrap interval (the same resampled item indices for a and b,
  which is the bootstrap of the per-item differences), and a two-sided test of no difference:
  * McNemar's exact test (McNemar 1947, Psychometrika 12(2)) when both evaluations are binary with one sample
    per item: the two-sided binomial test of the discordant pairs, p = min(1, 2 P(X <= min(n01, n10))) with
    X ~ Binomial(n01 + n10, 1/2), n01 the items a got wrong and b right, n10 the reverse;
  * otherwise the paired sign-flip permutation test (Fisher 1935, "The Design of Experiments"; Good 2005,
    "Permutation, Parametric and Bootstrap Tests of Hypotheses"): under no difference each per-item
    difference d_i = score_b - score_a is as likely to have either sign, so p = (1 + #{resamples with
    |mean(s_i d_i)| >= |mean(d)|}) / (1 + resamples) with random signs s_i (Phipson & Smyth 2010: the +1s keep
    a Monte Carlo p-value valid, never 0).

Everything random draws from random.Random(seed): the same inputs and seed give the same numbers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# |mean(s d)| >= |mean(d)| is compared with this slack: a sign vector that reproduces the observed statistic
# (all +1, or flips of zero differences) must count as "at least as extreme" despite float rounding.
_PERMUTATION_TOLERANCE = 1e-12


@dataclass(frozen=True)
class Interval:
    """A closed interval [low, high]."""

    low: float
    high: float

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"interval low {self.low} is above high {self.high}")

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


def is_binary(values: Iterable[float]) -> bool:
    """True when there is at least one value and every value is 0.0 or 1.0."""
    seen = False
    for value in values:
        if value not in (0.0, 1.0):
            return False
        seen = True
    return seen


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of an item with n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    # C(n-c, k) / C(n, k) = prod_{j=n-c+1}^{n} (1 - k/j): a product of factors in (0, 1], where the binomials
    # themselves overflow a float from n ~ 1030 on (Chen et al. 2021, figure 3).
    miss = 1.0
    for j in range(n - c + 1, n + 1):
        miss *= 1.0 - k / j
    return 1.0 - miss


def _mean(values: Sequence[float]) -> float:
    # fsum: the mean of a resample must not drift with the order of its terms (and constant data stays constant)
    return math.fsum(values) / len(values)


def _percentile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of sorted values, linear between order statistics (numpy's default)."""
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    weight = position - below
    return ordered[below] + (ordered[above] - ordered[below]) * weight


def bootstrap_mean(
    values: Sequence[float], *, seed: int, resamples: int = 2000, level: float = 0.95
) -> Interval:
    """Percentile bootstrap interval of the mean of values (the items, resampled with replacement)."""
    if not values:
        raise ValueError("bootstrap of an empty sample")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    first = values[0]
    if all(value == first for value in values):
        return Interval(first, first)  # every resample has this mean; no need to draw
    rng = random.Random(seed)
    n = len(values)
    means = sorted(_mean(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return Interval(_percentile(means, tail), _percentile(means, 1.0 - tail))


@dataclass(frozen=True)
class ItemOutcome:
    """The total rewards of the samples of one dataset item; None where every reward source abstained."""

    rewards: tuple[float | None, ...]

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ValueError("an item has at least one sample")
        for reward in self.rewards:
            # NaN or inf would silently poison every mean and interval downstream
            if reward is not None and not math.isfinite(reward):
                raise ValueError(f"reward {reward} is not a finite number")

    @property
    def scored(self) -> tuple[float, ...]:
        """The rewards that are not None."""
        return tuple(reward for reward in self.rewards if reward is not None)

    @property
    def score(self) -> float | None:
        scored = self.scored
        return _mean(scored) if scored else None

    @property
    def correct(self) -> int:
        return sum(1 for reward in self.rewards if reward == 1.0)

    @property
    def abstained(self) -> int:
        return sum(1 for reward in self.rewards if reward is None)


def _all_binary(items: Sequence[ItemOutcome]) -> bool:
    """Every reward of every item is 0 or 1 and none abstained (and there is at least one item)."""
    return bool(items) and all(item.abstained == 0 and is_binary(item.scored) for item in items)


def _interval(values: Sequence[float], seed: int, resamples: int) -> Interval | None:
    return bootstrap_mean(values, seed=seed, resamples=resamples) if values else None


@dataclass(frozen=True)
class Summary:
    """The statistics of one evaluation; the binary-only fields are None for other evaluations."""

    items: int
    samples: int
    abstained: int
    mean_reward: float | None
    mean_reward_interval: Interval | None
    binary: bool
    accuracy: float | None
    accuracy_interval: Interval | None
    k: int
    pass_at_k: float | None
    pass_at_k_interval: Interval | None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: asdict turns each Interval into {"low": .., "high": ..} and leaves None as None."""
        return asdict(self)


def summarize(items: Sequence[ItemOutcome], *, k: int, seed: int, resamples: int = 2000) -> Summary:
    """The statistics of an evaluation whose items were each sampled k times (k = samples_per_item).

    An item with fewer than k samples (some were lost) counts in pass@k with pass@n_i: pass@k is not defined
    for it. An item with more than k samples contradicts k and is an error.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    longest = max((len(item.rewards) for item in items), default=0)
    if longest > k:
        raise ValueError(f"an item has {longest} samples, more than k={k}")
    scores = [score for score in (item.score for item in items) if score is not None]
    binary = _all_binary(items)
    accuracies: list[float] = []
    passes: list[float] = []
    if binary:
        accuracies = [item.correct / len(item.rewards) for item in items]
        passes = [pass_at_k(len(item.rewards), item.correct, min(k, len(item.rewards))) for item in items]
    reward_interval = _interval(scores, seed, resamples)
    return Summary(
        items=len(items),
        samples=sum(len(item.rewards) for item in items),
        abstained=sum(item.abstained for item in items),
        mean_reward=_mean(scores) if scores else None,
        mean_reward_interval=reward_interval,
        binary=binary,
        accuracy=_mean(accuracies) if binary else None,
        # binary: each item's score is exactly correct / n (a sum of 0s and 1s is exact), so the accuracies are
        # the scores and their bootstrap (same values, same seed) is the same interval: not drawn twice
        accuracy_interval=reward_interval if binary else None,
        k=k,
        pass_at_k=_mean(passes) if binary else None,
        pass_at_k_interval=_interval(passes, seed, resamples),
    )


@dataclass(frozen=True)
class Comparison:
    """Evaluation b against evaluation a on the items both scored; difference = mean_b - mean_a."""

    metric: str
    items: int
    mean_a: float
    mean_b: float
    difference: float
    interval: Interval
    test: str
    p_value: float
    b_better: int
    a_better: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def mcnemar_exact(n01: int, n10: int) -> float:
    """Two-sided exact McNemar p-value of n01 and n10 discordant pairs (binomial test with p = 1/2)."""
    discordant = n01 + n10
    if discordant == 0:
        return 1.0
    tail = sum(math.comb(discordant, i) for i in range(min(n01, n10) + 1))
    # 2 * tail / 2**N as int / int: Python rounds the exact quotient once, even where 2**N overflows a float
    return min(1.0, tail / (1 << (discordant - 1)))


def sign_flip_p_value(differences: Sequence[float], *, seed: int, resamples: int) -> float:
    """Two-sided Monte Carlo p-value of the paired sign-flip permutation test of mean(differences) = 0."""
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    if all(d == 0.0 for d in differences):
        return 1.0  # every sign vector gives the observed 0: nothing to test
    observed = abs(_mean(differences)) - _PERMUTATION_TOLERANCE
    rng = random.Random(seed)
    n = len(differences)
    extreme = 0
    for _ in range(resamples):
        signs = rng.choices((-1.0, 1.0), k=n)
        if abs(math.fsum(s * d for s, d in zip(signs, differences, strict=True)) / n) >= observed:
            extreme += 1
    return (1 + extreme) / (1 + resamples)


def _one_sample_each(items: Sequence[ItemOutcome]) -> bool:
    return all(len(item.rewards) == 1 for item in items)


def compare(
    a: Sequence[ItemOutcome], b: Sequence[ItemOutcome], *, seed: int, resamples: int = 2000
) -> Comparison:
    """Compare evaluation b with evaluation a, item by item (a[i] and b[i] are the same dataset item)."""
    if len(a) != len(b):
        raise ValueError(f"the evaluations have {len(a)} and {len(b)} items: they must score the same items")
    if not a:
        raise ValueError("no items to compare")
    pairs = [
        (score_a, score_b)
        for score_a, score_b in ((x.score, y.score) for x, y in zip(a, b, strict=True))
        if score_a is not None and score_b is not None
    ]
    if not pairs:
        raise ValueError("no item is scored in both evaluations")
    binary = _all_binary(a) and _all_binary(b)
    scores_a = [pair[0] for pair in pairs]
    scores_b = [pair[1] for pair in pairs]
    # In a binary evaluation an item's score is correct / n: the accuracy and the mean reward coincide.
    differences = [score_b - score_a for score_a, score_b in pairs]
    mean_a, mean_b = _mean(scores_a), _mean(scores_b)
    exact = binary and _one_sample_each(a) and _one_sample_each(b)
    if exact:
        n01 = sum(1 for score_a, score_b in pairs if score_a == 0.0 and score_b == 1.0)
        n10 = sum(1 for score_a, score_b in pairs if score_a == 1.0 and score_b == 0.0)
        p_value = mcnemar_exact(n01, n10)
    else:
        p_value = sign_flip_p_value(differences, seed=seed, resamples=resamples)
    return Comparison(
        metric="accuracy" if binary else "mean_reward",
        items=len(pairs),
        mean_a=mean_a,
        mean_b=mean_b,
        # mean(d) is mean_b - mean_a up to rounding; taken from d so it agrees exactly with the interval's data
        difference=_mean(differences),
        # Resampling the same item indices for a and b is resampling the paired differences: the mean of a
        # resample of d is mean_b - mean_a of that resample, and the items' own difficulty cancels out.
        interval=bootstrap_mean(differences, seed=seed, resamples=resamples),
        test="mcnemar_exact" if exact else "paired_permutation",
        p_value=p_value,
        b_better=sum(1 for d in differences if d > 0),
        a_better=sum(1 for d in differences if d < 0),
    )
