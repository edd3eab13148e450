"""Fenced progress reports of one attempt: metrics, samples, events, checkpoints and the final state.

Thin wrappers over the jobs domain (service.jobs.progress), each in its own transaction that starts with
the lease fence (service.execution.lease.fence), retried through transient database errors. A write refused because
a newer attempt owns the job raises `LeaseLost`; the runner then stops without touching anything else.

Retried writes are idempotent: a step's metrics and usage replace that step's earlier rows, samples of a step are
replaced, a checkpoint is keyed by an id chosen before the upload.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from service.checkpoints.models import Checkpoint
from service.checkpoints.service import new_checkpoint_id
from service.evaluations import progress as evaluation_progress
from service.evaluations import scheduled
from service.evaluations.progress import EvaluationItemIn
from service.execution import repository
from service.execution.lease import OWNED_STATES, Claim, LeaseLost, fenced_write
from service.execution.repository import JobControl
from service.jobs import progress
from service.jobs import repository as jobs_repository
from service.jobs.schemas import SampleIn
from service.jobs.states import JobStatus
from service.kit.db import session_scope
from service.kit.queue import get_job_queue
from service.storage import get_storage
from service.usage import service as usage_service
from service.usage.budget import BUDGET_EXHAUSTED, Exhausted
from service.usage.service import StepUsageIn

# The values of the reports, named here so that the worker needs nothing else of the service to make them.
__all__ = [
    "OWNED_STATES",
    "Exhausted",
    "JobControl",
    "JobStatus",
    "SampleIn",
    "EvaluationItemIn",
    "StepUsageIn",
    "finish",
    "finish_evaluation",
    "finite_metrics",
    "new_checkpoint_id",
    "pause_for_budget",
    "read_control",
    "record_evaluation_batch",
    "record_checkpoint",
    "record_event",
    "record_step",
    "set_total_steps",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


def _fenced(claim: Claim, work: Callable[[Session], T]) -> T:
    try:
        return fenced_write(claim, work)
    except progress.StaleAttempt as exc:
        raise LeaseLost(claim.job_id, claim.attempt) from exc


def finite_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Drop NaN/inf values (a zero-spread group's std...): the metrics store and JSON hold finite numbers."""
    return {name: float(value) for name, value in metrics.items() if math.isfinite(float(value))}


def record_step(
    claim: Claim,
    step: int,
    metrics: Mapping[str, float],
    samples: Sequence[SampleIn],
    usage: StepUsageIn | None = None,
) -> Exhausted | None:
    """One training step's metrics, logged samples and usage, atomically. Returns the budget the job has
    reached with this step, if any (service.usage.budget)."""
    values = finite_metrics(metrics)

    def work(session: Session) -> Exhausted | None:
        progress.record_metrics(session, claim.job_id, claim.attempt, step, values)
        repository.delete_step_samples(session, claim.job_id, step)
        if samples:
            progress.record_samples(session, claim.job_id, claim.attempt, step, samples)
        if usage is None:
            return None
        job = jobs_repository.get_job_any_tenant(session, claim.job_id)  # loaded and locked by record_metrics
        assert job is not None
        return usage_service.record_step(session, job, step, claim.attempt, usage)

    return _fenced(claim, work)


def record_evaluation_batch(
    claim: Claim,
    step: int,
    items: Sequence[EvaluationItemIn],
    metrics: Mapping[str, float],
    usage: StepUsageIn,
) -> Exhausted | None:
    """One batch of an evaluation, atomically: its items, progress (`step`: the items recorded so far, where the
    next attempt continues), metrics and usage. Returns the budget the job has reached with it, if any."""
    values = finite_metrics(metrics)

    def work(session: Session) -> Exhausted | None:
        progress.record_metrics(session, claim.job_id, claim.attempt, step, values)
        evaluation_progress.record_items(session, claim.job_id, claim.attempt, step, items)
        job = jobs_repository.get_job_any_tenant(session, claim.job_id)  # loaded and locked by record_metrics
        assert job is not None
        return usage_service.record_step(session, job, step, claim.attempt, usage)

    return _fenced(claim, work)


def finish_evaluation(claim: Claim, *, reason: str) -> JobStatus:
    """Every item is recorded: store the summary and succeed; a cancel requested meanwhile wins."""

    def work(session: Session) -> JobStatus:
        target = JobStatus.succeeded
        if jobs_repository.job_status(session, claim.job_id) == JobStatus.cancelling.value:
            target = JobStatus.cancelled
        else:
            scheduled.summarize_and_report(session, claim.job_id)
        progress.worker_transition(session, claim.job_id, claim.attempt, target, reason=reason)
        return target

    return _fenced(claim, work)


def pause_for_budget(claim: Claim, reached: Exhausted, step: int) -> JobStatus:
    """Pause the job (its checkpoint of `step` is recorded) with error `budget_exhausted` naming the limit,
    and the `budget_exhausted` event (webhook `job.budget_exhausted`). A cancel requested meanwhile wins."""

    def work(session: Session) -> JobStatus:
        job = progress.load_owned_job(session, claim.job_id, claim.attempt)
        if job.status == JobStatus.cancelling.value:
            progress.worker_transition(session, job.id, claim.attempt, JobStatus.cancelled, reason="cancelled")
            return JobStatus.cancelled
        message = f"{BUDGET_EXHAUSTED} at step {step}: {reached.message}"
        progress.append_locked_event(session, job, BUDGET_EXHAUSTED, message, {"step": step, **reached.as_data()})
        progress.worker_transition(session, job.id, claim.attempt, JobStatus.paused, reason=message)
        job.error_code = BUDGET_EXHAUSTED
        job.error_message = f"{reached.message}; raise it (PATCH /v1/jobs/{job.id}) and resume the job"
        session.flush()
        return JobStatus.paused

    return _fenced(claim, work)


def record_event(claim: Claim, type_: str, message: str, data: Mapping[str, Any] | None = None) -> None:
    _fenced(claim, lambda s: progress.record_event(s, claim.job_id, claim.attempt, type_, message, data))


def set_total_steps(claim: Claim, total_steps: int) -> None:
    _fenced(claim, lambda s: progress.set_total_steps(s, claim.job_id, claim.attempt, total_steps))


def record_checkpoint(
    claim: Claim,
    *,
    checkpoint_id: str,
    step: int,
    files: Mapping[str, Mapping[str, Any]],
    metrics: Mapping[str, float] | None = None,
) -> None:
    """Register a checkpoint whose files are already uploaded under checkpoint_prefix(job, id)."""

    def work(session: Session) -> None:
        if session.get(Checkpoint, checkpoint_id) is not None:  # a retry after a lost commit reply
            return
        progress.record_checkpoint(
            session, get_storage(), claim.job_id, claim.attempt, checkpoint_id=checkpoint_id, step=step,
            files=files, metrics=None if metrics is None else finite_metrics(metrics),
        )
        session.flush()
        job = jobs_repository.get_job_any_tenant(session, claim.job_id)  # loaded and locked by record_checkpoint
        assert job is not None
        scheduled.evaluate_checkpoint(session, job, checkpoint_id, step, get_job_queue())

    _fenced(claim, work)


def finish(
    claim: Claim,
    to: JobStatus,
    *,
    reason: str,
    error_code: str | None = None,
    error_message: str | None = None,
) -> JobStatus:
    """Move the job to its final state for this attempt; returns the state actually reached.

    A cancel requested meanwhile wins: a job in `cancelling` ends `cancelled` whatever the attempt
    was about to report (unless it failed, which is kept as the more informative outcome).
    """

    def work(session: Session) -> JobStatus:
        status = jobs_repository.job_status(session, claim.job_id)
        target = to
        if status == JobStatus.cancelling.value and to is not JobStatus.failed:
            target = JobStatus.cancelled
        progress.worker_transition(
            session, claim.job_id, claim.attempt, target, reason=reason,
            error_code=error_code, error_message=error_message,
        )
        return target

    return _fenced(claim, work)


def read_control(job_id: str) -> JobControl | None:
    """The job's status, pause request and owning attempt, read without a lock; None if it is gone."""
    with session_scope() as session:
        return repository.job_control(session, job_id)
