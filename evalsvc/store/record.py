"""Writing results: commits, builds, jobs and runs, idempotent and one transaction per run.

Re-recording a run (same job, build and fingerprint) replaces it instead of adding another; a run
whose write fails leaves nothing of itself behind. Token-level arrays go to a Parquet file per run
under the results directory, referenced from the run row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from evalsvc.judging import Judgement
from evalsvc.store.db import Store
from evalsvc.store.models import (
    Build,
    Commit,
    Job,
    Metric,
    Run,
    SampleRow,
    ScenarioRow,
    VerdictRow,
    utcnow,
)
from evalsvc.thresholds import Limits
from evalsvc.types import SAMPLE_FIELDS, TOKEN_FIELDS, JobStatus, RunResult, RunStatus, Verdict

# scenario metrics whose interval and sample count go on the row of their mean
INTERVALS = ("kl_k3", "extend_kl_k3")


@dataclass
class BuildRef:
    """What was evaluated: a commit (or release) of a repository, plus a patch set."""

    repository: str
    sha: str | None = None
    version: str | None = None
    committed_at: datetime | None = None
    branch: str | None = None
    patches: list[str] = field(default_factory=list)
    probes: dict[str, Any] | None = None
    base_env: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None

    @property
    def ref(self) -> str:
        return f"{self.repository}@{self.sha}" if self.sha else f"{self.repository}=={self.version}"

    @property
    def patch_set(self) -> str:
        return ",".join(sorted(set(self.patches)))


def _utc(when: datetime | None) -> datetime | None:
    """Aware UTC (a naive time is taken as UTC). SQLite stores a timestamp's wall time and drops
    its offset, so commit times with offsets would compare wrongly there unless made UTC first."""
    if when is None:
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def ensure_commit(session: Session, b: BuildRef) -> Commit:
    committed_at = _utc(b.committed_at)
    commit = session.scalar(select(Commit).where(Commit.ref == b.ref))
    if commit is None:
        commit = Commit(ref=b.ref, repository=b.repository, sha=b.sha, version=b.version,
                        committed_at=committed_at, branch=b.branch)
        session.add(commit)
        session.flush()
    else:
        commit.committed_at = commit.committed_at or committed_at
        commit.branch = commit.branch or b.branch
    return commit


def ensure_build(session: Session, b: BuildRef) -> Build:
    commit = ensure_commit(session, b)
    build = session.scalar(select(Build).where(Build.commit_id == commit.id,
                                               Build.patch_set == b.patch_set))
    if build is None:
        build = Build(commit_id=commit.id, patch_set=b.patch_set, probes=b.probes,
                      base_env=b.base_env, manifest=b.manifest)
        session.add(build)
        session.flush()
    return build


def ensure_job(session: Session, job_id: str, trigger: str, spec: dict[str, Any],
               priority: int = 0, status: str = JobStatus.RUNNING) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        job = Job(id=job_id, trigger=trigger, spec=spec, priority=priority, status=status,
                  started_at=utcnow() if status == JobStatus.RUNNING else None)
        session.add(job)
        session.flush()
    return job


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def metric_rows(scenario: str, metrics: dict[str, Any]) -> list[Metric]:
    """Scalar metrics of one scenario; the KL means carry their interval and sample count."""
    rows = []
    carried = {f"{p}_{k}" for p in INTERVALS for k in ("ci_low", "ci_high", "n_samples")}
    for name, value in metrics.items():
        if name in carried:
            continue
        v = _number(value)
        if v is None and value is not None:
            continue
        row = Metric(scenario=scenario, name=name, value=v)
        prefix = name.removesuffix("_mean")
        if prefix in INTERVALS and name.endswith("_mean"):
            row.ci_low = _number(metrics.get(f"{prefix}_ci_low"))
            row.ci_high = _number(metrics.get(f"{prefix}_ci_high"))
            n = metrics.get(f"{prefix}_n_samples")
            row.count = int(n) if n is not None else None
        rows.append(row)
    return rows


def write_samples_parquet(result: RunResult, path: Path) -> Path | None:
    import pandas as pd

    rows = [{"scenario": s.scenario, "sample_id": row["sample_id"],
             **{k: row.get(k) for k in SAMPLE_FIELDS + TOKEN_FIELDS}}
            for s in result.scenarios for row in s.samples]
    if not rows:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    tmp.replace(path)
    return path


def record_run(session: Session, job: Job, build: Build, matrix: str, result: RunResult,
               samples_path: Path | None, judgements: list[Judgement] | None = None) -> Run:
    """Write a run (``result``, as judged: ``judging.judge_run``) with its scenarios, metrics
    and samples, and its verdicts (``judgements``, replacing those it had; None: it keeps
    them)."""
    run = session.scalar(select(Run).where(Run.job_id == job.id, Run.build_id == build.id,
                                           Run.fingerprint == result.fingerprint))
    if run is None:
        run = Run(job_id=job.id, build_id=build.id, fingerprint=result.fingerprint)
        session.add(run)
    else:  # re-recorded: replace what it had
        run.scenarios.clear()
        run.metrics.clear()
        run.samples.clear()
        session.flush()
    run.config, run.matrix, run.model = result.config, matrix, result.model
    run.settings = result.settings
    run.requested_args = result.requested_args
    run.resolved_args = result.resolved_args
    run.reference = result.reference
    run.command = result.command
    run.status = (RunStatus.CANCELLED if result.verdict == Verdict.CANCELLED
                  else RunStatus.DONE)
    run.verdict, run.reason = result.verdict, result.reason or None
    run.engine_pid = None
    run.startup_seconds, run.seconds = result.startup_seconds, result.seconds
    run.log_path = result.log_path
    run.samples_path = str(samples_path) if samples_path else None
    run.finished_at = utcnow()
    for s in result.scenarios:
        run.scenarios.append(ScenarioRow(scenario=s.scenario, verdict=s.verdict,
                                         reason=s.reason or None, seconds=s.seconds))
        run.metrics.extend(metric_rows(s.scenario, s.metrics))
        for row in s.samples:
            run.samples.append(SampleRow(scenario=s.scenario, sample_id=row["sample_id"],
                                      **{k: row.get(k) for k in SAMPLE_FIELDS}))
    session.flush()
    if judgements is not None:
        write_verdicts(session, run, judgements)
    return run


def write_verdicts(session: Session, run: Run, judgements: list[Judgement]) -> list[VerdictRow]:
    """A run's metric verdicts (``judging.judge_run``'s judgements), replacing any it had."""
    session.execute(delete(VerdictRow).where(VerdictRow.run_id == run.id))
    rows = [VerdictRow(run_id=run.id, scenario=j.scenario, metric=j.metric, verdict=j.verdict,
                    method=j.method, value=j.value, baseline=j.baseline, diff_low=j.diff_low,
                    diff_high=j.diff_high, threshold=j.threshold, p_value=j.p_value,
                    evidence=j.evidence, reason=j.reason or None) for j in judgements]
    session.add_all(rows)
    session.flush()
    return rows


def plan_run(session: Session, job: Job, build: Build, matrix: str, config,
             limits: dict[str, Limits] | None = None) -> Run:
    """A pending run of a config (a ``matrix.Config``) in a job, unless the job has it already;
    ``limits``: what it is judged against, by scenario (``judging.config_limits``), stored on it
    (``runs.limits``; a run the job had already keeps its own)."""
    run = session.scalar(select(Run).where(Run.job_id == job.id, Run.build_id == build.id,
                                           Run.fingerprint == config.fingerprint))
    if run is None:
        run = Run(job_id=job.id, build_id=build.id, fingerprint=config.fingerprint,
                  config=config.name, matrix=matrix, model=config.model,
                  settings=dict(config.settings), requested_args=dict(config.args),
                  status=RunStatus.PENDING)
        session.add(run)
    if limits is not None and run.limits is None:
        run.limits = {name: lim.model_dump(mode="json") for name, lim in limits.items()}
    session.flush()
    return run


def record_results(store: Store, *, job_id: str, trigger: str, spec: dict[str, Any],
                   build: BuildRef, matrix: str, results: list[RunResult],
                   results_dir: Path) -> list[int]:
    """Record a job's runs; each run in a transaction of its own. Returns the run ids.

    A run's Parquet file is written aside first and moved into place once its rows are committed:
    a run that fails leaves no file, and a failed re-recording keeps the recorded run's file."""
    with store.session() as s:
        ensure_job(s, job_id, trigger, spec)
        build_id = ensure_build(s, build).id
    ids = []
    for result in results:
        path = results_dir / job_id / f"{result.fingerprint}.parquet"
        staged = write_samples_parquet(result, path.with_name(f"{path.stem}.staged.parquet"))
        try:
            with store.session() as s:
                job = s.get(Job, job_id)
                run = record_run(s, job, s.get(Build, build_id), matrix, result,
                                 path if staged else None)
                run_id = run.id
        except BaseException:
            if staged:
                staged.unlink(missing_ok=True)
            raise
        if staged:
            staged.replace(path)
        else:
            path.unlink(missing_ok=True)  # re-recorded without samples: the old file is stale
        ids.append(run_id)
    with store.session() as s:
        job = s.get(Job, job_id)
        job.status, job.finished_at = JobStatus.DONE, utcnow()
    return ids
