"""Requests of the environment registry, and its responses (shapes in contract.api.environments) from rows."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contract.api.environments import (
    EnvironmentHealth,
    EnvironmentOut,
    EnvironmentSchemas,
    EnvironmentWithSecret,
)
from contract.fields import HeaderValue
from outbound.urlpolicy import is_grpc_url
from service.environments.models import Environment
from service.rewards.schemas import NAME_PATTERN, check_headers, overlap_end, redact_headers


class EnvironmentCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "calculator",
                    "url": "https://envs.example.com/calculator",
                    "max_concurrency": 8,
                    "headers": {"Authorization": "Bearer my-environment-token"},
                }
            ]
        },
    )

    name: str = Field(pattern=NAME_PATTERN, description="Display name (letters, digits, space, '_', '.', '-').")
    url: str = Field(
        min_length=1,
        max_length=2048,
        description="Base URL of an OpenEnv server (`/health`, `/schema`, `WS /ws` below it). https only in "
        "production (and the host must resolve to public addresses only); no credentials.",
    )
    max_concurrency: int = Field(
        1, ge=1, le=1024, description="Most episodes a job runs on it at once (OpenEnv's max_concurrent_envs; "
        "a session past the server's capacity waits and retries).",
    )
    step_timeout_s: float = Field(30.0, gt=0, le=600, allow_inf_nan=False, description="Per-message timeout.")
    episode_timeout_s: float = Field(
        300.0, gt=0, le=3600, allow_inf_nan=False, description="Most wall time of one episode, all turns."
    )
    max_attempts: int = Field(
        5, ge=1, le=10, description="Attempts to open an episode (the first included) on connection errors, "
        "timeouts, 5xx and CAPACITY_REACHED, with exponential backoff and full jitter.",
    )
    backoff_s: float = Field(
        0.5, ge=0.05, le=30, allow_inf_nan=False,
        description="Backoff base: the wait before retry n is random in [0, backoff_s * 2^n], at most 20 s.",
    )
    breaker_threshold: int = Field(
        3, ge=1, le=20, description="Consecutive episodes that could not be opened before the environment "
        "counts as down and the job pauses (environment_unavailable).",
    )
    headers: dict[str, HeaderValue] = Field(
        default_factory=dict,
        description="Extra headers of every request and WebSocket handshake (e.g. Authorization); the same "
        "names are reserved as for reward functions. Values are never shown again (reads return <redacted>).",
    )

    @field_validator("url")
    @classmethod
    def _http_only(cls, url: str) -> str:
        if is_grpc_url(url):
            raise ValueError("an environment is an OpenEnv server over http(s); grpc:// is for reward functions")
        return url

    @field_validator("headers")
    @classmethod
    def _check_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        return check_headers(headers)


def environment_out(row: Environment) -> EnvironmentOut:
    return EnvironmentOut(
        id=row.id,
        name=row.name,
        url=row.url,
        max_concurrency=row.max_concurrency,
        step_timeout_s=row.step_timeout_s,
        episode_timeout_s=row.episode_timeout_s,
        max_attempts=row.max_attempts,
        backoff_s=row.backoff_s,
        breaker_threshold=row.breaker_threshold,
        headers=redact_headers(dict(row.headers)),
        health=EnvironmentHealth(status=row.health_status, checked_at=row.checked_at,
                                 latency_ms=row.health_latency_ms, session_status=row.session_status),
        schemas=EnvironmentSchemas.model_validate(row.schemas),
        created_at=row.created_at,
        updated_at=row.updated_at,
        previous_secret_expires_at=overlap_end(row.previous_secret_expires_at),
    )


def environment_with_secret(row: Environment) -> EnvironmentWithSecret:
    return EnvironmentWithSecret(**environment_out(row).model_dump(), signing_secret=row.signing_secret)
