"""The PostgreSQL reset between tests (`_truncate_all`) leaves what a fresh migration leaves: no rows in any table
and every id sequence restarted, whatever the previous test wrote."""

from __future__ import annotations

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from tests.service.conftest import _truncate_all
from tests.service.factories import create_tenant


def test_rows_in_parent_and_child_tables_go_and_sequences_restart(_postgres_database: str) -> None:
    url = _postgres_database
    _truncate_all(url)
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            first = conn.execute(text("SELECT nextval('job_events_id_seq')")).scalar()
        with Session(engine) as session, session.begin():
            create_tenant(session, "reset")  # a tenant and its API key: a row that references another
        with engine.begin() as conn:
            assert conn.execute(text("SELECT count(*) FROM api_keys")).scalar() == 1
            conn.execute(text("SELECT nextval('job_metrics_id_seq')"))
            conn.execute(text("SELECT nextval('job_events_id_seq')"))
        _truncate_all(url)
        with engine.begin() as conn:
            tables = conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                                       " AND tablename <> 'alembic_version'")).scalars().all()
            counts = {t: conn.execute(text(f'SELECT count(*) FROM "{t}"')).scalar() for t in tables}
            assert len(tables) > 20 and set(counts.values()) == {0}, counts
            assert conn.execute(text("SELECT nextval('job_events_id_seq')")).scalar() == first
            assert conn.execute(text("SELECT nextval('job_metrics_id_seq')")).scalar() == 1
    finally:
        engine.dispose()
        _truncate_all(url)
