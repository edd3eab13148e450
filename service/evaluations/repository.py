"""All SQL of the evaluations domain. Every query of a tenant's data filters on tenant_id."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.evaluations.models import Evaluation, EvaluationItem
from service.jobs.models import Job


def get(session: Session, tenant_id: str, evaluation_id: str) -> tuple[Evaluation, Job] | None:
    row = session.execute(
        select(Evaluation, Job)
        .join(Job, Job.id == Evaluation.id)
        .where(Evaluation.id == evaluation_id, Evaluation.tenant_id == tenant_id)
    ).one_or_none()
    return None if row is None else (row[0], row[1])


def get_any_tenant(session: Session, evaluation_id: str) -> Evaluation | None:
    """For the worker, which acts on the id it was sent."""
    return session.get(Evaluation, evaluation_id)


def list_page(
    session: Session, tenant_id: str, *, limit: int, before_id: str | None
) -> Sequence[tuple[Evaluation, Job]]:
    """Newest first (ids are time-sortable), `limit` rows."""
    stmt = select(Evaluation, Job).join(Job, Job.id == Evaluation.id).where(Evaluation.tenant_id == tenant_id)
    if before_id is not None:
        stmt = stmt.where(Evaluation.id < before_id)
    return [(e, j) for e, j in session.execute(stmt.order_by(Evaluation.id.desc()).limit(limit)).all()]


def items_page(session: Session, evaluation_id: str, *, after: int | None, limit: int) -> Sequence[EvaluationItem]:
    stmt = select(EvaluationItem).where(EvaluationItem.evaluation_id == evaluation_id)
    if after is not None:
        stmt = stmt.where(EvaluationItem.item_index > after)
    return session.scalars(stmt.order_by(EvaluationItem.item_index).limit(limit)).all()


def all_items(session: Session, evaluation_id: str) -> Sequence[EvaluationItem]:
    stmt = select(EvaluationItem).where(EvaluationItem.evaluation_id == evaluation_id)
    return session.scalars(stmt.order_by(EvaluationItem.item_index)).all()


def items_recorded(session: Session, evaluation_id: str) -> int:
    """Items recorded: items 0 .. n-1, since batches are recorded in order, each with its items."""
    count = session.scalar(select(func.count()).where(EvaluationItem.evaluation_id == evaluation_id))
    return int(count or 0)
