"""The primitive training API (the Tinker door): sessions, training clients, sampling sessions, saved weights,
requests (futures) and the live primitives workers.

Revision ID: 0012_primitives
Revises: 0011_sample_episode
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012_primitives'
down_revision: str | None = '0011_sample_episode'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('primitive_workers',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('models', sa.JSON(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_primitive_workers'))
    )
    op.create_table('primitive_requests',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('target_id', sa.String(length=80), nullable=False),
    sa.Column('operation', sa.String(length=32), nullable=False),
    sa.Column('seq_id', sa.Integer(), nullable=False),
    sa.Column('body', sa.LargeBinary(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('result', sa.LargeBinary(), nullable=True),
    sa.Column('media', sa.String(length=16), nullable=False),
    sa.Column('error', sa.JSON(), nullable=True),
    sa.Column('worker', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_primitive_requests_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_primitive_requests')),
    sa.UniqueConstraint('target_id', 'seq_id', name=op.f('uq_primitive_requests_target_id_seq_id'))
    )
    with op.batch_alter_table('primitive_requests', schema=None) as batch_op:
        batch_op.create_index('ix_primitive_requests_target_id_status', ['target_id', 'status'], unique=False)
        batch_op.create_index('ix_primitive_requests_tenant_id_id', ['tenant_id', 'id'], unique=False)

    op.create_table('primitive_sessions',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('sdk_version', sa.String(length=64), nullable=False),
    sa.Column('tags', sa.JSON(), nullable=False),
    sa.Column('user_metadata', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_primitive_sessions_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_primitive_sessions'))
    )
    with op.batch_alter_table('primitive_sessions', schema=None) as batch_op:
        batch_op.create_index('ix_primitive_sessions_tenant_id_id', ['tenant_id', 'id'], unique=False)

    op.create_table('training_clients',
    sa.Column('id', sa.String(length=80), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('base_model', sa.String(length=512), nullable=False),
    sa.Column('lora', sa.JSON(), nullable=False),
    sa.Column('worker', sa.String(length=128), nullable=True),
    sa.Column('last_seq_id', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['session_id'], ['primitive_sessions.id'], name=op.f('fk_training_clients_session_id_primitive_sessions'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_training_clients_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_training_clients'))
    )
    with op.batch_alter_table('training_clients', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_training_clients_session_id'), ['session_id'], unique=False)
        batch_op.create_index('ix_training_clients_tenant_id_id', ['tenant_id', 'id'], unique=False)

    op.create_table('primitive_weights',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('training_client_id', sa.String(length=80), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('base_model', sa.String(length=512), nullable=False),
    sa.Column('lora', sa.JSON(), nullable=False),
    sa.Column('storage_path', sa.String(length=512), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_primitive_weights_tenant_id_tenants'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['training_client_id'], ['training_clients.id'], name=op.f('fk_primitive_weights_training_client_id_training_clients'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_primitive_weights')),
    sa.UniqueConstraint('training_client_id', 'kind', 'name', name=op.f('uq_primitive_weights_training_client_id_kind_name'))
    )
    with op.batch_alter_table('primitive_weights', schema=None) as batch_op:
        batch_op.create_index('ix_primitive_weights_tenant_id_id', ['tenant_id', 'id'], unique=False)

    op.create_table('sampling_sessions',
    sa.Column('id', sa.String(length=80), nullable=False),
    sa.Column('tenant_id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('base_model', sa.String(length=512), nullable=False),
    sa.Column('weights_id', sa.String(length=40), nullable=True),
    sa.Column('worker', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['primitive_sessions.id'], name=op.f('fk_sampling_sessions_session_id_primitive_sessions'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_sampling_sessions_tenant_id_tenants'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['weights_id'], ['primitive_weights.id'], name=op.f('fk_sampling_sessions_weights_id_primitive_weights')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sampling_sessions'))
    )
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sampling_sessions_session_id'), ['session_id'], unique=False)
        batch_op.create_index('ix_sampling_sessions_tenant_id_id', ['tenant_id', 'id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('sampling_sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_sampling_sessions_tenant_id_id')
        batch_op.drop_index(batch_op.f('ix_sampling_sessions_session_id'))

    op.drop_table('sampling_sessions')
    with op.batch_alter_table('primitive_weights', schema=None) as batch_op:
        batch_op.drop_index('ix_primitive_weights_tenant_id_id')

    op.drop_table('primitive_weights')
    with op.batch_alter_table('training_clients', schema=None) as batch_op:
        batch_op.drop_index('ix_training_clients_tenant_id_id')
        batch_op.drop_index(batch_op.f('ix_training_clients_session_id'))

    op.drop_table('training_clients')
    with op.batch_alter_table('primitive_sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_primitive_sessions_tenant_id_id')

    op.drop_table('primitive_sessions')
    with op.batch_alter_table('primitive_requests', schema=None) as batch_op:
        batch_op.drop_index('ix_primitive_requests_tenant_id_id')
        batch_op.drop_index('ix_primitive_requests_target_id_status')

    op.drop_table('primitive_requests')
    op.drop_table('primitive_workers')
