"""Helper for users writing gRPC reward servers (``grpo.v1.RewardService/Score``) in Python.

The gRPC twin of `worker.reward_server`. With grpc.aio (or a thread-pool ``grpc.server``, same call)::

    from worker.grpc_reward_server import add_reward_service

    server = grpc.aio.server()
    add_reward_service(server, SECRET, lambda request: [score(item) for item in request.items])
    server.add_insecure_port("[::]:50051")   # add_secure_port(...) for a grpcs:// registration
    await server.start()

`request` is a ``reward_pb2.ScoreRequest`` (prompt, completion, completion_ids, extras_json, group_id, index
per item); return one float or None (abstain) per item, in order.

Any framework: `verify_score_request(secret, metadata, raw_bytes)` checks the Standard Webhooks signature
(``webhook-id``, ``webhook-timestamp``, ``webhook-signature`` metadata; HMAC-SHA256 over
``{id}.{timestamp}.{base64(raw_bytes)}``, timestamp within 5 minutes) and parses the request. The
signature covers the serialised bytes, so the handler registered here receives them raw (no deserialiser)
and parses only after verifying: re-serialising a parsed message is not guaranteed to give the same bytes.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from standardwebhooks.webhooks import WebhookVerificationError

from contract.gen.grpo.v1 import reward_pb2
from outbound.signing import grpc_signed_content, load_secret
from worker.reward_server import RewardRequestRejected

__all__ = [
    "RewardRequestRejected",
    "ScoreFn",
    "add_reward_service",
    "make_aio_score_handler",
    "make_score_handler",
    "verify_score_request",
]

SyncScoreFn = Callable[[reward_pb2.ScoreRequest], list[float | None]]
ScoreFn = Callable[[reward_pb2.ScoreRequest], list[float | None] | Awaitable[list[float | None]]]
SERVICE = "grpo.v1.RewardService"
_STATUS_OF_REJECTION = {401: grpc.StatusCode.UNAUTHENTICATED, 422: grpc.StatusCode.INVALID_ARGUMENT}

Metadata = Mapping[str, str] | Iterable[tuple[str, str | bytes]]


def verify_score_request(secret: str, metadata: Metadata, raw: bytes) -> reward_pb2.ScoreRequest:
    """Check the signature of the serialised request `raw`, then parse it. Raises RewardRequestRejected."""
    signer = load_secret(secret)
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    headers = {key.lower(): value.decode() if isinstance(value, bytes) else value for key, value in pairs}
    try:
        signer.verify(grpc_signed_content(raw), headers, json_parse=False)
    except WebhookVerificationError as exc:
        raise RewardRequestRejected(f"signature verification failed: {exc}", status=401) from exc
    except ValueError as exc:  # a malformed signature or timestamp value
        raise RewardRequestRejected(f"signature verification failed: malformed metadata ({exc})", status=401) from exc
    try:
        request = reward_pb2.ScoreRequest.FromString(raw)
    except DecodeError as exc:
        raise RewardRequestRejected(f"invalid reward request: not a ScoreRequest ({exc})", status=422) from exc
    if not request.items:
        raise RewardRequestRejected("invalid reward request: items is empty", status=422)
    return request


def _response(request: reward_pb2.ScoreRequest, rewards: Any) -> reward_pb2.ScoreResponse | str:
    """The ScoreResponse for `rewards`, or why they are not a valid answer to `request` (a server bug)."""
    rewards = list(rewards)
    if len(rewards) != len(request.items) or any(r is not None and not math.isfinite(r) for r in rewards):
        return f"score_fn returned {len(rewards)} rewards for {len(request.items)} items (each finite or None)"
    return reward_pb2.ScoreResponse(
        rewards=[reward_pb2.Reward() if r is None else reward_pb2.Reward(value=float(r)) for r in rewards]
    )


def _generic_handler(behavior: Any) -> grpc.GenericRpcHandler:
    handler: grpc.RpcMethodHandler[bytes, reward_pb2.ScoreResponse] = grpc.unary_unary_rpc_method_handler(
        behavior,
        request_deserializer=None,  # the raw bytes: they are what was signed
        response_serializer=reward_pb2.ScoreResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"Score": handler})


def make_score_handler(secret: str, score_fn: SyncScoreFn) -> grpc.GenericRpcHandler:
    """A handler for a thread-pool `grpc.server` that verifies every call before `score_fn` sees it."""
    load_secret(secret)  # fail at start-up, not on the first call

    def score(raw: bytes, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        try:
            request = verify_score_request(secret, context.invocation_metadata() or (), raw)
        except RewardRequestRejected as exc:
            context.abort(_STATUS_OF_REJECTION.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT), str(exc))
        answer = _response(request, score_fn(request))
        if isinstance(answer, str):  # the server's own bug: say so instead of an answer the worker refuses
            context.abort(grpc.StatusCode.INTERNAL, answer)
        return answer

    return _generic_handler(score)


def make_aio_score_handler(secret: str, score_fn: ScoreFn) -> grpc.GenericRpcHandler:
    """The same for a `grpc.aio.server`; a plain `score_fn` runs in a thread, off the event loop."""
    load_secret(secret)

    async def score(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> reward_pb2.ScoreResponse:
        try:
            request = verify_score_request(secret, context.invocation_metadata() or (), raw)
        except RewardRequestRejected as exc:
            await context.abort(_STATUS_OF_REJECTION.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT), str(exc))
        rewards: Any
        if inspect.iscoroutinefunction(score_fn):
            rewards = await score_fn(request)
        else:  # a plain function may be slow (a model, a sandbox): keep it off the event loop
            rewards = await asyncio.to_thread(score_fn, request)
            if inspect.isawaitable(rewards):
                rewards = await rewards
        answer = _response(request, rewards)
        if isinstance(answer, str):
            await context.abort(grpc.StatusCode.INTERNAL, answer)
        return answer

    return _generic_handler(score)


def add_reward_service(server: grpc.Server | grpc.aio.Server, secret: str, score_fn: ScoreFn) -> None:
    """Serve RewardService.Score on `server` (grpc.aio or thread-pool grpc) with signature verification.

    With a thread-pool server `score_fn` must be a plain function.
    """
    if isinstance(server, grpc.aio.Server):
        server.add_generic_rpc_handlers((make_aio_score_handler(secret, score_fn),))
    else:
        if inspect.iscoroutinefunction(score_fn):
            raise TypeError("a thread-pool grpc.server needs a plain score_fn (use grpc.aio.server for async)")
        server.add_generic_rpc_handlers((make_score_handler(secret, score_fn),))  # type: ignore[arg-type]
