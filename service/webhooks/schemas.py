"""Requests of the webhooks API, and its responses (shapes in contract.api.webhooks) built from rows."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from contract.api.webhooks import (
    EVENT_TYPES,
    DeliveryOut,
    WebhookOut,
    WebhookWithSecret,
)
from contract.fields import Text
from service.rewards.schemas import overlap_end
from service.webhooks.models import WebhookDelivery, WebhookEndpoint


class WebhookCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"url": "https://hooks.example.com/grpo", "description": "CI notifier"}]},
    )

    url: str = Field(
        min_length=1,
        max_length=2048,
        description="http(s) URL receiving signed job events; https only in production, no credentials, "
        "no private or loopback addresses in production, whether written literally or resolved from the "
        "name (the reward endpoints' SSRF policy).",
    )
    description: Text | None = Field(None, max_length=256)


def webhook_out(row: WebhookEndpoint) -> WebhookOut:
    return WebhookOut(id=row.id, url=row.url, description=row.description, event_types=list(EVENT_TYPES),
               created_at=row.created_at,
                      previous_secret_expires_at=overlap_end(row.previous_secret_expires_at))


def webhook_with_secret(row: WebhookEndpoint) -> WebhookWithSecret:
    return WebhookWithSecret(**webhook_out(row).model_dump(), secret=row.secret)


def delivery_out(row: WebhookDelivery) -> DeliveryOut:
    return DeliveryOut(
        id=row.id, message_id=row.message_id, event_type=row.event_type, job_id=row.job_id,
        status=row.status,  # type: ignore[arg-type]
        attempts=row.attempts,
        next_attempt_at=row.next_attempt_at if row.status == "pending" else None,
        last_status_code=row.last_status_code, last_error=row.last_error, payload=row.payload,
        created_at=row.created_at, delivered_at=row.delivered_at,
    )
