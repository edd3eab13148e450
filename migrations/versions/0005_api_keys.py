"""API keys: name, scopes, expiry and last use; signing secrets: the previous secret of a rotation and until when
it still signs.

Keys that exist before this revision get every scope (`read write admin`): they were made by `grpo admin`,
which only made full-access keys, and keep working exactly as before.

Revision ID: 0005_api_keys
Revises: 0004_robustness
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_api_keys"
down_revision: str | None = "0004_robustness"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("name", sa.String(length=128), server_default="", nullable=False))
        batch.add_column(sa.Column("scopes", sa.String(length=64), server_default="read write admin", nullable=False))
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
    for table, column in (("reward_functions", "signing_secret"), ("webhook_endpoints", "secret")):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column(f"previous_{column}", sa.String(length=128), nullable=True))
            batch.add_column(sa.Column("previous_secret_expires_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    for table, column in (("webhook_endpoints", "secret"), ("reward_functions", "signing_secret")):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("previous_secret_expires_at")
            batch.drop_column(f"previous_{column}")
    with op.batch_alter_table("api_keys") as batch:
        for column in ("last_used_at", "expires_at", "scopes", "name"):
            batch.drop_column(column)
