"""Asynchronous GRPO: a producer thread generates and scores the next steps' batches while the trainer trains.

The trainer (worker.grpo.trainer) asks `RolloutProducer.take(step)` for each step's batch instead of generating
it. Behind it:

- **the sampler** (`Sampler`): the engine the producer samples from, with the policy version its weights hold
  (optimiser steps applied). Native generation samples from `PolicyCopy`, a copy of the policy's weights (the
  trainer's own are being updated meanwhile); vLLM samples from its engine (`EngineSampler`). The trainer pushes
  the policy's weights in every `weight_sync_steps` steps, under the sampler's lock, so a push never lands in the
  middle of a generation.
- **the producer** (`RolloutProducer`): one thread that, step after step, draws the prompts, generates from the
  sampler and hands the rewards to the reward loop (`Scored` arrives as a future), then queues the batch. It
  holds a step's generation back until the sampler is fresh enough: batch t is sampled by version v only if
  (t - 1) - v <= max_staleness, the trainer's version at step t being t - 1. So generation of step t + 1 runs
  while step t's rewards are still being scored and while step t trains; on one CPU the gain is the waits
  (remote reward endpoints, environments) overlapped with training.
- **bounded ahead**: at most `GRPOConfig.steps_ahead` batches wait generated but untrained (max_inflight_tasks).

Correctness rules:
- Every batch records the version that sampled it; `take` refuses (drops, counts and regenerates) a batch whose
  staleness exceeds max_staleness. The hold-back makes that the exception, kept as a guard.
- Seeds are per (run, step, group) as in the synchronous trainer, and the producer draws prompts in step order,
  so max_staleness 0 reproduces the synchronous trainer exactly (the producer then waits for each push).
- A checkpoint records the prompt cursor of the last *trained* batch (`Produced.cursor`), not the producer's: a
  resume regenerates the batches that were in flight.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from contract.config import GRPOConfig
from worker.grpo.batch import Generated, Scored
from worker.grpo.logprobs import completion_logprobs
from worker.grpo.modeling import ModelBundle
from worker.grpo.rollout import NativeRollout, Rollout


class Sampler(Protocol):
    """The engine asynchronous generation samples from. `version`: optimiser steps applied to its weights;
    `lock`: held while it generates or takes new weights."""

    version: int
    lock: threading.Lock
    # Samples through the policy's own code: a batch it sampled with the trainer's current weights is on-policy
    # exactly (no correction), as in the synchronous trainer. vLLM's kernels differ: its batches keep the correction.
    same_code: bool

    def generate(self, prompts: list[str], seeds: list[int]) -> Rollout: ...

    def push(self, version: int) -> None: ...

    def score(self, rollout: Rollout, rows: slice) -> Tensor: ...


class PolicyCopy:
    """Native generation's sampler: a frozen copy of the policy, sampled through the same code (and fast path)
    as the synchronous trainer's, its trainable weights copied in on each push. Holds a second copy of the
    trainable weights (with LoRA, of the adapters and a second base)."""

    same_code = True

    def __init__(self, models: ModelBundle, config: GRPOConfig, version: int) -> None:
        self.source = models.policy
        self.model = copy.deepcopy(models.policy).eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.fast = models.fast
        self.config = config
        self.rollout = NativeRollout(self.model, models.tokenizer, config, fast=models.fast)
        self.version = version
        self.lock = threading.Lock()
        # Only what training changes is copied on a push (LoRA: the adapters).
        self._pairs = [
            (mine, theirs)
            for mine, theirs in zip(self.model.parameters(), self.source.parameters(), strict=True)
            if theirs.requires_grad
        ]

    def generate(self, prompts: list[str], seeds: list[int]) -> Rollout:
        # With the log-probs of the weights that sampled, from the decoding: a stale batch's pi_old (the trainer
        # no longer holds those weights).
        return self.rollout.generate(prompts, generator_seed=seeds, with_logprobs=True)

    @torch.no_grad()
    def push(self, version: int) -> None:
        for mine, theirs in self._pairs:
            mine.copy_(theirs)
        self.version = version

    @torch.no_grad()
    def score(self, rollout: Rollout, rows: slice) -> Tensor:
        """(B, C) log-probs of `rows`' completions under this copy's weights (raw logits), 0 after EOS."""
        logps, _ = completion_logprobs(
            self.model, rollout.input_ids[rows], rollout.attention_mask[rows], rollout.completion_ids.shape[1],
            temperature=1.0, fast=self.fast,
        )
        return logps * rollout.completion_mask[rows]


class EngineSampler:
    """vLLM's engine as the asynchronous sampler: it already holds its own weights; a push is its weight sync."""

    same_code = False

    def __init__(self, generate: Callable[[list[str], list[int]], Rollout], sync: Callable[[], None],
                 score: Callable[[Rollout, slice], Tensor], version: int) -> None:
        self._generate, self._sync, self._score = generate, sync, score
        self.version = version
        self.lock = threading.Lock()

    def generate(self, prompts: list[str], seeds: list[int]) -> Rollout:
        return self._generate(prompts, seeds)

    def push(self, version: int) -> None:
        self._sync()
        self.version = version

    def score(self, rollout: Rollout, rows: slice) -> Tensor:
        return self._score(rollout, rows)


@dataclass
class Produced:
    """One step's batch as the producer hands it over."""

    step: int
    version: int  # policy version of the weights that sampled it
    generated: Generated
    scored: Future[Scored]
    cursor_before: dict[str, int]  # the prompt sampler's state before this batch's prompts were drawn
    cursor: dict[str, int]  # and after
    timings: dict[str, float] = field(default_factory=dict)  # time/generate_s, time/reward_s (filled when scored)


class RolloutProducer:
    """The producer thread and its bounded queue; see the module docstring for the rules."""

    def __init__(
        self,
        make: Callable[[int], Produced],
        sampler: Sampler,
        *,
        first_step: int,
        last_step: int,
        max_staleness: int,
        steps_ahead: int,
        rewind: Callable[[dict[str, int]], None],
    ) -> None:
        """`make(step)`: draw, generate (under the sampler's lock) and start scoring step's batch; `rewind(cursor)`:
        put the prompt sampler back to a cursor (a dropped batch's prompts are drawn again)."""
        self._make, self.sampler = make, sampler
        self._last, self._max_staleness, self._ahead = last_step, max_staleness, steps_ahead
        self._rewind = rewind
        self._cond = threading.Condition()
        self._queue: deque[Produced] = deque()
        self._next = first_step
        self._epoch = 0  # bumped when the queue is thrown away: batches made before are discarded
        self._rewind_to: dict[str, int] | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self.dropped = 0  # batches dropped for staleness
        self.busy_s = 0.0  # seconds spent generating, since the trainer last read it
        self._thread = threading.Thread(target=self._run, name="grpo-producer", daemon=True)

    def __enter__(self) -> RolloutProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop after the generation in progress; batches not yet trained are dropped with the run."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # --- the trainer's side ----------------------------------------------------------------------

    def take(self, step: int) -> Produced:
        """Step `step`'s batch, waiting for it; never one whose staleness exceeds max_staleness."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._error is not None)
                if not self._queue:  # batches made before the producer failed are still trained
                    assert self._error is not None
                    raise self._error
                item = self._queue.popleft()
                self._cond.notify_all()
            if item.step != step:
                raise RuntimeError(f"the producer sent step {item.step}'s batch for step {step}")
            if (step - 1) - item.version <= self._max_staleness:
                return item
            self._drop_and_regenerate(item)

    def pushed(self) -> None:
        """The sampler holds newer weights: held-back generation may go on."""
        with self._cond:
            self._cond.notify_all()

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def take_busy(self) -> float:
        """Seconds the producer spent generating since the last call."""
        with self._cond:
            busy, self.busy_s = self.busy_s, 0.0
            return busy

    def _drop_and_regenerate(self, item: Produced) -> None:
        """Throw `item` and every batch after it away, and make them again from `item`'s prompts on."""
        with self._cond:
            self.dropped += 1 + len(self._queue)
            self._queue.clear()
            self._epoch += 1
            self._next = item.step
            self._rewind_to = item.cursor_before  # applied by the producer thread, the only one drawing prompts
            self._cond.notify_all()

    # --- the producer's side ---------------------------------------------------------------------

    def _ready(self, step: int) -> bool:
        """Whether to make `step`'s batch now: there is room ahead and the sampler is fresh enough for it. Past the
        last step the thread waits too (a drop may still send it back) until close() stops it."""
        fresh = (step - 1) - self.sampler.version <= self._max_staleness
        return self._stopped or (step <= self._last and len(self._queue) < self._ahead and fresh)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._ready(self._next))
                    if self._stopped:
                        return
                    if self._rewind_to is not None:
                        self._rewind(self._rewind_to)
                        self._rewind_to = None
                    step, epoch = self._next, self._epoch
                    self._next += 1
                started = time.perf_counter()
                item = self._make(step)
                with self._cond:
                    self.busy_s += time.perf_counter() - started
                    if epoch == self._epoch:
                        self._queue.append(item)
                    self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001  # handed to the trainer, which raises it
            with self._cond:
                self._error = error
                self._cond.notify_all()


def staleness_metrics(version: int, step: int, producer: RolloutProducer, waited_s: float,
                      step_s: float) -> dict[str, float]:
    """async/*: the staleness of the step's batch (sampled by `version`; mean and max over its samples, which
    share it: TRL's names), drops so far, queue depth, busy fractions."""
    staleness = float((step - 1) - version)
    return {
        "async/staleness_mean": staleness,
        "async/staleness_max": staleness,
        "async/dropped": float(producer.dropped),
        "async/queue_depth": float(producer.queued()),
        "async/producer_busy": min(1.0, producer.take_busy() / max(step_s, 1e-9)),
        "async/trainer_busy": max(0.0, 1.0 - waited_s / max(step_s, 1e-9)),
    }

