"""ApiKeyService over a real channel: the same operations as /v1/api-keys."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from contract.gen.grpo.v1 import api_keys_pb2 as pb
from contract.gen.grpo.v1 import api_keys_pb2_grpc, jobs_pb2, jobs_pb2_grpc
from tests.grpc.helpers import bearer, error_code, error_field
from tests.service.factories import TenantHeaders


async def test_create_list_revoke(channel: grpc.aio.Channel, tenant_a: TenantHeaders) -> None:
    keys = api_keys_pb2_grpc.ApiKeyServiceStub(channel)
    admin = bearer(tenant_a.api_key)
    created = await keys.CreateApiKey(pb.CreateApiKeyRequest(name="reader", scopes=["read"]), metadata=admin)
    assert list(created.api_key.scopes) == ["read"] and created.key.startswith(created.api_key.prefix)
    assert not created.api_key.HasField("expires_at")

    jobs = jobs_pb2_grpc.JobServiceStub(channel)
    await jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=bearer(created.key))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await jobs.CancelJob(jobs_pb2.CancelJobRequest(job_id="job_x"), metadata=bearer(created.key))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and error_code(err.value) == "insufficient_scope"

    listed = await keys.ListApiKeys(pb.ListApiKeysRequest(), metadata=admin)
    assert created.api_key.id in {k.id for k in listed.api_keys}

    revoked = await keys.RevokeApiKey(pb.RevokeApiKeyRequest(api_key_id=created.api_key.id), metadata=admin)
    assert revoked.api_key.HasField("revoked_at")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await jobs.ListJobs(jobs_pb2.ListJobsRequest(), metadata=bearer(created.key))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.CreateApiKeyRequest(name="x", scopes=["read", "sudo"]), "scopes.1"),
        (pb.CreateApiKeyRequest(name=""), "name"),
        (pb.CreateApiKeyRequest(name="x", expires_at=Timestamp(seconds=1_000_000)), "expires_at"),
    ],
    ids=["unknown-scope", "empty-name", "past-expiry"],
)
async def test_bad_requests_name_the_field(
    channel: grpc.aio.Channel, tenant_a: TenantHeaders, request_: pb.CreateApiKeyRequest, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await api_keys_pb2_grpc.ApiKeyServiceStub(channel).CreateApiKey(request_, metadata=bearer(tenant_a.api_key))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_field(err.value) == field
