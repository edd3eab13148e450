"""ApiKeyService over a real channel: the same operations as /v1/api-keys."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from contract.gen.grpo.v1 import api_keys_pb2 as pb
from contract.gen.grpo.v1 import api_keys_pb2_grpc, jobs_pb2, jobs_pb2_grpc
from service.kit.config import get_settings
from service.kit.db import session_scope
from tests.grpc.helpers import bearer, error_code, error_field
from tests.service.factories import TenantHeaders, create_key


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


async def test_a_key_never_outgrows_the_key_that_makes_it(
    channel: grpc.aio.Channel, tenant_a: TenantHeaders, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = api_keys_pb2_grpc.ApiKeyServiceStub(channel)
    with session_scope() as session:
        admin_only = bearer(create_key(session, tenant_a.tenant_id, ["admin"]))
        expiring = bearer(create_key(session, tenant_a.tenant_id, ["read", "admin"],
                                     expires_at=datetime.now(UTC) + timedelta(minutes=5)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await keys.CreateApiKey(pb.CreateApiKeyRequest(name="wide", scopes=["read", "write", "admin"]),
                                metadata=admin_only)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_code(err.value) == "insufficient_scope" and error_field(err.value) == "scopes"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await keys.CreateApiKey(pb.CreateApiKeyRequest(name="forever", scopes=["read"]), metadata=expiring)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(err.value) == "expires_at"
    soon = Timestamp()
    soon.FromDatetime(datetime.now(UTC) + timedelta(minutes=1))
    made = await keys.CreateApiKey(pb.CreateApiKeyRequest(name="ok", scopes=["read"], expires_at=soon),
                                   metadata=expiring)
    assert list(made.api_key.scopes) == ["read"]

    monkeypatch.setenv("GRPO_MAX_API_KEYS_PER_TENANT", "4")  # the fixture's, the two above and `made`
    get_settings.cache_clear()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await keys.CreateApiKey(pb.CreateApiKeyRequest(name="one-too-many", scopes=["admin"]), metadata=admin_only)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and error_code(err.value) == "too_many_api_keys"
