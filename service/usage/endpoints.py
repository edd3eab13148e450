"""Routes (thin): usage reports, job estimates and budgets."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Body, Query

from contract.api.jobs import JobOut
from contract.api.usage import Estimate, JobUsage, UsageReport
from contract.spec import JobSpec
from service.jobs.schemas import job_out
from service.kit.deps import SessionDep
from service.kit.openapi import error_responses
from service.kit.params import PathId
from service.tenants.auth import CurrentTenant
from service.usage import service
from service.usage.schemas import JobPatch

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


@router.get(
    "/jobs/{job_id}/usage",
    response_model=JobUsage,
    summary="A job's usage, per step, and its budget",
    responses=error_responses(401, 404),
)
def get_job_usage(job_id: PathId, tenant: CurrentTenant, session: SessionDep) -> JobUsage:
    return service.job_usage(session, tenant.tenant_id, job_id)


@router.post(
    "/jobs/estimate",
    response_model=Estimate,
    summary="Expected tokens and device-seconds of a spec",
    responses=error_responses(401, 422),
)
def estimate_job(spec: Annotated[JobSpec, Body()], tenant: CurrentTenant, session: SessionDep) -> Estimate:
    """Validated like a submission; nothing is created. From what workers measured on the same base model (or
    models of its size), else the documented defaults (`calibration.source` says which)."""
    return service.estimate(session, tenant.tenant_id, spec)


@router.patch(
    "/jobs/{job_id}",
    response_model=JobOut,
    summary="Change a job's budget",
    responses=error_responses(401, 404, 409, 422),
)
def patch_job(job_id: PathId, patch: JobPatch, tenant: CurrentTenant, session: SessionDep) -> JobOut:
    """Replace the budget of an unfinished job; resume a job paused with `budget_exhausted` afterwards."""
    return job_out(service.set_job_budget(session, tenant.tenant_id, job_id, patch.budget))
