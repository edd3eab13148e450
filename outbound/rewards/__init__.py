"""Client for remote reward endpoints (torch-free): protocol, signing, SSRF-safe transport, retries, cache.

Public API::

    from outbound.rewards import RemoteRewardConfig, RemoteRewardSource, RetryEvent, test_endpoint

`RemoteRewardSource(config, on_retry=..., resolver=...)` (HTTP webhooks) and `GrpcRewardSource(...)`
(grpc:// and grpcs:// URLs, the RewardService protocol) implement `contract.reward_types.RewardSource`;
`build_remote_source(config, ...)` picks one by the URL's scheme.
"""

from outbound.rewards.client import RemoteRewardSource, RetryEvent, SourceStats
from outbound.rewards.config import RemoteRewardConfig
from outbound.rewards.errors import (
    RewardEndpointGrpcError,
    RewardEndpointHTTPError,
    RewardEndpointInvalidResponse,
    RewardEndpointRefused,
    RewardError,
    RewardUnavailable,
)
from outbound.rewards.factory import build_remote_source
from outbound.rewards.grpc_source import GrpcRewardSource
from outbound.rewards.protocol import RewardItem, RewardRequest, RewardResponse
from outbound.rewards.testing import test_endpoint

__all__ = [
    "GrpcRewardSource",
    "RemoteRewardConfig",
    "RemoteRewardSource",
    "RetryEvent",
    "RewardEndpointGrpcError",
    "RewardEndpointHTTPError",
    "RewardEndpointInvalidResponse",
    "RewardEndpointRefused",
    "RewardError",
    "RewardItem",
    "RewardRequest",
    "RewardResponse",
    "RewardUnavailable",
    "SourceStats",
    "build_remote_source",
    "test_endpoint",
]
