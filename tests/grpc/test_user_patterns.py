"""CreateJob validates regex_match patterns as RE2, like REST: INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from contract.gen.grpo.v1 import job_spec_pb2, jobs_pb2, jobs_pb2_grpc
from contract.spec import MAX_PATTERN_LENGTH
from service.kit.queue import set_job_queue
from tests.grpc.helpers import bearer, error_field
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, make_dataset


@pytest.fixture
def queue(settings: object) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


def request(tenant: TenantHeaders, pattern: str) -> jobs_pb2.CreateJobRequest:
    return jobs_pb2.CreateJobRequest(
        spec=job_spec_pb2.JobSpec(
            base_model="builtin:tiny",
            train_dataset=make_dataset(tenant.tenant_id),
            rewards=[job_spec_pb2.RewardSpec(regex_match=job_spec_pb2.RegexMatchReward(pattern=pattern))],
            hyperparameters=job_spec_pb2.Hyperparameters(max_steps=2, num_generations=2, prompts_per_step=2),
        )
    )


@pytest.mark.parametrize("pattern", [r"(a+)\1", r"(?=a)", "a" * (MAX_PATTERN_LENGTH + 1)])
async def test_patterns_re2_refuses_name_the_field(
    channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue, pattern: str
) -> None:
    stub = jobs_pb2_grpc.JobServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CreateJob(request(tenant_a, pattern), metadata=bearer(tenant_a.api_key))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_field(err.value) == "spec.rewards.0.builtin.pattern"
    assert queue.sent == []


async def test_catastrophic_pattern_is_accepted(
    channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue
) -> None:
    stub = jobs_pb2_grpc.JobServiceStub(channel)
    reply = await stub.CreateJob(request(tenant_a, "(.|.)*ZQ"), metadata=bearer(tenant_a.api_key))
    assert queue.sent == [(reply.job.id, "cpu")]
