"""All SQL of the reward-function registry. Soft-deleted rows are invisible to tenants."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.rewards.models import RewardFunction


def get(session: Session, tenant_id: str, rf_id: str, *, for_update: bool = False) -> RewardFunction | None:
    stmt = select(RewardFunction).where(
        RewardFunction.id == rf_id, RewardFunction.tenant_id == tenant_id, RewardFunction.deleted_at.is_(None)
    )
    if for_update:
        stmt = stmt.with_for_update()
    return session.scalars(stmt).one_or_none()


def live(session: Session, tenant_id: str, ids: Sequence[str]) -> dict[str, RewardFunction]:
    """{id: row} of those of `ids` that are the tenant's."""
    if not ids:
        return {}
    stmt = select(RewardFunction).where(
        RewardFunction.tenant_id == tenant_id, RewardFunction.id.in_(ids), RewardFunction.deleted_at.is_(None)
    )
    return {row.id: row for row in session.scalars(stmt)}


def get_for_job(session: Session, rf_id: str) -> RewardFunction | None:
    """Any row, deleted or not: a job keeps calling what it was submitted with."""
    return session.get(RewardFunction, rf_id)


def list_page(session: Session, tenant_id: str, *, limit: int, after: str | None) -> Sequence[RewardFunction]:
    stmt = select(RewardFunction).where(
        RewardFunction.tenant_id == tenant_id, RewardFunction.deleted_at.is_(None)
    )
    if after is not None:
        stmt = stmt.where(RewardFunction.id < after)
    return session.scalars(stmt.order_by(RewardFunction.id.desc()).limit(limit)).all()


def add(session: Session, row: RewardFunction) -> None:
    session.add(row)
    session.flush()
