"""Quotas and fair scheduling: per-tenant quota overrides; the devices and priority of a job, and an index
for the fair claim's scan of queued jobs.

Revision ID: 0006_quotas
Revises: 0005_api_keys
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_quotas"
down_revision: str | None = "0005_api_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_quotas",
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("max_running_jobs", sa.Integer(), nullable=True),
        sa.Column("max_queued_jobs", sa.Integer(), nullable=True),
        sa.Column("max_devices", sa.Integer(), nullable=True),
        sa.Column("max_dataset_storage_bytes", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_quotas_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_quotas")),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("devices", sa.Integer(), server_default="1", nullable=False))
        batch.add_column(sa.Column("priority", sa.Integer(), server_default="0", nullable=False))
        batch.create_index("ix_jobs_status_queue", ["status", "queue"], unique=False)
        batch.create_index("ix_jobs_tenant_id_started_at", ["tenant_id", "started_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_tenant_id_started_at")
        batch.drop_index("ix_jobs_status_queue")
        batch.drop_column("priority")
        batch.drop_column("devices")
    op.drop_table("tenant_quotas")
