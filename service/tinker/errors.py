"""Errors of the routes under /tinker in the shape the `tinker` SDK reads: `{"error", "category", "detail"}`,
`category` "user" for a request to fix, "server" for ours.

Status codes follow the SDK's retry rules: it retries 408, 409, 429 and 5xx for minutes, so a request that can
never succeed as sent (a seq_id that is out of order: our 409) answers 400, which it raises at once.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from service.kit.errors import DomainError

PREFIX = "/tinker"
_NOT_RETRIED = {409: 400}


def in_scope(request: Request) -> bool:
    path = request.url.path
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_response(status: int, message: str, *, code: str, details: Any = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    category = "server" if status >= 500 else "user"
    return JSONResponse(
        status_code=_NOT_RETRIED.get(status, status),
        content={"error": message, "category": category, "detail": message, "code": code, "details": details},
        headers=headers,
    )


def render_domain(exc: DomainError) -> JSONResponse:
    return error_response(exc.http_status, exc.message, code=exc.code, details=exc.details,
                          headers=exc.http_headers() or None)


def render_validation(errors: list[dict[str, Any]]) -> JSONResponse:
    """A body that does not parse: the first field at fault named as the request's own path."""
    fields = [
        {"field": ".".join(str(p) for p in e.get("loc", ()) if p != "body"), "message": e.get("msg", "")}
        for e in errors
    ]
    first = fields[0] if fields else {"field": "", "message": "invalid request"}
    return error_response(400, f"{first['field']}: {first['message']}", code="validation_error", details=fields)
