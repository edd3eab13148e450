"""Single-statement reads for the hot, polled paths (a job, a page of jobs), awaited on the event loop.

Why: clients poll `GET /v1/jobs/{id}`, and on that route the hop to a worker thread and SQLAlchemy's
execution machinery (session, pool events, result metadata built from 26 column descriptions on every call)
cost several times what the rest of the request costs. On PostgreSQL, `PostgresReads` runs the same
SQLAlchemy Core statement, compiled once to SQL, on an asyncpg pool: no thread, no session (asyncpg rather
than psycopg's asyncio mode, which costs more CPU per read). Everywhere else (SQLite,
GRPO_DB_ASYNC_READS=false, or an app run without its lifespan) `ThreadedReads` runs it on the small read
thread pool through a SQLAlchemy session. bench/README.md has the API figures.

Statements stay defined once, as Core selects in the repositories, whichever class runs them; rows are
read by attribute under the statement's column labels on both. Only single SELECTs belong here (each runs
in autocommit, so one statement is one snapshot); anything that writes or needs several statements to
agree goes through `session_scope`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import asyncpg
from sqlalchemy import Select
from sqlalchemy.dialects.postgresql import asyncpg as pg_asyncpg
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from service.kit.config import Settings
from service.kit.db import run_read, single_read_session
from service.kit.errors import ServiceUnavailable

log = logging.getLogger(__name__)

Params = Mapping[str, Any]

# What a read answers (503 / UNAVAILABLE) when the database cannot serve it; the cause is logged, not shown.
DATABASE_UNAVAILABLE = "the database is unavailable; retry shortly"


class Reads(Protocol):
    """Runs one SELECT and returns its rows (attribute access by column label)."""

    async def all(self, stmt: Select[Any], params: Params) -> Sequence[Any]: ...

    async def close(self) -> None: ...


async def one_or_none(reads: Reads, stmt: Select[Any], params: Params) -> Any | None:
    rows = await reads.all(stmt, params)
    if len(rows) > 1:
        raise RuntimeError(f"expected at most one row, got {len(rows)}")
    return rows[0] if rows else None


# --- any database: a SQLAlchemy session on the read thread pool -------------------------------------


@contextmanager
def unavailable_database_is_503(what: str) -> Iterator[None]:
    """SQLAlchemy work inside answers ServiceUnavailable (503 / UNAVAILABLE) when the database cannot serve it:
    unreachable, restarting, locked are the database's state, not the request's. The cause is logged."""
    try:
        yield
    except OperationalError as exc:
        log.warning("%s failed: database unavailable (%s)", what, exc.orig)
        raise ServiceUnavailable(DATABASE_UNAVAILABLE) from exc


def _all_in_session(stmt: Select[Any], params: Params) -> Sequence[Any]:
    with unavailable_database_is_503("read"), single_read_session() as session:
        return session.connection().execute(stmt, dict(params)).all()


class ThreadedReads:
    """Runs statements through SQLAlchemy on `kit.db.run_read`'s thread pool (any backend)."""

    async def all(self, stmt: Select[Any], params: Params) -> Sequence[Any]:
        return await run_read(_all_in_session, stmt, params)

    async def close(self) -> None:
        return None


THREADED_READS = ThreadedReads()


# --- PostgreSQL: an asyncpg pool ---------------------------------------------------------------------

_PG_DIALECT = pg_asyncpg.dialect()

# The connection's session could not be used (server restart, a proxy's idle timeout, admin shutdown):
# nothing ran, so a read is safe to retry on a fresh connection.
_LOST_CONNECTION: tuple[type[BaseException], ...] = (
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    OSError,
)


@dataclass(frozen=True)
class CompiledRead:
    sql: str
    names: tuple[str, ...]  # bound parameter names in `$1, $2, ...` order
    values: Mapping[str, Any]  # values bound in the statement itself (`Job.id == "job_1"`)

    def args(self, params: Params) -> list[Any]:
        return [params[name] if name in params else self.values[name] for name in self.names]


@lru_cache(maxsize=64)
def compiled_read(stmt: Select[Any]) -> CompiledRead:
    """The statement as PostgreSQL SQL with `$n` placeholders, compiled once per statement object.

    Statements whose parameters SQLAlchemy expands at execution time (`in_` over a list) cannot be compiled
    ahead like this: they are refused here rather than sent half-rendered.
    """
    compiled = stmt.compile(dialect=_PG_DIALECT)
    sql = str(compiled)
    if "POSTCOMPILE" in sql:
        raise ValueError("statements with expanding parameters cannot run on PostgresReads")
    return CompiledRead(sql, tuple(compiled.positiontup or ()), dict(compiled.params))


class _Row(asyncpg.Record):
    """Rows read by attribute, like SQLAlchemy's."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


async def _decode_json(conn: asyncpg.Connection) -> None:
    # asyncpg hands json columns over as text; SQLAlchemy (through psycopg) returns them decoded.
    for type_name in ("json", "jsonb"):
        await conn.set_type_codec(type_name, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """The pool's reset on release, as a no-op. asyncpg's default sends `RESET ALL; UNLISTEN *; CLOSE ALL;
    pg_advisory_unlock_all()` after every statement: one more round trip per read (about half the
    database time of a job read). These connections only ever run single autocommit SELECTs, which leave no
    session state behind to reset."""


def asyncpg_dsn(sqlalchemy_url: str) -> str:
    """`postgresql+psycopg://...` (SQLAlchemy) -> `postgresql://...` (libpq syntax, which asyncpg reads)."""
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


READS_APPLICATION_NAME = "grpo-api-reads"  # how the pool's sessions show in pg_stat_activity


class PostgresReads:
    """Runs statements on an asyncpg connection pool (each statement autocommits).

    Bound to the event loop it was opened on (the app's, through its lifespan). The pool starts empty and
    connects on demand, so the API starts (and /readyz reports) while the database is still coming up. A
    statement that fails because its connection was lost is retried once, after every pooled connection
    has been marked for replacement (after a server restart they are all dead); if that fails too, the read
    is answered ServiceUnavailable (503 / UNAVAILABLE), never an unhandled error.
    """

    def __init__(self, pool: asyncpg.Pool, max_size: int) -> None:
        self._pool = pool
        # First come, first served: asyncpg's pool lets a new caller take a connection that was just released
        # ahead of callers already waiting, and those then queue again at the back. Under load (64 clients on
        # 10 connections) that starved some reads for hundreds of ms; this FIFO gate, sized to the pool, keeps
        # the pool itself from ever having waiters.
        self._turns = asyncio.Semaphore(max_size)

    @classmethod
    async def open(cls, database_url: str, *, max_size: int) -> PostgresReads:
        pool = await asyncpg.create_pool(
            asyncpg_dsn(database_url),
            min_size=0,
            max_size=max_size,
            record_class=_Row,
            init=_decode_json,
            reset=_keep_session,
            server_settings={"application_name": READS_APPLICATION_NAME},
        )
        return cls(pool, max_size)

    async def all(self, stmt: Select[Any], params: Params) -> Sequence[Any]:
        read = compiled_read(stmt)
        args = read.args(params)
        async with self._turns:
            try:
                return await self._pool.fetch(read.sql, *args)
            except _LOST_CONNECTION as exc:
                log.warning("read failed on a pooled connection (%r); retrying once on a new one", exc)
            await self._pool.expire_connections()
            try:
                return await self._pool.fetch(read.sql, *args)
            except _LOST_CONNECTION as exc:
                log.warning("read failed again: database unavailable (%r)", exc)
                raise ServiceUnavailable(DATABASE_UNAVAILABLE) from exc

    async def close(self) -> None:
        await self._pool.close()


async def open_reads(settings: Settings) -> Reads:
    """`PostgresReads` on PostgreSQL when GRPO_DB_ASYNC_READS is on, else the threaded SQLAlchemy path."""
    if settings.db_async_reads and make_url(settings.database_url).get_backend_name() == "postgresql":
        return await PostgresReads.open(settings.database_url, max_size=settings.db_async_read_pool_size)
    return THREADED_READS
