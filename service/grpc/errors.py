"""The one place where failures become gRPC statuses (the REST twin is service/app.py's handlers).

Domain errors carry their own `grpc_status` (service/kit/errors.py); this module only renders them:
status code + message, and trailing metadata with the stable error code (`grpo-error-code`) and, for
validation errors, the offending field path (`grpo-error-field`) so clients need not parse messages.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, NoReturn

import grpc
from pydantic import ValidationError

from service.kit.errors import DomainError, ValidationFailed
from service.kit.ids import new_id

log = logging.getLogger(__name__)

ERROR_CODE_KEY = "grpo-error-code"
ERROR_FIELD_KEY = "grpo-error-field"
ERROR_DETAILS_KEY = "grpo-error-details"
REQUEST_ID_KEY = "grpo-request-id"  # of an INTERNAL error: the id its log record carries (REST: X-Request-ID)  # REST's error.details as JSON (e.g. [{line, error}] of a dataset)
# Metadata shares the default 8 KiB header budget: larger details are cut to their first entries.
MAX_DETAILS_BYTES = 4096


def field_path(loc: Sequence[Any]) -> str:
    """Pydantic error location -> dotted field path ("rewards.0.regex_match.pattern")."""
    return ".".join(str(part) for part in loc)


def from_validation_error(exc: ValidationError, *, prefix: str = "") -> ValidationFailed:
    """A pydantic ValidationError as the domain's ValidationFailed, naming the first bad field.

    `prefix` is prepended to every field path (e.g. "spec" when validating CreateJobRequest.spec).
    """
    errors = [
        {"field": ".".join(p for p in (prefix, field_path(e.get("loc", ()))) if p), "message": e.get("msg", "")}
        for e in exc.errors()
    ]
    first = errors[0] if errors else {"field": prefix, "message": "invalid value"}
    label = f"{first['field']}: " if first["field"] else ""
    return ValidationFailed(f"{label}{first['message']}", details=errors)


def prefix_fields(exc: ValidationFailed, prefix: str) -> ValidationFailed:
    """The same error with its field paths under `prefix` (REST bodies are the spec; RPCs nest it).

    `header.*` fields (e.g. header.Idempotency-Key) are not part of the message and are left alone.
    """
    details = exc.details if isinstance(exc.details, list) else None
    if not details:
        return exc
    moved = [
        {**d, "field": f"{prefix}.{d['field']}"}
        if isinstance(d, dict) and isinstance(d.get("field"), str) and not d["field"].startswith("header.")
        else d
        for d in details
    ]
    message = exc.message
    old, new = details[0], moved[0]
    if isinstance(old, dict) and old is not new and message.startswith(f"{old['field']}:"):
        message = new["field"] + message[len(old["field"]) :]
    prefixed = ValidationFailed(message, details=moved)
    prefixed.code = exc.code
    return prefixed


def _field_of(exc: DomainError) -> str | None:
    """The field a validation error is about, from its details (REST's [{"field": ...}] shape)."""
    details = exc.details
    if isinstance(details, list) and details and isinstance(details[0], dict):
        details = details[0]
    if isinstance(details, dict):
        field = details.get("field")
        if isinstance(field, str) and field:
            return field
    return None


def status_of(exc: DomainError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(status code, message, trailing metadata) for a domain error."""
    trailers = [(ERROR_CODE_KEY, exc.code)]
    field = _field_of(exc)
    if field is not None:
        trailers.append((ERROR_FIELD_KEY, field))
    details = _details_json(exc.details)
    if details is not None:
        trailers.append((ERROR_DETAILS_KEY, details))
    trailers.extend(exc.grpc_trailers())
    return exc.grpc_status, exc.message, tuple(trailers)


def _details_json(details: Any) -> str | None:
    """ASCII JSON of the details, dropping trailing list entries until it fits MAX_DETAILS_BYTES."""
    if details is None:
        return None
    items = details if isinstance(details, list) else None
    text = json.dumps(details, default=str)
    while items and len(text) > MAX_DETAILS_BYTES:
        items = items[:-1]
        text = json.dumps(items, default=str)
    return text if len(text) <= MAX_DETAILS_BYTES else None


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], exc: DomainError) -> NoReturn:
    """End the call with the status the domain error stands for."""
    code, message, trailers = status_of(exc)
    await context.abort(code, message, trailing_metadata=trailers)
    raise AssertionError("context.abort returned")  # abort always raises; this keeps NoReturn honest


@asynccontextmanager
async def rendered_errors(context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
    """Wrap a call: domain errors -> their status, pydantic errors -> INVALID_ARGUMENT, the rest -> INTERNAL."""
    try:
        yield
    except DomainError as exc:
        await abort_with(context, exc)
    except ValidationError as exc:
        await abort_with(context, from_validation_error(exc))
    except grpc.aio.AbortError:
        raise  # already a status (context.abort was called)
    except Exception:
        # A bug, not an expected failure: log it with its traceback and a request id, tell the client only the id.
        request_id = new_id("req")
        log.exception("unhandled error in gRPC handler (request id %s)", request_id)
        await context.abort(
            grpc.StatusCode.INTERNAL,
            f"internal error (request id {request_id})",
            trailing_metadata=((ERROR_CODE_KEY, "internal"), (REQUEST_ID_KEY, request_id)),
        )
