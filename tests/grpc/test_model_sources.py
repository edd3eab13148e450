"""CreateJob over a real channel refuses the cross-tenant model sources REST refuses (one domain check serves
both): a storage path of another tenant's checkpoint, the service's data dir, another tenant's
`checkpoint:<id>` (answered exactly like an unknown id), for `base_model` and for a reward model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from contract.gen.grpo.v1 import job_spec_pb2, jobs_pb2, jobs_pb2_grpc
from service.checkpoints.models import Checkpoint
from service.grpc.errors import ERROR_DETAILS_KEY
from service.kit.config import Settings
from service.kit.queue import set_job_queue
from service.storage import checkpoint_prefix, get_storage
from tests.grpc.helpers import bearer, error_code, error_field, trailer
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, job_spec, make_dataset, put_checkpoint, start_job

FIELDS = ["base_model", "rewards[0].model"]


@pytest.fixture
def queue(settings: object) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> jobs_pb2_grpc.JobServiceAsyncStub:
    return jobs_pb2_grpc.JobServiceStub(channel)


@pytest.fixture
def checkpoint_of_a(client: TestClient, tenant_a: TenantHeaders, queue: RecordingQueue) -> Checkpoint:
    response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant_a.tenant_id)), headers=tenant_a)
    job_id = response.json()["id"]
    checkpoint, _ = put_checkpoint(get_storage(), job_id, start_job(job_id), 2, {"config.json": b"{}"})
    return checkpoint


def request(tenant: TenantHeaders, field: str, value: str) -> jobs_pb2.CreateJobRequest:
    spec = job_spec_pb2.JobSpec(
        base_model=value if field == "base_model" else "builtin:tiny",
        train_dataset=make_dataset(tenant.tenant_id),
        rewards=[
            job_spec_pb2.RewardSpec(model=job_spec_pb2.ModelReward(model=value))
            if field != "base_model"
            else job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())
        ],
        hyperparameters=job_spec_pb2.Hyperparameters(max_steps=2, num_generations=2, prompts_per_step=2),
    )
    return jobs_pb2.CreateJobRequest(spec=spec)


async def refused(
    stub: jobs_pb2_grpc.JobServiceAsyncStub, tenant: TenantHeaders, field: str, value: str
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CreateJob(request(tenant, field, value), metadata=bearer(tenant.api_key))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_code(err.value) == "validation_error"
    assert error_field(err.value) == f"spec.{field}"
    return err.value


@pytest.mark.parametrize("field", FIELDS)
async def test_paths_into_the_services_data_are_refused(
    stub: jobs_pb2_grpc.JobServiceAsyncStub,
    settings: Settings,
    tenant_b: TenantHeaders,
    checkpoint_of_a: Checkpoint,
    queue: RecordingQueue,
    tmp_path: Path,
    field: str,
) -> None:
    target = Path(settings.storage_url) / checkpoint_prefix(checkpoint_of_a.job_id, checkpoint_of_a.id)
    assert (target / "config.json").exists()
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    for value in (str(target), str(link), settings.data_dir):
        err = await refused(stub, tenant_b, field, value)
        assert str(target) not in (err.details() or "")
    assert queue.sent == [(checkpoint_of_a.job_id, "cpu")]  # tenant A's own job only


@pytest.mark.parametrize("field", FIELDS)
async def test_another_tenants_checkpoint_reads_like_an_unknown_id(
    stub: jobs_pb2_grpc.JobServiceAsyncStub,
    tenant_a: TenantHeaders,
    tenant_b: TenantHeaders,
    checkpoint_of_a: Checkpoint,
    queue: RecordingQueue,
    field: str,
) -> None:
    unknown_id = "ckpt_" + "0" * len(checkpoint_of_a.id.removeprefix("ckpt_"))
    other = await refused(stub, tenant_b, field, f"checkpoint:{checkpoint_of_a.id}")
    unknown = await refused(stub, tenant_b, field, f"checkpoint:{unknown_id}")
    assert other.details() == (unknown.details() or "").replace(unknown_id, checkpoint_of_a.id)
    assert trailer(other, ERROR_DETAILS_KEY) == (trailer(unknown, ERROR_DETAILS_KEY) or "").replace(
        unknown_id, checkpoint_of_a.id
    )
    reply = await stub.CreateJob(
        request(tenant_a, field, f"checkpoint:{checkpoint_of_a.id}"), metadata=bearer(tenant_a.api_key)
    )
    assert reply.job.id
