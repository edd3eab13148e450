"""UsageService over a real channel (SQLite and PostgreSQL): the same sums, estimates and budget changes as
REST, and bad budgets or windows INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from fastapi.testclient import TestClient
from google.protobuf.timestamp_pb2 import Timestamp

from contract.gen.grpo.v1 import job_spec_pb2, jobs_pb2, jobs_pb2_grpc, usage_pb2, usage_pb2_grpc
from service.kit.db import session_scope
from service.kit.queue import set_job_queue
from service.usage import service as usage
from service.usage.service import StepUsageIn
from tests.grpc.helpers import bearer, error_code, error_details, error_field
from tests.grpc.test_jobs import spec_message
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, load_job, make_dataset, start_job


@pytest.fixture
def queue(settings: object) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


def _record(job_id: str, step: int, attempt: int, tokens: int) -> None:
    with session_scope() as session:
        job = session.merge(load_job(job_id))
        usage.record_step(session, job, step, attempt, StepUsageIn(
            tokens_generated=tokens, tokens_trained=3 * tokens, reward_calls=8, device_seconds=0.25,
            completions=8, completion_capacity=128, num_iterations=1, parameters=1_000_000,
        ))


def _ts(value: datetime) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(value)
    return stamp


async def _fails(call: object, request: object, tenant: TenantHeaders) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(request, metadata=bearer(tenant.api_key))  # type: ignore[operator]
    return err.value


class TestUsageService:
    async def test_usage_matches_rest_and_budget_round_trips(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, tenant_b: TenantHeaders, client: TestClient,
        queue: RecordingQueue,
    ) -> None:
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        stub = usage_pb2_grpc.UsageServiceStub(channel)
        spec = spec_message(make_dataset(tenant_a.tenant_id))
        spec.budget.max_tokens = 1000
        job = (await jobs.CreateJob(jobs_pb2.CreateJobRequest(spec=spec), metadata=bearer(tenant_a.api_key))).job
        assert job.spec.budget.max_tokens == 1000 and not job.spec.budget.HasField("max_device_seconds")
        attempt = start_job(job.id)
        _record(job.id, 1, attempt, 10)
        _record(job.id, 2, attempt, 5)

        report = await stub.GetUsage(
            usage_pb2.GetUsageRequest(group_by=usage_pb2.USAGE_GROUP_BY_JOB), metadata=bearer(tenant_a.api_key)
        )
        rest = client.get("/v1/usage", params={"group_by": "job"}, headers=tenant_a).json()
        assert [(g.key, g.totals.tokens_generated, g.totals.tokens, g.totals.steps) for g in report.groups] == [
            (g["key"], g["tokens_generated"], g["tokens"], g["steps"]) for g in rest["data"]
        ] == [(job.id, 15, 60, 2)]
        assert report.totals.device_seconds == rest["totals"]["device_seconds"] == 0.5

        per_job = await stub.GetJobUsage(usage_pb2.GetJobUsageRequest(job_id=job.id), metadata=bearer(tenant_a.api_key))
        assert [(s.step, s.attempt, s.usage.tokens_generated) for s in per_job.steps] == [(1, 1, 10), (2, 1, 5)]
        assert per_job.budget.max_tokens == 1000 and per_job.exhausted == ""

        updated = await stub.UpdateJobBudget(
            usage_pb2.UpdateJobBudgetRequest(job_id=job.id, budget=job_spec_pb2.JobBudget(max_tokens=60)),
            metadata=bearer(tenant_a.api_key),
        )
        assert updated.job.spec.budget.max_tokens == 60
        per_job = await stub.GetJobUsage(usage_pb2.GetJobUsageRequest(job_id=job.id), metadata=bearer(tenant_a.api_key))
        assert per_job.exhausted == "budget.max_tokens"
        removed = await stub.UpdateJobBudget(
            usage_pb2.UpdateJobBudgetRequest(job_id=job.id), metadata=bearer(tenant_a.api_key)
        )
        assert not removed.job.spec.HasField("budget")

        other = await _fails(stub.GetJobUsage, usage_pb2.GetJobUsageRequest(job_id=job.id), tenant_b)
        assert other.code() == grpc.StatusCode.NOT_FOUND
        empty = await stub.GetUsage(usage_pb2.GetUsageRequest(), metadata=bearer(tenant_b.api_key))
        assert empty.totals.tokens == 0 and list(empty.groups) == []

    async def test_estimate_matches_rest(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        stub = usage_pb2_grpc.UsageServiceStub(channel)
        dataset = make_dataset(tenant_a.tenant_id)
        estimate = await stub.EstimateJob(
            usage_pb2.EstimateJobRequest(spec=spec_message(dataset, max_completion_length=16)),
            metadata=bearer(tenant_a.api_key),
        )
        rest = client.post("/v1/jobs/estimate", headers=tenant_a, json={
            "name": "tiny-run", "base_model": "builtin:tiny", "train_dataset": dataset,
            "rewards": [{"type": "builtin", "name": "exact_match"}],
            "hyperparameters": {"max_steps": 10, "num_generations": 4, "prompts_per_step": 2,
                                "max_completion_length": 16},
        }).json()
        assert (estimate.steps, estimate.tokens_generated, estimate.tokens, estimate.calibration_source) == (
            rest["steps"], rest["tokens_generated"], rest["tokens"], "default"
        )
        assert estimate.device_seconds == pytest.approx(rest["device_seconds"])


class TestBadInput:
    @pytest.mark.parametrize(
        ("budget", "field"),
        [
            (job_spec_pb2.JobBudget(max_tokens=0), "budget.max_tokens"),
            (job_spec_pb2.JobBudget(max_tokens=10**15 + 1), "budget.max_tokens"),
            (job_spec_pb2.JobBudget(max_device_seconds=-1), "budget.max_device_seconds"),
            (job_spec_pb2.JobBudget(max_device_seconds=float("inf")), "budget.max_device_seconds"),
            (job_spec_pb2.JobBudget(), "budget"),
        ],
    )
    async def test_bad_budgets_name_the_field(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue,
        budget: job_spec_pb2.JobBudget, field: str,
    ) -> None:
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        stub = usage_pb2_grpc.UsageServiceStub(channel)
        spec = spec_message(make_dataset(tenant_a.tenant_id))
        spec.budget.CopyFrom(budget)
        created = await _fails(jobs.CreateJob, jobs_pb2.CreateJobRequest(spec=spec), tenant_a)
        assert created.code() == grpc.StatusCode.INVALID_ARGUMENT, created.details()
        assert error_field(created) == f"spec.{field}"

        spec.ClearField("budget")
        job = (await jobs.CreateJob(jobs_pb2.CreateJobRequest(spec=spec), metadata=bearer(tenant_a.api_key))).job
        patched = await _fails(
            stub.UpdateJobBudget, usage_pb2.UpdateJobBudgetRequest(job_id=job.id, budget=budget), tenant_a
        )
        assert patched.code() == grpc.StatusCode.INVALID_ARGUMENT, patched.details()
        assert error_code(patched) == "validation_error" and error_field(patched) == field

    async def test_window_and_finished_job(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        stub = usage_pb2_grpc.UsageServiceStub(channel)
        now = datetime.now(UTC)
        backwards = usage_pb2.GetUsageRequest(start=_ts(now), end=_ts(now - timedelta(days=1)))
        error = await _fails(stub.GetUsage, backwards, tenant_a)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(error) == "end"
        error = await _fails(stub.GetUsage, usage_pb2.GetUsageRequest(group_by=7), tenant_a)  # type: ignore[arg-type]
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(error) == "group_by"

        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        spec = spec_message(make_dataset(tenant_a.tenant_id))
        job = (await jobs.CreateJob(jobs_pb2.CreateJobRequest(spec=spec), metadata=bearer(tenant_a.api_key))).job
        await jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id=job.id), metadata=bearer(tenant_a.api_key))
        error = await _fails(stub.UpdateJobBudget, usage_pb2.UpdateJobBudgetRequest(
            job_id=job.id, budget=job_spec_pb2.JobBudget(max_tokens=5)), tenant_a)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION

        estimate = await _fails(stub.EstimateJob, usage_pb2.EstimateJobRequest(spec=spec_message("ds_nope")), tenant_a)
        assert estimate.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(estimate) == "spec.train_dataset"


class TestMonthlyCapAtSubmission:
    async def test_create_job_over_the_cap_is_failed_precondition_naming_it(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        from sqlalchemy import func, select

        from service.jobs.models import Job
        from service.usage import repository

        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        spec = spec_message(make_dataset(tenant_a.tenant_id))
        job = (await jobs.CreateJob(jobs_pb2.CreateJobRequest(spec=spec), metadata=bearer(tenant_a.api_key))).job
        _record(job.id, 1, start_job(job.id), tokens=5)  # 20 tokens
        with session_scope() as session:
            repository.set_tenant_budget(
                session, tenant_a.tenant_id, monthly_max_device_seconds=None, monthly_max_tokens=20
            )
        refused = await _fails(jobs.CreateJob, jobs_pb2.CreateJobRequest(spec=spec), tenant_a)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.details()
        assert error_code(refused) == "budget_exhausted"
        assert error_details(refused) == {"field": "tenant.monthly_max_tokens", "limit": 20, "used": 20}
        with session_scope() as session:
            assert session.scalar(select(func.count()).where(Job.tenant_id == tenant_a.tenant_id)) == 1
        assert [job_id for job_id, _ in queue.sent] == [job.id]
