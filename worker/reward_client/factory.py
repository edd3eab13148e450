"""Pick the transport for a registered endpoint from its URL scheme."""

from __future__ import annotations

from typing import Any

from service.kit.urlpolicy import Resolver, is_grpc_url
from worker.reward_client.client import RemoteRewardSource
from worker.reward_client.config import RemoteRewardConfig
from worker.reward_client.grpc_source import GrpcRewardSource
from worker.reward_client.source import EndpointRewardSource, OnDegraded, OnRetry


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
