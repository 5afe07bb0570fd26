"""Verdicts per run, scenario and metric; regressions with their triage; alerts; bisections

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 16:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "regressions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("patch_set", sa.String(length=500), nullable=False),
        sa.Column("scenario", sa.String(length=40), nullable=False),
        sa.Column("metric", sa.String(length=80), nullable=False),
        sa.Column("config", sa.String(length=200), nullable=False),
        sa.Column("matrix", sa.String(length=100), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("first_run_id", sa.Integer(), nullable=False),
        sa.Column("last_run_id", sa.Integer(), nullable=False),
        sa.Column("last_good_run_id", sa.Integer(), nullable=True),
        sa.Column("resolved_run_id", sa.Integer(), nullable=True),
        sa.Column("runs_seen", sa.Integer(), nullable=False),
        sa.Column("triage", sa.String(length=20), nullable=True),
        sa.Column("comment", sa.Text(), nullable=True),
        sa.Column("triaged_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["first_run_id"], ["runs.id"], name=op.f("fk_regressions_first_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["last_good_run_id"],
            ["runs.id"],
            name=op.f("fk_regressions_last_good_run_id_runs"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["last_run_id"], ["runs.id"], name=op.f("fk_regressions_last_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["resolved_run_id"],
            ["runs.id"],
            name=op.f("fk_regressions_resolved_run_id_runs"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_regressions")),
    )
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.create_index(
            "ix_regressions_series", ["fingerprint", "patch_set", "scenario", "metric"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_regressions_state"), ["state"], unique=False)

    op.create_table(
        "verdicts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("scenario", sa.String(length=40), nullable=False),
        sa.Column("metric", sa.String(length=80), nullable=False),
        sa.Column("verdict", sa.String(length=20), nullable=False),
        sa.Column("method", sa.String(length=20), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("baseline", sa.Float(), nullable=True),
        sa.Column("diff_low", sa.Float(), nullable=True),
        sa.Column("diff_high", sa.Float(), nullable=True),
        sa.Column("threshold", sa.Float(), nullable=True),
        sa.Column("p_value", sa.Float(), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_verdicts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_verdicts")),
        sa.UniqueConstraint("run_id", "scenario", "metric", name=op.f("uq_verdicts_run_id_scenario_metric")),
    )
    with op.batch_alter_table("verdicts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_verdicts_run_id"), ["run_id"], unique=False)

    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("regression_ids", sa.JSON(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_alerts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
        sa.UniqueConstraint("job_id", "kind", name=op.f("uq_alerts_job_id_kind")),
    )
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_alerts_delivered_at"), ["delivered_at"], unique=False)

    op.create_table(
        "bisections",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("repository", sa.String(length=500), nullable=False),
        sa.Column("good", sa.String(length=64), nullable=False),
        sa.Column("bad", sa.String(length=64), nullable=False),
        sa.Column("matrix", sa.String(length=100), nullable=False),
        sa.Column("config", sa.String(length=200), nullable=False),
        sa.Column("scenario", sa.String(length=40), nullable=False),
        sa.Column("metric", sa.String(length=80), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("candidates", sa.JSON(), nullable=True),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.Column("first_bad", sa.String(length=64), nullable=True),
        sa.Column("runs_used", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("regression_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["regression_id"],
            ["regressions.id"],
            name=op.f("fk_bisections_regression_id_regressions"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_bisections")),
    )
    with op.batch_alter_table("bisections", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_bisections_status"), ["status"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("bisections", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_bisections_status"))

    op.drop_table("bisections")
    with op.batch_alter_table("alerts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_alerts_delivered_at"))

    op.drop_table("alerts")
    with op.batch_alter_table("verdicts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_verdicts_run_id"))

    op.drop_table("verdicts")
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_regressions_state"))
        batch_op.drop_index("ix_regressions_series")

    op.drop_table("regressions")
