"""Tables of the results store: portable across SQLite and PostgreSQL (generic column types only).

A commit (repository + sha, or a released version) has engine builds (a patch set on top of it);
a job asks for runs; a run is one config on one build, with its scenario verdicts, scalar metrics
and per-sample statistics. Token-level arrays stay in the run's Parquet file (``samples_path``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, MappedColumn, mapped_column, relationship

from evalsvc.types import SAMPLE_COLUMNS, JobStatus, MetricVerdict, RunStatus, SampleColumn, Verdict

NAMING = {"ix": "ix_%(column_0_label)s", "uq": "uq_%(table_name)s_%(column_0_N_name)s",
          "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
          "pk": "pk_%(table_name)s"}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC datetime on every database: stored as UTC, read back with tzinfo
    (SQLite keeps no offset of its own)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class EnumString(TypeDecorator):
    """A ``StrEnum``'s values in a plain VARCHAR (no database enum type, so no migration): written
    as their strings, read back as the enum's members (a value it lacks, as the string it is)."""

    impl = String
    cache_ok = True

    def __init__(self, enum: type[StrEnum], length: int = 20) -> None:
        super().__init__(length)
        self.enum = enum

    def process_bind_param(self, value: str | None, dialect) -> str | None:
        return None if value is None else str(value)

    def process_result_value(self, value: str | None, dialect) -> str | None:
        if value is None:
            return None
        try:
            return self.enum(value)
        except ValueError:
            return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Commit(Base):
    __tablename__ = "commits"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ref: Mapped[str] = mapped_column(String(300), unique=True)  # repository@sha or repository==version
    repository: Mapped[str] = mapped_column(String(255))
    sha: Mapped[str | None] = mapped_column(String(64))
    version: Mapped[str | None] = mapped_column(String(100))
    committed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)
    branch: Mapped[str | None] = mapped_column(String(255))
    builds: Mapped[list[Build]] = relationship(back_populates="commit")


class Build(Base):
    __tablename__ = "builds"
    __table_args__ = (UniqueConstraint("commit_id", "patch_set"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    commit_id: Mapped[int] = mapped_column(ForeignKey("commits.id", ondelete="CASCADE"), index=True)
    patch_set: Mapped[str] = mapped_column(String(500), default="")  # sorted names, comma-joined
    probes: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    base_env: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    manifest: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    commit: Mapped[Commit] = relationship(back_populates="builds")


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    trigger: Mapped[str] = mapped_column(String(20))  # api | nightly | cli | bisect
    status: Mapped[str] = mapped_column(EnumString(JobStatus), index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    error: Mapped[str | None] = mapped_column(Text)
    # times the runner took the job up: a job found running after as many restarts is failed
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    cancel_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # while running
    # a job of two builds: their comparison, judged when the job ended done
    # (``verdicts.compare_builds``' rows); None for other jobs, and those ended before 0009
    comparison: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    runs: Mapped[list[Run]] = relationship(back_populates="job")


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (UniqueConstraint("job_id", "build_id", "fingerprint"),
                      Index("ix_runs_fingerprint_build", "fingerprint", "build_id"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"), index=True)
    config: Mapped[str] = mapped_column(String(200), index=True)
    matrix: Mapped[str] = mapped_column(String(100))
    model: Mapped[str] = mapped_column(String(200))
    fingerprint: Mapped[str] = mapped_column(String(64))
    settings: Mapped[dict[str, Any]] = mapped_column(JSON)
    requested_args: Mapped[dict[str, Any]] = mapped_column(JSON)
    resolved_args: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    reference: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    command: Mapped[list[str] | None] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(EnumString(RunStatus), index=True)
    engine_pid: Mapped[int | None] = mapped_column(Integer)  # its process group while running
    verdict: Mapped[str | None] = mapped_column(EnumString(Verdict))
    reason: Mapped[str | None] = mapped_column(Text)
    startup_seconds: Mapped[float | None] = mapped_column(Float)
    seconds: Mapped[float | None] = mapped_column(Float)
    log_path: Mapped[str | None] = mapped_column(String(1000))
    samples_path: Mapped[str | None] = mapped_column(String(1000))
    # the limits it is judged against, by scenario (``Limits`` dumped), written when it is planned
    # (``judging.config_limits``); None for runs from before 0009 (``verdicts.stored_limits``)
    limits: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    job: Mapped[Job] = relationship(back_populates="runs")
    build: Mapped[Build] = relationship()
    scenarios: Mapped[list[ScenarioRow]] = relationship(cascade="all, delete-orphan",
                                                        passive_deletes=True)
    metrics: Mapped[list[Metric]] = relationship(cascade="all, delete-orphan", passive_deletes=True)
    samples: Mapped[list[SampleRow]] = relationship(cascade="all, delete-orphan", passive_deletes=True)


class ScenarioRow(Base):
    __tablename__ = "scenarios"
    __table_args__ = (UniqueConstraint("run_id", "scenario"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    scenario: Mapped[str] = mapped_column(String(40))
    verdict: Mapped[str] = mapped_column(EnumString(Verdict))
    reason: Mapped[str | None] = mapped_column(Text)
    seconds: Mapped[float | None] = mapped_column(Float)


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (UniqueConstraint("run_id", "scenario", "name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    scenario: Mapped[str] = mapped_column(String(40))
    name: Mapped[str] = mapped_column(String(80))
    value: Mapped[float | None] = mapped_column(Float)
    ci_low: Mapped[float | None] = mapped_column(Float)
    ci_high: Mapped[float | None] = mapped_column(Float)
    count: Mapped[int | None] = mapped_column(Integer)


class SampleRow(Base):
    """One evaluated sample of a scenario of a run: its key here, and a column per field of
    ``types.SampleScalars`` (added below from ``SAMPLE_COLUMNS``, their one declaration)."""

    __tablename__ = "samples"
    __table_args__ = (UniqueConstraint("run_id", "scenario", "sample_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    scenario: Mapped[str] = mapped_column(String(40))
    sample_id: Mapped[str] = mapped_column(String(100))


SQL_TYPES = {str: String, int: Integer, float: Float, bool: Boolean}


def sample_column(c: SampleColumn) -> MappedColumn[Any]:
    """The store's column of a declared sample field."""
    return mapped_column(SQL_TYPES[c.type](c.length) if c.length else SQL_TYPES[c.type],
                         nullable=c.nullable, default=c.default)


# declarative takes columns added to a mapped class, in this order, onto its table
for _c in SAMPLE_COLUMNS:
    setattr(SampleRow, _c.name, sample_column(_c))
del _c


class GoldenRun(Base):
    """The stored run a fingerprint's later runs may be compared with."""

    __tablename__ = "golden_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64), unique=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    label: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    run: Mapped[Run] = relationship()


class VerdictRow(Base):
    """One metric of one scenario of a run, judged: against fixed limits, the fingerprint's
    history (an interval on the difference) or a change point along its series, with the
    evidence."""

    __tablename__ = "verdicts"
    __table_args__ = (UniqueConstraint("run_id", "scenario", "metric"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    scenario: Mapped[str] = mapped_column(String(40))
    metric: Mapped[str] = mapped_column(String(80))
    verdict: Mapped[str] = mapped_column(EnumString(MetricVerdict))
    method: Mapped[str] = mapped_column(String(20))  # coverage threshold bit_exact history change_point
    value: Mapped[float | None] = mapped_column(Float)
    baseline: Mapped[float | None] = mapped_column(Float)  # mean of the baseline runs' values
    diff_low: Mapped[float | None] = mapped_column(Float)  # interval on contender - baseline
    diff_high: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)  # the limit or effect size it was held to
    p_value: Mapped[float | None] = mapped_column(Float)
    evidence: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    reason: Mapped[str | None] = mapped_column(Text)
    run: Mapped[Run] = relationship()


class Regression(Base):
    """An open question for people: a series (fingerprint, patch set, scenario, metric) that
    regressed, from the run that first showed it until a later run passes again; triaged as
    acknowledged, expected or fixed, with a comment and a link. Triaged expected, it is a known
    failure: while it is open, later runs of its series no worse than ``expected_level`` (by more
    than the metric's effect floor) are judged ``expected`` instead of regressions."""

    __tablename__ = "regressions"
    __table_args__ = (Index("ix_regressions_series", "fingerprint", "patch_set", "scenario",
                            "metric"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    patch_set: Mapped[str] = mapped_column(String(500), default="")
    scenario: Mapped[str] = mapped_column(String(40))
    metric: Mapped[str] = mapped_column(String(80))
    config: Mapped[str] = mapped_column(String(200))
    matrix: Mapped[str] = mapped_column(String(100))
    state: Mapped[str] = mapped_column(String(20), index=True)  # open | resolved
    first_run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    last_run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    last_good_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    resolved_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    runs_seen: Mapped[int] = mapped_column(Integer, default=1)
    triage: Mapped[str | None] = mapped_column(String(20))  # acknowledged | expected | fixed
    comment: Mapped[str | None] = mapped_column(Text)
    link: Mapped[str | None] = mapped_column(String(500))  # an http(s) URL: the issue, the PR
    # triaged expected: the worst value of the runs it had seen then (the known failure's level)
    expected_level: Mapped[float | None] = mapped_column(Float)
    triaged_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    opened_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    resolved_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    first_run: Mapped[Run] = relationship(foreign_keys=[first_run_id])
    last_run: Mapped[Run] = relationship(foreign_keys=[last_run_id])
    last_good_run: Mapped[Run | None] = relationship(foreign_keys=[last_good_run_id])
    resolved_run: Mapped[Run | None] = relationship(foreign_keys=[resolved_run_id])


class Alert(Base):
    """A webhook message about the regressions a job opened (``appeared``) or closed
    (``resolved``): at most one of each kind per job, whatever restarts or retries happen."""

    __tablename__ = "alerts"
    __table_args__ = (UniqueConstraint("job_id", "kind"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(20))  # appeared | resolved
    regression_ids: Mapped[list[int]] = mapped_column(JSON)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)


class Bisection(Base):
    """A search for the first bad commit of a git repository between a good and a bad one, running
    one config on midpoints."""

    __tablename__ = "bisections"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    repository: Mapped[str] = mapped_column(String(500))
    good: Mapped[str] = mapped_column(String(64))
    bad: Mapped[str] = mapped_column(String(64))
    matrix: Mapped[str] = mapped_column(String(100))
    config: Mapped[str] = mapped_column(String(200))
    scenario: Mapped[str] = mapped_column(String(40))
    metric: Mapped[str | None] = mapped_column(String(80))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # the job body of each step
    status: Mapped[str] = mapped_column(String(20), index=True)  # queued running done failed
    candidates: Mapped[list[str] | None] = mapped_column(JSON)  # good exclusive .. bad inclusive
    steps: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    first_bad: Mapped[str | None] = mapped_column(String(64))
    runs_used: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    regression_id: Mapped[int | None] = mapped_column(ForeignKey("regressions.id",
                                                                 ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class AuditEvent(Base):
    """Who did what, and when: an action a person took on a regression, a job or a bisection,
    through the API or the dashboard."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_target", "target_type", "target_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    user_name: Mapped[str] = mapped_column(String(200))
    via: Mapped[str] = mapped_column(String(20))  # api | dashboard
    action: Mapped[str] = mapped_column(String(40))  # triage submit cancel bisect
    target_type: Mapped[str] = mapped_column(String(20))  # regression | job | bisection
    target_id: Mapped[str] = mapped_column(String(64))
    comment: Mapped[str | None] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class RevokedSession(Base):
    """A dashboard session ended by signing out: its cookie (signed, and valid for
    ``EVALSVC_SESSION_MAX_AGE_S`` from its last use) names nobody any more. Kept until no copy
    of the cookie can be valid (``expires_at``), then dropped."""

    __tablename__ = "revoked_sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the session's random id
    user_name: Mapped[str] = mapped_column(String(200))
    revoked_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
