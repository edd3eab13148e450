"""The polled reads (kit.reads): on PostgreSQL the asyncpg path renders exactly what the SQLAlchemy path
renders, survives connections the server dropped, and the app uses it only when its lifespan opened it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, TypeVar

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, text

from service.jobs import progress
from service.jobs import service as jobs_service
from service.jobs.models import Job
from service.jobs.states import JobStatus
from service.kit.config import Settings
from service.kit.db import session_scope
from service.kit.errors import ServiceUnavailable
from service.kit.reads import (
    DATABASE_UNAVAILABLE,
    READS_APPLICATION_NAME,
    THREADED_READS,
    PostgresReads,
    Reads,
    ThreadedReads,
    compiled_read,
)
from tests.service.factories import TenantHeaders
from tests.service.jobs_support import job_spec, make_dataset, start_job

T = TypeVar("T")

postgres_only = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def run(make: Callable[[PostgresReads], Coroutine[Any, Any, T]], settings: Settings) -> T:
    """Open a PostgresReads on a fresh event loop, run `make(reads)`, close it."""

    async def main() -> T:
        reads = await PostgresReads.open(settings.database_url, max_size=2)
        try:
            return await make(reads)
        finally:
            await reads.close()

    return asyncio.run(main())


def jobs_in_every_shape(client: TestClient, tenant: TenantHeaders) -> list[str]:
    """Queued, running with metrics, failed with an error, paused: every nullable column set and unset."""
    ids = []
    for _ in range(4):
        response = client.post("/v1/jobs", json=job_spec(make_dataset(tenant.tenant_id)), headers=tenant)
        assert response.status_code == 201
        ids.append(response.json()["id"])
    running, failed, paused = ids[1], ids[2], ids[3]
    attempt = start_job(running)
    with session_scope() as session:
        progress.record_metrics(session, running, attempt, 3, {"loss": 0.25, "reward/mean": 0.5})
    attempt = start_job(failed)
    with session_scope() as session:
        progress.worker_transition(
            session,
            failed,
            attempt,
            JobStatus.failed,
            reason="x",
            error_code="boom",
            error_message="it broke",
        )
    assert client.post(f"/v1/jobs/{paused}/pause", headers=tenant).status_code == 200
    return ids


@postgres_only
def test_asyncpg_rows_render_like_sqlalchemy_rows(
    client: TestClient, tenant_a: TenantHeaders, settings: Settings
) -> None:
    ids = jobs_in_every_shape(client, tenant_a)

    async def read_all(reads: Reads) -> tuple[list[Any], Any]:
        jobs = [await jobs_service.read_job(reads, tenant_a.tenant_id, job_id) for job_id in ids]
        pages = [
            await jobs_service.list_jobs(reads, tenant_a.tenant_id, status=status, limit=2, after=after)
            for status in (None, JobStatus.failed)
            for after in (None, ids[3])
        ]
        return jobs, pages

    expected = asyncio.run(read_all(THREADED_READS))
    got = run(read_all, settings)
    assert got == expected
    jobs = got[0]
    assert [j.status for j in jobs] == ["queued", "running", "failed", "paused"]
    assert jobs[1].metrics == {"loss": 0.25, "reward/mean": 0.5} and jobs[1].progress.step == 3
    assert jobs[2].error is not None and jobs[2].error.code == "boom"
    assert all(j.created_at.utcoffset() is not None for j in jobs)


@postgres_only
def test_other_tenants_job_is_not_found_on_asyncpg(
    client: TestClient, tenant_a: TenantHeaders, tenant_b: TenantHeaders, settings: Settings
) -> None:
    job_id = jobs_in_every_shape(client, tenant_a)[0]

    async def rows(reads: Reads) -> int:
        stmt = select(Job.id).where(Job.id == job_id)  # a statement of its own: compiled on first use
        assert len(await reads.all(stmt, {})) == 1
        page, _ = await jobs_service.list_jobs(reads, tenant_b.tenant_id, status=None, limit=10, after=None)
        return len(page)

    assert run(rows, settings) == 0
    response = client.get(f"/v1/jobs/{job_id}", headers=tenant_b)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@postgres_only
def test_a_read_on_a_dropped_connection_is_retried(
    client: TestClient, tenant_a: TenantHeaders, settings: Settings
) -> None:
    job_id = jobs_in_every_shape(client, tenant_a)[0]
    admin = create_engine(settings.database_url, isolation_level="AUTOCOMMIT")

    async def read_after_kill(reads: PostgresReads) -> list[str]:
        statuses = []
        for _ in range(2):
            job = await jobs_service.read_job(reads, tenant_a.tenant_id, job_id)
            statuses.append(job.status)
            # Kill every server session of the pool, as a database restart does.
            with admin.connect() as conn:
                killed = conn.scalar(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND application_name = :name"
                    ),
                    {"name": READS_APPLICATION_NAME},
                )
            assert killed >= 1
        job = await jobs_service.read_job(reads, tenant_a.tenant_id, job_id)
        return [*statuses, job.status]

    try:
        assert run(read_after_kill, settings) == ["queued"] * 3
    finally:
        admin.dispose()


def test_statements_with_expanding_parameters_are_refused() -> None:
    stmt = select(Job.id).where(Job.id.in_(["a", "b"]))
    with pytest.raises(ValueError, match="expanding parameters"):
        compiled_read(stmt)


def test_the_app_reads_through_what_its_lifespan_opened(app: FastAPI, settings: Settings) -> None:
    """PostgreSQL: the asyncpg pool (and it is closed at shutdown); SQLite or GRPO_DB_ASYNC_READS=false: threads."""
    backend = "postgres" if settings.database_url.startswith("postgresql") else "sqlite"
    with TestClient(app):
        reads = app.state.reads
        assert isinstance(reads, PostgresReads if backend == "postgres" else ThreadedReads)
    assert not hasattr(app.state, "reads")


@postgres_only
def test_async_reads_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    from service.app import create_app
    from service.kit.config import get_settings

    monkeypatch.setenv("GRPO_DB_ASYNC_READS", "false")
    get_settings.cache_clear()
    app = create_app()
    with TestClient(app):
        assert app.state.reads is THREADED_READS


DEAD_DATABASE = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"  # nothing listens on port 1


@postgres_only
def test_an_unreachable_database_is_a_503_not_a_500(
    app: FastAPI, tenant_a: TenantHeaders, settings: Settings
) -> None:
    with TestClient(app) as client:
        job_id = jobs_in_every_shape(client, tenant_a)[0]  # also caches the key: no auth query below
        live = app.state.reads
        app.state.reads = client.portal.call(partial(PostgresReads.open, DEAD_DATABASE, max_size=1))
        try:
            response = client.get(f"/v1/jobs/{job_id}", headers=tenant_a)
            listing = client.get("/v1/jobs", headers=tenant_a)
        finally:
            client.portal.call(app.state.reads.close)
            app.state.reads = live
        assert client.get(f"/v1/jobs/{job_id}", headers=tenant_a).status_code == 200  # nothing else broke
    for answer in (response, listing):
        assert answer.status_code == 503
        assert answer.json()["error"] == {
            "code": "service_unavailable",
            "message": DATABASE_UNAVAILABLE,
            "details": None,
        }


def test_the_threaded_path_answers_unavailable_too(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite and GRPO_DB_ASYNC_READS=false read through SQLAlchemy: a database it cannot reach is the same 503."""
    from service.kit import db as kit_db
    from service.kit.config import get_settings

    monkeypatch.setenv("GRPO_DATABASE_URL", DEAD_DATABASE)
    get_settings.cache_clear()
    kit_db._engine_for.cache_clear()
    with pytest.raises(ServiceUnavailable, match="database is unavailable"):
        asyncio.run(THREADED_READS.all(select(Job.id), {}))
