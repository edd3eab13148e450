"""JobService over a real channel: every RPC, idempotency shared with REST, tenant isolation, bad input."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from fastapi.testclient import TestClient

from contract.gen.grpo.v1 import job_spec_pb2, jobs_pb2, jobs_pb2_grpc
from service.jobs.models import JobSample
from service.jobs.progress import record_metrics, worker_transition
from service.jobs.states import JobStatus
from service.kit.db import session_scope, utcnow
from service.kit.queue import set_job_queue
from tests.grpc.helpers import bearer, error_code, error_field
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, make_dataset, start_job


@pytest.fixture
def queue(settings: object) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> jobs_pb2_grpc.JobServiceAsyncStub:
    return jobs_pb2_grpc.JobServiceStub(channel)


def spec_message(dataset_id: str, **hyper: int) -> job_spec_pb2.JobSpec:
    return job_spec_pb2.JobSpec(
        name="tiny-run",
        base_model="builtin:tiny",
        train_dataset=dataset_id,
        rewards=[job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())],
        hyperparameters=job_spec_pb2.Hyperparameters(
            **{"max_steps": 10, "num_generations": 4, "prompts_per_step": 2, **hyper}
        ),
    )


async def _create(stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant: TenantHeaders, **hyper: int) -> jobs_pb2.Job:
    request = jobs_pb2.CreateJobRequest(spec=spec_message(make_dataset(tenant.tenant_id), **hyper))
    return (await stub.CreateJob(request, metadata=bearer(tenant.api_key))).job


async def _fails(call: object, request: object, metadata: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(request, metadata=metadata)  # type: ignore[operator]
    return err.value


class TestCreateAndRead:
    async def test_create_get_list(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue, client: TestClient
    ) -> None:
        job = await _create(stub, tenant_a)
        assert job.id.startswith("job_") and job.state == jobs_pb2.JOB_STATE_QUEUED
        assert job.queue == "cpu" and job.total_steps == 10
        assert job.spec.hyperparameters.num_generations == 4
        assert job.spec.hyperparameters.learning_rate == pytest.approx(1e-6)  # default filled in
        assert queue.sent == [(job.id, "cpu")]  # enqueued after commit
        auth = bearer(tenant_a.api_key)
        assert (await stub.GetJob(jobs_pb2.GetJobRequest(job_id=job.id), metadata=auth)).job == job
        # The same row through REST.
        rest = client.get(f"/v1/jobs/{job.id}", headers=tenant_a).json()
        assert rest["status"] == "queued" and rest["spec"]["hyperparameters"]["num_generations"] == 4

        second = await _create(stub, tenant_a)
        listed = await stub.ListJobs(jobs_pb2.ListJobsRequest(page_size=1), metadata=auth)
        assert [j.id for j in listed.jobs] == [second.id] and listed.next_page_token == second.id
        rest_of = await stub.ListJobs(jobs_pb2.ListJobsRequest(page_token=listed.next_page_token), metadata=auth)
        assert [j.id for j in rest_of.jobs] == [job.id]
        await stub.CancelJob(jobs_pb2.CancelJobRequest(job_id=job.id), metadata=auth)
        cancelled = await stub.ListJobs(jobs_pb2.ListJobsRequest(state=jobs_pb2.JOB_STATE_CANCELLED), metadata=auth)
        assert [j.id for j in cancelled.jobs] == [job.id]

    async def test_invalid_spec_names_the_field(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        request = jobs_pb2.CreateJobRequest(spec=spec_message(make_dataset(tenant_a.tenant_id), num_generations=1))
        err = await _fails(stub.CreateJob, request, bearer(tenant_a.api_key))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(err) == "spec.hyperparameters.num_generations"
        assert queue.sent == []

    async def test_unknown_dataset_names_the_field(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, tenant_b: TenantHeaders, queue: RecordingQueue
    ) -> None:
        # Another tenant's dataset is as unknown as a missing one.
        request = jobs_pb2.CreateJobRequest(spec=spec_message(make_dataset(tenant_b.tenant_id)))
        err = await _fails(stub.CreateJob, request, bearer(tenant_a.api_key))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(err) == "spec.train_dataset"

    async def test_reward_without_source_names_it(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        spec = spec_message(make_dataset(tenant_a.tenant_id))
        spec.rewards.add(weight=2.0)
        err = await _fails(stub.CreateJob, jobs_pb2.CreateJobRequest(spec=spec), bearer(tenant_a.api_key))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_field(err) == "spec.rewards[1]"


class TestIdempotency:
    async def test_replay_conflict_and_rest_interplay(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue, client: TestClient
    ) -> None:
        dataset = make_dataset(tenant_a.tenant_id)
        keyed = (*bearer(tenant_a.api_key), ("idempotency-key", "run-42"))
        request = jobs_pb2.CreateJobRequest(spec=spec_message(dataset))
        first = (await stub.CreateJob(request, metadata=keyed)).job
        again = (await stub.CreateJob(request, metadata=keyed)).job
        assert again.id == first.id and len(queue.sent) == 1

        other = jobs_pb2.CreateJobRequest(spec=spec_message(dataset, max_steps=11))
        err = await _fails(stub.CreateJob, other, keyed)
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert error_code(err) == "idempotency_key_reused"

        # The same key and spec over REST replays the job created over gRPC.
        body = {
            "name": "tiny-run",
            "base_model": "builtin:tiny",
            "train_dataset": dataset,
            "rewards": [{"type": "builtin", "name": "exact_match"}],
            "hyperparameters": {"max_steps": 10, "num_generations": 4, "prompts_per_step": 2},
        }
        rest = client.post("/v1/jobs", json=body, headers={**tenant_a, "Idempotency-Key": "run-42"})
        assert rest.json()["id"] == first.id


class TestControl:
    async def test_pause_resume_cancel_and_illegal_transition(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        auth = bearer(tenant_a.api_key)
        job = await _create(stub, tenant_a)
        paused = (await stub.PauseJob(jobs_pb2.PauseJobRequest(job_id=job.id), metadata=auth)).job
        assert paused.state == jobs_pb2.JOB_STATE_PAUSED
        resumed = (await stub.ResumeJob(jobs_pb2.ResumeJobRequest(job_id=job.id), metadata=auth)).job
        assert resumed.state == jobs_pb2.JOB_STATE_QUEUED and len(queue.sent) == 2
        start_job(job.id)
        requested = (await stub.PauseJob(jobs_pb2.PauseJobRequest(job_id=job.id), metadata=auth)).job
        assert requested.state == jobs_pb2.JOB_STATE_RUNNING and requested.pause_requested
        cancelling = (await stub.CancelJob(jobs_pb2.CancelJobRequest(job_id=job.id), metadata=auth)).job
        assert cancelling.state == jobs_pb2.JOB_STATE_CANCELLING
        err = await _fails(stub.ResumeJob, jobs_pb2.ResumeJobRequest(job_id=job.id), auth)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION

    async def test_other_tenants_jobs_are_not_found(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, tenant_b: TenantHeaders, queue: RecordingQueue
    ) -> None:
        job = await _create(stub, tenant_a)
        theirs = bearer(tenant_b.api_key)
        requests = [
            (stub.GetJob, jobs_pb2.GetJobRequest(job_id=job.id)),
            (stub.CancelJob, jobs_pb2.CancelJobRequest(job_id=job.id)),
            (stub.PauseJob, jobs_pb2.PauseJobRequest(job_id=job.id)),
            (stub.ResumeJob, jobs_pb2.ResumeJobRequest(job_id=job.id)),
            (stub.ListJobEvents, jobs_pb2.ListJobEventsRequest(job_id=job.id)),
            (stub.GetJobMetrics, jobs_pb2.GetJobMetricsRequest(job_id=job.id)),
            (stub.ListJobSamples, jobs_pb2.ListJobSamplesRequest(job_id=job.id)),
        ]
        for call, request in requests:
            err = await _fails(call, request, theirs)
            assert err.code() == grpc.StatusCode.NOT_FOUND, call
            assert err.details() == f"job {job.id!r} not found"
        with pytest.raises(grpc.aio.AioRpcError) as watch_err:
            async for _ in stub.WatchJob(jobs_pb2.WatchJobRequest(job_id=job.id), metadata=theirs):
                pass
        assert watch_err.value.code() == grpc.StatusCode.NOT_FOUND
        assert list((await stub.ListJobs(jobs_pb2.ListJobsRequest(), metadata=theirs)).jobs) == []


class TestProgress:
    async def test_events_metrics_samples(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        auth = bearer(tenant_a.api_key)
        job = await _create(stub, tenant_a)
        attempt = start_job(job.id)
        with session_scope() as session:
            for step in (1, 2, 3):
                record_metrics(session, job.id, attempt, step, {"reward": step / 10, "kl": 0.01 * step})
            session.add(
                JobSample(
                    job_id=job.id, step=2, prompt="p", completion="c", reward=0.5,
                    rewards={"exact_match": 0.5, "remote:rf": None}, attempt=attempt, created_at=utcnow(),
                )
            )

        events = await stub.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=job.id, page_size=2), metadata=auth)
        assert [e.type for e in events.events] == ["status", "status"]  # created, claimed
        assert events.next_after_event_id == events.events[-1].id
        metric_events = await stub.ListJobEvents(
            jobs_pb2.ListJobEventsRequest(job_id=job.id, types=["metrics"]), metadata=auth
        )
        assert [e.data["step"] for e in metric_events.events] == [1, 2, 3]
        assert not metric_events.HasField("next_after_event_id")

        metrics = await stub.GetJobMetrics(jobs_pb2.GetJobMetricsRequest(job_id=job.id, from_step=2), metadata=auth)
        assert [(m.step, dict(m.values)) for m in metrics.steps] == [
            (2, {"reward": 0.2, "kl": 0.02}),
            (3, {"reward": pytest.approx(0.3), "kl": 0.03}),
        ]
        paged = await stub.GetJobMetrics(
            jobs_pb2.GetJobMetricsRequest(job_id=job.id, names=["reward"], page_size=2), metadata=auth
        )
        assert [m.step for m in paged.steps] == [1, 2] and paged.next_from_step == 3

        samples = await stub.ListJobSamples(jobs_pb2.ListJobSamplesRequest(job_id=job.id, step=2), metadata=auth)
        assert [(s.prompt, s.reward, dict(s.rewards)) for s in samples.samples] == [("p", 0.5, {"exact_match": 0.5})]
        none = await stub.ListJobSamples(jobs_pb2.ListJobSamplesRequest(job_id=job.id, step=1), metadata=auth)
        assert list(none.samples) == []

    async def test_finished_job_reports_its_error(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        job = await _create(stub, tenant_a)
        attempt = start_job(job.id)
        with session_scope() as session:
            worker_transition(
                session, job.id, attempt, JobStatus.failed, reason="boom",
                error_code="reward_invalid_response", error_message="bad reward",
            )
        got = (await stub.GetJob(jobs_pb2.GetJobRequest(job_id=job.id), metadata=bearer(tenant_a.api_key))).job
        assert got.state == jobs_pb2.JOB_STATE_FAILED
        assert (got.error_code, got.error_message) == ("reward_invalid_response", "bad reward")
        assert got.HasField("finished_at")


class TestDeleteJob:
    async def test_delete_refuses_unfinished_then_removes_a_finished_job(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, queue: RecordingQueue,
        client: TestClient,
    ) -> None:
        from service.storage import get_storage, job_prefix

        auth = bearer(tenant_a.api_key)
        job = await _create(stub, tenant_a)
        err = await _fails(stub.DeleteJob, jobs_pb2.DeleteJobRequest(job_id=job.id), auth)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "queued" in (err.details() or "")
        assert error_code(err) == "job_not_finished"

        attempt = start_job(job.id)
        get_storage().put_stream(f"{job_prefix(job.id)}/tensorboard/events", [b"x"])
        with session_scope() as session:
            worker_transition(session, job.id, attempt, JobStatus.failed, reason="boom")
        await stub.DeleteJob(jobs_pb2.DeleteJobRequest(job_id=job.id), metadata=auth)
        assert get_storage().list(job_prefix(job.id)) == []
        assert client.get(f"/v1/jobs/{job.id}", headers=tenant_a).status_code == 404
        err = await _fails(stub.DeleteJob, jobs_pb2.DeleteJobRequest(job_id=job.id), auth)
        assert err.code() == grpc.StatusCode.NOT_FOUND


class TestSupersededEvents:
    async def test_list_job_events_shows_each_step_once(
        self, stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant_a: TenantHeaders, client: TestClient
    ) -> None:
        from tests.worker.test_superseded_events import _crashed_and_resumed_job

        job_id = _crashed_and_resumed_job(tenant_a.tenant_id)
        auth = bearer(tenant_a.api_key)
        default = await stub.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=job_id, page_size=500), metadata=auth)
        assert [(e.step, e.attempt) for e in default.events if e.type == "metrics"] == [(1, 1), (2, 1), (3, 2), (4, 2)]
        everything = await stub.ListJobEvents(
            jobs_pb2.ListJobEventsRequest(job_id=job_id, page_size=500, include_superseded=True), metadata=auth
        )
        assert [(e.step, e.attempt) for e in everything.events if e.superseded] == [(3, 1), (4, 1)]
