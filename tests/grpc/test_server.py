"""The server plumbing on a real port: health, reflection, the auth interceptor and the error mapping."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pydantic import BaseModel, Field

from service.grpc.auth import current_tenant
from service.grpc.errors import ERROR_CODE_KEY, ERROR_FIELD_KEY, REQUEST_ID_KEY
from service.grpc.interceptors import AuthInterceptor, ErrorInterceptor
from service.kit.errors import (
    DomainError,
    IdempotencyInFlight,
    IdempotencyMismatch,
    IllegalTransition,
    NotFound,
    ValidationFailed,
)
from service.tenants.scopes import Scope
from tests.grpc.helpers import bearer
from tests.service.factories import TenantHeaders


class _Model(BaseModel):
    count: int = Field(ge=1)


def _raise(name: str) -> None:
    errors: dict[str, Callable[[], Exception]] = {
        "not_found": lambda: NotFound("job", "job_x"),
        "validation": lambda: ValidationFailed("spec.base_model: too long", details=[{"field": "spec.base_model"}]),
        "transition": lambda: IllegalTransition("job is succeeded"),
        "mismatch": lambda: IdempotencyMismatch("key reused"),
        "in_flight": lambda: IdempotencyInFlight("key in flight"),
        "bug": lambda: RuntimeError("secret internals"),
    }
    if name == "pydantic":
        _Model(count=0)
    if name in errors:
        raise errors[name]()


async def _whoami(request: bytes, context: Any) -> bytes:
    _raise(request.decode())
    return current_tenant().tenant_id.encode()


async def _whoami_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"first"
    _raise(request.decode())
    yield current_tenant().tenant_id.encode()


@pytest.fixture
async def test_channel(settings: object) -> AsyncIterator[grpc.aio.Channel]:
    """A server with the production interceptors and a test-only service calling current_tenant()."""
    scopes: dict[str, Scope] = {"/test.Probe/Who": "read", "/test.Probe/WhoStream": "read"}
    server = grpc.aio.server(interceptors=[ErrorInterceptor(), AuthInterceptor(scopes)])
    handlers: dict[str, grpc.RpcMethodHandler] = {
        "Who": grpc.unary_unary_rpc_method_handler(_whoami),
        "WhoStream": grpc.unary_stream_rpc_method_handler(_whoami_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Probe", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan
    await server.stop(None)


def _who(chan: grpc.aio.Channel) -> Any:
    return chan.unary_unary("/test.Probe/Who")  # raw bytes in and out


def _who_stream(chan: grpc.aio.Channel) -> Any:
    return chan.unary_stream("/test.Probe/WhoStream")


def _trailer(error: grpc.aio.AioRpcError, key: str) -> str | None:
    for name, value in error.trailing_metadata() or ():
        if name == key:
            return str(value)
    return None


class TestAuthInterceptor:
    async def test_valid_key_binds_the_tenant(self, test_channel: grpc.aio.Channel, tenant_a: TenantHeaders) -> None:
        reply = await _who(test_channel)(b"ok", metadata=bearer(tenant_a.api_key))
        assert reply == tenant_a.tenant_id.encode()

    async def test_tenants_are_told_apart(
        self, test_channel: grpc.aio.Channel, tenant_a: TenantHeaders, tenant_b: TenantHeaders
    ) -> None:
        call = _who(test_channel)
        assert await call(b"ok", metadata=bearer(tenant_b.api_key)) == tenant_b.tenant_id.encode()
        assert await call(b"ok", metadata=bearer(tenant_a.api_key)) == tenant_a.tenant_id.encode()

    @pytest.mark.parametrize(
        "metadata",
        [(), (("authorization", "Bearer grpo_sk_not_a_real_key"),), (("authorization", "Basic dXNlcjpwYXNz"),)],
        ids=["missing", "wrong-key", "not-bearer"],
    )
    async def test_bad_credentials_are_unauthenticated(
        self, test_channel: grpc.aio.Channel, tenant_a: TenantHeaders, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _who(test_channel)(b"ok", metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _trailer(err.value, ERROR_CODE_KEY) == "unauthenticated"

    async def test_streams_are_authenticated_too(self, test_channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in _who_stream(test_channel)(b"ok"):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


class TestErrorMapping:
    @pytest.mark.parametrize(
        ("trigger", "status", "code"),
        [
            ("not_found", grpc.StatusCode.NOT_FOUND, "not_found"),
            ("validation", grpc.StatusCode.INVALID_ARGUMENT, "validation_error"),
            ("pydantic", grpc.StatusCode.INVALID_ARGUMENT, "validation_error"),
            ("transition", grpc.StatusCode.FAILED_PRECONDITION, "illegal_transition"),
            ("mismatch", grpc.StatusCode.ALREADY_EXISTS, "idempotency_key_reused"),
            ("in_flight", grpc.StatusCode.ABORTED, "idempotency_key_in_flight"),
            ("bug", grpc.StatusCode.INTERNAL, "internal"),
        ],
    )
    async def test_status_per_error(
        self,
        test_channel: grpc.aio.Channel,
        tenant_a: TenantHeaders,
        trigger: str,
        status: grpc.StatusCode,
        code: str,
    ) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _who(test_channel)(trigger.encode(), metadata=bearer(tenant_a.api_key))
        assert err.value.code() == status
        assert _trailer(err.value, ERROR_CODE_KEY) == code

    async def test_validation_names_the_field(self, test_channel: grpc.aio.Channel, tenant_a: TenantHeaders) -> None:
        call = _who(test_channel)
        for trigger, field in (("validation", "spec.base_model"), ("pydantic", "count")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(trigger.encode(), metadata=bearer(tenant_a.api_key))
            assert _trailer(err.value, ERROR_FIELD_KEY) == field
            assert field in (err.value.details() or "")

    async def test_bugs_do_not_leak_internals(
        self, test_channel: grpc.aio.Channel, tenant_a: TenantHeaders, caplog: pytest.LogCaptureFixture
    ) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _who(test_channel)(b"bug", metadata=bearer(tenant_a.api_key))
        assert "secret" not in (err.value.details() or "")
        request_id = _trailer(err.value, REQUEST_ID_KEY)
        assert request_id and request_id in (err.value.details() or "")
        assert any(request_id in record.getMessage() and record.exc_info for record in caplog.records)

    async def test_error_mid_stream(self, test_channel: grpc.aio.Channel, tenant_a: TenantHeaders) -> None:
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for item in _who_stream(test_channel)(
                b"not_found", metadata=bearer(tenant_a.api_key)
            ):
                received.append(item)
        assert received == [b"first"]
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    def test_every_domain_error_has_a_status(self) -> None:
        def subclasses(cls: type[DomainError]) -> list[type[DomainError]]:
            return [cls, *(s for sub in cls.__subclasses__() for s in subclasses(sub))]

        for cls in subclasses(DomainError):
            assert isinstance(cls.grpc_status, grpc.StatusCode), cls
            assert cls.grpc_status not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN), cls


class TestStandardServices:
    async def test_health_needs_no_key(self, channel: grpc.aio.Channel) -> None:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    async def test_reflection_lists_the_services(self, channel: grpc.aio.Channel) -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = set()
        async for reply in replies:
            names |= {s.name for s in reply.list_services_response.service}
        assert "grpc.health.v1.Health" in names
