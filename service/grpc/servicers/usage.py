"""UsageService: the same domain functions as /v1/usage (service.usage.service) and the jobs' usage, estimate
and budget routes (service.jobs.service)."""

from __future__ import annotations

from datetime import UTC
from typing import Any

import grpc
from pydantic import ValidationError

from contract.api.usage import UsageTotals
from contract.gen.grpo.v1 import job_spec_pb2, usage_pb2, usage_pb2_grpc
from contract.spec import JobBudget
from service.grpc.auth import current_tenant
from service.grpc.calls import in_session
from service.grpc.convert import job_spec_from_proto, job_to_proto, timestamp
from service.grpc.errors import from_validation_error, prefix_fields
from service.jobs import service as jobs
from service.jobs.schemas import job_out
from service.kit.errors import ValidationFailed
from service.usage import service

Context = grpc.aio.ServicerContext[Any, Any]
_GROUP_BY: dict[int, service.GroupBy] = {usage_pb2.USAGE_GROUP_BY_UNSPECIFIED: "day", usage_pb2.USAGE_GROUP_BY_DAY: "day",
             usage_pb2.USAGE_GROUP_BY_JOB: "job"}


def _totals(totals: UsageTotals) -> usage_pb2.UsageTotals:
    return usage_pb2.UsageTotals(**totals.model_dump(include=set(usage_pb2.UsageTotals.DESCRIPTOR.fields_by_name)))


def _budget_in(request: usage_pb2.UpdateJobBudgetRequest) -> JobBudget | None:
    if not request.HasField("budget"):
        return None
    values = {field.name: value for field, value in request.budget.ListFields()}
    try:
        return JobBudget.model_validate(values)
    except ValidationError as exc:
        raise from_validation_error(exc, prefix="budget") from exc


class UsageServicer(usage_pb2_grpc.UsageServiceServicer):
    async def GetUsage(self, request: usage_pb2.GetUsageRequest, context: Context) -> usage_pb2.GetUsageResponse:
        tenant = current_tenant()
        group_by = _GROUP_BY.get(request.group_by)
        if group_by is None:
            raise ValidationFailed(
                f"group_by: unknown value {request.group_by}",
                details=[{"field": "group_by", "message": "unknown value", "type": "enum"}],
            )
        start = request.start.ToDatetime(tzinfo=UTC) if request.HasField("start") else None
        end = request.end.ToDatetime(tzinfo=UTC) if request.HasField("end") else None
        report = await in_session(
            lambda s: service.report(s, tenant.tenant_id, start=start, end=end, group_by=group_by)
        )
        return usage_pb2.GetUsageResponse(
            start=timestamp(report.start), end=timestamp(report.end), totals=_totals(report.totals),
            groups=[usage_pb2.UsageGroup(key=g.key, totals=_totals(g)) for g in report.data],
        )

    async def GetJobUsage(
        self, request: usage_pb2.GetJobUsageRequest, context: Context
    ) -> usage_pb2.GetJobUsageResponse:
        tenant = current_tenant()
        usage = await in_session(lambda s: jobs.job_usage(s, tenant.tenant_id, request.job_id))
        budget = usage.budget.budget
        return usage_pb2.GetJobUsageResponse(
            job_id=usage.job_id,
            totals=_totals(usage.totals),
            budget=None if budget is None else job_spec_pb2.JobBudget(**budget.model_dump(exclude_none=True)),
            exhausted=usage.budget.exhausted or "",
            steps=[
                usage_pb2.StepUsage(step=s.step, attempt=s.attempt, usage=_totals(s), recorded_at=timestamp(s.recorded_at))
                for s in usage.steps
            ],
        )

    async def EstimateJob(
        self, request: usage_pb2.EstimateJobRequest, context: Context
    ) -> usage_pb2.EstimateJobResponse:
        tenant = current_tenant()
        spec = job_spec_from_proto(request.spec)
        try:
            estimate = await in_session(lambda s: jobs.estimate(s, tenant.tenant_id, spec))
        except ValidationFailed as exc:
            raise prefix_fields(exc, "spec") from exc  # reference checks name fields of the spec
        calibration = estimate.calibration
        return usage_pb2.EstimateJobResponse(
            steps=estimate.steps, tokens_generated=estimate.tokens_generated, tokens_trained=estimate.tokens_trained,
            tokens=estimate.tokens, reward_calls=estimate.reward_calls, device_seconds=estimate.device_seconds,
            calibration_source=calibration.source, calibration_bucket=calibration.bucket or "",
            calibration_steps_observed=calibration.steps_observed, seconds_per_token=calibration.seconds_per_token,
        )

    async def UpdateJobBudget(
        self, request: usage_pb2.UpdateJobBudgetRequest, context: Context
    ) -> usage_pb2.UpdateJobBudgetResponse:
        tenant = current_tenant()
        budget = _budget_in(request)
        job = await in_session(
            lambda s: job_out(jobs.set_job_budget(s, tenant.tenant_id, request.job_id, budget))
        )
        return usage_pb2.UpdateJobBudgetResponse(job=job_to_proto(job))
