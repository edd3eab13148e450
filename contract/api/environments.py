"""Response shapes of the environment registry: user-hosted OpenEnv servers that multi-turn jobs talk to."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field


class EnvironmentHealth(BaseModel):
    status: str = Field(description="What `/health` answered at the last check ('healthy' when registered).")
    checked_at: datetime
    latency_ms: float = Field(description="Wall time of the last check's `/health` and `/schema` reads.")
    session_status: Literal["ok", "at_capacity"] = Field(
        description="A session opened over `WS /ws` as an episode is, asked for its state: 'ok', or 'at_capacity' "
        "when the server answered CAPACITY_REACHED (it speaks the protocol; every session was taken)."
    )


class EnvironmentSchemas(BaseModel):
    """The JSON schemas the server publishes at `/schema`, as read at the last check."""

    action: dict[str, Any]
    observation: dict[str, Any]
    state: dict[str, Any]


class EnvironmentOut(BaseModel):
    object: Literal["environment"] = "environment"
    id: str = Field(examples=["env_01J9Z3M4T6V8X0Z2B4D6F8H0K2"])
    name: str
    url: str = Field(description="The server's base URL; episodes run over its `WS /ws`.")
    max_concurrency: int
    step_timeout_s: float
    episode_timeout_s: float
    max_attempts: int
    backoff_s: float
    breaker_threshold: int
    headers: dict[str, str] = Field(description="The configured header names; every value is shown as <redacted>.")
    health: EnvironmentHealth
    schemas: EnvironmentSchemas
    created_at: datetime
    updated_at: datetime
    previous_secret_expires_at: datetime | None = Field(
        None,
        description="After a rotation: until when requests are signed with the replaced secret too (both "
        "signatures in webhook-signature). None when no overlap is running.",
    )


class EnvironmentWithSecret(EnvironmentOut):
    """Returned by create and rotate-secret only: the one time the signing secret is shown."""

    signing_secret: str = Field(
        description="Standard Webhooks secret ('whsec_' + base64 key): verify the webhook-signature header of "
        "every request and WebSocket handshake with it. Shown only now.",
        examples=["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"],
    )


class EnvironmentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[EnvironmentOut]
    has_more: bool
    next_after: str | None = Field(description="Pass as `after` to get the next (older) page.")
