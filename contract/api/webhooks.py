"""Response shapes of the webhooks API, and the job lifecycle events a webhook receives."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

EVENT_TYPES = (
    "job.queued",
    "job.running",
    "job.checkpoint_saved",
    "job.eval_completed",
    "job.health",
    "job.budget_exhausted",
    "job.paused",
    "job.succeeded",
    "job.failed",
    "job.cancelled",
)


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


class WebhookWithSecret(WebhookOut):
    secret: str = Field(
        description="Standard Webhooks signing secret (whsec_...). Shown only in this response: verify "
        "`webhook-signature` with it (e.g. the `standardwebhooks` package)."
    )


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


class DeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DeliveryOut]
    has_more: bool
    next_after: int | None
