"""Request/response models of the webhooks API, and the body receivers get."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.fields import Text
from service.rewards.schemas import overlap_end
from service.webhooks.models import WebhookDelivery, WebhookEndpoint
from service.webhooks.outbox import EVENT_TYPES


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


class WebhookOut(BaseModel):
    object: Literal["webhook"] = "webhook"
    id: str = Field(examples=["wh_01JDX3V8Q4M2C6T9W1R5Y7Z0AB"])
    url: str
    description: str | None
    event_types: list[str] = Field(description="Every job lifecycle event is sent to every webhook.")
    created_at: datetime
    previous_secret_expires_at: datetime | None = Field(
        None,
        description="After a rotation: until when deliveries are signed with the replaced secret too (both "
        "signatures in webhook-signature). None when no overlap is running.",
    )

    @classmethod
    def from_row(cls, row: WebhookEndpoint) -> WebhookOut:
        return cls(id=row.id, url=row.url, description=row.description, event_types=list(EVENT_TYPES),
                   created_at=row.created_at, previous_secret_expires_at=overlap_end(row.previous_secret_expires_at))


class WebhookWithSecret(WebhookOut):
    secret: str = Field(
        description="Standard Webhooks signing secret (whsec_...). Shown only in this response: verify "
        "`webhook-signature` with it (e.g. the `standardwebhooks` package)."
    )

    @classmethod
    def from_row(cls, row: WebhookEndpoint) -> WebhookWithSecret:
        return cls(**WebhookOut.from_row(row).model_dump(), secret=row.secret)


class WebhookList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")


class DeliveryOut(BaseModel):
    id: int
    message_id: str = Field(description="The `webhook-id` header; the same on every retry.")
    event_type: str = Field(examples=list(EVENT_TYPES))
    job_id: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    next_attempt_at: datetime | None = Field(description="When a pending delivery is tried next.")
    last_status_code: int | None
    last_error: str | None
    payload: dict[str, Any]
    created_at: datetime
    delivered_at: datetime | None

    @classmethod
    def from_row(cls, row: WebhookDelivery) -> DeliveryOut:
        return cls(
            id=row.id, message_id=row.message_id, event_type=row.event_type, job_id=row.job_id,
            status=row.status,  # type: ignore[arg-type]
            attempts=row.attempts,
            next_attempt_at=row.next_attempt_at if row.status == "pending" else None,
            last_status_code=row.last_status_code, last_error=row.last_error, payload=row.payload,
            created_at=row.created_at, delivered_at=row.delivered_at,
        )


class DeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DeliveryOut]
    has_more: bool
    next_after: int | None
