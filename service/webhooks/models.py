"""Webhook endpoints tenants register, and the outbox of deliveries to them.

`WebhookDelivery` rows are written in the same transaction as the job event they announce (see
service/webhooks/outbox.py), so an event is announced if and only if it happened, and sending never
runs inside the job's transaction: the API process delivers them later (service/webhooks/delivery.py).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from service.kit.db import Base, BigIntId, UTCDateTime, utcnow


class WebhookEndpoint(Base):
    """`secret` is stored as issued ("whsec_..."): signing needs it (HMAC), so it cannot be hashed."""

    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_tenant_id_id", "tenant_id", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(String(2048))
    description: Mapped[str | None] = mapped_column(String(256), nullable=True)
    secret: Mapped[str] = mapped_column(String(128))
    # The secret a rotation replaced: deliveries are signed with both until previous_secret_expires_at.
    previous_secret: Mapped[str | None] = mapped_column(String(128), nullable=True)
    previous_secret_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class DeliveryStatus:
    pending = "pending"  # waiting for its first or next attempt (next_attempt_at)
    delivered = "delivered"  # the receiver answered 2xx
    failed = "failed"  # gave up: attempts exhausted, or the URL is refused by the SSRF policy


class WebhookDelivery(Base):
    """One event for one endpoint. `message_id` is the `webhook-id`: the same on every retry."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_status_next_attempt_at", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint_id_id", "endpoint_id", "id"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(String(40))
    job_id: Mapped[str] = mapped_column(String(40))
    message_id: Mapped[str] = mapped_column(String(80))
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default=DeliveryStatus.pending)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
