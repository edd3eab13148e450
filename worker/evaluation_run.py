"""One attempt of an evaluation (a job of kind `evaluation`, service.evaluations): the model and the rewards
set up as a job's, then the dataset's items a batch at a time (worker.grpo.evaluator), each batch reported with
its progress and usage in one fenced write, so that the next attempt continues after the last batch recorded.

The stop poll runs between batches (cancel, pause, a lost lease); a batch that reaches the job's or tenant's
budget ends the attempt (paused, `budget_exhausted`), like a training step. The outcome's states are the
runner's (worker.runner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from contract.evaluation import EvaluationSpec
from service.execution import inputs as port
from service.execution import reporting
from service.execution.lease import Claim
from service.execution.reporting import EvaluationItemIn, Exhausted, StepUsageIn
from service.execution.runtime import Settings
from worker.job_inputs import InputFetcher
from worker.model_sources import ModelUnavailable
from worker.reward_setup import build_rewards

if TYPE_CHECKING:
    from worker.grpo.evaluator import Evaluator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluationOutcome:
    items_done: int
    stopped: bool  # by the stop poll, or by a reached budget (`budget`)
    budget: tuple[Exhausted, int] | None = None


def run_evaluation(
    claim: Claim, inputs: port.JobInputs, fetcher: InputFetcher, settings: Settings, workdir: Path, *,
    device: str, should_stop: Callable[[], bool],
) -> EvaluationOutcome:
    # The engine imports torch: only the job's process may (the Celery parent forks children).
    from worker.grpo.evaluator import items_per_batch

    spec = inputs.evaluation
    assert spec is not None
    rows = fetcher.rows(inputs, workdir)[0][: spec.max_items]
    reporting.set_total_steps(claim, len(rows))
    evaluator = _evaluator(claim, inputs, spec, fetcher, settings, workdir, device)
    done, per_batch = claim.resume_step, items_per_batch(spec.samples_per_item)
    while done < len(rows):
        if should_stop():
            return EvaluationOutcome(done, stopped=True)
        batch = evaluator.run_batch(rows[done : done + per_batch], done)
        done += len(batch.items)
        items = [EvaluationItemIn(index=i.index, prompt=i.prompt, completions=i.completions, rewards=i.rewards,
                                  sources=i.sources) for i in batch.items]
        usage = StepUsageIn(
            tokens_generated=batch.tokens_generated, tokens_trained=0,
            reward_calls=sum(len(i.rewards) for i in batch.items) * len(spec.rewards),
            device_seconds=batch.seconds, completions=0, completion_capacity=0, num_iterations=1,
            parameters=evaluator.parameters(),  # completions=0: an evaluation is not a step of the job estimates
        )
        reached = reporting.record_evaluation_batch(claim, done, items, _batch_metrics(items), usage)
        if reached is not None:
            log.info("evaluation %s: %s after %d items; pausing", claim.job_id, reached.message, done)
            return EvaluationOutcome(done, stopped=True, budget=(reached, done))
    return EvaluationOutcome(done, stopped=False)


def _evaluator(claim: Claim, inputs: port.JobInputs, spec: EvaluationSpec, fetcher: InputFetcher,
               settings: Settings, workdir: Path, device: str) -> Evaluator:
    # The engine imports torch: only the job's process may (the Celery parent forks children).
    from worker.grpo.evaluator import Evaluator
    from worker.grpo.load_errors import load_failure_reason

    model = fetcher.resolve_model(inputs, "model", spec.model, workdir / "model")
    rewards = build_rewards(claim, inputs, fetcher, settings, workdir / "reward-models", device=device)
    try:
        return Evaluator(spec, model, rewards.reward, cache_dir=Path(settings.data_dir) / "models", device=device)
    except Exception as exc:
        log.exception("evaluation %s: loading model %r failed", claim.job_id, spec.model)
        raise ModelUnavailable("model_load_failed", "model", spec.model, load_failure_reason(exc, model)) from exc


def _batch_metrics(items: list[EvaluationItemIn]) -> dict[str, float]:
    """The batch's mean reward and, for 0/1 rewards, its accuracy: the evaluation's plot as it runs."""
    rewards = [r for item in items for r in item.rewards if r is not None]
    metrics = {"eval/items": float(len(items))}
    if rewards:
        metrics["eval/reward/mean"] = sum(rewards) / len(rewards)
        if all(r in (0.0, 1.0) for r in rewards):
            metrics["eval/accuracy"] = sum(rewards) / len(rewards)
    return metrics
