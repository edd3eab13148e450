"""Evaluations: a job's kind, the evaluations run as jobs of kind `evaluation`, and their per-item results.

Revision ID: 0008_evaluations
Revises: 0007_usage
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_evaluations"
down_revision: str | None = "0007_usage"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("kind", sa.String(length=16), server_default="train", nullable=False))
    op.create_table(
        "evaluations",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=512), nullable=False),
        sa.Column("dataset_id", sa.String(length=40), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("source_job_id", sa.String(length=40), nullable=True),
        sa.Column("source_step", sa.Integer(), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["id"], ["jobs.id"], name=op.f("fk_evaluations_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["datasets.id"], name=op.f("fk_evaluations_dataset_id_datasets")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_evaluations_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluations")),
    )
    op.create_index("ix_evaluations_tenant_id_id", "evaluations", ["tenant_id", "id"], unique=False)
    op.create_index(op.f("ix_evaluations_dataset_id"), "evaluations", ["dataset_id"], unique=False)
    op.create_table(
        "evaluation_items",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("evaluation_id", sa.String(length=40), nullable=False),
        sa.Column("item_index", sa.Integer(), nullable=False),
        sa.Column("batch", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("completions", sa.JSON(), nullable=False),
        sa.Column("rewards", sa.JSON(), nullable=False),
        sa.Column("sources", sa.JSON(), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["evaluation_id"], ["evaluations.id"], name=op.f("fk_evaluation_items_evaluation_id_evaluations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluation_items")),
        sa.UniqueConstraint("evaluation_id", "item_index", name=op.f("uq_evaluation_items_evaluation_id_item_index")),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("evaluation_items")
    op.drop_index(op.f("ix_evaluations_dataset_id"), table_name="evaluations")
    op.drop_index("ix_evaluations_tenant_id_id", table_name="evaluations")
    op.drop_table("evaluations")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("kind")
