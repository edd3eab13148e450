"""EnvironmentService over a real channel against the example OpenEnv server on loopback: register (schemas as
Structs), get/list/check/rotate/delete, the REST twin sees the same rows, errors name the field, another tenant
gets NOT_FOUND."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import pytest
from fastapi.testclient import TestClient
from google.protobuf import json_format

from contract.gen.grpo.v1 import environments_pb2 as pb
from contract.gen.grpo.v1 import environments_pb2_grpc
from tests.grpc.helpers import bearer, error_code, error_field
from tests.service.factories import TenantHeaders
from tests.worker.procs import free_port

if TYPE_CHECKING:  # the async stub exists in the typing stubs only
    Stub = environments_pb2_grpc.EnvironmentServiceAsyncStub


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> Stub:
    return environments_pb2_grpc.EnvironmentServiceStub(channel)


class TestEnvironments:
    async def test_lifecycle(self, stub: Stub, tenant_a: TenantHeaders, client: TestClient, calculator_url: str) -> None:
        auth = bearer(tenant_a.api_key)
        created = await stub.RegisterEnvironment(pb.RegisterEnvironmentRequest(
            name="calculator", url=calculator_url, max_concurrency=3, headers={"Authorization": "Bearer t"}),
            metadata=auth)
        env = created.environment
        assert created.signing_secret.startswith("whsec_") and env.id.startswith("env_")
        assert (env.max_concurrency, env.step_timeout_s, env.max_attempts) == (3, 30.0, 5)  # REST defaults
        assert env.health_status == "healthy" and dict(env.headers) == {"Authorization": "<redacted>"}
        assert json_format.MessageToDict(env.action_schema)["properties"]["tool_name"]["type"] == "string"
        rest = client.get(f"/v1/environments/{env.id}", headers=tenant_a).json()
        assert json_format.MessageToDict(env.action_schema) == rest["schemas"]["action"]
        got = await stub.GetEnvironment(pb.GetEnvironmentRequest(environment_id=env.id), metadata=auth)
        assert got.environment == env
        checked = await stub.CheckEnvironment(pb.CheckEnvironmentRequest(environment_id=env.id), metadata=auth)
        assert checked.environment.checked_at.ToDatetime() >= env.checked_at.ToDatetime()
        rotated = await stub.RotateEnvironmentSecret(pb.RotateEnvironmentSecretRequest(environment_id=env.id),
                                                     metadata=auth)
        assert rotated.signing_secret != created.signing_secret and rotated.environment.HasField(
            "previous_secret_expires_at")
        listed = await stub.ListEnvironments(pb.ListEnvironmentsRequest(), metadata=auth)
        assert [e.id for e in listed.environments] == [env.id]
        await stub.DeleteEnvironment(pb.DeleteEnvironmentRequest(environment_id=env.id), metadata=auth)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetEnvironment(pb.GetEnvironmentRequest(environment_id=env.id), metadata=auth)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    @pytest.mark.parametrize(
        ("fields", "field"),
        [({"max_concurrency": 0}, "max_concurrency"), ({"headers": {"Host": "x"}}, "headers"),
         ({"url": "grpc://127.0.0.1:1"}, "url"), ({"name": "bad/name"}, "name")],
    )
    async def test_invalid_fields_are_named(
        self, stub: Stub, tenant_a: TenantHeaders, fields: dict[str, object], field: str
    ) -> None:
        request = pb.RegisterEnvironmentRequest(**{"name": "e", "url": "http://127.0.0.1:1", **fields})  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterEnvironment(request, metadata=bearer(tenant_a.api_key))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_field(err.value) == field

    async def test_an_unreachable_server_is_failed_precondition(self, stub: Stub, tenant_a: TenantHeaders) -> None:
        request = pb.RegisterEnvironmentRequest(name="e", url=f"http://127.0.0.1:{free_port()}")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RegisterEnvironment(request, metadata=bearer(tenant_a.api_key))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_code(err.value) == "environment_unreachable"

    async def test_other_tenant_gets_not_found(
        self, stub: Stub, tenant_a: TenantHeaders, tenant_b: TenantHeaders, calculator_url: str
    ) -> None:
        env = (await stub.RegisterEnvironment(pb.RegisterEnvironmentRequest(name="e", url=calculator_url),
                                              metadata=bearer(tenant_a.api_key))).environment
        for call, request in (
            (stub.GetEnvironment, pb.GetEnvironmentRequest(environment_id=env.id)),
            (stub.CheckEnvironment, pb.CheckEnvironmentRequest(environment_id=env.id)),
            (stub.DeleteEnvironment, pb.DeleteEnvironmentRequest(environment_id=env.id)),
            (stub.RotateEnvironmentSecret, pb.RotateEnvironmentSecretRequest(environment_id=env.id)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request, metadata=bearer(tenant_b.api_key))  # type: ignore[arg-type]
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
