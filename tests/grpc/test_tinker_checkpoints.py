"""Weights saved through the Tinker API as CheckpointService sees them, over a real channel: GetCheckpoint names
their tinker:// path and no job, ListCheckpoints by `tinker_path` lists each save, DownloadCheckpoint streams the
files as listed; another tenant sees nothing. Recorded through the primitives worker's port (record_weights),
which writes the weights' row and their checkpoint together or neither."""

from __future__ import annotations

import hashlib

import grpc
import pytest

from contract.gen.grpo.v1 import checkpoints_pb2, checkpoints_pb2_grpc
from service.execution import primitives as port
from service.kit.db import session_scope
from service.kit.errors import ValidationFailed
from service.primitives import service as primitives
from service.storage import get_storage, primitive_weights_prefix
from tests.grpc.helpers import bearer, error_field
from tests.service.factories import TenantHeaders

FILES = {"adapter_model.safetensors": b"\x01" * 1000, "adapter_config.json": b'{"r": 4}', "lora_spec.json": b"{}"}


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> checkpoints_pb2_grpc.CheckpointServiceAsyncStub:
    return checkpoints_pb2_grpc.CheckpointServiceStub(channel)


def _client(tenant_id: str) -> str:
    with session_scope() as session:
        session_id = primitives.start_session(session, tenant_id, "test", [], {})
        client_id, _ = primitives.create_training_client(
            session, tenant_id, session_id, 0, "builtin:tiny-instruct", {"rank": 4, "seed": 0}
        )
    return client_id


def _save(tenant_id: str, client_id: str, token: str, files: dict[str, bytes]) -> port.SavedWeights:
    """What the primitives worker does after saving: upload under a fresh prefix, then record."""
    prefix = primitive_weights_prefix(tenant_id, token)
    for path, data in files.items():
        get_storage().put_stream(f"{prefix}/{path}", [data])
    listed = {path: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for path, data in files.items()}
    return port.record_weights(tenant_id, client_id, "state", "step-1", prefix, listed)


async def test_get_list_and_download(
    stub: checkpoints_pb2_grpc.CheckpointServiceAsyncStub, tenant_a: TenantHeaders, tenant_b: TenantHeaders
) -> None:
    client_id = _client(tenant_a.tenant_id)
    first, second = (_save(tenant_a.tenant_id, client_id, token, FILES) for token in ("a" * 24, "b" * 24))
    assert first.path == second.path == f"tinker://{client_id}/weights/step-1"
    auth = bearer(tenant_a.api_key)

    got = (await stub.GetCheckpoint(checkpoints_pb2.GetCheckpointRequest(checkpoint_id=first.checkpoint_id),
                                    metadata=auth)).checkpoint
    assert (got.job_id, got.tinker_path, got.step) == ("", first.path, 0)
    assert {f.path: f.sha256 for f in got.files} == {p: hashlib.sha256(d).hexdigest() for p, d in FILES.items()}
    listed = await stub.ListCheckpoints(checkpoints_pb2.ListCheckpointsRequest(tinker_path=first.path), metadata=auth)
    assert [c.id for c in listed.checkpoints] == [first.checkpoint_id, second.checkpoint_id]

    received: dict[str, bytes] = {}
    request = checkpoints_pb2.DownloadCheckpointRequest(checkpoint_id=second.checkpoint_id)
    async for message in stub.DownloadCheckpoint(request, metadata=auth):
        if message.WhichOneof("payload") == "chunk":
            received[message.chunk.path] = received.get(message.chunk.path, b"") + message.chunk.data
    assert received == FILES

    theirs = bearer(tenant_b.api_key)
    nothing = await stub.ListCheckpoints(checkpoints_pb2.ListCheckpointsRequest(tinker_path=first.path), metadata=theirs)
    assert list(nothing.checkpoints) == []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetCheckpoint(checkpoints_pb2.GetCheckpointRequest(checkpoint_id=first.checkpoint_id), metadata=theirs)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    with pytest.raises(grpc.aio.AioRpcError) as err:
        both = checkpoints_pb2.ListCheckpointsRequest(job_id="job_x", tinker_path=first.path)
        await stub.ListCheckpoints(both, metadata=auth)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(err.value) == "tinker_path"


def test_a_save_whose_files_are_not_all_stored_records_nothing(tenant_a: TenantHeaders) -> None:
    client_id = _client(tenant_a.tenant_id)
    prefix = primitive_weights_prefix(tenant_a.tenant_id, "c" * 24)
    get_storage().put_stream(f"{prefix}/lora_spec.json", [b"{}"])
    listed = {"lora_spec.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()},
              "adapter_model.safetensors": {"size": 10, "sha256": "0" * 64}}
    with pytest.raises(ValidationFailed, match="adapter_model.safetensors"):
        port.record_weights(tenant_a.tenant_id, client_id, "state", "lost", prefix, listed)
    assert port.saved_weights(tenant_a.tenant_id, client_id, "state", "lost") is None
