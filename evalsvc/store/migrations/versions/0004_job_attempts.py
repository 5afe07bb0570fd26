"""Jobs count how often the runner took them up, and remember a cancel asked while running

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 19:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempts", sa.Integer(), nullable=False,
                                      server_default=sa.text("0")))
        batch_op.add_column(sa.Column("cancel_requested_at", sa.DateTime(timezone=True),
                                      nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("cancel_requested_at")
        batch_op.drop_column("attempts")
