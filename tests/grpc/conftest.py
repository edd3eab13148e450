"""gRPC test fixtures: a real grpc.aio server on port 0 over the service test database, and a channel.

Reuses tests/service/conftest.py (migrated database, settings, tenants): every test runs on SQLite and on
PostgreSQL (`db_url` is parametrized there), where the polled RPCs read through the asyncpg pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from service.grpc.server import running_grpc
from tests.service.conftest import (  # noqa: F401  (fixtures, used by name)
    _postgres_database,
    _sqlite_template,
    app,
    client,
    db_url,
    make_tenant,
    settings,
    tenant_a,
    tenant_b,
)


@pytest.fixture
async def grpc_port(settings: object) -> AsyncIterator[int]:  # noqa: F811
    """A started server on a free loopback port (with the reads `grpo serve` would use), stopped after the test."""
    async with running_grpc(0) as (_server, port):
        yield port


@pytest.fixture
async def channel(grpc_port: int) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as chan:
        yield chan
