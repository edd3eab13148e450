"""JobService: the same domain functions as /v1/jobs (service.jobs.service), plus WatchJob (service.grpc.watch)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import grpc
from sqlalchemy.orm import Session

from contract.api.jobs import EventOut, JobOut, SampleOut
from contract.gen.grpo.v1 import jobs_pb2, jobs_pb2_grpc
from contract.spec import JobSpec
from service.grpc.auth import bearer_token, current_tenant, metadata_value
from service.grpc.calls import in_session
from service.grpc.convert import (
    event_to_proto,
    job_spec_from_proto,
    job_status,
    job_to_proto,
    metrics_by_step,
    sample_to_proto,
)
from service.grpc.errors import prefix_fields
from service.grpc.validation import int32_field
from service.grpc.watch import watch_job
from service.jobs import service
from service.jobs.idempotency import request_hash, run_idempotent
from service.jobs.schemas import event_out, job_out, sample_out
from service.kit.errors import ValidationFailed
from service.kit.paging import EVENTS, METRIC_POINTS, RESOURCES, page_size
from service.kit.queue import get_job_queue
from service.kit.reads import THREADED_READS, Reads
from service.storage import get_storage
from service.tenants.auth import reauthenticate

Context = grpc.aio.ServicerContext[Any, Any]
IDEMPOTENCY_KEY = "idempotency-key"  # the REST Idempotency-Key header, as metadata


def _create(session: Session, tenant_id: str, spec: JobSpec, key: str | None) -> JobOut:
    """REST's create_job route, transport aside: the same service call and the same idempotency records.

    A key used over REST replays over gRPC and vice versa (same request hash of the validated spec).
    """

    def work(s: Session) -> tuple[int, dict[str, Any]]:
        job = service.create_job(s, tenant_id, spec, get_job_queue())
        return 201, job_out(job).model_dump(mode="json")

    if key is None:
        return JobOut.model_validate(work(session)[1])
    outcome = run_idempotent(session, tenant_id, key, request_hash(spec.model_dump(mode="json")), work)
    return JobOut.model_validate(outcome.body)


class JobServicer(jobs_pb2_grpc.JobServiceServicer):
    def __init__(self, reads: Reads = THREADED_READS) -> None:
        self._reads = reads  # the polled reads (GetJob, ListJobs, WatchJob): see kit.reads

    async def CreateJob(self, request: jobs_pb2.CreateJobRequest, context: Context) -> jobs_pb2.CreateJobResponse:
        tenant = current_tenant()
        spec = job_spec_from_proto(request.spec)
        key = metadata_value(context.invocation_metadata(), IDEMPOTENCY_KEY)
        try:
            job = await in_session(lambda s: _create(s, tenant.tenant_id, spec, key))
        except ValidationFailed as exc:
            raise prefix_fields(exc, "spec") from exc  # reference checks name fields of the spec
        return jobs_pb2.CreateJobResponse(job=job_to_proto(job))

    async def GetJob(self, request: jobs_pb2.GetJobRequest, context: Context) -> jobs_pb2.GetJobResponse:
        tenant = current_tenant()
        job = await service.read_job(self._reads, tenant.tenant_id, request.job_id)
        return jobs_pb2.GetJobResponse(job=job_to_proto(job))

    async def ListJobs(self, request: jobs_pb2.ListJobsRequest, context: Context) -> jobs_pb2.ListJobsResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, RESOURCES)
        status = job_status(request.state)
        jobs, has_more = await service.list_jobs(
            self._reads, tenant.tenant_id, status=status, limit=limit, after=request.page_token or None
        )
        return jobs_pb2.ListJobsResponse(
            jobs=[job_to_proto(j) for j in jobs], next_page_token=jobs[-1].id if has_more and jobs else ""
        )

    async def CancelJob(self, request: jobs_pb2.CancelJobRequest, context: Context) -> jobs_pb2.CancelJobResponse:
        tenant = current_tenant()
        job = await in_session(lambda s: job_out(service.cancel_job(s, tenant.tenant_id, request.job_id)))
        return jobs_pb2.CancelJobResponse(job=job_to_proto(job))

    async def DeleteJob(self, request: jobs_pb2.DeleteJobRequest, context: Context) -> jobs_pb2.DeleteJobResponse:
        tenant = current_tenant()
        await in_session(lambda s: service.delete_job(s, tenant.tenant_id, request.job_id, get_storage()))
        return jobs_pb2.DeleteJobResponse()

    async def PauseJob(self, request: jobs_pb2.PauseJobRequest, context: Context) -> jobs_pb2.PauseJobResponse:
        tenant = current_tenant()
        job = await in_session(lambda s: job_out(service.pause_job(s, tenant.tenant_id, request.job_id)))
        return jobs_pb2.PauseJobResponse(job=job_to_proto(job))

    async def ResumeJob(self, request: jobs_pb2.ResumeJobRequest, context: Context) -> jobs_pb2.ResumeJobResponse:
        tenant = current_tenant()
        job = await in_session(
            lambda s: job_out(service.resume_job(s, tenant.tenant_id, request.job_id, get_job_queue()))
        )
        return jobs_pb2.ResumeJobResponse(job=job_to_proto(job))

    async def ListJobEvents(
        self, request: jobs_pb2.ListJobEventsRequest, context: Context
    ) -> jobs_pb2.ListJobEventsResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, EVENTS)

        def work(s: Session) -> tuple[list[EventOut], bool]:
            rows, has_more = service.list_events(
                s,
                tenant.tenant_id,
                request.job_id,
                after=request.after_event_id or None,
                limit=limit,
                types=list(request.types) or None,
                include_superseded=request.include_superseded,
            )
            return [event_out(r) for r in rows], has_more

        events, has_more = await in_session(work)
        return jobs_pb2.ListJobEventsResponse(
            events=[event_to_proto(e) for e in events],
            next_after_event_id=events[-1].id if has_more and events else None,
        )

    async def GetJobMetrics(
        self, request: jobs_pb2.GetJobMetricsRequest, context: Context
    ) -> jobs_pb2.GetJobMetricsResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, METRIC_POINTS)
        metrics = await in_session(
            lambda s: service.get_metrics(
                s,
                tenant.tenant_id,
                request.job_id,
                names=list(request.names) or None,
                since_step=max(int32_field(request.from_step, "from_step"), 0),
                limit=limit,
            )
        )
        series = {name: (s.steps, s.values) for name, s in metrics.series.items()}
        return jobs_pb2.GetJobMetricsResponse(steps=metrics_by_step(series), next_from_step=metrics.next_since_step)

    async def ListJobSamples(
        self, request: jobs_pb2.ListJobSamplesRequest, context: Context
    ) -> jobs_pb2.ListJobSamplesResponse:
        tenant = current_tenant()
        limit = page_size(request.page_size, EVENTS)
        step = int32_field(request.step, "step") if request.HasField("step") else None

        def work(s: Session) -> tuple[list[SampleOut], bool]:
            rows, has_more = service.list_samples(
                s, tenant.tenant_id, request.job_id, step=step, after=request.after_sample_id or None, limit=limit
            )
            return [sample_out(r) for r in rows], has_more

        samples, has_more = await in_session(work)
        return jobs_pb2.ListJobSamplesResponse(
            samples=[sample_to_proto(x) for x in samples],
            next_after_sample_id=samples[-1].id if has_more and samples else None,
        )

    async def WatchJob(
        self, request: jobs_pb2.WatchJobRequest, context: Context
    ) -> AsyncIterator[jobs_pb2.WatchJobResponse]:
        tenant = current_tenant()
        from_step = max(int32_field(request.from_step, "from_step"), 0)
        still_authorized = partial(reauthenticate, bearer_token(context.invocation_metadata()))
        async for message in watch_job(self._reads, tenant.tenant_id, request.job_id, from_step, still_authorized):
            yield message
