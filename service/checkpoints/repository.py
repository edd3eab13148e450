"""All SQL of the checkpoints domain."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.checkpoints.models import Checkpoint
from service.jobs.models import JobMetric


def get(session: Session, tenant_id: str, checkpoint_id: str) -> Checkpoint | None:
    stmt = select(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.tenant_id == tenant_id)
    return session.scalars(stmt).one_or_none()


def list_for_job(session: Session, job_id: str) -> Sequence[Checkpoint]:
    return session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
    ).all()


def get_by_step(session: Session, job_id: str, step: int) -> Checkpoint | None:
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
    return session.scalars(stmt).one_or_none()


def metrics_at_step(session: Session, job_id: str, step: int) -> dict[str, float]:
    stmt = select(JobMetric.name, JobMetric.value).where(JobMetric.job_id == job_id, JobMetric.step == step)
    return {row.name: row.value for row in session.execute(stmt)}
