"""Errors of remote reward endpoints, each with the stable code the job's error will carry.

All derive from `contract.reward_types.RewardError` (fails the job) except `RewardUnavailable`
(re-exported here), which pauses the job instead.
"""

from __future__ import annotations

from contract.reward_types import RewardError, RewardUnavailable

__all__ = [
    "RewardEndpointGrpcError",
    "RewardEndpointHTTPError",
    "RewardEndpointInvalidResponse",
    "RewardEndpointRefused",
    "RewardError",
    "RewardUnavailable",
]


class RewardEndpointInvalidResponse(RewardError):
    """The endpoint answered 2xx with something that is not a valid reward response."""

    code = "reward_endpoint_invalid_response"


class RewardEndpointHTTPError(RewardError):
    """The endpoint answered a status that retrying will not fix (4xx other than 429, a redirect, 501...)."""

    code = "reward_endpoint_http_error"

    def __init__(self, source: str, message: str, *, status: int) -> None:
        super().__init__(source, message)
        self.status = status


class RewardEndpointRefused(RewardError):
    """The SSRF policy refused the endpoint's address at call time (see `outbound.urlpolicy`)."""

    code = "reward_endpoint_url_rejected"


class RewardEndpointGrpcError(RewardError):
    """A gRPC endpoint answered a status that retrying will not fix (INVALID_ARGUMENT, UNAUTHENTICATED...)."""

    code = "reward_endpoint_grpc_error"

    def __init__(self, source: str, message: str, *, status: str) -> None:
        super().__init__(source, message)
        self.status = status  # the grpc.StatusCode name, e.g. "PERMISSION_DENIED"
