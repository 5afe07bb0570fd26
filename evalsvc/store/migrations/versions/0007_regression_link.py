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


LOWER_IS_WORSE = {"accept_length"}


def upgrade() -> None:
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("link", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("expected_level", sa.Float(), nullable=True))
    # the regressions triaged expected already hold to their level as known failures: the worst
    # value of the runs that opened them and that they saw last (``verdicts.failure_level``)
    conn = op.get_bind()
    expected = conn.execute(sa.text(
        "SELECT id, scenario, metric, first_run_id, last_run_id FROM regressions "
        "WHERE triage = 'expected'")).all()
    for reg_id, scenario, metric, first, last in expected:
        values = [v for (v,) in conn.execute(sa.text(
            "SELECT value FROM verdicts WHERE run_id IN (:first, :last) AND scenario = :scenario "
            "AND metric = :metric"), {"first": first, "last": last, "scenario": scenario,
                                      "metric": metric}) if v is not None]
        if values:
            level = min(values) if metric in LOWER_IS_WORSE else max(values)
            conn.execute(sa.text("UPDATE regressions SET expected_level = :level WHERE id = :id"),
                         {"level": level, "id": reg_id})


def downgrade() -> None:
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.drop_column("expected_level")
        batch_op.drop_column("link")
