"""Initial schema: commits, builds, jobs, runs, scenarios, metrics, samples, golden runs

Revision ID: 0001
Revises:
Create Date: 2026-11-29 11:20:36.374949
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "commits",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("ref", sa.String(length=300), nullable=False),
        sa.Column("repository", sa.String(length=255), nullable=False),
        sa.Column("sha", sa.String(length=64), nullable=True),
        sa.Column("version", sa.String(length=100), nullable=True),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("branch", sa.String(length=255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_commits")),
        sa.UniqueConstraint("ref", name=op.f("uq_commits_ref")),
    )
    with op.batch_alter_table("commits", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_commits_committed_at"), ["committed_at"], unique=False)

    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("trigger", sa.String(length=20), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_status"), ["status"], unique=False)

    op.create_table(
        "builds",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("commit_id", sa.Integer(), nullable=False),
        sa.Column("patch_set", sa.String(length=500), nullable=False),
        sa.Column("probes", sa.JSON(), nullable=True),
        sa.Column("base_env", sa.JSON(), nullable=True),
        sa.Column("manifest", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["commit_id"], ["commits.id"], name=op.f("fk_builds_commit_id_commits"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_builds")),
        sa.UniqueConstraint("commit_id", "patch_set", name=op.f("uq_builds_commit_id_patch_set")),
    )
    with op.batch_alter_table("builds", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_builds_commit_id"), ["commit_id"], unique=False)

    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("build_id", sa.Integer(), nullable=False),
        sa.Column("config", sa.String(length=200), nullable=False),
        sa.Column("matrix", sa.String(length=100), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("requested_args", sa.JSON(), nullable=False),
        sa.Column("resolved_args", sa.JSON(), nullable=True),
        sa.Column("reference", sa.JSON(), nullable=True),
        sa.Column("command", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("verdict", sa.String(length=20), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("startup_seconds", sa.Float(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("log_path", sa.String(length=1000), nullable=True),
        sa.Column("samples_path", sa.String(length=1000), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["build_id"], ["builds.id"], name=op.f("fk_runs_build_id_builds"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_runs_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint(
            "job_id", "build_id", "fingerprint", name=op.f("uq_runs_job_id_build_id_fingerprint")
        ),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_build_id"), ["build_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_config"), ["config"], unique=False)
        batch_op.create_index("ix_runs_fingerprint_build", ["fingerprint", "build_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_runs_job_id"), ["job_id"], unique=False)

    op.create_table(
        "golden_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("label", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_golden_runs_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_golden_runs")),
        sa.UniqueConstraint("fingerprint", name=op.f("uq_golden_runs_fingerprint")),
    )
    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("scenario", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=80), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("ci_low", sa.Float(), nullable=True),
        sa.Column("ci_high", sa.Float(), nullable=True),
        sa.Column("count", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_metrics_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metrics")),
        sa.UniqueConstraint("run_id", "scenario", "name", name=op.f("uq_metrics_run_id_scenario_name")),
    )
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("scenario", sa.String(length=40), nullable=False),
        sa.Column("sample_id", sa.String(length=100), nullable=False),
        sa.Column("prompt_id", sa.String(length=200), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("host_cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("hit", sa.Boolean(), nullable=False),
        sa.Column("kl_k1_mean", sa.Float(), nullable=True),
        sa.Column("kl_k2_mean", sa.Float(), nullable=True),
        sa.Column("kl_k3_mean", sa.Float(), nullable=True),
        sa.Column("kl_k3_max", sa.Float(), nullable=True),
        sa.Column("topk_kl_mean", sa.Float(), nullable=True),
        sa.Column("same_top_rate", sa.Float(), nullable=True),
        sa.Column("first_divergence", sa.Integer(), nullable=True),
        sa.Column("accept_length", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_samples_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_samples")),
        sa.UniqueConstraint(
            "run_id", "scenario", "sample_id", name=op.f("uq_samples_run_id_scenario_sample_id")
        ),
    )
    op.create_table(
        "scenarios",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("scenario", sa.String(length=40), nullable=False),
        sa.Column("verdict", sa.String(length=20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_scenarios_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scenarios")),
        sa.UniqueConstraint("run_id", "scenario", name=op.f("uq_scenarios_run_id_scenario")),
    )


def downgrade() -> None:
    op.drop_table("scenarios")
    op.drop_table("samples")
    op.drop_table("metrics")
    op.drop_table("golden_runs")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_job_id"))
        batch_op.drop_index("ix_runs_fingerprint_build")
        batch_op.drop_index(batch_op.f("ix_runs_config"))
        batch_op.drop_index(batch_op.f("ix_runs_build_id"))

    op.drop_table("runs")
    with op.batch_alter_table("builds", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_builds_commit_id"))

    op.drop_table("builds")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_status"))

    op.drop_table("jobs")
    with op.batch_alter_table("commits", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_commits_committed_at"))

    op.drop_table("commits")
