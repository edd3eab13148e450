"""Usage of the primitive training API: one row per call a primitives worker ran (tokens, device seconds).

Revision ID: 0014_primitive_usage
Revises: 0013_tinker_checkpoints
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_primitive_usage"
down_revision: str | None = "0013_tinker_checkpoints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "primitive_usage",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("request_id", sa.String(length=40), nullable=False),
        sa.Column("target_id", sa.String(length=80), nullable=False),
        sa.Column("operation", sa.String(length=32), nullable=False),
        sa.Column("tokens_generated", sa.BigInteger(), nullable=False),
        sa.Column("tokens_trained", sa.BigInteger(), nullable=False),
        sa.Column("device_seconds", sa.Float(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_primitive_usage_tenant_id_tenants"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_primitive_usage")),
        sa.UniqueConstraint("request_id", name=op.f("uq_primitive_usage_request_id")),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("primitive_usage") as batch:
        batch.create_index("ix_primitive_usage_tenant_id_recorded_at", ["tenant_id", "recorded_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("primitive_usage") as batch:
        batch.drop_index("ix_primitive_usage_tenant_id_recorded_at")
    op.drop_table("primitive_usage")
