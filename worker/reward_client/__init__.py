"""Client for remote reward endpoints (torch-free): protocol, signing, SSRF-safe transport, retries, cache.

Public API::

    from worker.reward_client import RemoteRewardConfig, RemoteRewardSource, RetryEvent, test_endpoint

`RemoteRewardSource(config, on_retry=..., resolver=...)` implements `worker.grpo.reward_types.RewardSource`.
"""

from worker.reward_client.client import RemoteRewardSource, RetryEvent, SourceStats
from worker.reward_client.config import RemoteRewardConfig
from worker.reward_client.errors import (
    RewardEndpointHTTPError,
    RewardEndpointInvalidResponse,
    RewardEndpointRefused,
    RewardError,
    RewardUnavailable,
)
from worker.reward_client.protocol import RewardItem, RewardRequest, RewardResponse
from worker.reward_client.testing import test_endpoint

__all__ = [
    "RemoteRewardConfig",
    "RemoteRewardSource",
    "RetryEvent",
    "RewardEndpointHTTPError",
    "RewardEndpointInvalidResponse",
    "RewardEndpointRefused",
    "RewardError",
    "RewardItem",
    "RewardRequest",
    "RewardResponse",
    "RewardUnavailable",
    "SourceStats",
    "test_endpoint",
]
