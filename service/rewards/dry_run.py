"""Dry run of a registered reward endpoint: ``POST /v1/reward-functions/{id}/test`` and gRPC TestRewardFunction.

Calls the endpoint once, now, exactly as a training job would (the worker's client: the same transport
chosen by the URL scheme, Standard Webhooks signing, SSRF policy with the address pinned, strict response
validation, batches of at most max_batch_size), but with a single attempt and no cache, so the caller sees
the precise failure at once. Requests carry ``job_id "test"`` and ``step 0``.

A failing endpoint is the caller's configuration problem, not ours, and is reported with the same error code
a job would fail with:

=================================== ====== ==================== =============================================
code                                HTTP   gRPC                 when
=================================== ====== ==================== =============================================
reward_endpoint_invalid_response    422    FAILED_PRECONDITION  it answered, but not a valid reward response
reward_endpoint_http_error          422    FAILED_PRECONDITION  it answered a non-retryable HTTP status
reward_endpoint_grpc_error          422    FAILED_PRECONDITION  it answered a non-retryable gRPC status
reward_endpoint_url_rejected        422    FAILED_PRECONDITION  its host now resolves to a refused address
reward_endpoint_unavailable         424    UNAVAILABLE          no answer: refused, timed out, 5xx/UNAVAILABLE
=================================== ====== ==================== =============================================

422 for an endpoint that answered badly: the request to us was fine, but the registered endpoint cannot be
used as it is, and retrying will not change that. 424 (Failed Dependency) when it gave no usable answer at
all, which a retry might fix: the failure is the registered endpoint's, so a 4xx, not a 5xx (which would say
this service failed, and which clients and monitors treat as such).
"""

from __future__ import annotations

import grpc
from pydantic import ValidationError
from sqlalchemy.orm import Session

from contract.api.rewards import RewardTestResult
from contract.reward_types import RewardError, RewardUnavailable
from outbound.rewards import RemoteRewardConfig, RewardItem, test_endpoint
from outbound.rewards.errors import RewardEndpointGrpcError, RewardEndpointHTTPError
from service.kit.config import get_settings
from service.kit.db import utcnow
from service.kit.errors import DomainError
from service.rewards.schemas import RewardTestItem
from service.rewards.service import get_reward_function, previous_secret_in_overlap, run_blocking

TEST_JOB_ID = "test"


class RewardEndpointFailed(DomainError):
    """The endpoint answered, but not usably (or may not be called): fix the endpoint or its registration."""

    code = "reward_endpoint_invalid_response"
    http_status = 422
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class RewardEndpointUnreachable(DomainError):
    """No answer from the endpoint (connection refused, timeout, 5xx / UNAVAILABLE)."""

    code = "reward_endpoint_unavailable"
    http_status = 424
    grpc_status = grpc.StatusCode.UNAVAILABLE


def endpoint_config(session: Session, tenant_id: str, rf_id: str) -> RemoteRewardConfig:
    """The client configuration a job of this tenant would use for `rf_id`. Raises NotFound."""
    row = get_reward_function(session, tenant_id, rf_id)
    try:
        return RemoteRewardConfig(
            reward_function_id=row.id,
            url=row.url,
            secret=row.signing_secret,  # pydantic wraps it in SecretStr
            previous_secret=previous_secret_in_overlap(
                row.previous_signing_secret, row.previous_secret_expires_at, utcnow()
            ),
            previous_secret_until=row.previous_secret_expires_at,
            job_id=TEST_JOB_ID,
            timeout_s=row.timeout_s,
            max_batch_size=row.max_batch_size,
            max_concurrency=row.max_concurrency,
            headers={str(k): str(v) for k, v in row.headers.items()},
            allow_private=bool(get_settings().allow_private_reward_urls),
        )
    except ValidationError as exc:
        # E.g. an http:// function registered in development, tested by a server now in production mode, or
        # header values stored before registration checked them.
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        failure = RewardEndpointFailed(
            f"reward function {rf_id!r} cannot be called under the current policy: "
            f"{where + ': ' if where else ''}{error['msg']}",
            details={"reward_function_id": rf_id},
        )
        failure.code = "reward_endpoint_url_rejected"
        raise failure from exc


def call_endpoint(config: RemoteRewardConfig, items: list[RewardTestItem]) -> RewardTestResult:
    """Score `items` with one attempt per batch; a failure as a DomainError carrying the job's error code."""
    wire = [
        RewardItem(id=str(i), prompt=it.prompt, completion=it.completion, metadata=it.metadata, group_id=it.group_id)
        for i, it in enumerate(items)
    ]
    try:
        rewards, latency_ms = run_blocking(test_endpoint(config, wire))
    except RewardUnavailable as exc:
        raise RewardEndpointUnreachable(str(exc), details={"reward_function_id": config.reward_function_id}) from exc
    except RewardError as exc:
        details: dict[str, object] = {"reward_function_id": config.reward_function_id}
        if isinstance(exc, RewardEndpointHTTPError | RewardEndpointGrpcError):
            details["status"] = exc.status
        failure = RewardEndpointFailed(str(exc), details=details)
        failure.code = exc.code
        raise failure from exc
    return RewardTestResult(rewards=rewards, latency_ms=round(latency_ms, 3))


def test_reward_function(
    session: Session, tenant_id: str, rf_id: str, items: list[RewardTestItem]
) -> RewardTestResult:
    """Score `items` with the tenant's reward function `rf_id` now (NotFound for another tenant's id).

    The row is read first; the call follows in the same unit of work (it writes nothing). Blocking: run it
    from a worker thread (REST's threadpool, gRPC's `in_session`).
    """
    return call_endpoint(endpoint_config(session, tenant_id, rf_id), items)


test_reward_function.__test__ = False  # type: ignore[attr-defined]  # not a pytest test despite the name
