"""Regressions keep a link (the issue or PR a triage points at) and, triaged expected, the level
of the known failure

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-10 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("link", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("expected_level", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.drop_column("expected_level")
        batch_op.drop_column("link")
