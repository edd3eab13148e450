"""ASGI middleware timing every HTTP request into `grpo_http_request_duration_seconds`.

Plain ASGI rather than Starlette's BaseHTTPMiddleware: it does not buffer or re-wrap the response, so
SSE streams and large downloads pass through untouched. The latency of a streamed response is measured
up to its last byte.
"""

from __future__ import annotations

import re
import time

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.observability.metrics import HTTP_LATENCY

_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::[A-Za-z_]+)?\}")
UNMATCHED = "<unmatched>"  # one label for every path no route matched: keeps cardinality bounded


class PrometheusMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception escaping the app is answered 500 by the server

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            HTTP_LATENCY.labels(scope["method"], route_template(scope), str(status)).observe(
                time.perf_counter() - started
            )


def route_template(scope: Scope) -> str:
    """The matched route's full path template, e.g. `/v1/jobs/{job_id}`, or `<unmatched>`.

    Starlette stores the matched route in the scope. Its `path` may lack the prefix of the router it was
    included with (FastAPI's included routers keep their own paths), so the prefix is recovered from the
    concrete path: render the route's template with the request's path parameters and take what precedes
    it. Parameter values never end up in the label.
    """
    route = scope.get("route")
    template = getattr(route, "path", None) if isinstance(route, BaseRoute) else None
    if not isinstance(template, str):
        return UNMATCHED
    params = scope.get("path_params") or {}
    rendered = _PARAM.sub(lambda m: str(params.get(m.group(1), m.group(0))), template)
    path = str(scope.get("path", ""))
    prefix = path[: len(path) - len(rendered)] if rendered and path.endswith(rendered) else ""
    return prefix + template
