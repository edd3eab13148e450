"""PostgreSQL pool without pool_pre_ping: connections that died while idle are replaced at checkout (no
request sees them), and a connection in steady use is not pinged (no extra round trip per request)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from service.kit import db as kit_db
from service.kit.config import Settings

pytestmark = pytest.mark.parametrize("db_url", ["postgres"], indirect=True)


def _backend_pid() -> int:
    with kit_db.session_scope() as session:
        return int(session.scalar(text("SELECT pg_backend_pid()")))


def _terminate(settings: Settings, pid: int) -> None:
    """Kill one server backend from outside, as a database restart or an idle timeout would."""
    admin = create_engine(settings.database_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            assert conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    finally:
        admin.dispose()


def test_connection_killed_while_idle_is_replaced(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kit_db, "PING_AFTER_IDLE_SECONDS", 0.0)  # every checkout counts as idle
    pid = _backend_pid()
    _terminate(settings, pid)
    assert _backend_pid() != pid  # the ping failed, the pool opened a new connection, the query worked


def test_without_the_idle_ping_the_dead_connection_would_fail(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counterfactual of the test above: proves it exercises the ping, not some other recovery."""
    monkeypatch.setattr(kit_db, "PING_AFTER_IDLE_SECONDS", 3600.0)
    pid = _backend_pid()
    _terminate(settings, pid)
    with pytest.raises(OperationalError):
        _backend_pid()
    assert _backend_pid() != pid  # and the pool recovered after that one failure


@pytest.mark.parametrize(("idle_threshold", "pings"), [(1.0, 0), (0.0, 4)])
def test_busy_connection_is_not_pinged(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, idle_threshold: float, pings: int
) -> None:
    """Back-to-back requests reuse a connection without a ping; with a zero threshold every reuse pings."""
    monkeypatch.setattr(kit_db, "PING_AFTER_IDLE_SECONDS", idle_threshold)
    dialect = kit_db.get_engine().dialect
    real_ping = dialect.do_ping
    calls: list[object] = []

    def counting_ping(dbapi_conn: Any) -> bool:
        calls.append(dbapi_conn)
        return real_ping(dbapi_conn)

    monkeypatch.setattr(dialect, "do_ping", counting_ping)
    for _ in range(5):
        _backend_pid()
    assert len(calls) == pings  # the first checkout opens a new connection: never pinged
