"""Samples of multi-turn jobs keep their episode: turns, tool calls and results, the environment's reward.

Revision ID: 0011_sample_episode
Revises: 0010_environments
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_sample_episode"
down_revision: str | None = "0010_environments"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_samples") as batch:
        batch.add_column(sa.Column("episode", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_samples") as batch:
        batch.drop_column("episode")
