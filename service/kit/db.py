"""Database engine, sessions and the declarative base.

Services and repositories never commit: the boundary (request dependency, Celery task wrapper,
gRPC servicer) does, through `session_scope`. Work that must only happen once a transaction is
durable (enqueueing a Celery task) is registered with `on_commit` and dropped on rollback.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import BigInteger, DateTime, Engine, Integer, MetaData, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

from service.kit.config import get_settings

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on both PostgreSQL and SQLite (which drops the offset)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime")
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


# An autoincrementing 64-bit key on PostgreSQL; SQLite only autoincrements an INTEGER PRIMARY KEY.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


PING_AFTER_IDLE_SECONDS = 1.0
RECYCLE_SECONDS = 1800


def make_engine(url: str, *, idle_transaction_timeout_s: float | None = None) -> Engine:
    """An engine for `url`. With `idle_transaction_timeout_s` (PostgreSQL), the server ends a session that sits
    idle inside a transaction that long, releasing its row locks (see `end_idle_transactions_after`)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cursor = dbapi_conn.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA busy_timeout=30000")
            cursor.close()

        return engine
    # No pool_pre_ping (one more round trip on every checkout, on every request): connections
    # that sat idle are pinged instead (so a database restart is survived), busy ones are not; LIFO
    # keeps the busy ones few and hot, and a disconnect seen mid-request makes the pool replace every
    # connection opened before it. pool_recycle retires connections that idle proxies may have dropped.
    connect_args: dict[str, Any] = {}
    if idle_transaction_timeout_s is not None and parsed.get_backend_name() == "postgresql":
        timeout_ms = max(1, int(idle_transaction_timeout_s * 1000))
        connect_args["options"] = f"-c idle_in_transaction_session_timeout={timeout_ms}"
    engine = create_engine(
        url,
        pool_size=20,
        max_overflow=20,
        pool_use_lifo=True,
        pool_recycle=RECYCLE_SECONDS,
        connect_args=connect_args,
    )
    _ping_after_idle(engine)
    return engine


def _ping_after_idle(engine: Engine) -> None:
    """Ping a pooled connection at checkout if it sat idle for PING_AFTER_IDLE_SECONDS or more. A failed ping
    raises DisconnectionError, on which the pool discards the connection and checks out (or opens) another:
    the pool's documented retry, so no request sees a connection that died while it was idle."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.pop("idle_since", None)
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_SECONDS:
            return  # new, or in use moments ago
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # any failure: the connection is unusable, get another
            raise DisconnectionError(f"pooled connection failed its ping: {exc}") from exc


@lru_cache
def _engine_for(url: str, idle_transaction_timeout_s: float | None) -> Engine:
    return make_engine(url, idle_transaction_timeout_s=idle_transaction_timeout_s)


# Set by job-running processes only (worker.tasks): API requests may legitimately keep a transaction open
# around slow I/O, a worker's transactions are all short.
_idle_transaction_timeout_s: float | None = None


def end_idle_transactions_after(seconds: float) -> None:
    """From now on this process's engine asks PostgreSQL to end any session left idle inside a transaction
    for `seconds`. A worker frozen mid-transaction (SIGSTOP, a suspended VM, a debugger) would otherwise keep
    its job row locked, and the reaper's take-back of that job would wait on the lock for as long as the
    freeze lasts instead of handing the job to a new attempt once the lease runs out."""
    global _idle_transaction_timeout_s
    _idle_transaction_timeout_s = seconds


def get_engine() -> Engine:
    return _engine_for(get_settings().database_url, _idle_transaction_timeout_s)


@lru_cache
def _factory_for(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def session_factory(engine: Engine | None = None) -> sessionmaker[Session]:
    return _factory_for(engine or get_engine())


@contextmanager
def session_scope(engine: Engine | None = None) -> Iterator[Session]:
    """The transaction boundary: commit on success, roll back on any exception."""
    session = session_factory(engine)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


@lru_cache
def _autocommit_factory_for(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False)


@contextmanager
def single_read_session(engine: Engine | None = None) -> Iterator[Session]:
    """A session for ONE read-only statement, in autocommit mode: no BEGIN and COMMIT round trips.

    One statement sees one consistent snapshot by itself, so this is equivalent to a transaction for it.
    Not for writes, nor for several statements that must agree with each other: use `session_scope`.
    """
    session = _autocommit_factory_for(engine or get_engine())()
    try:
        yield session
    finally:
        session.close()


# Threads for `run_read`. Few on purpose: a read's thread mostly waits on the database, and on a small machine
# dozens of runnable threads (Starlette's shared pool has 40) fight the event loop for the GIL: under many
# concurrent GET /v1/jobs/{id}, 4 threads cost less server CPU per request than the shared pool.
# A pool of its own, so that slow sync routes (uploads, streams) cannot starve the hot reads and vice versa.
READ_THREADS = 4

P = ParamSpec("P")
T = TypeVar("T")


@lru_cache(maxsize=1)
def _read_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="db-read")


async def run_read(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a short blocking database read off the event loop, on the small read pool (see READ_THREADS).

    The caller's context variables go along, as with Starlette's run_in_threadpool.
    """
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_read_executor(), call)


def on_commit(session: Session, callback: Callable[[], None]) -> None:
    """Run `callback` after the session's current transaction commits; forget it on rollback."""
    session.info.setdefault("on_commit", []).append(callback)


@event.listens_for(Session, "after_commit")
def _run_on_commit(session: Session) -> None:
    callbacks: list[Callable[[], None]] = session.info.pop("on_commit", [])
    for callback in callbacks:
        callback()


@event.listens_for(Session, "after_soft_rollback")
def _drop_on_rollback(session: Session, _previous_transaction: Any) -> None:
    session.info.pop("on_commit", None)
