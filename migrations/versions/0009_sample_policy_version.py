"""Samples record the policy version that sampled them (asynchronous generation trains older samples).

Revision ID: 0009_sample_policy_version
Revises: 0008_evaluations
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_sample_policy_version"
down_revision: str | None = "0008_evaluations"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_samples") as batch:
        batch.add_column(sa.Column("policy_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_samples") as batch:
        batch.drop_column("policy_version")
