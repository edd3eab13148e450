"""GRPOTrainer: the training loop, read top to bottom.

One step (https://arxiv.org/abs/2402.03300, algorithm 1; TRL's GRPOTrainer for the details):

    sample prompts -> generate G completions each -> score them (async) while the frozen
    old/reference log-probs are computed -> group-relative advantages -> mu optimisation passes
    over mini-batches (gradient accumulation, clip, AdamW + scheduler step per pass) -> metrics
    -> periodic eval, sample logging and checkpoint.

With async_generation the first phase is a producer thread's (`worker.grpo.async_rollout`): it samples and
scores the next steps' batches from its own engine while this step trains, and the trainer takes them in step
order, never staler than max_staleness; weights reach that engine, and are checked there, through
`worker.grpo.weight_sync`.

A "step" is one generation batch. With num_iterations = mu > 1 it makes mu optimiser updates
(each pass over the batch is one update, as in PPO); with mu = 1 (the default) one update, the
old log-probs are the detached current ones and no extra forward pass runs (as in TRL).

Model plumbing (loading, LoRA, reference, optimiser, scheduler) lives in `worker.grpo.modeling`;
everything model-shaped the loop asks for (sampling, log-probs, backward) goes through a backend,
chosen once (`worker.grpo.backends`: the module forward, or the CPU fast path); the step's data
containers and metric helpers live in `worker.grpo.batch`, checkpoint files in
`worker.grpo.checkpoint`, what changes on several devices (ranks) in `worker.grpo.distributed`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from contract.config import GRPOConfig
from worker.grpo.advantages import group_advantages, step_advantages
from worker.grpo.allocator import keep_freed_memory, return_freed_memory
from worker.grpo.async_rollout import (
    EngineSampler,
    PolicyCopy,
    Produced,
    RolloutProducer,
    Sampler,
    staleness_metrics,
)
from worker.grpo.backends import BackendName, backend_for, choose_backend
from worker.grpo.batch import (
    Generated,
    MiniBatchResult,
    Scored,
    StepBatch,
    batch_metrics,
    episode_metrics,
    loss_mask_for,
    reward_inputs,
    sample_records,
    select_groups,
)
from worker.grpo.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from worker.grpo.data import PromptRow, PromptSampler
from worker.grpo.distributed import SHARDED_DIR, Parallel, Ranks, group_seeds, main_first, share
from worker.grpo.environment import ToolEnvironment
from worker.grpo.health import Finding, HealthGuard, dominated_fraction
from worker.grpo.held_out import HeldOutEvaluation
from worker.grpo.loss import AdaptiveEntropy, LossSettings, grpo_loss
from worker.grpo.modeling import ModelBundle, build_model_bundle, seed_everything
from worker.grpo.multi_turn import MultiTurnRollout
from worker.grpo.rewards import CompositeReward, RewardResult
from worker.grpo.rollout import Rollout, render_prompt
from worker.grpo.sampling_correction import SamplingCorrection
from worker.grpo.vllm_rollout import VLLMRollout
from worker.grpo.weight_sync import WeightSync

MetricsHook = Callable[[int, dict[str, float], list[dict[str, Any]]], None]
CheckpointHook = Callable[[int, Path, dict[str, Any]], None]
HealthHook = Callable[[Finding], None]
StopHook = Callable[[], bool]


@dataclass
class TrainResult:
    """What `GRPOTrainer.train` returns."""

    step: int  # steps completed in total (including those before a resume)
    stopped: bool  # should_stop() ended the run early
    last_checkpoint: Path | None
    history: list[dict[str, float]] = field(default_factory=list)  # metrics of every step, in order
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)  # eval/* by step, 0 = the start
    findings: list[Finding] = field(default_factory=list)  # health findings, in order
    unhealthy: Finding | None = None  # the finding that stopped the run (on_unhealthy: pause)


class GRPOTrainer:
    """Trains `base_model` on `train_rows` with `reward`. Pure library: no database, queue or HTTP."""

    def __init__(
        self,
        config: GRPOConfig,
        *,
        base_model: str,
        train_rows: list[PromptRow],
        reward: CompositeReward,
        output_dir: Path,
        eval_rows: list[PromptRow] | None = None,
        retain_rows: list[PromptRow] | None = None,
        model_cache_dir: Path | None = None,
        resume_from: Path | None = None,
        on_metrics: MetricsHook | None = None,
        on_checkpoint: CheckpointHook | None = None,
        should_stop: StopHook | None = None,
        on_health: HealthHook | None = None,
        device: str | None = None,
        checkpoint_metadata: dict[str, Any] | None = None,
        ranks: Ranks | None = None,
        backend: BackendName = "auto",
        environment: ToolEnvironment | None = None,
    ) -> None:
        if not train_rows:
            raise ValueError("train_rows is empty")
        self.config = config
        self.train_rows = train_rows
        self.eval_rows = eval_rows or []
        self.retain_rows = retain_rows or []  # skills to keep: evaluated with the eval set
        self.reward = reward
        self.output_dir = Path(output_dir)
        self.on_metrics = on_metrics
        self.on_checkpoint = on_checkpoint
        self.should_stop = should_stop
        self.on_health = on_health
        self.guard = HealthGuard(config.health)
        self.findings: list[Finding] = []
        self.unhealthy: Finding | None = None
        self.checkpoint_metadata = checkpoint_metadata or {}
        self.total_steps = config.total_steps(len(train_rows))
        seed_everything(config.seed)
        ranks = ranks or Ranks()
        sharded = ranks.distributed and config.resolved_parallelism() == "fsdp"
        (return_freed_memory if sharded else keep_freed_memory)()  # allocator.py: shards, or pages reused
        checkpoint = load_checkpoint(resume_from) if resume_from is not None else None
        cache_dir = model_cache_dir or self.output_dir / "models"
        with main_first(ranks):  # rank 0 fills the shared model cache
            self.models: ModelBundle = build_model_bundle(
                base_model,
                config,
                cache_dir=cache_dir,
                total_updates=self.total_steps * config.num_iterations,
                device=device,
                resume_dir=None if checkpoint is None else checkpoint.path,
            )
        choose_backend(self.models, config, backend, sharded=sharded)
        # One process, or this rank's part of a job on several devices (hooks: rank 0 only).
        self.parallel = Parallel.wrap(self.models, ranks, config.resolved_parallelism(), config.loss_type)
        self.loss_settings = LossSettings.from_config(config)
        self.correction = SamplingCorrection.from_config(config)  # None unless another engine samples
        self.entropy_control = AdaptiveEntropy.from_config(config)
        self.sampler = PromptSampler(len(train_rows), seed=config.seed)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.evaluations: dict[int, dict[str, float]] = {}  # eval/* metrics by step (0 = before training)
        self.last_checkpoint: Path | None = None
        self._saved_step = 0  # step of the newest checkpoint written or resumed from
        if checkpoint is not None:
            self._restore(checkpoint.trainer_state, checkpoint.path)
        # After the restore: its generation engine starts from the weights just loaded. Entered by train().
        self.backend = backend_for(self.models, self.parallel, config, self.loss_settings, self.output_dir)
        self.multi_turn = None if environment is None else MultiTurnRollout.on(  # episodes, not single turns
            self.backend, self.models, config, environment, distributed=ranks.distributed)
        self.held_out = HeldOutEvaluation(config, self.models, self.parallel, reward, self.backend.score, self.multi_turn)
        if config.async_generation and ranks.distributed:
            raise ValueError("async_generation runs on one device")
        # The engine that samples when it is not the policy itself (vLLM, or async generation's copy).
        self.weight_sync = WeightSync(self._sampling_engine(), config, self.parallel, self.step)
        self.producer: RolloutProducer | None = None  # async generation, while train() runs
        self._cursor = self.sampler.state_dict()  # the prompt cursor after the last trained batch
        self._produced: Produced | None = None  # this step's batch, from the async producer

    # --- the loop ----------------------------------------------------------------------------

    def train(self) -> TrainResult:
        """Run until total_steps (or should_stop()); saves a checkpoint at the end either way."""
        stopped = False
        with self.backend, self._producer():
            if self.step == 0 and self._evaluates():
                # The starting point, so every later eval has something to be compared with.
                self._report_eval(0, self._evaluate(0))
            while self.step < self.total_steps and self.unhealthy is None:
                if self.parallel.from_main(self.should_stop is not None and self.should_stop()):
                    stopped = True
                    break
                self._run_step()
            stopped = stopped or self.unhealthy is not None
        if self.step > self._saved_step:
            self._save()
        return TrainResult(
            self.step, stopped, self.last_checkpoint, list(self.history), dict(self.evaluations),
            list(self.findings), self.unhealthy,
        )

    def _run_step(self) -> None:
        step = self.step + 1
        started = time.perf_counter()
        timings: dict[str, float] = {}

        # ===== 1. rollout: sample prompts, generate G each, score (overlapped with frozen log-probs)
        batch = self._rollout_phase(step, timings)

        # ===== 2. optimise: mu passes over mini-batches, one optimiser update per pass
        train_started = time.perf_counter()
        train_stats = self._optimise(batch)
        timings["time/train_s"] += time.perf_counter() - train_started  # after the early forward, if any
        if self.weight_sync.push(step, timings) and self.producer is not None:
            self.producer.pushed()  # the next rollouts may sample from the updated policy
        sync_check = self.weight_sync.check(step, batch.scored.rollout)  # this rank's batch

        # ===== 3. metrics, samples, eval, checkpoint
        timings["time/step_s"] = time.perf_counter() - started
        batch = self.parallel.gather_batch(batch)  # the global batch: metrics as one process reports them
        waited = timings.pop("async/wait_s", 0.0)
        metrics = {**batch_metrics(batch), **episode_metrics(batch), **train_stats, **timings, **sync_check}
        if self.producer is not None and self._produced is not None:
            metrics["time/reward_s"] = self._produced.timings["time/reward_s"]  # scored by the producer
            metrics.update(
                staleness_metrics(self._produced.version, step, self.producer, waited, timings["time/step_s"])
            )
        generated_tokens = sum(int(s.rollout.policy_mask.sum()) for s in batch.generated)
        metrics["tokens_per_s"] = generated_tokens / max(timings["time/step_s"], 1e-9)
        # Usage counts (metered per step by the service): completion tokens of every sampling round; prompt +
        # completion tokens (no padding) through the policy's forward and backward, once per pass; completions
        # scored, once per reward source.
        metrics["usage/tokens_generated"] = float(generated_tokens)
        metrics["usage/tokens_trained"] = float(
            int(batch.scored.rollout.attention_mask.sum()) * self.config.num_iterations
        )
        metrics["usage/reward_calls"] = float(
            sum(int(s.rewards.numel()) for s in batch.generated) * len(self.reward.sources)
        )
        health = self.config.health
        metrics["groups/dominated_frac"] = dominated_fraction(
            batch.scored.rollout.completion_texts,
            batch.scored.rewards.tolist(),
            self.config.num_generations,
            health.dominance,
            health.solved_reward,
        )
        every = self.config.eval_every
        if every and self.eval_rows and (step % every == 0 or step == self.total_steps):
            self.evaluations[step] = self._evaluate(step)
            metrics.update(self.evaluations[step])
        metrics = self.parallel.from_main(metrics)  # rank 0's timings: every rank decides on the same values
        samples = (
            sample_records(step, batch, self.config.log_completions_count, self._sampled_by_version(step))
            if step % self.config.log_completions_every == 0
            else []
        )
        self.step = step
        self.history.append(metrics)
        if self.on_metrics is not None:
            self.on_metrics(step, metrics, samples)
        self._check_health(step, metrics)
        if step % self.config.checkpoint_every == 0:
            self._save()

    # --- 1. rollout ----------------------------------------------------------------------------

    def _rollout_phase(self, step: int, timings: dict[str, float]) -> StepBatch:
        timings["time/generate_s"] = 0.0
        timings["time/reward_s"] = 0.0
        timings["time/train_s"] = 0.0
        first, pending = self._next_batch(step, timings)
        if self.config.dynamic_sampling:
            generated = self._refill(pending.result(), step, timings)
            final, in_loss = select_groups(
                generated,
                self.config.prompts_per_step,
                self.config.num_generations,
                self.models.tokenizer.pad_token_id,
            )
            forwards = self.backend.start_forwards(final.rollout, timings)
        else:
            # Rewards do not depend on the old/reference log-probs: compute them while scoring runs.
            forwards = self.backend.start_forwards(first.rollout, timings)
            self.backend.forward_while_scoring(forwards, first.rollout, pending, timings)
            final = pending.result()
            generated, in_loss = [final], torch.ones(len(final.rows), dtype=torch.bool)
        advantages = step_advantages(final.rewards, final.per_source, self.reward.sources, in_loss, self.config)
        loss_mask = loss_mask_for(
            final.rollout, in_loss, mask_truncated=self.config.mask_truncated_completions
        )
        advantages = advantages.to(loss_mask.device)
        return StepBatch(
            final, advantages, loss_mask, forwards.old_logps, forwards.reference, generated, forwards.early,
            forwards.halves,
        )

    def _next_batch(self, step: int, timings: dict[str, float]) -> tuple[Generated, Future[Scored]]:
        """This step's first generation round and its rewards (a future): generated now, or taken from the
        asynchronous producer (timings: its generation time, and the trainer's wait for it)."""
        if self.producer is None:
            first = self._generate(step, 0, self.config.prompts_per_step, timings)
            return first, self._score(first, step, timings)
        started = time.perf_counter()
        produced = self.producer.take(step)
        timings["async/wait_s"] = time.perf_counter() - started
        timings["time/generate_s"] = produced.timings["time/generate_s"]
        self._cursor, self._produced = produced.cursor, produced
        if produced.version == step - 1 and self._engine().same_code:
            produced.generated.rollout.sampler_logps = None  # sampled by the trainer's very weights: on-policy
        return produced.generated, produced.scored

    def _produce(self, step: int) -> Produced:
        """The producer's work for one step: draw, generate from the engine (under its lock), start scoring."""
        engine = self._engine()
        timings = {"time/generate_s": 0.0, "time/reward_s": 0.0}
        before = self.sampler.state_dict()
        with engine.lock:
            version = engine.version
            generated = self._generate(step, 0, self.config.prompts_per_step, timings, engine.generate)
        scored = self._score(generated, step, timings)
        return Produced(step, version, generated, scored, before, self.sampler.state_dict(), timings)

    def _generate(
        self, step: int, round_index: int, num_prompts: int, timings: dict[str, float],
        engine: Callable[[list[str], list[int]], Rollout] | None = None,
    ) -> Generated:
        started = time.perf_counter()
        indices = self.sampler.next_indices(num_prompts)  # the global batch, the same on every rank
        mine = share(len(indices), self.parallel.ranks)  # this rank's whole groups
        rows = [self.train_rows[indices[i]] for i in mine]
        # A seed per (run, step, round, group position): sampling is reproducible across resumes whatever
        # ran before, and a group samples the same tokens on any number of ranks.
        seeds = [s % (2**63) for s in group_seeds(self.config.seed, step, round_index, mine)]
        if self.multi_turn is not None:
            rollout, prompts = self.multi_turn.generate(rows, seeds)
        else:
            prompts = [render_prompt(self.models.tokenizer, row.prompt) for row in rows]
            rollout = (engine or self.backend.generate)(prompts, seeds)
        timings["time/generate_s"] += time.perf_counter() - started
        return Generated(rollout, rows, prompts)

    def _score(self, generated: Generated, step: int, timings: dict[str, float]) -> Future[Scored]:
        rollout, rows, prompts = generated.rollout, generated.rows, generated.prompts
        items = reward_inputs(rollout, rows, prompts)
        group_size = self.config.num_generations

        async def score() -> Scored:
            started = time.perf_counter()
            result: RewardResult = await self.reward.score(items, step=step)
            timings["time/reward_s"] += time.perf_counter() - started
            rewards = torch.tensor(result.total, dtype=torch.float32)  # (N,)
            _, group_std = group_advantages(rewards, group_size, std=self.config.advantage_std)
            return Scored(rollout, rows, prompts, rewards, result.per_source, group_std)

        return self.backend.score(score())

    def _refill(self, first: Scored, step: int, timings: dict[str, float]) -> list[Scored]:
        """DAPO dynamic sampling: generate more groups until prompts_per_step have reward spread (bounded)."""
        generated = [first]
        for round_index in range(1, self.config.max_resample_rounds + 1):
            useful = sum(int((s.group_std > 0).sum()) for s in generated)
            missing = self.config.prompts_per_step - useful
            if missing <= 0:
                break
            more = self._generate(step, round_index, missing, timings)
            generated.append(self._score(more, step, timings).result())
        return generated

    # --- the sampling engine, when the policy does not sample itself -----------------------------

    def _sampling_engine(self) -> Sampler | None:
        """vLLM's engine, or async generation's copy of the policy; None when the policy samples itself."""
        rollouts = self.backend.rollouts
        if isinstance(rollouts, VLLMRollout):
            return EngineSampler(self.backend.generate, self.backend.sync_weights, rollouts.score, self.step)
        return PolicyCopy(self.models, self.config, self.step) if self.config.async_generation else None

    def _sampled_by_version(self, step: int) -> int:
        """Policy version of the weights that sampled step's batch: the trainer's own (step - 1), or the producer's."""
        return step - 1 if self._produced is None else self._produced.version

    def _engine(self) -> Sampler:
        assert self.weight_sync.engine is not None  # async generation always has one
        return self.weight_sync.engine

    def _producer(self) -> AbstractContextManager[Any]:
        """Async generation's producer thread for one train() run; nothing otherwise."""
        if not self.config.async_generation:
            return nullcontext()
        self.producer = RolloutProducer(
            self._produce, self._engine(), first_step=self.step + 1, last_step=self.total_steps,
            max_staleness=self.config.max_staleness, steps_ahead=self.config.steps_ahead,
            rewind=self.sampler.load_state_dict,
        )
        return self.producer

    # --- 2. optimise ---------------------------------------------------------------------------

    def _optimise(self, batch: StepBatch) -> dict[str, float]:
        rollout = batch.scored.rollout
        slices = self.backend.mini_batches(rollout.completion_ids.shape[0])
        step_tokens = int(self.parallel.sum([float(batch.loss_mask.sum())])[0])  # over all ranks
        sums: dict[str, float] = {}
        losses: list[float] = []
        grad_norms: list[float] = []
        entropy_sums: list[float] = []
        sampled_by: list[Tensor] = []  # (B, C) per mini-batch: the trainer's log-probs of the weights that sampled
        for iteration in range(self.config.num_iterations):
            pass_loss, bonus_entropy, bonus_tokens = 0.0, 0.0, 0.0
            for rows in slices:
                result = self._backward_mini_batch(batch, rows, len(slices), step_tokens, iteration)
                pass_loss += result.loss
                bonus_entropy += result.stats.pop("entropy/bonus_sum", 0.0)
                bonus_tokens += result.stats.pop("entropy/bonus_tokens", 0.0)
                for key, value in result.stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                if result.entropy_sum is not None:
                    entropy_sums.append(result.entropy_sum)
                if result.sampled_by is not None:
                    sampled_by.append(result.sampled_by)
            grad_norms.append(self._optimizer_update())
            losses.append(pass_loss)
            if self.config.use_adaptive_entropy:
                bonus_entropy, bonus_tokens = self.parallel.sum([bonus_entropy, bonus_tokens])
                self.entropy_control.update(bonus_entropy / max(bonus_tokens, 1.0))
        passes = self.config.num_iterations * len(slices)
        metrics = {key: value / passes for key, value in sums.items()}
        metrics.pop("ratio_mean", None)
        if self.config.entropy_bonus:
            metrics["entropy_coef"] = self.entropy_control.coef  # after this step's update, as TRL logs it
        if self.config.beta == 0:
            metrics.pop("kl", None)  # no reference model: there is no KL to report
        if self.correction is not None and sampled_by:  # another engine sampled
            assert rollout.sampler_logps is not None
            metrics.update(
                self.correction.metrics(torch.cat(sampled_by), rollout.sampler_logps, rollout.policy_mask)
            )
        entropy_sum, entropy_tokens = self.parallel.sum([sum(entropy_sums), float(rollout.policy_mask.sum())])
        metrics.update(
            loss=sum(losses) / len(losses),
            grad_norm=sum(grad_norms) / len(grad_norms),
            learning_rate=self.models.optimizer.param_groups[0]["lr"],
        )
        metrics = self.parallel.merge_stats(metrics, float(batch.loss_mask.sum()))  # the global batch's
        metrics["entropy"] = entropy_sum / max(entropy_tokens, 1.0)
        return metrics

    def _backward_mini_batch(
        self, batch: StepBatch, rows: slice, num_slices: int, step_tokens: int, iteration: int
    ) -> MiniBatchResult:
        """Forward, loss and backward of one mini-batch (weighted by the sampling correction when
        another engine sampled)."""
        rollout = batch.scored.rollout
        halves = None
        if iteration == 0 and batch.early_forward is not None and batch.early_forward[0] == rows:
            logps, entropy = batch.early_forward[1]  # run while the rewards were being scored
            halves, batch.early_forward, batch.halves = batch.halves, None, None
        else:
            logps, entropy = self.backend.policy_forward(rollout, rows, batch.reference, iteration)
        is_weights, sampled_by = None, None
        if self.correction is not None and rollout.sampler_logps is not None:
            # pi_old: the weights that sampled (the detached current ones on the first pass when mu = 1).
            behaviour = logps.detach() if batch.old_logps is None else batch.old_logps[rows]
            sampled_by = behaviour if iteration == 0 else None
            is_weights = self.correction.weights(
                behaviour, rollout.sampler_logps[rows], rollout.policy_mask[rows]
            )  # (B, C), or (B, 1) per sequence
        scaled, stats = grpo_loss(
            logps,
            None if batch.old_logps is None else batch.old_logps[rows],
            None if batch.ref_logps is None else batch.ref_logps[rows],
            batch.advantages[rows],
            batch.loss_mask[rows],
            self.loss_settings,
            step_tokens=step_tokens,
            num_mini_batches=num_slices,
            entropies=entropy,
            entropy_coef=self.entropy_control.coef_to_apply(),
            is_weights=is_weights,
        )  # already this mini-batch's share of the step's loss
        scaled = scaled * self.parallel.loss_scale  # over several ranks: this rank's share of the global loss
        self.backend.backward(scaled, halves)
        entropy_sum = None
        if entropy is not None and iteration == 0:  # the entropy metric: the policy before this step's updates
            mask = rollout.policy_mask[rows]
            entropy_sum = float((entropy.detach() * mask).sum())
        return MiniBatchResult(float(scaled.detach()), stats, entropy_sum, sampled_by)

    def _optimizer_update(self) -> float:
        """Clip, step the optimiser and the scheduler; returns the pre-clip gradient norm."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        grad_norm = self.parallel.clip_gradients(max_norm)  # averaged over ranks first
        self.models.optimizer.step()
        self.models.scheduler.step()
        self.models.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # --- 3. metrics, samples, eval, checkpoint -------------------------------------------------

    def _evaluates(self) -> bool:
        return bool(self.config.eval_every and self.eval_rows)

    def _report_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation outside a training step (step 0): reported, not part of the step history."""
        self.evaluations[step] = metrics
        if self.on_metrics is not None:
            self.on_metrics(step, metrics, [])
        self._check_health(step, metrics)

    def _check_health(self, step: int, metrics: dict[str, float]) -> None:
        """Run the detectors (worker.grpo.health); with on_unhealthy=pause a warning stops the run."""
        for finding in self.guard.observe(step, metrics):
            self.findings.append(finding)
            if self.on_health is not None:
                self.on_health(finding)
            if finding.severity == "warning" and self.config.on_unhealthy == "pause" and self.unhealthy is None:
                self.unhealthy = finding

    def _evaluate(self, step: int) -> dict[str, float]:
        return self.held_out(step, self.eval_rows, self.retain_rows)

    def _save(self) -> None:
        # Sharded state first (every rank writes its shards); rank 0 then writes the checkpoint around it.
        sharded = self.parallel.save_sharded(self.output_dir / f".sharded-{self.step}")
        optimizer_state = self.parallel.optimizer_state()  # gathered from every rank when fsdp spans nodes
        # fsdp: the whole model written from every rank's shards, a layer at a time; else the policy is saved.
        model_files = self.parallel.save_consolidated(self.output_dir / f".consolidated-{self.step}")
        self._saved_step = self.step
        if not self.parallel.ranks.is_main:
            return
        state = {
            "optimizer": optimizer_state,
            "scheduler": self.models.scheduler.state_dict(),
            "rng": capture_rng_state(),
            "sampler": self._cursor if self.producer is not None else self.sampler.state_dict(),
            "policy_version": self.step,  # optimiser steps in the saved weights
            "history": self.history,
            "entropy_control": self.entropy_control.state_dict(),
        }
        path, manifest = save_checkpoint(
            self.output_dir,
            step=self.step,
            model=self.models.policy if model_files is None else None,
            model_files=model_files,
            tokenizer=self.models.tokenizer,
            config=self.config,
            trainer_state=state,
            save_total_limit=self.config.save_total_limit,
            metadata=self.checkpoint_metadata,
            extra_dirs=None if sharded is None else {SHARDED_DIR: sharded},
        )
        self.last_checkpoint = path
        self._saved_step = self.step
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.step, path, manifest)

    def _restore(self, state: dict[str, Any], path: Path) -> None:
        """Continue exactly: optimiser, scheduler, data cursor, metrics history and RNG states."""
        self.parallel.load_optimizer(state.get("optimizer"), path)
        self.models.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.history = list(state["history"])
        if self.config.use_adaptive_entropy:
            self.entropy_control.load_state_dict(state["entropy_control"])
        self.step = int(state["step"])
        self.last_checkpoint = path
        self._saved_step = self.step
        restore_rng_state(state["rng"])  # last: building the models above may have drawn random numbers

