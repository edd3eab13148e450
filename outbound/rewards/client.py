"""`RemoteRewardSource`: a `RewardSource` that scores completions by calling a user's HTTP endpoint.

The batching, concurrency, retries, circuit breaker and cache are shared with the gRPC transport
(`outbound.rewards.source.EndpointRewardSource`); this module is the HTTP wire: a JSON body signed with
Standard Webhooks headers, POSTed through `PinnedResolutionTransport` (SSRF-checked, pinned to the validated
address, no redirects), the answer classified by `EndpointCaller`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import httpx

from outbound.rewards.config import RemoteRewardConfig
from outbound.rewards.endpoint import EndpointCaller
from outbound.rewards.protocol import RewardItem, RewardRequest, encode_request, parse_response
from outbound.rewards.source import (
    EndpointRewardSource,
    OnDegraded,
    OnRetry,
    Pending,
    RetryEvent,
    SourceStats,
)
from outbound.transport import PinnedResolutionTransport
from outbound.urlpolicy import Resolver, is_grpc_url

__all__ = ["HttpEndpointSource", "RemoteRewardSource", "RetryEvent", "SourceStats"]

logger = logging.getLogger(__name__)


class HttpEndpointSource(EndpointRewardSource[httpx.AsyncClient]):
    """An `EndpointRewardSource` over HTTP(S): signed POSTs through the pinned transport. Subclasses say how a
    batch is encoded (`_encode`) and how an answer is read (`parse`)."""

    def __init__(
        self,
        config: RemoteRewardConfig,
        *,
        name: str | None = None,
        parse: Callable[..., list[float | None]] = parse_response,
        on_retry: OnRetry | None = None,
        on_degraded: OnDegraded | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        if is_grpc_url(config.url):
            raise ValueError(f"{config.url!r} is a gRPC endpoint: use GrpcRewardSource (or build_remote_source)")
        caller = EndpointCaller(
            source=name or config.source_name,
            url=config.url,
            signer=config.signing_keys(),
            headers=dict(config.headers),
            max_bytes=config.max_response_bytes,
            parse=parse,
        )
        super().__init__(config, where=caller.where, on_retry=on_retry, on_degraded=on_degraded)
        self._caller = caller
        self._resolver = resolver
        if config.allow_private:
            logger.warning(
                "reward endpoint %s may resolve to loopback/private addresses (allow_private: development mode)",
                caller.source,
            )

    async def _attempt(
        self, conn: httpx.AsyncClient, *, msg_id: str, body: bytes, expected: int, budget_s: float
    ) -> list[float | None]:
        return await self._caller.attempt(conn, msg_id=msg_id, body=body, expected=expected, budget_s=budget_s)

    def _connect(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=PinnedResolutionTransport(
                allow_private=self.config.allow_private,
                resolver=self._resolver,
                limits=httpx.Limits(max_connections=self.config.max_concurrency),
            ),
            timeout=httpx.Timeout(
                self.config.timeout_s, connect=self.config.connect_timeout_s, pool=self.config.timeout_s
            ),
            follow_redirects=False,
            trust_env=False,
        )

    async def _disconnect(self, conn: httpx.AsyncClient) -> None:
        await conn.aclose()


class RemoteRewardSource(HttpEndpointSource):
    """Implements `contract.reward_types.RewardSource` for one HTTP(S) endpoint of the reward protocol within one job."""

    def _encode(self, batch: Sequence[Pending], step: int) -> bytes:
        request = RewardRequest(
            job_id=self.config.job_id,
            step=step,
            items=[
                RewardItem(
                    id=str(p.index),
                    prompt=p.item.prompt,
                    completion=p.item.completion,
                    metadata=p.item.extras,
                    group_id=p.item.group_id,
                    turns=p.item.turns,
                )
                for p in batch
            ],
        )
        return encode_request(request)
