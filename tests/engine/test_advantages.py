"""Group-relative advantages (acceptance item 1)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from worker.grpo.advantages import decoupled_advantages, group_advantages

NAN = float("nan")


class TestGroupScale:
    def test_seed_004_worked_example(self) -> None:
        # 6 of 10 correct: mean 0.6, population std sqrt(0.24) ~ 0.49 -> +0.82 / -1.22.
        rewards = torch.tensor([1.0] * 6 + [0.0] * 4)
        advantages, group_std = group_advantages(rewards, 10)
        assert group_std.tolist() == pytest.approx([math.sqrt(0.24)])
        assert advantages[:6].tolist() == pytest.approx([0.4 / (math.sqrt(0.24) + 1e-4)] * 6)
        assert advantages[6:].tolist() == pytest.approx([-0.6 / (math.sqrt(0.24) + 1e-4)] * 4)
        assert round(float(advantages[0]), 2) == 0.82
        assert round(float(advantages[-1]), 2) == -1.22

    def test_zero_spread_group_is_exactly_zero(self) -> None:
        # 0.1 * 3 / 3 != 0.1 in floating point: the naive (r - mean) / eps would be ~1e-13, not 0.
        rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.5])
        advantages, group_std = group_advantages(rewards, 3)
        assert advantages[:3].tolist() == [0.0, 0.0, 0.0]
        assert group_std[0].item() == 0.0
        assert group_std[1].item() > 0

    def test_groups_are_contiguous_blocks(self) -> None:
        rewards = torch.tensor([0.0, 1.0, 10.0, 30.0])
        advantages, group_std = group_advantages(rewards, 2, eps=0.0)
        assert advantages.tolist() == pytest.approx([-1.0, 1.0, -1.0, 1.0])
        assert group_std.tolist() == pytest.approx([0.5, 10.0])

    def test_nan_rewards_are_ignored_and_get_zero(self) -> None:
        # Valid rewards 1, 0, 0: mean 1/3, population std sqrt(2)/3.
        rewards = torch.tensor([1.0, NAN, 0.0, 0.0])
        advantages, group_std = group_advantages(rewards, 4, eps=0.0)
        std = math.sqrt(2) / 3
        assert group_std.tolist() == pytest.approx([std])
        assert advantages.tolist() == pytest.approx([(2 / 3) / std, 0.0, (-1 / 3) / std, (-1 / 3) / std])

    def test_group_with_a_single_valid_reward_is_zero(self) -> None:
        advantages, group_std = group_advantages(torch.tensor([NAN, 3.0, NAN, NAN]), 2)
        assert advantages.tolist() == [0.0, 0.0, 0.0, 0.0]
        assert group_std.tolist() == [0.0, 0.0]

    def test_unbiased_std(self) -> None:
        # [1, 0, 0]: mean 1/3, unbiased variance ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3.
        advantages, group_std = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, std="unbiased")
        std = math.sqrt(1 / 3)
        assert group_std.tolist() == pytest.approx([std])
        assert advantages.tolist() == pytest.approx([x / (std + 1e-4) for x in (2 / 3, -1 / 3, -1 / 3)])


class TestBatchAndNoneScale:
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0, 2.0, 4.0])  # groups of 2: means 0.5, 3, 3

    def test_batch_scale_uses_group_mean_and_one_batch_std(self) -> None:
        # Batch mean 13/6; population variance = mean(r^2) - mean^2 = 39/6 - (13/6)^2 = 65/36.
        batch_std = math.sqrt(65 / 36)
        advantages, group_std = group_advantages(self.rewards, 2, scale="batch")
        expected = [0.5, -0.5, 0.0, 0.0, -1.0, 1.0]
        assert advantages.tolist() == pytest.approx([e / (batch_std + 1e-4) for e in expected])
        assert group_std.tolist() == pytest.approx([0.5, 0.0, 1.0])

    def test_batch_scale_unbiased(self) -> None:
        batch_std = math.sqrt(65 / 36 * 6 / 5)
        advantages, _ = group_advantages(self.rewards, 2, scale="batch", std="unbiased")
        expected = [0.5, -0.5, 0.0, 0.0, -1.0, 1.0]
        assert advantages.tolist() == pytest.approx([e / (batch_std + 1e-4) for e in expected])

    def test_none_scale_only_centres(self) -> None:
        advantages, _ = group_advantages(self.rewards, 2, scale="none")
        assert advantages.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, -1.0, 1.0])

    def test_zero_spread_group_is_zero_in_every_scale(self) -> None:
        rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.0])
        for scale in ("group", "batch", "none"):
            advantages, _ = group_advantages(rewards, 3, scale=scale)  # type: ignore[arg-type]
            assert advantages[:3].tolist() == [0.0, 0.0, 0.0], scale


class TestNormalizeThenSum:
    """GDPO (TRL's multi_objective_aggregation="normalize_then_sum"), with TRL's unbiased std."""

    # Two sources, groups of 2; source 2 has weight 0.5.
    first = [1.0, 0.0, 1.0, 1.0]
    second = [0.0, 4.0, 2.0, 0.0]

    @staticmethod
    def normalised(pair: list[float]) -> list[float]:
        mean, std = statistics.mean(pair), statistics.stdev(pair)
        return [0.0, 0.0] if std == 0 else [(x - mean) / (std + 1e-4) for x in pair]

    def test_each_source_per_group_then_the_sum_over_the_batch(self) -> None:
        s1 = self.normalised(self.first[:2]) + self.normalised(self.first[2:])
        s2 = self.normalised(self.second[:2]) + self.normalised(self.second[2:])
        summed = [a + 0.5 * b for a, b in zip(s1, s2, strict=True)]
        mean, std = statistics.mean(summed), statistics.stdev(summed)
        expected = [(x - mean) / (std + 1e-4) for x in summed]
        rewards = torch.tensor([self.first, self.second]).T  # (N, F)
        advantages = decoupled_advantages(rewards, torch.tensor([1.0, 0.5]), 2, std="unbiased")
        assert advantages.tolist() == pytest.approx(expected, rel=1e-5)
        # Completion 0 wins on the first source by 1 and loses on the second by 4 x 0.5 = 2: summing
        # first ranks it below its sibling; normalising each source first ranks it above.
        assert advantages[0] > 0
        totals = torch.tensor([a + 0.5 * b for a, b in zip(self.first, self.second, strict=True)])
        assert group_advantages(totals, 2, std="unbiased")[0][0] < 0

    def test_abstentions(self) -> None:
        # Completion 2: every source abstained -> 0, left out of the batch statistics. A source with a
        # single valid value in a group carries no signal there.
        rewards = torch.tensor([[1.0, 0.0], [0.0, NAN], [NAN, NAN], [1.0, 3.0]])
        advantages = decoupled_advantages(rewards, torch.tensor([1.0, 1.0]), 2, std="unbiased")
        summed = self.normalised([1.0, 0.0]) + [0.0]  # completions 0, 1, 3; source 2 contributes 0 everywhere
        mean, std = statistics.mean(summed), statistics.stdev(summed)
        expected = [(x - mean) / (std + 1e-4) for x in summed]
        assert advantages.tolist() == pytest.approx([expected[0], expected[1], 0.0, expected[2]], rel=1e-5)

    def test_groups_outside_the_batch_leave_its_statistics_alone(self) -> None:
        # A third group (a dynamic-sampling filler) with spread on each source but outside the batch:
        # the first two groups get exactly the advantages they get alone, the filler 0.
        rewards = torch.tensor([self.first, self.second]).T  # (4, 2)
        filler = torch.tensor([[5.0, 0.0], [0.0, 9.0]])
        alone = decoupled_advantages(rewards, torch.tensor([1.0, 0.5]), 2, std="unbiased")
        with_filler = decoupled_advantages(
            torch.cat([rewards, filler]), torch.tensor([1.0, 0.5]), 2, std="unbiased",
            in_batch=torch.tensor([True, True, False]),
        )
        assert with_filler.tolist() == pytest.approx(alone.tolist() + [0.0, 0.0], rel=1e-6)

    def test_shapes_are_checked(self) -> None:
        with pytest.raises(ValueError, match="weights"):
            decoupled_advantages(torch.zeros(4, 2), torch.ones(3), 2)
        with pytest.raises(ValueError, match="one flag per group"):
            decoupled_advantages(torch.zeros(4, 2), torch.ones(2), 2, in_batch=torch.ones(4, dtype=torch.bool))


class TestGroupsOutsideTheBatch:
    def test_batch_std_counts_only_the_batchs_groups(self) -> None:
        # Groups of 2: [0, 2] is in the batch, the flat filler [5, 5] is not (it would lower the std).
        advantages, _ = group_advantages(
            torch.tensor([0.0, 2.0, 5.0, 5.0]), 2, scale="batch", std="unbiased", in_batch=torch.tensor([True, False])
        )
        std = statistics.stdev([0.0, 2.0])
        assert advantages.tolist() == pytest.approx([-1 / (std + 1e-4), 1 / (std + 1e-4), 0.0, 0.0], rel=1e-6)

    def test_a_group_outside_the_batch_gets_zero(self) -> None:
        advantages, group_std = group_advantages(torch.tensor([0.0, 2.0, 1.0, 3.0]), 2, in_batch=torch.tensor([False, True]))
        assert advantages[:2].tolist() == [0.0, 0.0]
        assert advantages[2:].tolist() == pytest.approx([-1 / (1 + 1e-4), 1 / (1 + 1e-4)])
        assert group_std.tolist() == [1.0, 1.0]  # the metric still describes every group


class TestValidation:
    def test_rewards_not_divisible_by_group(self) -> None:
        with pytest.raises(ValueError, match="groups of 4"):
            group_advantages(torch.zeros(6), 4)

    def test_rewards_must_be_one_dimensional(self) -> None:
        with pytest.raises(ValueError, match="1-D"):
            group_advantages(torch.zeros(2, 4), 4)

    def test_bad_scale_is_named(self) -> None:
        with pytest.raises(ValueError, match="scale"):
            group_advantages(torch.zeros(4), 2, scale="global")  # type: ignore[arg-type]

    def test_dtype_is_preserved(self) -> None:
        advantages, group_std = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float32), 2)
        assert advantages.dtype == torch.float32 and group_std.dtype == torch.float32


class TestZeroSpreadGuard:
    """The exact-zero guard for groups whose rewards are all equal, in float64 and in the trainer's float32.

    In float64, 0.1 + 0.1 + 0.1 = 0.30000000000000004, so the mean is not 0.1 and (r - mean) / eps would be
    about -1.4e-13 without the guard. For float32 rewards (what the trainer passes) the float64 mean of equal
    values is exact, so there the guard must simply not disturb the result, nor a nearly-zero spread.
    """

    @pytest.mark.parametrize("scale", ["group", "batch", "none"])
    def test_equal_float64_rewards_give_exactly_zero(self, scale: str) -> None:
        rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.5], dtype=torch.float64)
        assert (rewards[:3].mean() - rewards[0]).item() != 0.0  # the residue the guard exists for
        advantages, group_std = group_advantages(rewards, 3, scale=scale)  # type: ignore[arg-type]
        assert advantages.dtype == torch.float64
        assert advantages[:3].tolist() == [0.0, 0.0, 0.0]
        assert group_std[0].item() == 0.0 and group_std[1].item() > 0

    def test_equal_float64_rewards_with_an_abstention(self) -> None:
        rewards = torch.tensor([0.7, NAN, 0.7, 0.7, 0.1, 0.1, 0.1, 0.1], dtype=torch.float64)
        advantages, group_std = group_advantages(rewards, 4, eps=1e-12)
        assert advantages.tolist() == [0.0] * 8
        assert group_std.tolist() == [0.0, 0.0]

    def test_equal_float32_rewards_give_exactly_zero(self) -> None:
        rewards = torch.tensor([0.1] * 8 + [0.3, 0.3, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9], dtype=torch.float32)
        advantages, group_std = group_advantages(rewards, 8, eps=1e-12)
        assert advantages.dtype == torch.float32
        assert advantages[:8].tolist() == [0.0] * 8 and group_std[0].item() == 0.0
        assert all(a != 0.0 for a in advantages[8:].tolist())

    def test_nearly_zero_float32_spread_is_kept_and_bounded(self) -> None:
        # One ulp apart: a real (tiny) difference, not a flat group; eps keeps the advantage small.
        one = torch.tensor(1.0, dtype=torch.float32)
        above = torch.nextafter(one, torch.tensor(2.0, dtype=torch.float32))
        rewards = torch.stack([one, above, one, above])
        advantages, group_std = group_advantages(rewards, 4)
        spread = (above - one).double().item()
        assert group_std[0].item() == pytest.approx(spread / 2, rel=1e-3)
        expected = (spread / 2) / (spread / 2 + 1e-4)
        assert advantages.tolist() == pytest.approx([-expected, expected, -expected, expected], rel=1e-3)
        assert 0 < abs(advantages[0].item()) < 1e-3
