"""Samples keep the KL of their extend (the prompt tokens prefilled on the cached prefix)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 00:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.add_column(sa.Column("extend_tokens", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("extend_kl_k3_mean", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("extend_kl_k3_max", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_column("extend_kl_k3_max")
        batch_op.drop_column("extend_kl_k3_mean")
        batch_op.drop_column("extend_tokens")
