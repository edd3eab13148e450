"""Environments: registered OpenEnv servers (URL, episode limits, signing secrets, last health and schemas).

Revision ID: 0010_environments
Revises: 0009_sample_policy_version
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_environments"
down_revision: str | None = "0009_sample_policy_version"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "environments",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("max_concurrency", sa.Integer(), nullable=False),
        sa.Column("step_timeout_s", sa.Float(), nullable=False),
        sa.Column("episode_timeout_s", sa.Float(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("backoff_s", sa.Float(), nullable=False),
        sa.Column("breaker_threshold", sa.Integer(), nullable=False),
        sa.Column("headers", sa.JSON(), nullable=False),
        sa.Column("schemas", sa.JSON(), nullable=False),
        sa.Column("health_status", sa.String(length=32), nullable=False),
        sa.Column("health_latency_ms", sa.Float(), nullable=False),
        sa.Column("session_status", sa.String(length=32), nullable=False),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("signing_secret", sa.String(length=128), nullable=False),
        sa.Column("previous_signing_secret", sa.String(length=128), nullable=True),
        sa.Column("previous_secret_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_environments_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_environments")),
    )
    op.create_index("ix_environments_tenant_id_id", "environments", ["tenant_id", "id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_environments_tenant_id_id", table_name="environments")
    op.drop_table("environments")
