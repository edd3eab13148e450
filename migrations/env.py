"""Alembic environment: one migration chain for SQLite and PostgreSQL.

The URL is, in order: a connection handed over in `config.attributes["connection"]` (tests),
`config.attributes["database_url"]`, then the service settings (GRPO_DATABASE_URL or the embedded SQLite default).
"""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any, Literal

from alembic import context
from sqlalchemy.engine import Connection

from service.kit.config import get_settings
from service.kit.db import UTCDateTime, make_engine
from service.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    # Autogenerate writes our UTC decorator as the plain column type migrations should use.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things in place
        compare_type=True,
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection: Connection | None = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    url = config.attributes.get("database_url") or get_settings().database_url
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _configure(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported: run against a database")
run_migrations_online()
