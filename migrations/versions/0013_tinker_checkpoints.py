"""Weights saved through the Tinker API are checkpoints of their tenant too: `checkpoints.job_id` may be NULL,
and `tinker_path` (indexed per tenant) names the tinker:// path they were saved as.

On SQLite the table is rebuilt (batch mode), and its download pins (`checkpoint_pins`, leases of downloads in
progress) go with the old one: run it, like every migration, with the service stopped.

Revision ID: 0013_tinker_checkpoints
Revises: 0012_primitives
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_tinker_checkpoints"
down_revision: str | None = "0012_primitives"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.alter_column("job_id", existing_type=sa.String(length=40), nullable=True)
        batch.add_column(sa.Column("tinker_path", sa.String(length=512), nullable=True))
        batch.create_index("ix_checkpoints_tenant_id_tinker_path", ["tenant_id", "tinker_path"], unique=False)


def downgrade() -> None:
    # The Tinker API's checkpoints have no job to belong to: they go (their files stay, as the weights' own).
    op.execute(sa.text("DELETE FROM checkpoints WHERE job_id IS NULL"))
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_index("ix_checkpoints_tenant_id_tinker_path")
        batch.drop_column("tinker_path")
        batch.alter_column("job_id", existing_type=sa.String(length=40), nullable=False)
