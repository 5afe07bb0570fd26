"""One judge: the limits a run is judged against, stored when it is planned (runs.limits), and a
two-build job's comparison, judged once when it ends (jobs.comparison)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 21:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL for what was stored before: the limits fall back to the thresholds' rules
    # (``verdicts.stored_limits``), a done job's comparison is judged when read
    op.add_column("runs", sa.Column("limits", sa.JSON(), nullable=True))
    op.add_column("jobs", sa.Column("comparison", sa.JSON(), nullable=True))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN (SQLite 3.35 and later), not batch mode's copy of the table:
    # with foreign keys on, dropping the old jobs table would delete its runs through their
    # ON DELETE CASCADE
    op.drop_column("jobs", "comparison")
    op.drop_column("runs", "limits")
