"""The `hf` backend: the model as transformers builds it, through its module forward.

Every causal LM transformers loads (plain or peft LoRA), on any device: log-probs through the module forward
(`worker.grpo.logprobs.module_logprobs`, the LM head chunked over the vocabulary), sampling through the model's
own forward with a KV cache (or a vLLM engine), and the loss's plain `backward()`. The phases run one after
another; the only overlap is the one any device gains from, the policy's first forward while a reward
endpoint is still answering.

`worker.grpo.backends.fused.FusedBackend` derives from this class and changes how the same phases run on a
small CPU; the trainer sees only the methods defined here.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from contract.config import GRPOConfig
from worker.grpo.batch import HalfForward
from worker.grpo.concurrency import StepLanes, completed
from worker.grpo.distributed import Parallel
from worker.grpo.loss import LossSettings
from worker.grpo.modeling import ModelBundle, iter_chunks
from worker.grpo.rollout import NativeRollout, Rollout
from worker.grpo.vllm_rollout import VLLMRollout
from worker.grpo.vllm_server import VLLMServerRollout

T = TypeVar("T")
EarlyForward = tuple[slice, tuple[Tensor, Tensor | None]]  # (rows, (log-probs, entropy)) of the first mini-batch


@dataclass
class Forwards:
    """What a step's optimisation starts from, besides the rollout: the reference log-probs (maybe still
    being computed), the old ones (mu > 1), and the first mini-batch's policy forward if it already ran."""

    reference: Future[Tensor] | None  # (N, C), None when beta == 0
    old_logps: Tensor | None  # (N, C), None when mu == 1
    early: EarlyForward | None = None
    halves: list[HalfForward] | None = None  # the early forward's halves (fused backend)


class ModuleBackend:
    """What the trainer asks of the model, through the module forward. A context manager for one `train()`
    run (the reward loop's thread lives that long)."""

    name = "hf"

    def __init__(
        self, models: ModelBundle, parallel: Parallel, config: GRPOConfig, loss_settings: LossSettings, output_dir: Path
    ) -> None:
        self.models = models
        self.parallel = parallel
        self.config = config
        self.loss_settings = loss_settings
        self.lanes = StepLanes(models.policy.device, side=self.uses_side_lane)
        # Built from the weights already loaded (a checkpoint's when resuming); closed with the backend.
        engine = VLLMServerRollout if config.vllm_mode == "server" else VLLMRollout
        self.rollouts: NativeRollout | VLLMRollout = (
            engine(models, config, output_dir, parallel)
            if config.use_vllm
            else NativeRollout(models.policy, models.tokenizer, config, fast=models.fast, lockstep=parallel.lockstep)
        )

    uses_side_lane = False

    def __enter__(self) -> ModuleBackend:
        self.lanes.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.lanes.__exit__(None, None, None)
        finally:
            self.rollouts.close()

    # --- rollout and rewards -------------------------------------------------------------------

    def generate(self, prompts: list[str], seeds: list[int]) -> Rollout:
        """G samples of each prompt, seeded per group: from this rank's vLLM engine (no collective), or through
        the policy (with fsdp as a forward of the sharded root)."""
        if isinstance(self.rollouts, VLLMRollout):
            return self.rollouts.generate(prompts, generator_seed=seeds)
        return self.parallel.run_policy(
            lambda: self.rollouts.generate(prompts, generator_seed=seeds, side=self.lanes.side)
        )

    def continue_sequences(
        self, sequences: list[list[int]], budgets: list[int], seeds: list[int]
    ) -> list[tuple[list[int], list[float] | None]]:
        """One continuation of each token sequence, seeded per row (multi-turn rollouts' turns), from the engine
        that samples: vLLM (with its log-probs) or the policy."""
        if isinstance(self.rollouts, VLLMRollout):
            return self.rollouts.continue_sequences(sequences, budgets, seeds)
        rollouts = self.rollouts
        return self.parallel.run_policy(lambda: rollouts.continue_sequences(sequences, budgets, seeds))

    def score(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run a reward coroutine on the reward loop while torch works here."""
        return self.lanes.score(coro)

    def sync_weights(self) -> None:
        """The generation engine samples from the updated policy next (vLLM); nothing for the native one."""
        self.rollouts.sync_weights()

    # --- log-probs ------------------------------------------------------------------------------

    def mini_batches(self, total: int) -> list[slice]:
        """This rank's share of each global mini-batch: every rank makes the same number of passes."""
        size = (self.config.mini_batch_size or 0) // self.parallel.ranks.world_size
        return list(iter_chunks(total, size or total))

    def start_forwards(self, rollout: Rollout, timings: dict[str, float]) -> Forwards:
        """The reference and old log-probs of `rollout`, before its optimisation."""
        reference = None if self.config.beta == 0 else completed(self.reference_logps(rollout))
        return Forwards(reference, self.old_logps(rollout, reference))

    def forward_while_scoring(
        self, forwards: Forwards, rollout: Rollout, pending: Future[Any], timings: dict[str, float]
    ) -> None:
        """The first mini-batch's policy forward needs no rewards: while they are still being scored (a remote
        endpoint's latency), run it. Not with fsdp, whose forward is collective: every rank must run it at the
        same point."""
        if forwards.early is not None or pending.done() or not self.parallel.local_forward:
            return
        started = time.perf_counter()
        rows = self.mini_batches(rollout.completion_ids.shape[0])[0]
        forwards.early = (rows, self.policy_forward(rollout, rows, forwards.reference, iteration=0))
        timings["time/train_s"] = time.perf_counter() - started

    @torch.no_grad()
    def reference_logps(self, rollout: Rollout) -> Tensor:
        """(N, C) log-probs of the completions under the reference policy."""
        completion_length = rollout.completion_ids.shape[1]
        return torch.cat([
            self.parallel.reference_logps(
                rollout.input_ids[rows], rollout.attention_mask[rows], completion_length,
                temperature=self.config.temperature,
            )
            for rows in self.mini_batches(rollout.completion_ids.shape[0])
        ])

    @torch.no_grad()
    def old_logps(self, rollout: Rollout, reference: Future[Tensor] | None) -> Tensor | None:
        """(N, C) log-probs of the policy before this step's updates, needed when mu > 1."""
        if self.config.num_iterations == 1:
            return None
        with self.lanes.own_core_while(reference):
            return torch.cat([
                self.parallel.completion_logprobs(
                    rollout.input_ids[rows], rollout.attention_mask[rows], rollout.completion_ids.shape[1],
                    temperature=self.config.temperature,
                )[0]
                for rows in self.mini_batches(rollout.completion_ids.shape[0])
            ])

    def policy_forward(
        self, rollout: Rollout, rows: slice, reference: Future[Tensor] | None, iteration: int
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs (B, C) of mini-batch `rows` under the policy, with gradient, and their entropy."""
        return self._policy_forward(rollout, rows, reference, iteration)

    def _policy_forward(
        self, rollout: Rollout, rows: slice, reference: Future[Tensor] | None, iteration: int, **extra: Any
    ) -> tuple[Tensor, Tensor | None]:
        # The last mini-batch's backward ends the update: with DDP, gradients are averaged in it.
        last = rows == self.mini_batches(rollout.completion_ids.shape[0])[-1]
        with self.lanes.own_core_while(reference):
            return self.parallel.completion_logprobs(
                rollout.input_ids[rows],
                rollout.attention_mask[rows],
                rollout.completion_ids.shape[1],
                temperature=self.config.temperature,
                with_entropy=iteration == 0 or self.loss_settings.needs_entropy,
                entropy_grad=self.config.entropy_bonus,
                sync=last,
                **extra,
            )  # (B, C)

    # --- backward -------------------------------------------------------------------------------

    def backward(self, loss: Tensor, halves: list[HalfForward] | None) -> None:
        """Gradients of this mini-batch's share of the loss into the trainable parameters."""
        loss.backward()
