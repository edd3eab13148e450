"""The schema comes from Alembic migrations; the models must agree with it exactly."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from service.models import Base


def test_models_match_migrations(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_migrated_database_has_core_tables(db_url: str) -> None:
    engine = create_engine(db_url)
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"tenants", "api_keys", "datasets", "reward_functions", "alembic_version"} <= tables
