"""Routes (thin): usage reports. A job's usage, estimate and budget are jobs routes (service.jobs.endpoints)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from contract.api.usage import UsageReport
from service.kit.deps import SessionDep
from service.kit.openapi import error_responses
from service.tenants.auth import CurrentTenant
from service.usage import service

router = APIRouter(tags=["usage"])


@router.get(
    "/usage",
    response_model=UsageReport,
    summary="Your usage, by day or by job",
    responses=error_responses(401, 422),
)
def get_usage(
    tenant: CurrentTenant,
    session: SessionDep,
    start: Annotated[
        datetime | None, Query(description="Inclusive, ISO 8601 (UTC when no offset). Default: this month's start.")
    ] = None,
    end: Annotated[datetime | None, Query(description="Exclusive, ISO 8601. Default: now.")] = None,
    group_by: Annotated[service.GroupBy, Query(description="`day` (UTC) or `job`.")] = "day",
) -> UsageReport:
    """Exact sums of the per-step usage records whose step was recorded in [start, end)."""
    return service.report(session, tenant.tenant_id, start=start, end=end, group_by=group_by)
