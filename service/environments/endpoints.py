"""Environment routes (thin): parse, call the domain service, render."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from contract.api.environments import EnvironmentList, EnvironmentOut, EnvironmentWithSecret
from service.environments import service
from service.environments.schemas import EnvironmentCreate, environment_out, environment_with_secret
from service.kit.deps import SessionDep
from service.kit.paging import RESOURCES, Limit
from service.kit.params import Cursor, PathId
from service.tenants.auth import CurrentTenant

router = APIRouter(tags=["environments"])

_PROBE_ERRORS: dict[int | str, dict[str, Any]] = {
    422: {"description": "Invalid field; URL refused by the policy (`url_rejected`); or the server answered, but "
          "not as an OpenEnv server does (`environment_invalid_response`)."},
    424: {"description": "`environment_unreachable`: no answer, a 5xx, or `/health` not healthy."},
}


@router.post("/environments", status_code=201, response_model=EnvironmentWithSecret, responses=_PROBE_ERRORS)
def create_environment(body: EnvironmentCreate, session: SessionDep, tenant: CurrentTenant) -> EnvironmentWithSecret:
    """Register an OpenEnv server. Its `/health` and `/schema` are read now (signed, SSRF-checked) and shown;
    the response carries `signing_secret`, shown only here."""
    return environment_with_secret(service.create_environment(session, tenant.tenant_id, body))


@router.get("/environments", response_model=EnvironmentList)
def list_environments(
    session: SessionDep, tenant: CurrentTenant, limit: Limit = RESOURCES.default, after: Cursor = None
) -> EnvironmentList:
    """The tenant's environments, newest first (cursor pagination). Never includes secrets."""
    rows, has_more = service.list_environments(session, tenant.tenant_id, limit=limit, after=after)
    return EnvironmentList(data=[environment_out(r) for r in rows], has_more=has_more,
                           next_after=rows[-1].id if has_more and rows else None)


@router.get("/environments/{environment_id}", response_model=EnvironmentOut)
def get_environment(environment_id: PathId, session: SessionDep, tenant: CurrentTenant) -> EnvironmentOut:
    return environment_out(service.get_environment(session, tenant.tenant_id, environment_id))


@router.post("/environments/{environment_id}/check", response_model=EnvironmentOut, responses=_PROBE_ERRORS)
def check_environment(environment_id: PathId, session: SessionDep, tenant: CurrentTenant) -> EnvironmentOut:
    """Read the server's `/health` and `/schema` again and record them; on failure nothing changes."""
    return environment_out(service.check_environment(session, tenant.tenant_id, environment_id))


@router.delete("/environments/{environment_id}", status_code=204, response_class=Response)
def delete_environment(environment_id: PathId, session: SessionDep, tenant: CurrentTenant) -> Response:
    """Remove from the registry; jobs already submitted with it keep using it until they finish."""
    service.delete_environment(session, tenant.tenant_id, environment_id)
    return Response(status_code=204)


@router.post("/environments/{environment_id}/rotate-secret", response_model=EnvironmentWithSecret)
def rotate_secret(environment_id: PathId, session: SessionDep, tenant: CurrentTenant) -> EnvironmentWithSecret:
    """Issue a new signing secret (returned once); until `previous_secret_expires_at` requests carry signatures
    with both the new and the replaced secret."""
    return environment_with_secret(service.rotate_secret(session, tenant.tenant_id, environment_id))
