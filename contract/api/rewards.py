"""Response shapes of the reward-function registry."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field


class RewardFunctionOut(BaseModel):
    id: str = Field(examples=["rf_01J9Z3M4T6V8X0Z2B4D6F8H0K2"])
    name: str
    url: str
    timeout_s: float
    max_batch_size: int
    max_concurrency: int
    headers: dict[str, str] = Field(description="The configured header names; every value is shown as <redacted>.")
    max_attempts: int
    backoff_s: float
    breaker_threshold: int
    step_deadline_s: float
    max_abstain_fraction: float
    created_at: datetime
    updated_at: datetime
    previous_secret_expires_at: datetime | None = Field(
        None,
        description="After a rotation: until when requests are signed with the replaced secret too (both "
        "signatures in webhook-signature). None when no overlap is running.",
    )


class RewardFunctionWithSecret(RewardFunctionOut):
    """Returned by create and rotate-secret only: the one time the signing secret is shown."""

    signing_secret: str = Field(
        description="Standard Webhooks secret ('whsec_' + base64 key): verify the webhook-signature "
        "header of every request with it. Shown only now.",
        examples=["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"],
    )


class RewardFunctionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[RewardFunctionOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")


class RewardTestResult(BaseModel):
    rewards: list[float | None] = Field(description="One per item, in order; null where the endpoint abstained.")
    latency_ms: float = Field(description="Wall time of the one signed call (no retries), name resolution included.")
