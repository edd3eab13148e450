"""The held-out evaluation inside a training run: the eval set, and the retain set (skills to keep) under
eval/retain/, every eval_every steps and before the first (worker.grpo.evaluation names the metrics)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from contract.config import GRPOConfig
from worker.grpo.batch import reward_inputs
from worker.grpo.data import PromptRow
from worker.grpo.distributed import Parallel
from worker.grpo.evaluation import greedy_metrics, pass_at_k
from worker.grpo.modeling import ModelBundle, greedy_generate
from worker.grpo.multi_turn import MultiTurnRollout
from worker.grpo.rewards import CompositeReward
from worker.grpo.rollout import generate_rollout, render_prompt

Scorer = Callable[[Callable[[], dict[str, float]]], dict[str, float]]


class HeldOutEvaluation:
    """Greedy and sampled completions of the held-out prompts under the current policy, scored by the job's
    rewards. `score` runs a reward coroutine beside the caller (the backend's reward loop)."""

    def __init__(
        self,
        config: GRPOConfig,
        models: ModelBundle,
        parallel: Parallel,
        reward: CompositeReward,
        score: Callable[[Coroutine[Any, Any, Any]], Future[Any]],
        episodes: MultiTurnRollout | None = None,
    ) -> None:
        self.config, self.models, self.parallel, self.reward, self.score = config, models, parallel, reward, score
        self.episodes = episodes  # multi-turn jobs: G episodes per prompt instead of single completions

    def __call__(self, step: int, eval_rows: list[PromptRow], retain_rows: list[PromptRow]) -> dict[str, float]:
        """The eval set, and the retain set (skills to keep) under eval/retain/; the same metrics on every rank.
        Rank 0 alone scores (it talks to the reward endpoints). It alone generates too, unless the policy's
        forwards are collectives (fsdp): then every rank generates the same completions and joins each forward."""
        if not self.parallel.forwards_together:
            return self.parallel.on_main(lambda: self._sets(step, eval_rows, retain_rows, lambda compute: compute()))
        return self._sets(step, eval_rows, retain_rows, self.parallel.on_main)

    def _sets(
        self, step: int, eval_rows: list[PromptRow], retain_rows: list[PromptRow], scored: Scorer
    ) -> dict[str, float]:
        metrics = self._rows(eval_rows, "eval/", step, scored)
        if retain_rows:
            metrics.update(self._rows(retain_rows, "eval/retain/", step, scored))
        return metrics

    def _rows(self, all_rows: list[PromptRow], prefix: str, step: int, scored: Scorer) -> dict[str, float]:
        """The first eval_samples prompts: one greedy completion each (mean reward, accuracy) and
        G sampled ones (pass@G); see worker.grpo.evaluation for the names. `scored(compute)`: the metrics
        `compute` scores (on rank 0, its result on every rank, when every rank generates)."""
        rows = all_rows[: self.config.eval_samples]
        if self.episodes is not None:
            return scored(lambda: self._episode_metrics(rows, prefix, step))
        prompts = [render_prompt(self.models.tokenizer, row.prompt) for row in rows]
        synced = self.parallel.forwards_together
        rollout = self.parallel.run_policy(
            lambda: greedy_generate(self.models.policy, self.models.tokenizer, prompts, self.config, synced=synced)
        )

        def greedy() -> dict[str, float]:
            result = self.score(self.reward.score(reward_inputs(rollout, rows, prompts), step=step)).result()
            metrics = greedy_metrics(result.total, prefix)
            metrics.update({f"{prefix}{name}": value for name, value in result.metrics.items()})
            return metrics

        metrics = scored(greedy)
        if f"{prefix}accuracy" in metrics:  # binary reward: how often can the model answer at all?
            seed = (self.config.seed * 1_000_003 + step * 101 + 97) % (2**63)
            sampled = self.parallel.run_policy(
                lambda: generate_rollout(
                    self.models.policy, self.models.tokenizer, prompts, self.config, generator_seed=seed,
                    fast=self.models.fast, lockstep=self.parallel.lockstep,
                )
            )

            def at_k() -> dict[str, float]:
                items = reward_inputs(sampled, rows, prompts)
                total = self.score(self.reward.score(items, step=step)).result().total
                return pass_at_k(total, sampled.group_size, prefix)

            metrics.update(scored(at_k))
        return metrics

    def _episode_metrics(self, rows: list[PromptRow], prefix: str, step: int) -> dict[str, float]:
        """Multi-turn jobs: the same names over G sampled episodes per prompt (one device only): mean reward and
        accuracy over every episode, pass@G over each prompt's."""
        assert self.episodes is not None
        seed = (self.config.seed * 1_000_003 + step * 101 + 89) % (2**63)
        rollout, prompts = self.episodes.generate(rows, [(seed + i * 7_919) % (2**63) for i in range(len(rows))])
        total = self.score(self.reward.score(reward_inputs(rollout, rows, prompts), step=step)).result().total
        return {**greedy_metrics(total, prefix), **pass_at_k(total, rollout.group_size, prefix)}
