"""gRPC test fixtures: a real grpc.aio server on port 0 over the service test database, and a channel.

Reuses tests/service/conftest.py (migrated database, settings, tenants), on SQLite only: the domain layer's
own tests cover both databases; here the transport is under test.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from service.grpc.server import running_grpc
from tests.service.conftest import (  # noqa: F401  (fixtures, used by name)
    _sqlite_template,
    app,
    client,
    make_tenant,
    settings,
    tenant_a,
    tenant_b,
)


@pytest.fixture
def db_url(_sqlite_template: Path, tmp_path: Path) -> str:  # noqa: F811
    """A migrated, empty SQLite database (overrides the sqlite+postgres parametrisation)."""
    path = tmp_path / "grpo.db"
    shutil.copyfile(_sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
async def grpc_port(settings: object) -> AsyncIterator[int]:  # noqa: F811
    """A started server on a free loopback port (with the reads `grpo serve` would use), stopped after the test."""
    async with running_grpc(0) as (_server, port):
        yield port


@pytest.fixture
async def channel(grpc_port: int) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as chan:
        yield chan
