"""All SQL of the checkpoints domain."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, exists, select
from sqlalchemy.orm import Session

from service.checkpoints.models import Checkpoint


def get(session: Session, tenant_id: str, checkpoint_id: str) -> Checkpoint | None:
    stmt = select(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.tenant_id == tenant_id)
    return session.scalars(stmt).one_or_none()


def list_for_job(session: Session, job_id: str) -> Sequence[Checkpoint]:
    return session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
    ).all()


def list_for_tinker_path(session: Session, tenant_id: str, tinker_path: str) -> Sequence[Checkpoint]:
    return session.scalars(
        select(Checkpoint)
        .where(Checkpoint.tenant_id == tenant_id, Checkpoint.tinker_path == tinker_path)
        .order_by(Checkpoint.created_at, Checkpoint.id)
    ).all()


def get_by_step(session: Session, job_id: str, step: int) -> Checkpoint | None:
    stmt = select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
    return session.scalars(stmt).one_or_none()


def tenant_has_checkpoint(session: Session, tenant_id: str, checkpoint_id: str) -> bool:
    stmt = select(exists().where(Checkpoint.id == checkpoint_id, Checkpoint.tenant_id == tenant_id))
    return bool(session.scalar(stmt))


def latest_checkpoint_id(session: Session, job_id: str) -> str | None:
    stmt = select(Checkpoint.id).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc()).limit(1)
    return session.scalar(stmt)


def latest_checkpoint(session: Session, job_id: str, *, before_step: int | None = None) -> Checkpoint | None:
    query = select(Checkpoint).where(Checkpoint.job_id == job_id)
    if before_step is not None:
        query = query.where(Checkpoint.step < before_step)
    return session.execute(query.order_by(Checkpoint.step.desc()).limit(1)).scalar_one_or_none()


def delete_steps_after(session: Session, job_id: str, step: int) -> None:
    """Forget the checkpoints of steps after `step` (a resumed job re-runs them; service/execution/lease.py)."""
    session.execute(delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step > step))
