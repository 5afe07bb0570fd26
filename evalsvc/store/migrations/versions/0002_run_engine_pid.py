"""Runs remember their engine's process group, so a restarted service can stop an orphan

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 12:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("engine_pid", sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f("ix_runs_status"), ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_status"))
        batch_op.drop_column("engine_pid")
