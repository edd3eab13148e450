"""All SQL of the environment registry. Soft-deleted rows are invisible to tenants."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.environments.models import Environment


def get(session: Session, tenant_id: str, env_id: str, *, for_update: bool = False) -> Environment | None:
    stmt = select(Environment).where(
        Environment.id == env_id, Environment.tenant_id == tenant_id, Environment.deleted_at.is_(None)
    )
    if for_update:
        stmt = stmt.with_for_update()
    return session.scalars(stmt).one_or_none()


def list_page(session: Session, tenant_id: str, *, limit: int, after: str | None) -> Sequence[Environment]:
    stmt = select(Environment).where(Environment.tenant_id == tenant_id, Environment.deleted_at.is_(None))
    if after is not None:
        stmt = stmt.where(Environment.id < after)
    return session.scalars(stmt.order_by(Environment.id.desc()).limit(limit)).all()


def add(session: Session, row: Environment) -> None:
    session.add(row)
    session.flush()
