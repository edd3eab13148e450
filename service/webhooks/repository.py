"""All SQL of the webhooks domain. Endpoint queries of a tenant's data filter on tenant_id."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.webhooks.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint


def add_endpoint(session: Session, row: WebhookEndpoint) -> None:
    session.add(row)
    session.flush()


def get_endpoint(session: Session, tenant_id: str, endpoint_id: str) -> WebhookEndpoint | None:
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.tenant_id == tenant_id)
    return session.scalars(stmt).one_or_none()


def list_endpoints(session: Session, tenant_id: str, *, limit: int, after: str | None) -> Sequence[WebhookEndpoint]:
    """Newest first; ids are time-sortable, so `id < after` is a stable cursor."""
    stmt = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
    if after is not None:
        stmt = stmt.where(WebhookEndpoint.id < after)
    return session.scalars(stmt.order_by(WebhookEndpoint.id.desc()).limit(limit)).all()


def delete_endpoint(session: Session, row: WebhookEndpoint) -> None:
    """Deletes its deliveries too (ON DELETE CASCADE): nothing more is sent to a removed URL."""
    session.delete(row)
    session.flush()


def list_deliveries(
    session: Session, endpoint_id: str, *, limit: int, after: int | None
) -> Sequence[WebhookDelivery]:
    """Newest first."""
    stmt = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
    if after is not None:
        stmt = stmt.where(WebhookDelivery.id < after)
    return session.scalars(stmt.order_by(WebhookDelivery.id.desc()).limit(limit)).all()


# --- the delivery loop ----------------------------------------------------------------------------


def due_delivery_ids(session: Session, now: datetime, limit: int) -> list[int]:
    """Pending deliveries whose time has come, oldest first, locked against other API processes.

    SKIP LOCKED (PostgreSQL) lets several dispatchers share the outbox without waiting on each other;
    SQLite serialises writers anyway and ignores the clause.
    """
    stmt = (
        select(WebhookDelivery.id)
        .where(WebhookDelivery.status == DeliveryStatus.pending, WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return list(session.scalars(stmt))


def lease_deliveries(session: Session, ids: Sequence[int], until: datetime) -> None:
    """Push the claimed rows' next attempt past the send: a dispatcher that dies mid-send leaves them due later."""
    session.execute(
        update(WebhookDelivery).where(WebhookDelivery.id.in_(ids)).values(next_attempt_at=until)
        .execution_options(synchronize_session=False)
    )


def deliveries_with_endpoints(
    session: Session, ids: Sequence[int]
) -> Sequence[tuple[WebhookDelivery, WebhookEndpoint]]:
    stmt = (
        select(WebhookDelivery, WebhookEndpoint)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.id.in_(ids))
        .order_by(WebhookDelivery.id)
    )
    return [(d, e) for d, e in session.execute(stmt).tuples()]


def get_delivery(session: Session, delivery_id: int) -> WebhookDelivery | None:
    return session.get(WebhookDelivery, delivery_id)


def count_pending_deliveries(session: Session) -> int:
    stmt = select(func.count()).select_from(WebhookDelivery).where(WebhookDelivery.status == DeliveryStatus.pending)
    return int(session.scalar(stmt) or 0)
