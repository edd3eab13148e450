"""Reward functions' failure policy (retries, backoff, breaker, step deadline, abstention limit);
checkpoint download pins (retention skips a checkpoint being downloaded); the step of a job event and whether
a later attempt superseded it.

Revision ID: 0004_robustness
Revises: 0003_webhooks
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_robustness"
down_revision: str | None = "0003_webhooks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("reward_functions") as batch:
        batch.add_column(sa.Column("max_attempts", sa.Integer(), server_default="5", nullable=False))
        batch.add_column(sa.Column("backoff_s", sa.Float(), server_default="0.5", nullable=False))
        batch.add_column(sa.Column("breaker_threshold", sa.Integer(), server_default="3", nullable=False))
        batch.add_column(sa.Column("step_deadline_s", sa.Float(), server_default="300", nullable=False))
        batch.add_column(sa.Column("max_abstain_fraction", sa.Float(), server_default="0.25", nullable=False))
    op.create_table(
        "checkpoint_pins",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("checkpoint_id", sa.String(length=40), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_checkpoint_pins_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_pins")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_checkpoint_pins_checkpoint_id"), "checkpoint_pins", ["checkpoint_id"], unique=False)
    with op.batch_alter_table("job_events") as batch:
        batch.add_column(sa.Column("step", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("superseded", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("job_events") as batch:
        batch.drop_column("superseded")
        batch.drop_column("step")
    op.drop_index(op.f("ix_checkpoint_pins_checkpoint_id"), table_name="checkpoint_pins")
    op.drop_table("checkpoint_pins")
    with op.batch_alter_table("reward_functions") as batch:
        for column in ("max_abstain_fraction", "step_deadline_s", "breaker_threshold", "backoff_s", "max_attempts"):
            batch.drop_column(column)
