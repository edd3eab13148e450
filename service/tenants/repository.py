"""All SQL of the tenants domain."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from service.tenants.models import ApiKey, Tenant


def get_tenant(session: Session, tenant_id: str) -> Tenant | None:
    return session.get(Tenant, tenant_id)


def lock_tenant(session: Session, tenant_id: str) -> bool:
    """Serialise checks of one tenant's limits (quotas, API keys) until the transaction ends (a row lock on
    PostgreSQL, the write lock on SQLite), so two requests at once cannot both take the last unit. False if the
    tenant does not exist."""
    result = session.execute(
        update(Tenant).where(Tenant.id == tenant_id).values(name=Tenant.name).execution_options(
            synchronize_session=False
        )
    )
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def get_tenant_by_name(session: Session, name: str) -> Tenant | None:
    return session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()


def get_api_key(session: Session, tenant_id: str, key_id: str) -> ApiKey | None:
    return session.scalars(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id)).one_or_none()


def active_keys_with_prefix(session: Session, prefix: str, now: datetime) -> Sequence[tuple[ApiKey, Tenant]]:
    """Keys sharing a lookup prefix that are neither revoked nor expired at `now`, with their tenant (one query)."""
    rows = session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(
            ApiKey.prefix == prefix,
            ApiKey.revoked_at.is_(None),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
        )
    ).all()
    return [(key, tenant) for key, tenant in rows]


def count_active_keys(session: Session, tenant_id: str, now: datetime) -> int:
    """The tenant's keys that are neither revoked nor expired at `now`."""
    return session.scalar(
        select(func.count())
        .select_from(ApiKey)
        .where(
            ApiKey.tenant_id == tenant_id,
            ApiKey.revoked_at.is_(None),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
        )
    ) or 0


def list_api_keys(session: Session, tenant_id: str, *, limit: int, after: str | None) -> Sequence[ApiKey]:
    """Newest first; ids are time-sortable, so `id < after` is a stable cursor."""
    stmt = select(ApiKey).where(ApiKey.tenant_id == tenant_id)
    if after is not None:
        stmt = stmt.where(ApiKey.id < after)
    return session.scalars(stmt.order_by(ApiKey.id.desc()).limit(limit)).all()


def mark_used(session: Session, key_ids: Sequence[str], now: datetime, older_than: datetime) -> None:
    """Set last_used_at of keys not marked since `older_than` (so concurrent processes write about once)."""
    session.execute(
        update(ApiKey)
        .where(ApiKey.id.in_(key_ids), or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < older_than))
        .values(last_used_at=now)
    )


def add(session: Session, row: Tenant | ApiKey) -> None:
    session.add(row)
    session.flush()
