"""Liveness and readiness checks. Readiness = the database answers and the broker accepts a connection."""

from __future__ import annotations

import logging
from collections.abc import Callable

from kombu import Connection
from sqlalchemy import Engine, text

log = logging.getLogger(__name__)

BROKER_TIMEOUT_S = 2.0


def check_database(engine: Engine) -> None:
    """Raises if a connection cannot run SELECT 1."""
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def check_broker(broker_url: str, timeout_s: float = BROKER_TIMEOUT_S) -> None:
    """Raises if the broker does not accept a connection within about `timeout_s`."""
    with Connection(
        broker_url, connect_timeout=timeout_s, transport_options={"socket_timeout": timeout_s}
    ) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=timeout_s)


def run_checks(checks: dict[str, Callable[[], None]]) -> dict[str, str]:
    """Run every check; "ok" or the failure's class name (details go to the log, not to callers)."""
    results: dict[str, str] = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception as exc:
            log.warning("readiness check %s failed: %s", name, exc)
            results[name] = f"unavailable ({type(exc).__name__})"
    return results
