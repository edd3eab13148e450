"""The polled RPCs (GetJob, ListJobs, WatchJob) on PostgreSQL, where `running_grpc` gives the servicers the asyncpg
read pool (kit.reads) instead of the thread pool the SQLite tests use."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from sqlalchemy import create_engine, text

from contract.gen.grpo.v1 import jobs_pb2, jobs_pb2_grpc
from service.grpc.server import create_grpc_server
from service.kit.config import Settings
from service.kit.reads import READS_APPLICATION_NAME, PostgresReads
from tests.grpc.helpers import bearer
from tests.grpc.test_watch_job import STEPS, _collect, _job, _steps, _work, fast_polling, queue  # noqa: F401
from tests.service.conftest import _postgres_database, _truncate_all  # noqa: F401
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import RecordingQueue, start_job


@pytest.fixture
def db_url(_postgres_database: str) -> str:  # noqa: F811  (PostgreSQL only: overrides the parametrized db_url)
    _truncate_all(_postgres_database)
    return _postgres_database


def _read_pool_sessions(settings: Settings) -> int:
    engine = create_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            # This database's only: other test runs may share the server.
            query = text(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = :name AND datname = current_database()"
            )
            return int(conn.scalar(query, {"name": READS_APPLICATION_NAME}) or 0)
    finally:
        engine.dispose()


async def test_get_list_and_watch_read_through_the_asyncpg_pool(
    channel: grpc.aio.Channel,
    tenant_a: TenantHeaders,
    tenant_b: TenantHeaders,
    queue: RecordingQueue,  # noqa: F811
    settings: Settings,
) -> None:
    stub = jobs_pb2_grpc.JobServiceStub(channel)
    assert _read_pool_sessions(settings) == 0
    job_id = await _job(channel, tenant_a)

    got = (await stub.GetJob(jobs_pb2.GetJobRequest(job_id=job_id), metadata=bearer(tenant_a.api_key))).job
    assert got.id == job_id and got.state == jobs_pb2.JOB_STATE_QUEUED
    assert _read_pool_sessions(settings) >= 1  # the read went through the pool, not SQLAlchemy
    listed = await stub.ListJobs(jobs_pb2.ListJobsRequest(page_size=5), metadata=bearer(tenant_a.api_key))
    assert [j.id for j in listed.jobs] == [job_id]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetJob(jobs_pb2.GetJobRequest(job_id=job_id), metadata=bearer(tenant_b.api_key))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    await asyncio.to_thread(_work, job_id, start_job(job_id), 0)
    everything = await asyncio.wait_for(_collect(stub, tenant_a.api_key, job_id, from_step=0), timeout=10)
    assert _steps(everything) == list(range(1, STEPS + 1))
    assert everything[-1].job.state == jobs_pb2.JOB_STATE_SUCCEEDED


async def test_an_unreachable_database_is_unavailable(
    tenant_a: TenantHeaders,
    queue: RecordingQueue,  # noqa: F811
    settings: Settings,
) -> None:
    dead = await PostgresReads.open("postgresql+psycopg://postgres@127.0.0.1:1/nowhere", max_size=1)
    server, port = await create_grpc_server(0, reads=dead)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = jobs_pb2_grpc.JobServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetJob(jobs_pb2.GetJobRequest(job_id="job_x"), metadata=bearer(tenant_a.api_key))
    finally:
        await server.stop(None)
        await dead.close()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "database is unavailable" in (err.value.details() or "")
