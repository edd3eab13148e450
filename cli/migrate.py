"""`grpo migrate`: bring the database schema to the latest Alembic revision."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from alembic.config import Config

# alembic.ini sits at the repository root (the package is installed editable, as in the Makefile).
ALEMBIC_INI = Path(__file__).resolve().parents[1] / "alembic.ini"


def alembic_config(database_url: str | None = None) -> Config:
    """An Alembic config for `database_url` (default: the service settings' URL)."""
    # Imported here: alembic is slow to import and most commands never need it; neither it nor the server's
    # settings are in the client install.
    from alembic.config import Config

    from service.kit.config import get_settings

    config = Config(str(ALEMBIC_INI))
    # Passed as an attribute, not `sqlalchemy.url`, so a '%' in a password needs no ini escaping.
    config.attributes["database_url"] = database_url or get_settings().database_url
    config.attributes["configure_logging"] = False
    return config


def upgrade_head(database_url: str | None = None) -> None:
    """Apply every migration up to `head` (idempotent: a migrated database is left as is)."""
    from alembic import command  # slow to import, and not in the client install

    command.upgrade(alembic_config(database_url), "head")


def migrate(
    database_url: str | None = typer.Option(
        None,
        "--database-url",
        help="SQLAlchemy URL; default GRPO_DATABASE_URL or the embedded SQLite database.",
    ),
) -> None:
    """Create or upgrade the database schema (alembic upgrade head)."""
    from service.kit.config import get_settings  # the server's settings: not in the client install

    url = database_url or get_settings().database_url
    upgrade_head(url)
    typer.echo(f"database at head: {_redacted(url)}")


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url  # the server's: not in the client install

    return make_url(url).render_as_string(hide_password=True)
