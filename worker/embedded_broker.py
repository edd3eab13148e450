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
"""

from __future__ import annotations

from typing import Any

from kombu.transport import sqlalchemy as kombu_sqla
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

POLL_SECONDS = 0.2
TRANSPORT_PATH = "worker.embedded_broker:EmbeddedTransport"


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
