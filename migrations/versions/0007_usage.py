"""Usage metering and cost control: per-step usage records, the per-model calibration estimates come from,
and per-tenant monthly caps.

Revision ID: 0007_usage
Revises: 0006_quotas
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_usage"
down_revision: str | None = "0006_quotas"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "job_usage",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("tokens_generated", sa.BigInteger(), nullable=False),
        sa.Column("tokens_trained", sa.BigInteger(), nullable=False),
        sa.Column("reward_calls", sa.BigInteger(), nullable=False),
        sa.Column("device_seconds", sa.Float(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_job_usage_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_job_usage_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_usage")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_job_usage_job_id_step")),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_job_usage_tenant_id_recorded_at", "job_usage", ["tenant_id", "recorded_at"], unique=False)
    op.create_table(
        "usage_calibration",
        sa.Column("base_model", sa.String(length=512), nullable=False),
        sa.Column("bucket", sa.String(length=16), nullable=False),
        sa.Column("parameters", sa.BigInteger(), nullable=False),
        sa.Column("steps", sa.BigInteger(), nullable=False),
        sa.Column("completions", sa.BigInteger(), nullable=False),
        sa.Column("completion_capacity", sa.BigInteger(), nullable=False),
        sa.Column("tokens_generated", sa.BigInteger(), nullable=False),
        sa.Column("tokens_trained", sa.BigInteger(), nullable=False),
        sa.Column("tokens_trained_per_pass", sa.BigInteger(), nullable=False),
        sa.Column("device_seconds", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("base_model", name=op.f("pk_usage_calibration")),
    )
    op.create_index(op.f("ix_usage_calibration_bucket"), "usage_calibration", ["bucket"], unique=False)
    op.create_table(
        "tenant_budgets",
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("monthly_max_device_seconds", sa.Float(), nullable=True),
        sa.Column("monthly_max_tokens", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_budgets_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_budgets")),
    )


def downgrade() -> None:
    op.drop_table("tenant_budgets")
    op.drop_index(op.f("ix_usage_calibration_bucket"), table_name="usage_calibration")
    op.drop_table("usage_calibration")
    op.drop_index("ix_job_usage_tenant_id_recorded_at", table_name="job_usage")
    op.drop_table("job_usage")
