"""OpenAI's error shape for the routes under /openai/v1: ``{"error": {"message", "type", "param", "code"}}``.

The application's handlers call `render_*` for a request under `PREFIX`, so the rest of the API keeps its own
shape. OpenAI answers a bad request with 400 (we use 422 elsewhere), and names the offending field as a dotted
`param` in the request's terms (`method.reinforcement.hyperparameters.batch_size`, `training_file`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from service.kit.errors import DomainError

PREFIX = "/openai/v1"

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          409: "invalid_request_error", 429: "rate_limit_error"}
_UNION_TAG = re.compile(r"[\[\]()'\"]|^(int|float|str|bool|dict|list|none|literal.*|function-.*)$")

# Our job spec's fields in the terms of an OpenAI job request.
_SPEC_PARAMS = (
    (re.compile(r"^(spec\.)?train_dataset"), "training_file"),
    (re.compile(r"^(spec\.)?eval_dataset"), "validation_file"),
    (re.compile(r"^(spec\.)?base_model"), "model"),
    (re.compile(r"^(spec\.)?name$"), "suffix"),
    (re.compile(r"^(spec\.)?rewards(\[\d+\]|\.\d+)\.grader"), "method.reinforcement.grader"),
    (re.compile(r"^(spec\.)?hyperparameters"), "method.reinforcement.hyperparameters"),
)


class OpenAIInvalid(DomainError):
    """A request this door refuses, with the OpenAI `param` it concerns."""

    code = "invalid_request_error"
    http_status = 400

    def __init__(self, param: str | None, message: str, *, code: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message, details=[{"field": param, "message": message}])
        self.param = param
        if code is not None:
            self.code = code


def in_scope(request: Request) -> bool:
    path = request.url.path
    return path == PREFIX or path.startswith(PREFIX + "/")


def openai_param(field: str | None) -> str | None:
    """Our field path (``rewards[0].grader.operation``, ``train_dataset``) as the OpenAI request's param."""
    if not field:
        return None
    for pattern, replacement in _SPEC_PARAMS:
        if pattern.match(field):
            return pattern.sub(replacement, field, count=1)
    return field


def loc_param(loc: Sequence[Any]) -> str | None:
    """A pydantic error location as a dotted param, without the request part and union-member tags."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    kept = [p for p in parts if not _UNION_TAG.search(p)]
    return ".".join(kept) or None


def error_response(
    status: int, message: str, *, param: str | None, code: str | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    status = 400 if status == 422 else status
    kind = "server_error" if status >= 500 else _TYPES.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=body, headers=headers)


def render_domain(exc: DomainError) -> JSONResponse:
    param = exc.param if isinstance(exc, OpenAIInvalid) else None
    message = exc.message
    if param is None and isinstance(exc.details, list) and exc.details and isinstance(exc.details[0], dict):
        first = exc.details[0]
        field = first.get("field")
        param = openai_param(str(field)) if field else None
        if param and field and first.get("message"):
            message = f"{param}: {first['message']}"
    return error_response(exc.http_status, message, param=param, code=exc.code, headers=exc.http_headers() or None)


def render_validation(errors: Sequence[Any]) -> JSONResponse:
    first = errors[0] if errors else {}
    param = openai_param(loc_param(first.get("loc", ())))
    message = str(first.get("msg", "invalid request"))
    return error_response(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")
