"""Fenced progress reports of one attempt: metrics, samples, events, checkpoints and the final state.

Thin wrappers over the jobs domain (service.jobs.progress), each in its own transaction that starts with
the lease fence (worker.lease.fence), retried through transient database errors. A write refused because
a newer attempt owns the job raises `LeaseLost`; the runner then stops without touching anything else.

Retried writes are idempotent: a step's metrics replace that step's earlier rows, samples of a step are
replaced, a checkpoint is keyed by an id chosen before the upload.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.checkpoints import service as checkpoints
from service.checkpoints.models import Checkpoint
from service.jobs import progress
from service.jobs.models import Job, JobSample
from service.jobs.schemas import SampleIn
from service.jobs.states import JobStatus
from service.storage import get_storage
from worker.lease import Claim, LeaseLost, fenced_write

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


def record_step(claim: Claim, step: int, metrics: Mapping[str, float], samples: Sequence[SampleIn]) -> None:
    """One training step's metrics and logged samples, atomically."""
    values = finite_metrics(metrics)

    def work(session: Session) -> None:
        progress.record_metrics(session, claim.job_id, claim.attempt, step, values)
        session.execute(delete(JobSample).where(JobSample.job_id == claim.job_id, JobSample.step == step))
        if samples:
            progress.record_samples(session, claim.job_id, claim.attempt, step, samples)

    _fenced(claim, work)


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
        checkpoints.record_checkpoint(
            session, get_storage(), claim.job_id, claim.attempt, checkpoint_id=checkpoint_id, step=step,
            files=files, metrics=None if metrics is None else finite_metrics(metrics),
        )
        session.flush()

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
        status = session.scalar(select(Job.status).where(Job.id == claim.job_id))
        target = to
        if status == JobStatus.cancelling.value and to is not JobStatus.failed:
            target = JobStatus.cancelled
        progress.worker_transition(
            session, claim.job_id, claim.attempt, target, reason=reason,
            error_code=error_code, error_message=error_message,
        )
        return target

    return _fenced(claim, work)


@dataclass(frozen=True)
class JobControl:
    """What the runner polls between steps to know whether to go on."""

    status: str  # a JobStatus value
    pause_requested: bool
    attempt: int  # the attempt that owns the job


def read_control(job_id: str) -> JobControl | None:
    """The job's status, pause request and owning attempt, read without a lock; None if it is gone."""
    from service.kit.db import session_scope

    with session_scope() as session:
        row = session.execute(
            select(Job.status, Job.pause_requested, Job.attempt).where(Job.id == job_id)
        ).one_or_none()
    return None if row is None else JobControl(row[0], bool(row[1]), int(row[2]))
