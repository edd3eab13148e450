"""Scopes on every RPC of the served services, enumerated from the descriptors the server registers: an RPC
added without a scope fails here (and the server refuses to start, see `check_scopes_declared`).

The expected scope is derived independently of service.grpc.scopes: `admin` for ApiKeyService, `read` for
Get*/List*/Watch*/Download*, `write` for every other RPC.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor

from service.grpc import servicers
from service.grpc.scopes import check_scopes_declared
from service.kit import db as kit_db
from service.tenants.scopes import ALL_SCOPES
from tests.grpc.helpers import bearer, error_code
from tests.service.factories import TenantHeaders, create_key

ADMIN_SERVICES = {"grpo.v1.ApiKeyService", "grpo.v1.QuotaService"}
READ_PREFIXES = ("Get", "List", "Watch", "Download")


def expected_scope(method: MethodDescriptor) -> str:
    if method.containing_service.full_name in ADMIN_SERVICES:
        return "admin"
    return "read" if method.name.startswith(READ_PREFIXES) else "write"


async def served_methods() -> list[MethodDescriptor]:
    names = servicers.register_all(grpc.aio.server())
    pool = descriptor_pool.Default()
    return [method for name in names for method in pool.FindServiceByName(name).methods]


async def _call(channel: grpc.aio.Channel, method: MethodDescriptor, key: str) -> grpc.StatusCode:
    """Call `method` with an empty request (raw bytes); the status it ends with (OK when it succeeded)."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    metadata = bearer(key)

    async def no_requests() -> AsyncIterator[bytes]:
        for _ in ():
            yield b""

    try:
        if method.client_streaming:
            await channel.stream_unary(path)(no_requests(), metadata=metadata, timeout=10)
        elif method.server_streaming:
            async for _ in channel.unary_stream(path)(b"", metadata=metadata, timeout=10):
                break
        else:
            await channel.unary_unary(path)(b"", metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            assert error_code(exc) == "insufficient_scope", exc
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
def keys(tenant_a: TenantHeaders) -> Callable[[set[str]], str]:
    def make(scopes: set[str]) -> str:
        with kit_db.session_scope() as session:
            return create_key(session, tenant_a.tenant_id, sorted(scopes))

    return make


async def test_every_rpc_requires_its_scope(channel: grpc.aio.Channel, keys: Callable[[set[str]], str]) -> None:
    all_but = {scope: keys(set(ALL_SCOPES) - {scope}) for scope in ALL_SCOPES}
    only = {scope: keys({scope}) for scope in ALL_SCOPES}
    methods = await served_methods()
    for method in methods:
        scope = expected_scope(method)
        assert await _call(channel, method, all_but[scope]) == grpc.StatusCode.PERMISSION_DENIED, method.full_name
        assert await _call(channel, method, only[scope]) != grpc.StatusCode.PERMISSION_DENIED, method.full_name
    names = {m.full_name for m in methods}
    assert {"grpo.v1.JobService.CreateJob", "grpo.v1.DatasetService.UploadDataset"} <= names
    assert len([m for m in methods if expected_scope(m) != "read"]) >= 10


async def test_a_server_with_an_unscoped_rpc_does_not_start() -> None:
    jobs = descriptor_pool.Default().FindServiceByName("grpo.v1.JobService")
    scopes: dict[str, Any] = {f"/{jobs.full_name}/{m.name}": "read" for m in jobs.methods if m.name != "PauseJob"}
    with pytest.raises(RuntimeError, match="/grpo.v1.JobService/PauseJob"):
        check_scopes_declared([jobs], scopes)
