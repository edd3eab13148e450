"""The embedded broker for single-machine installs: kombu's SQLAlchemy transport on a SQLite file.

Why this and not a database-polling runner: the API sends jobs through Celery by task name
(service/kit/queue.py) whatever the broker is, so with an SQL transport `grpo serve` on a laptop runs
exactly the production code path (Celery worker, acks_late, the same task, the same claim/lease code),
just with a different `broker_url`. Its known weaknesses are covered elsewhere:

- it can lose a message (a delivered message is hidden, not restored, when the worker is SIGKILLed):
  the job row is the truth, and the reaper re-sends jobs left `queued` and re-enqueues jobs whose lease
  expired, so a lost message only delays a job;
- it polls: kombu's virtual transports sleep `polling_interval` (1 s by default) between empty polls.
  `EmbeddedTransport` polls every `POLL_SECONDS` instead, one indexed SELECT per queue on a local file,
  which brings submit -> running to a few hundred ms (bench/queue_latency.py measures it).

kombu passes every transport option straight to `create_engine`, so the polling interval cannot be set
through `broker_transport_options`; a transport subclass is the supported way. The producer side
(the API) keeps using kombu's stock `sqla+` transport: both share the same two tables.

Forks wait for the channel's SQLite calls (`_BROKER_CALLS`). The worker's pool forks each job's child from
a thread of its own (billiard's supervisor; a polling transport has no event loop) while the main thread
polls this channel. libsqlite guards its allocator with a process-wide mutex: a fork that lands while the
poll holds it leaves the child holding a mutex no thread will release, and the child hangs at its first
SQLite call, before it claims its job.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kombu.transport import sqlalchemy as kombu_sqla
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

POLL_SECONDS = 0.2
TRANSPORT_PATH = "worker.embedded_broker:EmbeddedTransport"

T = TypeVar("T")

# Re-entrant: `_put`, `_get` and `_size` call `_get_or_create`. The forking thread holds it across the fork,
# so the child's copy is released by the same thread (the child's only one).
_BROKER_CALLS = threading.RLock()
os.register_at_fork(
    before=_BROKER_CALLS.acquire, after_in_parent=_BROKER_CALLS.release, after_in_child=_BROKER_CALLS.release
)


def _fork_safe(call: Callable[..., T]) -> Callable[..., T]:
    """`call` runs with the channel's SQLite connection and no fork under way (module docstring)."""

    def guarded(*args: Any, **kwargs: Any) -> T:
        with _BROKER_CALLS:
            return call(*args, **kwargs)

    return guarded


def _sqlite_engine(url: str) -> Engine:
    # A busy timeout lets the API's publish and the worker's poll wait for each other instead of
    # failing with "database is locked"; WAL lets readers and the single writer overlap.
    engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    return engine


class EmbeddedChannel(kombu_sqla.Channel):
    _get = _fork_safe(kombu_sqla.Channel._get)
    _put = _fork_safe(kombu_sqla.Channel._put)
    _purge = _fork_safe(kombu_sqla.Channel._purge)
    _size = _fork_safe(kombu_sqla.Channel._size)

    @_fork_safe
    def _get_or_create(self, queue: str) -> Any:
        # kombu guards the insert of a new queue's row with a lock of its own process only: when the API
        # publishes the first job of a queue while the worker declares that queue at start-up, the second
        # insert fails on the unique name, and the worker stopped with "Unrecoverable error". The row exists.
        try:
            return super()._get_or_create(queue)
        except IntegrityError:
            self.session.rollback()
            return self.session.query(self.queue_cls).filter(self.queue_cls.name == queue).one()

    def _engine_from_config(self) -> Engine:
        url: str = self.connection.client.hostname
        if make_url(url).get_backend_name() == "sqlite":
            return _sqlite_engine(url)
        return create_engine(url, pool_pre_ping=True)


class EmbeddedTransport(kombu_sqla.Transport):
    Channel = EmbeddedChannel
    polling_interval = POLL_SECONDS


def split_sqla_url(broker_url: str) -> str | None:
    """`sqla+sqlite:///x.db` -> `sqlite:///x.db`; None for any other broker (Redis...)."""
    for prefix in ("sqla+", "sqlalchemy+"):
        if broker_url.startswith(prefix):
            return broker_url.removeprefix(prefix)
    return None
