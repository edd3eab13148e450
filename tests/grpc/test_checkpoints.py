"""CheckpointService over a real channel: list/get, chunked download matching the manifest, resuming."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import grpc
import pytest

from contract.gen.grpo.v1 import (
    checkpoints_pb2,
    checkpoints_pb2_grpc,
    job_spec_pb2,
    jobs_pb2,
    jobs_pb2_grpc,
)
from service.kit.queue import set_job_queue
from service.storage import get_storage
from tests.grpc.helpers import bearer, error_field
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, make_dataset, put_checkpoint, start_job

FILES = {
    "model.safetensors": os.urandom(3 * 1024 * 1024 + 123),
    "config.json": b'{"hidden_size": 64}',
    "optimizer/state.pt": os.urandom(70_001),
}


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> checkpoints_pb2_grpc.CheckpointServiceAsyncStub:
    return checkpoints_pb2_grpc.CheckpointServiceStub(channel)


@pytest.fixture
def queue(settings: object) -> Iterator[RecordingQueue]:
    recording = RecordingQueue()
    set_job_queue(recording)
    yield recording
    set_job_queue(None)


@pytest.fixture
async def checkpoint(channel: grpc.aio.Channel, tenant_a: TenantHeaders, queue: RecordingQueue) -> tuple[str, str]:
    """(job id, checkpoint id) of a job of tenant_a with one checkpoint at step 5."""
    spec = job_spec_pb2.JobSpec(
        base_model="builtin:tiny",
        train_dataset=make_dataset(tenant_a.tenant_id),
        rewards=[job_spec_pb2.RewardSpec(exact_match=job_spec_pb2.ExactMatchReward())],
        hyperparameters=job_spec_pb2.Hyperparameters(max_steps=10, num_generations=2),
    )
    jobs = jobs_pb2_grpc.JobServiceStub(channel)
    job = (await jobs.CreateJob(jobs_pb2.CreateJobRequest(spec=spec), metadata=bearer(tenant_a.api_key))).job
    attempt = start_job(job.id)
    row, _manifest = put_checkpoint(get_storage(), job.id, attempt, 5, FILES)
    return job.id, row.id


async def _download(
    stub: checkpoints_pb2_grpc.CheckpointServiceAsyncStub, api_key: str, request: checkpoints_pb2.DownloadCheckpointRequest
) -> tuple[dict[str, checkpoints_pb2.FileHeader], dict[str, bytearray]]:
    headers: dict[str, checkpoints_pb2.FileHeader] = {}
    files: dict[str, bytearray] = {}
    async for message in stub.DownloadCheckpoint(request, metadata=bearer(api_key)):
        if message.WhichOneof("payload") == "file":
            headers[message.file.file.path] = message.file
            files[message.file.file.path] = bytearray()
        else:
            got = files[message.chunk.path]
            assert message.chunk.offset == headers[message.chunk.path].offset + len(got)  # contiguous
            got += message.chunk.data
    return headers, files


class TestReadCheckpoints:
    async def test_list_and_get(
        self, stub: checkpoints_pb2_grpc.CheckpointServiceAsyncStub, checkpoint: tuple[str, str], tenant_a: TenantHeaders
    ) -> None:
        job_id, checkpoint_id = checkpoint
        auth = bearer(tenant_a.api_key)
        listed = await stub.ListCheckpoints(checkpoints_pb2.ListCheckpointsRequest(job_id=job_id), metadata=auth)
        assert [(c.id, c.step) for c in listed.checkpoints] == [(checkpoint_id, 5)]
        got = (await stub.GetCheckpoint(checkpoints_pb2.GetCheckpointRequest(checkpoint_id=checkpoint_id), metadata=auth)).checkpoint
        assert {f.path: (f.size_bytes, f.sha256) for f in got.files} == {
            path: (len(data), hashlib.sha256(data).hexdigest()) for path, data in FILES.items()
        }
        assert got.total_bytes == sum(len(d) for d in FILES.values())

    async def test_other_tenant_gets_not_found(
        self, stub: checkpoints_pb2_grpc.CheckpointServiceAsyncStub, checkpoint: tuple[str, str], tenant_b: TenantHeaders
    ) -> None:
        job_id, checkpoint_id = checkpoint
        theirs = bearer(tenant_b.api_key)
        for call, request in (
            (stub.ListCheckpoints, checkpoints_pb2.ListCheckpointsRequest(job_id=job_id)),
            (stub.GetCheckpoint, checkpoints_pb2.GetCheckpointRequest(checkpoint_id=checkpoint_id)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request, metadata=theirs)  # type: ignore[operator]
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _download(stub, tenant_b.api_key, checkpoints_pb2.DownloadCheckpointRequest(checkpoint_id=checkpoint_id))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


class TestDownloadCheckpoint:
    async def test_reassembled_files_match_the_manifest(
        self, stub: checkpoints_pb2_grpc.CheckpointServiceAsyncStub, checkpoint: tuple[str, str], tenant_a: TenantHeaders
    ) -> None:
        _, checkpoint_id = checkpoint
        request = checkpoints_pb2.DownloadCheckpointRequest(checkpoint_id=checkpoint_id, chunk_size=256 * 1024)
        headers, files = await _download(stub, tenant_a.api_key, request)
        assert set(files) == set(FILES)
        for path, data in files.items():
            assert hashlib.sha256(data).hexdigest() == headers[path].file.sha256
            assert len(data) == headers[path].file.size_bytes
            assert bytes(data) == FILES[path]

    async def test_resume_from_offsets(
        self, stub: checkpoints_pb2_grpc.CheckpointServiceAsyncStub, checkpoint: tuple[str, str], tenant_a: TenantHeaders
    ) -> None:
        _, checkpoint_id = checkpoint
        big, small = "model.safetensors", "config.json"
        have = FILES[big][:1_000_003]  # an interrupted download of the big file
        request = checkpoints_pb2.DownloadCheckpointRequest(
            checkpoint_id=checkpoint_id, paths=[big, small], offsets={big: len(have), small: len(FILES[small])}
        )
        headers, files = await _download(stub, tenant_a.api_key, request)
        assert headers[big].offset == len(have) and headers[small].offset == len(FILES[small])
        assert files[small] == b""  # complete already: header only
        resumed = have + bytes(files[big])
        assert hashlib.sha256(resumed).hexdigest() == headers[big].file.sha256

    @pytest.mark.parametrize(
        ("request_fields", "status", "field"),
        [
            ({"paths": ["../../etc/passwd"]}, grpc.StatusCode.NOT_FOUND, None),
            ({"offsets": {"unlisted.bin": 1}}, grpc.StatusCode.NOT_FOUND, None),
            ({"offsets": {"config.json": 10_000}}, grpc.StatusCode.OUT_OF_RANGE, "offsets['config.json']"),
            ({"chunk_size": 64 * 1024 * 1024}, grpc.StatusCode.INVALID_ARGUMENT, "chunk_size"),
        ],
    )
    async def test_bad_requests(
        self,
        stub: checkpoints_pb2_grpc.CheckpointServiceAsyncStub,
        checkpoint: tuple[str, str],
        tenant_a: TenantHeaders,
        request_fields: dict[str, object],
        status: grpc.StatusCode,
        field: str | None,
    ) -> None:
        request = checkpoints_pb2.DownloadCheckpointRequest(checkpoint_id=checkpoint[1], **request_fields)  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _download(stub, tenant_a.api_key, request)
        assert err.value.code() == status
        assert error_field(err.value) == field
