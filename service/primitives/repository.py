"""All SQL of the primitive training API on the API's side. Every read is scoped to the tenant: another tenant's
row reads as missing."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.primitives.models import (
    PrimitiveRequest,
    PrimitiveSession,
    PrimitiveWeights,
    SamplingSession,
    TrainingClient,
)


def get_session(session: Session, tenant_id: str, session_id: str) -> PrimitiveSession | None:
    return session.scalars(
        select(PrimitiveSession).where(PrimitiveSession.id == session_id, PrimitiveSession.tenant_id == tenant_id)
    ).one_or_none()


def get_training_client(
    session: Session, tenant_id: str, client_id: str, *, for_update: bool = False
) -> TrainingClient | None:
    stmt = select(TrainingClient).where(TrainingClient.id == client_id, TrainingClient.tenant_id == tenant_id)
    if for_update:
        stmt = stmt.with_for_update()
    return session.scalars(stmt).one_or_none()


def get_sampling_session(session: Session, tenant_id: str, sampler_id: str) -> SamplingSession | None:
    return session.scalars(
        select(SamplingSession).where(SamplingSession.id == sampler_id, SamplingSession.tenant_id == tenant_id)
    ).one_or_none()


def get_weights(
    session: Session, tenant_id: str, client_id: str, kind: str, name: str
) -> PrimitiveWeights | None:
    return session.scalars(
        select(PrimitiveWeights).where(
            PrimitiveWeights.tenant_id == tenant_id,
            PrimitiveWeights.training_client_id == client_id,
            PrimitiveWeights.kind == kind,
            PrimitiveWeights.name == name,
        )
    ).one_or_none()


def get_request(session: Session, tenant_id: str, request_id: str) -> PrimitiveRequest | None:
    return session.scalars(
        select(PrimitiveRequest).where(PrimitiveRequest.id == request_id, PrimitiveRequest.tenant_id == tenant_id)
    ).one_or_none()


def add(session: Session, row: object) -> None:
    session.add(row)
    session.flush()


def touch_session(session: Session, tenant_id: str, session_id: str, now: datetime) -> bool:
    """Record a heartbeat; False when the session is unknown or closed."""
    result = session.execute(
        update(PrimitiveSession)
        .where(
            PrimitiveSession.id == session_id,
            PrimitiveSession.tenant_id == tenant_id,
            PrimitiveSession.closed_at.is_(None),
        )
        .values(heartbeat_at=now)
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def close_session(session: Session, session_id: str, now: datetime) -> None:
    """Close a session and its training clients (their workers then free the adapters)."""
    session.execute(
        update(PrimitiveSession)
        .where(PrimitiveSession.id == session_id, PrimitiveSession.closed_at.is_(None))
        .values(closed_at=now)
    )
    session.execute(
        update(TrainingClient)
        .where(TrainingClient.session_id == session_id, TrainingClient.closed_at.is_(None))
        .values(closed_at=now)
    )
