"""Quota administration, as REST (`/v1/admin/tenants/{id}/quotas`), gRPC (QuotaService) and `grpo admin quotas`
call it.

Who may: any `admin`-scoped key reads its own tenant's quotas; changing them, or reading another tenant's,
takes an `admin` key of an operator tenant (settings `operator_tenants`): a tenant's own admin must not be
able to raise the limits the service sets for it. The server's shell (`grpo admin`) may do anything.
"""

from __future__ import annotations

import grpc
from sqlalchemy.orm import Session

from contract.api.quotas import QuotaLimits, QuotasOut
from service.datasets import repository as datasets_repository
from service.jobs import repository as jobs_repository
from service.jobs import service as jobs_service
from service.kit.config import get_settings
from service.kit.errors import DomainError, NotFound
from service.kit.queue import JobQueue
from service.quotas import service as quotas
from service.tenants.auth import TenantContext


class OperatorRequired(DomainError):
    code = "operator_required"
    http_status = 403
    grpc_status = grpc.StatusCode.PERMISSION_DENIED


def is_operator(caller: TenantContext) -> bool:
    operators = get_settings().operator_tenants
    return caller.tenant_id in operators or caller.tenant_name in operators


def quotas_of(session: Session, tenant_id: str) -> QuotasOut:
    """A tenant's limits, overrides and what its jobs and datasets use (NotFound if there is no such tenant)."""
    return quotas.get_quotas(session, tenant_id, jobs_repository.job_load, datasets_repository.stored_bytes)


def read_quotas(session: Session, caller: TenantContext, tenant_id: str) -> QuotasOut:
    """A tenant's limits, overrides and use. Another tenant's reads as not found unless the caller is an
    operator (no existence oracle)."""
    if tenant_id != caller.tenant_id and not is_operator(caller):
        raise NotFound("tenant", tenant_id)
    return quotas_of(session, tenant_id)


def write_quotas(
    session: Session, caller: TenantContext | None, tenant_id: str, overrides: QuotaLimits, queue: JobQueue
) -> QuotasOut:
    """Replace a tenant's overrides; `caller` None is the server's shell. Jobs a raised running or devices limit
    lets start get a delivery once this commits."""
    if caller is not None and not is_operator(caller):
        if tenant_id != caller.tenant_id:
            raise NotFound("tenant", tenant_id)
        raise OperatorRequired(
            "only an admin key of an operator tenant (settings operator_tenants) may change quotas",
            details={"tenant_id": tenant_id},
        )
    quotas.set_overrides(session, tenant_id, overrides)
    result = quotas_of(session, tenant_id)
    jobs_service.enqueue_waiting(session, tenant_id, queue)
    return result
