"""Requests of the reward-function registry, and its responses (shapes in contract.api.rewards) built from rows."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contract.api.rewards import (
    RewardFunctionOut,
    RewardFunctionWithSecret,
)
from contract.dataset_format import MAX_COLUMN_NAME_CHARS, MAX_COLUMNS
from contract.fields import HeaderValue, Text
from outbound.rewards.grpc_source import metadata_problem
from outbound.urlpolicy import is_grpc_url
from service.rewards.models import RewardFunction

# Headers the worker sets itself (Standard Webhooks signature, body framing) or that change routing or
# connection handling: a user value would break signing or smuggle requests. `Authorization` is allowed:
# reward endpoints commonly want a bearer token, and the signature is carried in webhook-* headers.
RESERVED_HEADERS = frozenset(
    {
        "content-type",
        "content-length",
        "content-encoding",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "expect",
        "host",
        "user-agent",
    }
)
RESERVED_HEADER_PREFIXES = ("webhook-", "proxy-", "x-forwarded-")
REDACTED = "<redacted>"
MAX_HEADERS = 32
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}$")  # RFC 9110 field-name
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\- ]{0,127}$"


def check_headers(headers: dict[str, str]) -> dict[str, str]:
    """Extra headers a user may have sent to their endpoint (reward functions, environments): valid names,
    none reserved or repeated, values bounded. ValueError naming the header otherwise."""
    if len(headers) > MAX_HEADERS:
        raise ValueError(f"at most {MAX_HEADERS} headers")
    seen: set[str] = set()
    for name, value in headers.items():
        lowered = name.lower()
        if not _TOKEN.match(name):
            raise ValueError(f"header name {name!r} is not a valid HTTP field name")
        if lowered in RESERVED_HEADERS or lowered.startswith(RESERVED_HEADER_PREFIXES):
            raise ValueError(f"header {name!r} is reserved (set by the worker or the HTTP client)")
        if lowered in seen:
            raise ValueError(f"header {name!r} is given twice (names are case-insensitive)")
        seen.add(lowered)
        if len(value) > 4096:
            raise ValueError(f"header {name!r} value is longer than 4096")
    return headers


class RewardFunctionCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "name": "math-checker",
                    "url": "https://rewards.example.com/score",
                    "timeout_s": 10,
                    "max_batch_size": 64,
                    "max_concurrency": 4,
                    "headers": {"Authorization": "Bearer my-endpoint-token"},
                }
            ]
        },
    )

    name: str = Field(pattern=NAME_PATTERN, description="Display name (letters, digits, space, '_', '.', '-').")
    url: str = Field(
        min_length=1,
        max_length=2048,
        description="Endpoint receiving signed batches: an http(s) webhook URL, or grpc(s)://host:port for the "
        "grpo.v1.RewardService protocol. https/grpcs only in production (and the host must resolve to public "
        "addresses only); no credentials.",
    )
    timeout_s: float = Field(10.0, gt=0, le=300, allow_inf_nan=False, description="Per-request timeout.")
    max_batch_size: int = Field(64, ge=1, le=4096, description="Most samples sent in one request.")
    max_concurrency: int = Field(4, ge=1, le=64, description="Most requests in flight at once per job.")
    headers: dict[str, HeaderValue] = Field(
        default_factory=dict,
        description="Extra request headers (e.g. Authorization). Content-Type, webhook-*, Host, framing and "
        "proxy headers are reserved. Values are HTTP header text (visible ASCII, space, tab) and are never "
        "shown again (reads return <redacted>).",
    )
    max_attempts: int = Field(
        5, ge=1, le=10, description="Attempts per request (the first included) on connection errors, timeouts, "
        "429 and 5xx, with exponential backoff and full jitter.",
    )
    backoff_s: float = Field(
        0.5, ge=0.05, le=30, allow_inf_nan=False,
        description="Backoff base: the wait before retry n is random in [0, backoff_s * 2^n], at most 20 s.",
    )
    breaker_threshold: int = Field(
        3, ge=1, le=20, description="Consecutive requests that exhausted their attempts before the endpoint "
        "counts as down: the circuit opens and the job pauses (reward_endpoint_unavailable).",
    )
    step_deadline_s: float = Field(
        300.0, ge=1, le=3600, allow_inf_nan=False,
        description="While the circuit stays closed, a request that exhausted its attempts is sent again until "
        "this long after the step's first request; then its items abstain (null).",
    )
    max_abstain_fraction: float = Field(
        0.25, ge=0, le=1, allow_inf_nan=False,
        description="Most of a step's completions that may abstain at the deadline (a reward_degraded event "
        "reports them); beyond it the job pauses as if the circuit had opened.",
    )

    @field_validator("headers")
    @classmethod
    def _check_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        return check_headers(headers)

    @model_validator(mode="after")
    def _grpc_headers_are_metadata(self) -> RewardFunctionCreate:
        # A gRPC endpoint receives the headers as call metadata, which allows fewer names and values.
        if is_grpc_url(self.url):
            for name, value in self.headers.items():
                problem = metadata_problem(name, value)
                if problem is not None:
                    raise ValueError(f"headers: {problem} (the url is a gRPC endpoint)")
        return self


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    """Every value hidden, names kept: whether a header carries a credential cannot be told from its name
    (`X-Credential`, `X-Pass`, `X-Api`...), and a reader needs only the names to see what is configured."""
    return dict.fromkeys(headers, REDACTED)


# --- dry run (POST /v1/reward-functions/{id}/test) -------------------------------------------------------

MAX_TEST_ITEMS = 64


class RewardTestItem(BaseModel):
    """One sample completion, as a job would send it."""

    model_config = ConfigDict(extra="forbid")

    prompt: Text = Field(max_length=100_000, description="The prompt (as rendered for the model).")
    completion: Text = Field(max_length=100_000, description="The completion to score.")
    metadata: dict[Annotated[Text, Field(max_length=MAX_COLUMN_NAME_CHARS)], Any] = Field(
        default_factory=dict,
        max_length=MAX_COLUMNS,
        description=f"The dataset row's other columns (at most {MAX_COLUMNS}, names up to {MAX_COLUMN_NAME_CHARS} "
        "characters, as in a dataset).",
    )
    group_id: int = Field(0, ge=0, le=2**31 - 1, description="Completions of the same prompt share a group id.")

    @field_validator("metadata")
    @classmethod
    def _sendable(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        # Sent on as JSON text: Python's json reads NaN/Infinity and "\udXXX" escapes that it cannot write back.
        try:
            json.dumps(metadata, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except ValueError as exc:  # UnicodeEncodeError is one
            raise ValueError("must be JSON text: no NaN or Infinity, no unpaired surrogates") from exc
        return metadata


class RewardTestRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"items": [{"prompt": "2+2=", "completion": "4", "metadata": {"answer": "4"}}]}]
        },
    )

    items: list[RewardTestItem] = Field(
        min_length=1,
        max_length=MAX_TEST_ITEMS,
        description=f"1 to {MAX_TEST_ITEMS} samples, sent as a job would (signed, batched by max_batch_size; "
        "job_id 'test', step 0), one attempt per request.",
    )


def overlap_end(until: datetime | None) -> datetime | None:
    """A rotation's overlap end while it lasts (a past one is not shown)."""
    return until if until is not None and until > datetime.now(UTC) else None


def reward_function_out(row: RewardFunction) -> RewardFunctionOut:
    return RewardFunctionOut(
        id=row.id,
        name=row.name,
        url=row.url,
        timeout_s=row.timeout_s,
        max_batch_size=row.max_batch_size,
        max_concurrency=row.max_concurrency,
        headers=redact_headers(dict(row.headers)),
        max_attempts=row.max_attempts,
        backoff_s=row.backoff_s,
        breaker_threshold=row.breaker_threshold,
        step_deadline_s=row.step_deadline_s,
        max_abstain_fraction=row.max_abstain_fraction,
        created_at=row.created_at,
        updated_at=row.updated_at,
        previous_secret_expires_at=overlap_end(row.previous_secret_expires_at),
    )


def reward_function_with_secret(row: RewardFunction) -> RewardFunctionWithSecret:
    return RewardFunctionWithSecret(**reward_function_out(row).model_dump(), signing_secret=row.signing_secret)
