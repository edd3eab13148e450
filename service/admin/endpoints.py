"""Quota administration routes (thin): `/v1/admin/tenants/{tenant_id}/quotas`, admin-scoped keys only."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from contract.api.quotas import QuotaLimits, QuotasOut
from service.admin import quotas as admin
from service.kit.deps import SessionDep
from service.kit.openapi import ErrorBody, error_responses
from service.kit.params import PathId
from service.kit.queue import JobQueue, get_job_queue
from service.tenants.auth import AdminTenant

router = APIRouter(tags=["admin"])

QueueDep = Annotated[JobQueue, Depends(get_job_queue)]

_FORBIDDEN: dict[int | str, dict[str, Any]] = {
    403: {
        "model": ErrorBody,
        "description": "The key lacks the `admin` scope (`insufficient_scope`), or changing quotas needs an "
        "operator tenant's key (`operator_required`).",
    }
}


@router.get(
    "/admin/tenants/{tenant_id}/quotas",
    response_model=QuotasOut,
    responses={**error_responses(401, 404), **_FORBIDDEN},
)
def get_tenant_quotas(tenant_id: PathId, session: SessionDep, caller: AdminTenant) -> QuotasOut:
    """A tenant's quota limits, its overrides and what it uses now. Your own tenant's, or any tenant's with an
    operator tenant's key."""
    return admin.read_quotas(session, caller, tenant_id)


@router.put(
    "/admin/tenants/{tenant_id}/quotas",
    response_model=QuotasOut,
    responses={**error_responses(401, 404, 422), **_FORBIDDEN},
)
def put_tenant_quotas(
    tenant_id: PathId, body: QuotaLimits, session: SessionDep, caller: AdminTenant, queue: QueueDep
) -> QuotasOut:
    """Replace a tenant's quota overrides (null: the service default). Needs an operator tenant's admin key."""
    return admin.write_quotas(session, caller, tenant_id, body, queue)
