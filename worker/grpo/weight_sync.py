"""Weight sync to the sampling engine, and its self-check: does the sampler really hold the policy's weights?

Where the policy does not sample itself (a vLLM engine, or asynchronous generation's copy of the policy), its
updated weights are pushed into that engine: after every optimiser step, or every `weight_sync_steps` with
async generation, always under the engine's lock so that a push never lands in the middle of a generation.

A sampler left on old weights (a push that never landed, a LoRA the engine ignored, a sleeping engine woken
with its old weights) trains silently on the wrong distribution. Right after a push, the sampler and the policy
hold the same weights, so they give the same log-probs to the same tokens up to kernel rounding; a stale sampler
gives the log-probs of the weights it kept. Every `sync_check_every` steps, right after a push, the check scores
a few sequences the step just trained on both ways, from the raw logits (temperature 1: vLLM's prompt log-probs
are raw), and reports the mean absolute gap per completion token as `sync/logprob_gap`; `worker.grpo.health`
raises `stale_sampler` above `health.sync_logprob_gap_max`.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from contract.config import GRPOConfig
from worker.grpo.async_rollout import Sampler
from worker.grpo.distributed import Parallel
from worker.grpo.rollout import Rollout


class WeightSync:
    """Pushes and checks for one run; `engine` None: the policy samples itself (nothing to push or check)."""

    def __init__(self, engine: Sampler | None, config: GRPOConfig, parallel: Parallel, step: int) -> None:
        self.engine, self.config, self.parallel = engine, config, parallel
        self.every = 1 if not config.async_generation else config.weight_sync_steps
        self._pushed_at = step  # the step after which the engine last took the policy's weights
        self._next_check = step + (config.sync_check_every or 0)

    def push(self, step: int, timings: dict[str, float]) -> bool:
        """After step `step`'s update: push the policy's weights if due; whether it did."""
        if self.engine is None or step % self.every:
            return False
        started = time.perf_counter()
        with self.engine.lock:
            self.engine.push(step)
        self._pushed_at = step
        timings["time/weight_sync_s"] = time.perf_counter() - started
        return True

    def check(self, step: int, rollout: Rollout) -> dict[str, float]:
        """sync/logprob_gap, when a check is due and the engine took the weights at this step (on every rank:
        the policy's forward may be a collective)."""
        every = self.config.sync_check_every
        if self.engine is None or not every or self._pushed_at != step or step < self._next_check:
            return {}
        self._next_check = step + every
        rows = slice(0, self.config.sync_check_samples)
        with self.engine.lock:
            sampler = self.engine.score(rollout, rows)
        with torch.no_grad():
            policy, _ = self.parallel.completion_logprobs(
                rollout.input_ids[rows], rollout.attention_mask[rows], rollout.completion_ids.shape[1],
                temperature=1.0,
            )
        total, count = self.parallel.sum(list(logprob_gap(policy, sampler, rollout.policy_mask[rows])))
        return {"sync/logprob_gap": total / max(count, 1.0)}


@torch.no_grad()
def logprob_gap(policy_logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> tuple[float, float]:
    """(sum of |policy - sampler| over the completion tokens, their count): summed so ranks can add them."""
    keep = mask.bool()
    gap = (policy_logps.float() - sampler_logps.float()).abs()[keep]
    gap = gap[~torch.isnan(gap)]
    return float(gap.sum()), float(gap.numel())
