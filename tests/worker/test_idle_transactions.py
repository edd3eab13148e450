"""A worker frozen inside a transaction must not keep its row locks: PostgreSQL ends the idle session."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from service.execution.lease import is_transient_db_error
from service.kit.db import make_engine


def test_an_idle_transaction_is_ended_by_the_server_and_its_lock_released(postgres_admin_url: str) -> None:
    frozen = make_engine(postgres_admin_url, idle_transaction_timeout_s=0.5)
    other = make_engine(postgres_admin_url)
    try:
        with other.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS idle_probe (id int PRIMARY KEY)"))
            conn.execute(text("INSERT INTO idle_probe VALUES (1) ON CONFLICT DO NOTHING"))
        with frozen.connect() as conn:
            conn.begin()
            conn.execute(text("SELECT id FROM idle_probe WHERE id = 1 FOR UPDATE"))
            time.sleep(1.5)  # "frozen" past the timeout, holding the row lock
            with other.begin() as free:  # would wait for the lock if the session were still alive
                free.execute(text("SET LOCAL lock_timeout = '5s'"))
                free.execute(text("SELECT id FROM idle_probe WHERE id = 1 FOR UPDATE"))
            with pytest.raises(DBAPIError) as ended:
                conn.execute(text("SELECT 1"))  # the server ended this session
            # The woken worker sees a dropped connection: retried on a new one, then refused by the fence.
            assert is_transient_db_error(ended.value)
    finally:
        with other.begin() as conn:
            conn.execute(text("DROP TABLE IF EXISTS idle_probe"))
        frozen.dispose()
        other.dispose()


def test_sqlite_and_default_engines_take_no_timeout(postgres_admin_url: str) -> None:
    engine = make_engine(postgres_admin_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar() == "0"
    finally:
        engine.dispose()
    make_engine("sqlite://", idle_transaction_timeout_s=1.0).dispose()  # ignored there, no error
