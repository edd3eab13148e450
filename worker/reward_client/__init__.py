"""Client for remote reward endpoints (torch-free): protocol, signing, SSRF-safe transport, retries, cache.

Public API::

    from worker.reward_client import RemoteRewardConfig, RemoteRewardSource, RetryEvent, test_endpoint

`RemoteRewardSource(config, on_retry=..., resolver=...)` (HTTP webhooks) and `GrpcRewardSource(...)`
(grpc:// and grpcs:// URLs, the RewardService protocol) implement `worker.grpo.reward_types.RewardSource`;
`build_remote_source(config, ...)` picks one by the URL's scheme.
"""

from worker.reward_client.client import RemoteRewardSource, RetryEvent, SourceStats
from worker.reward_client.config import RemoteRewardConfig
from worker.reward_client.errors import (
    RewardEndpointGrpcError,
    RewardEndpointHTTPError,
    RewardEndpointInvalidResponse,
    RewardEndpointRefused,
    RewardError,
    RewardUnavailable,
)
from worker.reward_client.factory import build_remote_source
from worker.reward_client.grpc_source import GrpcRewardSource
from worker.reward_client.protocol import RewardItem, RewardRequest, RewardResponse
from worker.reward_client.testing import test_endpoint

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
