"""Service test fixtures: a migrated database per backend, settings, the app, a real ASGI client, tenants.

- `db_url` is parametrized over SQLite and PostgreSQL: every test that uses it (directly or through
  `settings`/`app`/`client`/`tenant_a`) runs on both.
  * sqlite: one database migrated per session with Alembic, copied to a fresh file per test.
  * postgres: one throwaway database `grpo_test_<random>` per session on 127.0.0.1:5432, migrated with
    Alembic, emptied before each test (rows deleted, sequences restarted), dropped at the end.
- `settings`: GRPO_* env pointing at that database, tmp storage, `memory://` broker; caches cleared.
- `app`: the real ASGI app, one per test process (`process_app`); `client`: a starlette TestClient over it.
- `tenant_a` / `tenant_b`: `TenantHeaders` (a headers dict with `.tenant_id` and `.api_key`).
"""

from __future__ import annotations

import functools
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from cli.migrate import upgrade_head
from service.kit import db as kit_db
from service.kit.config import Settings, get_settings
from service.models import Base
from service.tenants.auth import FAILED_LOOKUPS
from tests.service.factories import TenantHeaders, auth_headers, create_tenant

__all__ = ["TenantHeaders", "auth_headers", "create_tenant"]


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade_head(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def _postgres_database(postgres_admin_url: str) -> Iterator[str]:
    yield from new_postgres_database(postgres_admin_url)


def new_postgres_database(postgres_admin_url: str) -> Iterator[str]:
    """A migrated PostgreSQL database of its own, dropped afterwards (a generator for fixtures)."""
    name = f"grpo_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(postgres_admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_head(url)
        yield url
    finally:
        kit_db._engine_for.cache_clear()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _truncate_all(url: str) -> None:
    """Empty every table and restart every id sequence, as a fresh migration leaves them.

    DELETE, children first, on the tables that hold rows, and setval on the sequences that have moved: a test
    touches a handful of tables, and TRUNCATE does file work for each table it names (and each one it cascades to),
    rows or not."""
    names = [table.name for table in Base.metadata.sorted_tables]
    probe = " UNION ALL ".join(f"SELECT '{name}' WHERE EXISTS (SELECT 1 FROM \"{name}\")" for name in names)
    used_sequences = "SELECT sequencename FROM pg_sequences WHERE schemaname = 'public' AND last_value IS NOT NULL"
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            holding = set(conn.execute(text(probe)).scalars())
            for name in reversed(names):
                if name in holding:
                    conn.execute(text(f'DELETE FROM "{name}"'))
            for sequence in conn.execute(text(used_sequences)).scalars().all():
                conn.execute(text("SELECT setval(:sequence, 1, false)"), {"sequence": f'"{sequence}"'})
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database URL on each backend."""
    if request.param == "sqlite":
        path = tmp_path / "grpo.db"
        shutil.copyfile(request.getfixturevalue("_sqlite_template"), path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("_postgres_database")
    _truncate_all(url)
    return url


@pytest.fixture
def settings(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    """Service settings for this test's database, storage under tmp_path, in-memory broker."""
    monkeypatch.setenv("GRPO_ENV", "development")
    monkeypatch.setenv("GRPO_DATABASE_URL", db_url)
    monkeypatch.setenv("GRPO_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("GRPO_STORAGE_URL", str(tmp_path / "storage"))
    monkeypatch.setenv("GRPO_BROKER_URL", "memory://")
    get_settings.cache_clear()
    kit_db._engine_for.cache_clear()
    kit_db._factory_for.cache_clear()
    FAILED_LOOKUPS.clear()  # per-process state: one test's refused keys must not throttle the next's
    yield get_settings()
    kit_db.get_engine().dispose()  # release connections so the next test can TRUNCATE / delete the file
    get_settings.cache_clear()
    kit_db._engine_for.cache_clear()
    kit_db._factory_for.cache_clear()


@functools.cache
def process_app() -> FastAPI:
    """One app per test process. Building one analyses every route's signature and models, and most service tests
    need an app; it reads no settings (its lifespan and each request do), so one serves every test's settings."""
    from service.app import create_app

    return create_app()


@pytest.fixture
def app(settings: Settings) -> Iterator[FastAPI]:
    """The app, under this test's settings, without what an earlier test left on it: dependency overrides, and the
    state its lifespan or first request makes from the settings in force (a test that adds routes builds its own)."""
    shared = process_app()
    for name in ("grading", "reads"):
        if hasattr(shared.state, name):
            delattr(shared.state, name)
    shared.dependency_overrides.clear()
    yield shared
    shared.dependency_overrides.clear()


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def make_tenant(settings: Settings) -> Callable[[str], TenantHeaders]:
    """Create (and commit) a tenant with an API key; returns its headers."""

    def make(name: str) -> TenantHeaders:
        with kit_db.session_scope() as session:
            tenant, key = create_tenant(session, name)
        return TenantHeaders(tenant.id, key)

    return make


@pytest.fixture
def tenant_a(make_tenant: Callable[[str], TenantHeaders]) -> TenantHeaders:
    return make_tenant("tenant-a")


@pytest.fixture
def tenant_b(make_tenant: Callable[[str], TenantHeaders]) -> TenantHeaders:
    return make_tenant("tenant-b")
