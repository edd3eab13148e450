"""OpenAPI helpers: the error body as a pydantic model, and per-route error response docs."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class ErrorDetail(BaseModel):
    code: str = Field(description="Stable machine-readable code.", examples=["not_found"])
    message: str = Field(examples=["job 'job_01J...' not found"])
    details: Any = Field(None, description="Extra context, e.g. a list of {field, message, type} for 422.")


class ErrorBody(BaseModel):
    """Every 4xx/5xx response has this shape."""

    error: ErrorDetail


_DESCRIPTIONS = {
    401: "Missing or invalid API key (`unauthenticated`).",
    403: "The API key lacks the scope this route needs (`insufficient_scope`).",
    404: "Unknown id, or another tenant's (`not_found`, identical either way).",
    409: "Conflict with the current state (`illegal_transition`, `idempotency_key_in_flight`, `conflict`).",
    413: "Payload too large (`payload_too_large`).",
    416: "Range not satisfiable.",
    422: "Invalid input (`validation_error`); `details` names each field.",
    429: "Rate limit of this API key reached (`rate_limited`): retry after `Retry-After` seconds.",
    503: "A dependency is unavailable (`service_unavailable`).",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each listed status documented with the error body."""
    return {code: {"model": ErrorBody, "description": _DESCRIPTIONS[code]} for code in codes}


def quota_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for a route a tenant's quota can refuse (service.quotas): 429 for the queued-jobs
    quota, 409 for the devices and dataset-storage quotas."""
    descriptions = {
        409: "Conflict with the current state, or a quota that only a change frees up: `quota_exceeded` "
        "(`max_devices`, `max_dataset_storage_bytes`), details {quota, limit, current, requested}.",
        429: "Over the tenant's queued-jobs quota: `quota_exceeded` (`max_queued_jobs`), details {quota, limit, "
        "current, requested}.",
    }
    return {code: {"model": ErrorBody, "description": descriptions[code]} for code in codes}
