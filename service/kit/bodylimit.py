"""A request-body size limit for the JSON routes, enforced while the body arrives.

Plain ASGI: a declared Content-Length over the limit is answered 413 before anything is read; otherwise
the `http.request` messages are counted as the route reads them, and the first one that passes the limit
raises `BodyTooLarge` instead of being handed on, so at most the limit plus one message is ever held.
Routes that stream their own uploads under their own limit (dataset uploads) are exempt.

(The framework's own limit answers a declared over-limit Content-Length with a plain-text 413, replacing
the JSON error body every other failure has; hence this small middleware.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.kit.errors import PayloadTooLarge

# Digits of the largest Content-Length worth parsing: anything longer is over every limit.
_MAX_DIGITS = 19


def payload_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body exceeds the {limit}-byte limit (GRPO_MAX_REQUEST_BODY_BYTES)",
        details={"limit_bytes": limit},
    )


class BodyTooLarge(HTTPException):
    """Raised from `receive` mid-body. An HTTPException because FastAPI turns any other exception raised
    while it reads the body into a 400; the app's handler renders it as `payload_too_large`."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"request body exceeds the {limit}-byte limit")
        self.limit = limit


class BodyLimitMiddleware:
    """`max_bytes` is asked at each request, so that building the app reads no settings: like the lifespan, the
    middleware takes the limit from the settings the app is served with."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: Callable[[], int], exempt: Collection[tuple[str, str]] = ()
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = frozenset(exempt)  # (method, path) pairs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in self.exempt:
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes()
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and (len(declared) > _MAX_DIGITS or int(declared) > limit):
            error = payload_too_large(limit)
            await JSONResponse(error.to_body(), status_code=error.http_status)(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted_receive, send)
