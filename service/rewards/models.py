"""Registered remote reward functions (webhook endpoints the worker calls with signed batches)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, UTCDateTime, utcnow


class RewardFunction(Base):
    """Soft-deleted (`deleted_at`): a job that references a deleted function keeps a valid row to call.

    `signing_secret` is stored as issued ("whsec_..."): the worker must read it back to sign requests
    (Standard Webhooks HMAC), so a one-way hash is impossible. Protect the database accordingly.
    """

    __tablename__ = "reward_functions"
    __table_args__ = (Index("ix_reward_functions_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    url: Mapped[str] = mapped_column(String(2048))
    timeout_s: Mapped[float] = mapped_column(Float)
    max_batch_size: Mapped[int] = mapped_column(Integer)
    max_concurrency: Mapped[int] = mapped_column(Integer)
    headers: Mapped[dict[str, Any]] = mapped_column(JSON)
    # Failure policy of a job's calls (see outbound.rewards.source); bounds in service/rewards/schemas.py.
    max_attempts: Mapped[int] = mapped_column(Integer, server_default="5")
    backoff_s: Mapped[float] = mapped_column(Float, server_default="0.5")
    breaker_threshold: Mapped[int] = mapped_column(Integer, server_default="3")
    step_deadline_s: Mapped[float] = mapped_column(Float, server_default="300")
    max_abstain_fraction: Mapped[float] = mapped_column(Float, server_default="0.25")
    signing_secret: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
