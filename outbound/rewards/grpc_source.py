"""`GrpcRewardSource`: a `RewardSource` for endpoints registered as ``grpc://`` / ``grpcs://`` URLs.

The endpoint implements ``grpo.v1.RewardService/Score`` (proto/grpo/v1/reward.proto). Batching, concurrency,
retries, circuit breaker and cache are the HTTP client's (`EndpointRewardSource`); this module is the wire:

- the batch is serialised once (deterministically) and those exact bytes are signed and sent (the channel's
  serialiser is the identity), so the signature covers what the server receives;
- Standard Webhooks ``webhook-id`` / ``webhook-timestamp`` / ``webhook-signature`` go out as call metadata,
  signed over base64 of the serialised request; user headers go out as metadata too (lower-cased);
- UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED are retried (``grpc-retry-pushback-ms`` trailing
  metadata is honoured like HTTP's Retry-After); any other status fails the job
  (`RewardEndpointGrpcError`). UNKNOWN/INTERNAL (an exception in the server) are not retried: unlike a
  proxy's 5xx they mean the scorer itself failed on this input;
- SSRF: every attempt resolves the host and checks every answer (`outbound.urlpolicy`), then talks to the
  validated address itself: the channel target is ``ipv4:<ip>:<port>`` / ``ipv6:[<ip>]:<port>`` (no second
  lookup, so DNS rebinding cannot redirect it) while ``:authority``, TLS SNI and certificate verification use
  the name (``grpc.default_authority`` / ``grpc.ssl_target_name_override``). HTTP proxies from the
  environment and gRPC's own retries are disabled; responses larger than ``max_response_bytes`` are refused.

The channels are grpcio's thread-based ones, awaited through a future bridge, not ``grpc.aio``: grpc.aio
binds its process-wide completion-queue poller to the event loop that first used it, so aio channels made
on short-lived loops (``asyncio.run`` in the API's dry run, successive loops in a worker) would stall or
break every other aio user in the process (the gRPC API server) once that loop closes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from contract.gen.grpo.v1 import reward_pb2
from outbound.rewards.config import RemoteRewardConfig
from outbound.rewards.endpoint import TransientFailure
from outbound.rewards.errors import (
    RewardEndpointGrpcError,
    RewardEndpointInvalidResponse,
    RewardEndpointRefused,
)
from outbound.rewards.protocol import ResponseInvalid, check_rewards
from outbound.rewards.source import EndpointRewardSource, OnDegraded, OnRetry, Pending
from outbound.signing import grpc_signed_content, sign_headers
from outbound.urlpolicy import Resolver, UrlRejected, host_and_port, is_grpc_url, resolve_and_check

logger = logging.getLogger(__name__)

SCORE_METHOD = "/grpo.v1.RewardService/Score"
RETRY_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's server-side retry delay hint (gRFC A6)
_METADATA_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")
_EXCERPT_CHARS = 300


def metadata_problem(name: str, value: str) -> str | None:
    """Why a user header cannot be sent as gRPC metadata, or None when it can."""
    key = name.lower()
    if not key or not set(key) <= _METADATA_KEY_CHARS or key.startswith("grpc-"):
        return f"header {name!r} is not a valid gRPC metadata key (a-z, 0-9, '-', '_', '.'; no 'grpc-' prefix)"
    if key.endswith("-bin"):
        return f"header {name!r}: binary ('-bin') metadata is not supported"
    if not all(0x20 <= ord(ch) < 0x7F for ch in value):
        return f"header {name!r} value must be printable ASCII to travel as gRPC metadata"
    return None


def encode_score_request(config: RemoteRewardConfig, batch: Sequence[Pending], step: int) -> bytes:
    """The ScoreRequest for `batch`, serialised deterministically (map entries sorted)."""
    request = reward_pb2.ScoreRequest(
        job_id=config.job_id,
        step=step,
        reward_function_id=config.reward_function_id,
        items=[
            reward_pb2.ScoreItem(
                prompt=p.item.prompt,
                completion=p.item.completion,
                completion_ids=list(p.item.completion_ids),
                extras_json={k: json.dumps(v, ensure_ascii=False, default=str) for k, v in p.item.extras.items()},
                group_id=p.item.group_id,
                index=p.index,
                turns_json=None if p.item.turns is None else json.dumps(p.item.turns, ensure_ascii=False),
            )
            for p in batch
        ],
    )
    return request.SerializeToString(deterministic=True)


def decode_score_response(raw: bytes, *, expected: int) -> list[float | None]:
    """Rewards from a serialised ScoreResponse (unset value = abstain). Raises ResponseInvalid."""
    try:
        response = reward_pb2.ScoreResponse.FromString(raw)
    except DecodeError as exc:
        raise ResponseInvalid(f"response is not a ScoreResponse message ({exc})") from exc
    values = [reward.value if reward.HasField("value") else None for reward in response.rewards]
    return check_rewards({"rewards": values}, expected=expected)


def _pushback_s(metadata: Any) -> float | None:
    """The server's retry delay hint in seconds, if it sent a valid one."""
    for key, value in metadata or ():
        if key == PUSHBACK_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return int(text) / 1000.0 if text.isdigit() else None
    return None


async def call_unary(
    channel: grpc.Channel, method: str, body: bytes, *, timeout_s: float, metadata: Sequence[tuple[str, str | bytes]]
) -> bytes:
    """One unary call with raw bytes in and out, awaited from any event loop; cancelling it cancels the RPC.

    No (de)serialisers: the signed bytes go out exactly as they are, the answer comes back unparsed.
    """
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[bytes] = loop.create_future()
    score: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(method)
    future: grpc.Future[bytes] = score.future(body, timeout=timeout_s, metadata=tuple(metadata))

    def settle(done: grpc.Future[bytes]) -> None:  # on the event loop
        if waiter.done():
            return
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        if error is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(done.result())

    def on_done(done: grpc.Future[bytes]) -> None:  # on a gRPC thread
        try:
            loop.call_soon_threadsafe(settle, done)
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting any more
            pass

    future.add_done_callback(on_done)
    try:
        return await waiter
    except asyncio.CancelledError:
        future.cancel()
        raise


class PinnedChannels:
    """Channels to validated addresses of one endpoint, one per address, made on demand.

    Each `get()` resolves the host and checks every answer before a byte is sent, then uses the channel of
    the first answer that already has one (round-robin DNS reorders answers; switching channels on every
    call would close connections under calls in flight), else opens one to the first answer.
    """

    def __init__(
        self,
        url: str,
        *,
        allow_private: bool,
        resolver: Resolver | None,
        root_certificates: bytes | None,
        max_response_bytes: int,
    ) -> None:
        self.tls = url.lower().startswith("grpcs:")
        self.host, self.port = host_and_port(url)
        self._allow_private = allow_private
        self._resolver = resolver
        self._root_certificates = root_certificates
        self._max_response_bytes = max_response_bytes
        self._channels: dict[str, grpc.Channel] = {}  # target ("ipv4:1.2.3.4:443") -> channel

    async def get(self) -> grpc.Channel:
        """A channel to a validated address of the host; raises UrlRejected if any answer is refused."""
        addresses = await resolve_and_check(
            self.host, self.port, allow_private=self._allow_private, resolver=self._resolver
        )
        targets = [f"ipv4:{ip}:{self.port}" if ip.version == 4 else f"ipv6:[{ip}]:{self.port}" for ip in addresses]
        for target in targets:
            if target in self._channels:
                return self._channels[target]
        channel = self._channels[targets[0]] = self._open(targets[0])
        return channel

    def _open(self, target: str) -> grpc.Channel:
        name = self.host if ":" not in self.host else f"[{self.host}]"
        default_port = 443 if self.tls else 80
        authority = name if self.port == default_port else f"{name}:{self.port}"
        options: list[tuple[str, Any]] = [
            ("grpc.enable_http_proxy", 0),  # a proxy would resolve the name itself (and could be anywhere)
            ("grpc.enable_retries", 0),  # retries are ours: re-signed, counted and reported as events
            ("grpc.max_receive_message_length", self._max_response_bytes),
            ("grpc.default_authority", authority),  # :authority carries the name, not the pinned IP
        ]
        if not self.tls:
            return grpc.insecure_channel(target, options=options)
        # SNI and the certificate check use the name, while the socket goes to the validated IP.
        options.append(("grpc.ssl_target_name_override", self.host))
        credentials = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
        return grpc.secure_channel(target, credentials, options=options)

    def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


class GrpcRewardSource(EndpointRewardSource[PinnedChannels]):
    """Implements `contract.reward_types.RewardSource` for one gRPC endpoint within one job.

    `root_certificates` (PEM) replaces gRPC's default trust roots for grpcs (a private CA; tests).
    """

    connection_survives_loops = True  # grpcio's thread-based channels are not bound to an event loop

    def __init__(
        self,
        config: RemoteRewardConfig,
        *,
        on_retry: OnRetry | None = None,
        on_degraded: OnDegraded | None = None,
        resolver: Resolver | None = None,
        root_certificates: bytes | None = None,
    ) -> None:
        if not is_grpc_url(config.url):
            raise ValueError(f"{config.url!r} is not a grpc:// or grpcs:// URL: use RemoteRewardSource")
        for name, value in config.headers.items():
            problem = metadata_problem(name, value)
            if problem is not None:
                raise ValueError(problem)
        super().__init__(config, where=config.url, on_retry=on_retry, on_degraded=on_degraded)
        self._signer = config.signing_keys()
        self._metadata = tuple((name.lower(), value) for name, value in config.headers.items())
        self._resolver = resolver
        self._root_certificates = root_certificates
        if config.allow_private:
            logger.warning(
                "reward endpoint %s may resolve to loopback/private addresses (allow_private: development mode)",
                self.name,
            )

    def _encode(self, batch: Sequence[Pending], step: int) -> bytes:
        return encode_score_request(self.config, batch, step)

    def _connect(self) -> PinnedChannels:
        return PinnedChannels(
            self.config.url,
            allow_private=self.config.allow_private,
            resolver=self._resolver,
            root_certificates=self._root_certificates,
            max_response_bytes=self.config.max_response_bytes,
        )

    async def _disconnect(self, conn: PinnedChannels) -> None:
        conn.close()

    async def _attempt(
        self, conn: PinnedChannels, *, msg_id: str, body: bytes, expected: int, budget_s: float
    ) -> list[float | None]:
        signing = sign_headers(self._signer, msg_id, grpc_signed_content(body), now=datetime.now(tz=UTC))
        metadata = (*self._metadata, *signing.items())
        lookup_s = self.config.connect_timeout_s
        try:
            async with asyncio.timeout(lookup_s):
                channel = await conn.get()
            # The deadline (connect + read budget) travels to the server as grpc-timeout.
            raw = await call_unary(channel, SCORE_METHOD, body, timeout_s=budget_s, metadata=metadata)
        except UrlRejected as exc:
            raise RewardEndpointRefused(self.name, f"{self.where}: {exc.message}") from exc
        except TimeoutError as exc:
            raise TransientFailure(f"name resolution took longer than {lookup_s:g} s") from exc
        except grpc.RpcError as exc:
            raise self._classify(exc) from exc
        try:
            return decode_score_response(raw, expected=expected)
        except ResponseInvalid as exc:
            raise self._invalid(str(exc)) from exc

    def _classify(self, exc: grpc.RpcError) -> Exception:
        """A failed call as TransientFailure (retried) or the RewardError that fails the job."""
        # Errors of grpcio's calls are also grpc.Call (code, details, trailing metadata).
        call = exc if isinstance(exc, grpc.Call) else None
        code = call.code() if call is not None else grpc.StatusCode.UNKNOWN
        details = ((call.details() if call is not None else None) or str(exc))[:_EXCERPT_CHARS]
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
            # Our own receive limit, not the server's back-pressure: retrying would get the same answer.
            return self._invalid(f"response exceeds the {self.config.max_response_bytes}-byte limit ({details})")
        if code in RETRY_CODES:
            pushback = _pushback_s(call.trailing_metadata() if call is not None else None)
            return TransientFailure(f"gRPC {code.name}: {details}", retry_after=pushback)
        return RewardEndpointGrpcError(
            self.name, f"{self.where} answered gRPC {code.name}: {details!r}", status=code.name
        )

    def _invalid(self, what: str) -> RewardEndpointInvalidResponse:
        return RewardEndpointInvalidResponse(self.name, f"{self.where}: {what}")
