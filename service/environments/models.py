"""Registered environments: user-hosted OpenEnv servers a multi-turn job runs its episodes on."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, UTCDateTime, utcnow


class Environment(Base):
    """Soft-deleted (`deleted_at`): a job that names a deleted environment keeps a row to connect to.

    `signing_secret` is stored as issued, as for reward functions: the worker signs each handshake with it.
    `schemas` and `health_*` are what the server published at the last check (registration or `/check`).
    """

    __tablename__ = "environments"
    __table_args__ = (Index("ix_environments_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    url: Mapped[str] = mapped_column(String(2048))
    max_concurrency: Mapped[int] = mapped_column(Integer)
    step_timeout_s: Mapped[float] = mapped_column(Float)
    episode_timeout_s: Mapped[float] = mapped_column(Float)
    max_attempts: Mapped[int] = mapped_column(Integer)
    backoff_s: Mapped[float] = mapped_column(Float)
    breaker_threshold: Mapped[int] = mapped_column(Integer)
    headers: Mapped[dict[str, Any]] = mapped_column(JSON)
    schemas: Mapped[dict[str, Any]] = mapped_column(JSON)
    health_status: Mapped[str] = mapped_column(String(32))
    health_latency_ms: Mapped[float] = mapped_column(Float)
    session_status: Mapped[str] = mapped_column(String(32))
    checked_at: Mapped[datetime] = mapped_column(UTCDateTime())
    signing_secret: Mapped[str] = mapped_column(String(128))
    previous_signing_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)
    previous_secret_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
