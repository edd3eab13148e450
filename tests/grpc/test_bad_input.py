"""The gRPC twin of tests/service/test_bad_input.py: NUL characters anywhere in a request and steps beyond
INTEGER are INVALID_ARGUMENT naming the field (never INTERNAL), on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from contract.gen.grpo.v1 import (
    checkpoints_pb2,
    checkpoints_pb2_grpc,
    datasets_pb2,
    datasets_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    reward_functions_pb2,
    reward_functions_pb2_grpc,
)
from service.kit.queue import set_job_queue
from tests.grpc.helpers import bearer, error_code, error_field
from tests.grpc.test_jobs import spec_message
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, make_dataset, start_job

BEYOND_INT32 = 2**31


@pytest.fixture
def queue(settings: object) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


@pytest.fixture
async def job_id(channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue) -> str:
    stub = jobs_pb2_grpc.JobServiceStub(channel)
    request = jobs_pb2.CreateJobRequest(spec=spec_message(make_dataset(tenant_a.tenant_id)))
    job = (await stub.CreateJob(request, metadata=bearer(tenant_a.api_key))).job
    start_job(job.id)
    return str(job.id)


async def invalid(call: Any, request: Message, tenant: TenantHeaders, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        response = call(request, metadata=bearer(tenant.api_key))
        if hasattr(response, "__aiter__"):  # a server-streaming call fails on its first read
            async for _ in response:
                pass
        else:
            await response
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert error_code(err.value) == "validation_error"
    assert error_field(err.value) == field


class TestNulCharacters:
    async def test_in_ids_and_page_tokens(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        datasets = datasets_pb2_grpc.DatasetServiceStub(channel)
        rewards = reward_functions_pb2_grpc.RewardFunctionServiceStub(channel)
        checkpoints = checkpoints_pb2_grpc.CheckpointServiceStub(channel)
        await invalid(jobs.GetJob, jobs_pb2.GetJobRequest(job_id="job_\x00"), tenant_a, "job_id")
        await invalid(jobs.ListJobs, jobs_pb2.ListJobsRequest(page_token="\x00"), tenant_a, "page_token")
        await invalid(jobs.CancelJob, jobs_pb2.CancelJobRequest(job_id="\x00"), tenant_a, "job_id")
        await invalid(jobs.WatchJob, jobs_pb2.WatchJobRequest(job_id="\x00"), tenant_a, "job_id")
        await invalid(datasets.ListDatasets, datasets_pb2.ListDatasetsRequest(page_token="a\x00"), tenant_a,
                      "page_token")
        await invalid(datasets.GetDataset, datasets_pb2.GetDatasetRequest(dataset_id="ds_\x00"), tenant_a,
                      "dataset_id")
        await invalid(rewards.GetRewardFunction,
                      reward_functions_pb2.GetRewardFunctionRequest(reward_function_id="rf_\x00"), tenant_a,
                      "reward_function_id")
        await invalid(checkpoints.DownloadCheckpoint,
                      checkpoints_pb2.DownloadCheckpointRequest(checkpoint_id="ckpt_x", paths=["ok", "a\x00"]),
                      tenant_a, "paths.1")

    async def test_in_filters(self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, job_id: str) -> None:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        request = jobs_pb2.ListJobEventsRequest(job_id=job_id, types=["status", "log\x00"])
        await invalid(stub.ListJobEvents, request, tenant_a, "types.1")
        await invalid(stub.GetJobMetrics, jobs_pb2.GetJobMetricsRequest(job_id=job_id, names=["\x00"]), tenant_a,
                      "names.0")

    async def test_in_a_job_spec(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue
    ) -> None:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        spec = spec_message(make_dataset(tenant_a.tenant_id))
        spec.metadata["team"] = "a\x00b"
        await invalid(stub.CreateJob, jobs_pb2.CreateJobRequest(spec=spec), tenant_a, "spec.metadata.team")
        spec = spec_message("ds_\x00")
        await invalid(stub.CreateJob, jobs_pb2.CreateJobRequest(spec=spec), tenant_a, "spec.train_dataset")
        assert queue.sent == []


class TestStepRanges:
    async def test_beyond_integer(self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, job_id: str) -> None:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        await invalid(stub.GetJobMetrics, jobs_pb2.GetJobMetricsRequest(job_id=job_id, from_step=BEYOND_INT32),
                      tenant_a, "from_step")
        await invalid(stub.ListJobSamples, jobs_pb2.ListJobSamplesRequest(job_id=job_id, step=BEYOND_INT32),
                      tenant_a, "step")
        await invalid(stub.ListJobSamples, jobs_pb2.ListJobSamplesRequest(job_id=job_id, step=-BEYOND_INT32 - 1),
                      tenant_a, "step")
        await invalid(stub.WatchJob, jobs_pb2.WatchJobRequest(job_id=job_id, from_step=BEYOND_INT32), tenant_a,
                      "from_step")

    async def test_the_largest_step_and_ids_are_accepted(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, job_id: str
    ) -> None:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        auth = bearer(tenant_a.api_key)
        metrics = await stub.GetJobMetrics(jobs_pb2.GetJobMetricsRequest(job_id=job_id, from_step=2**31 - 1),
                                           metadata=auth)
        assert list(metrics.steps) == []
        samples = await stub.ListJobSamples(
            jobs_pb2.ListJobSamplesRequest(job_id=job_id, step=2**31 - 1, after_sample_id=2**63 - 1), metadata=auth
        )
        assert list(samples.samples) == []
        events = await stub.ListJobEvents(jobs_pb2.ListJobEventsRequest(job_id=job_id, after_event_id=2**63 - 1),
                                          metadata=auth)
        assert list(events.events) == []


class TestJobSizeCaps:
    """Issue 30: resources past the deployment's bounds (GRPO_MAX_JOB_NODES 16, GRPO_MAX_JOB_DEVICES 128 by
    default) are INVALID_ARGUMENT naming the field, like REST's 422."""

    @pytest.mark.parametrize(
        ("devices", "nodes", "field", "bound"),
        [(64, 64, "spec.resources.nodes", 16), (256, 16, "spec.resources.devices", 128)],
    )
    async def test_create_job_past_the_bounds(
        self, channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue,
        devices: int, nodes: int, field: str, bound: int,
    ) -> None:
        from tests.grpc.helpers import error_details

        spec = spec_message(make_dataset(tenant_a.tenant_id), prompts_per_step=devices)
        spec.resources.devices, spec.resources.nodes = devices, nodes
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CreateJob(jobs_pb2.CreateJobRequest(spec=spec), metadata=bearer(tenant_a.api_key))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert error_code(err.value) == "validation_error" and error_field(err.value) == field
        assert error_details(err.value)[0]["limit"] == bound
        assert f"must be at most {bound}" in (err.value.details() or "")
        assert queue.sent == []
