"""Reward-function routes (thin): parse, call the domain service, render."""

from __future__ import annotations

from fastapi import APIRouter, Response

from contract.api.rewards import (
    RewardFunctionList,
    RewardFunctionOut,
    RewardFunctionWithSecret,
    RewardTestResult,
)
from service.kit.deps import SessionDep
from service.kit.paging import RESOURCES, Limit
from service.kit.params import Cursor, PathId
from service.rewards import dry_run, service
from service.rewards.schemas import (
    RewardFunctionCreate,
    RewardTestRequest,
    reward_function_out,
    reward_function_with_secret,
)
from service.tenants.auth import CurrentTenant

router = APIRouter(tags=["reward functions"])


@router.post(
    "/reward-functions",
    status_code=201,
    response_model=RewardFunctionWithSecret,
    responses={
        422: {
            "description": "Invalid field, or URL refused by the policy (`url_rejected`; in production the host "
            "must resolve to public addresses only)."
        }
    },
)
def create_reward_function(
    body: RewardFunctionCreate, session: SessionDep, tenant: CurrentTenant
) -> RewardFunctionWithSecret:
    """Register a remote reward endpoint. The response carries `signing_secret`, shown only here."""
    return reward_function_with_secret(service.create_reward_function(session, tenant.tenant_id, body))


@router.get("/reward-functions", response_model=RewardFunctionList)
def list_reward_functions(
    session: SessionDep, tenant: CurrentTenant, limit: Limit = RESOURCES.default, after: Cursor = None
) -> RewardFunctionList:
    """The tenant's reward functions, newest first (cursor pagination). Never includes secrets."""
    rows, has_more = service.list_reward_functions(session, tenant.tenant_id, limit=limit, after=after)
    return RewardFunctionList(
        data=[reward_function_out(r) for r in rows],
        has_more=has_more,
        next_after=rows[-1].id if has_more and rows else None,
    )


@router.get("/reward-functions/{reward_function_id}", response_model=RewardFunctionOut)
def get_reward_function(
    reward_function_id: PathId, session: SessionDep, tenant: CurrentTenant
) -> RewardFunctionOut:
    return reward_function_out(
        service.get_reward_function(session, tenant.tenant_id, reward_function_id)
    )


@router.delete("/reward-functions/{reward_function_id}", status_code=204, response_class=Response)
def delete_reward_function(reward_function_id: PathId, session: SessionDep, tenant: CurrentTenant) -> Response:
    """Remove from the registry; jobs already submitted with it keep using it until they finish."""
    service.delete_reward_function(session, tenant.tenant_id, reward_function_id)
    return Response(status_code=204)


@router.post("/reward-functions/{reward_function_id}/rotate-secret", response_model=RewardFunctionWithSecret)
def rotate_secret(
    reward_function_id: PathId, session: SessionDep, tenant: CurrentTenant
) -> RewardFunctionWithSecret:
    """Issue a new signing secret (returned once). Until `previous_secret_expires_at`
    (GRPO_SECRET_ROTATION_OVERLAP_SECONDS, default 24 h) requests carry signatures with both the new and the
    replaced secret, so the endpoint can switch to the new one at any time within that window."""
    return reward_function_with_secret(
        service.rotate_secret(session, tenant.tenant_id, reward_function_id)
    )


@router.post(
    "/reward-functions/{reward_function_id}/test",
    response_model=RewardTestResult,
    responses={
        422: {
            "description": "The endpoint answered but not usably, with the code a job would fail with: "
            "`reward_endpoint_invalid_response`, `reward_endpoint_http_error`, `reward_endpoint_grpc_error`, "
            "`reward_endpoint_url_rejected`; or an invalid body."
        },
        424: {"description": "`reward_endpoint_unavailable`: no answer (refused, timed out, 5xx); a retry may help."},
    },
)
def test_reward_function(
    reward_function_id: PathId, body: RewardTestRequest, session: SessionDep, tenant: CurrentTenant
) -> RewardTestResult:
    """Call the endpoint now with sample items, exactly as a training job would (signed, SSRF-checked,
    validated) but with one attempt per request, and return its rewards and the latency."""
    return dry_run.test_reward_function(session, tenant.tenant_id, reward_function_id, body.items)
