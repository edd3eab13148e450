"""The last line of REST error handling: an exception no handler rendered (a bug) becomes the documented
JSON error, a 500 carrying a request id that is also logged with the traceback.

Plain ASGI, installed inside the metrics middleware and outside FastAPI's own handlers. It does not
re-raise: Starlette's ServerErrorMiddleware would answer `text/plain` and re-raise, and the server would
then close the keep-alive connection. Once a response has started (a stream failing mid-body) nothing can
be answered any more, so the error propagates and the server ends that connection.
"""

from __future__ import annotations

import json
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.kit.ids import new_id

log = logging.getLogger("grpo.unhandled")
REQUEST_ID_HEADER = "X-Request-ID"


class UnhandledErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            request_id = new_id("req")
            log.exception("unhandled error in %s %s (request id %s)", scope["method"], scope["path"], request_id)
            if started:
                raise
            await send_internal_error(send, request_id)


async def send_internal_error(send: Send, request_id: str) -> None:
    body = json.dumps(
        {
            "error": {
                "code": "internal_error",
                "message": f"internal server error (request id {request_id})",
                "details": {"request_id": request_id},
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 500,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (REQUEST_ID_HEADER.lower().encode(), request_id.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
