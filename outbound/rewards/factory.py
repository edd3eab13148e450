"""Pick the transport for a registered endpoint from its URL scheme."""

from __future__ import annotations

from typing import Any

from outbound.rewards.client import RemoteRewardSource
from outbound.rewards.config import RemoteRewardConfig
from outbound.rewards.grpc_source import GrpcRewardSource
from outbound.rewards.source import EndpointRewardSource, OnDegraded, OnRetry
from outbound.urlpolicy import Resolver, is_grpc_url


def build_remote_source(
    config: RemoteRewardConfig,
    *,
    on_retry: OnRetry | None = None,
    on_degraded: OnDegraded | None = None,
    resolver: Resolver | None = None,
) -> EndpointRewardSource[Any]:
    """`GrpcRewardSource` for grpc:// and grpcs:// URLs, `RemoteRewardSource` (HTTP webhooks) otherwise."""
    if is_grpc_url(config.url):
        return GrpcRewardSource(config, on_retry=on_retry, on_degraded=on_degraded, resolver=resolver)
    return RemoteRewardSource(config, on_retry=on_retry, on_degraded=on_degraded, resolver=resolver)
