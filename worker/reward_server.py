"""Helper for users writing reward servers in Python (any framework).

Framework-agnostic::

    from worker.reward_server import verify_and_parse, RewardRequestRejected, encode_response

    request = verify_and_parse(SECRET, headers, raw_body)   # RewardRequest, or raises RewardRequestRejected
    return encode_response([score(item) for item in request.items])

Or a ready-made ASGI app (Starlette) serving ``POST`` on any path::

    app = make_reward_app(SECRET, lambda request: [score(i) for i in request.items])
    # uvicorn module:app

Verification uses the `standardwebhooks` package: HMAC-SHA256 over ``{id}.{timestamp}.{body}`` and a
timestamp within 5 minutes of now (older or newer requests are refused, which stops replays).
Torch-free; depends only on pydantic, standardwebhooks and (for the app) starlette.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import ValidationError
from standardwebhooks.webhooks import WebhookVerificationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outbound.rewards.protocol import RewardRequest, encode_response
from outbound.signing import load_secret

__all__ = ["RewardRequest", "RewardRequestRejected", "encode_response", "make_reward_app", "verify_and_parse"]

ScoreFn = Callable[[RewardRequest], list[float | None] | Awaitable[list[float | None]]]


class RewardRequestRejected(ValueError):
    """The request is not authentic (status 401) or not a valid reward request (status 422)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


def verify_and_parse(secret: str, headers: Mapping[str, str], body: bytes) -> RewardRequest:
    """Check the Standard Webhooks signature of `body`, then parse it. Raises RewardRequestRejected."""
    signer = load_secret(secret)
    lowered = {name.lower(): value for name, value in headers.items()}
    try:
        signer.verify(body, lowered, json_parse=False)
    except WebhookVerificationError as exc:
        raise RewardRequestRejected(f"signature verification failed: {exc}", status=401) from exc
    except (ValueError, UnicodeDecodeError) as exc:  # a malformed signature header or non-UTF-8 body
        raise RewardRequestRejected(
            f"signature verification failed: malformed request ({exc})", status=401
        ) from exc
    try:
        return RewardRequest.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise RewardRequestRejected(f"invalid reward request: {where}: {first['msg']}", status=422) from exc


def make_reward_app(secret: str, score_fn: ScoreFn) -> Starlette:
    """An ASGI app answering signed reward requests on any path with `score_fn(request)`'s rewards."""
    load_secret(secret)  # fail at start-up, not on the first request

    async def handle(request: Request) -> Response:
        body = await request.body()
        try:
            parsed = verify_and_parse(secret, request.headers, body)
        except RewardRequestRejected as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)
        rewards: Any
        if inspect.iscoroutinefunction(score_fn):
            rewards = await score_fn(parsed)
        else:  # a plain function may be slow (a model, a sandbox): keep it off the event loop
            rewards = await run_in_threadpool(score_fn, parsed)
            if inspect.isawaitable(rewards):  # a plain function that returned a coroutine
                rewards = await rewards
        if len(rewards) != len(parsed.items):
            raise ValueError(f"score_fn returned {len(rewards)} rewards for {len(parsed.items)} items")
        return Response(encode_response(list(rewards)), media_type="application/json")

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[Route("/healthz", healthz, methods=["GET"]), Route("/{path:path}", handle, methods=["POST"])]
    )
