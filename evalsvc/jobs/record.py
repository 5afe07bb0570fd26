"""A job's runs in the store: planned before they run (with the limits they are judged against),
each finished run judged (``judging.judge_run``, with its history) and recorded in one
transaction, and a job of two builds compared when it ends. One way for the job service and
``evalsvc run``.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from sqlalchemy import case, select, update
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from evalsvc import judging
from evalsvc.jobs.spec import job_spec
from evalsvc.matrix import Config, MatrixFile
from evalsvc.paths import inside
from evalsvc.store.db import Store
from evalsvc.store.models import Job, Run, VerdictRow, utcnow
from evalsvc.store.record import (
    BuildRef,
    ensure_build,
    plan_run,
    record_run,
    write_samples_parquet,
)
from evalsvc.thresholds import ThresholdsFile
from evalsvc.types import JobStatus, RunEvent, RunResult, RunStatus, Verdict
from evalsvc.verdicts import compare_builds, run_history, stored_limits, track

log = logging.getLogger("evalsvc.jobs")


class JobCancelled(Exception):
    """Raised in a job's phases once its cancel was asked (``RunOptions.cancelled``)."""


class PlannedRun(NamedTuple):
    run_id: int
    build_id: int
    status: str  # pending, or what a run the job had already is at
    config: Config


def plan_build_runs(store: Store, job_id: str, ref: BuildRef, matrix: MatrixFile | str,
                    configs: list[Config], cancelled: threading.Event | None = None, *,
                    engine: str | None = None, thresholds: ThresholdsFile | None = None
                    ) -> list[PlannedRun]:
    """The runs of ``configs`` on one build of a job, planned in one transaction (pending; a run
    the job has already is found, whatever its status), in order, each with the limits it is
    judged against (``judging.config_limits`` on ``engine``, default the matrix's; ``matrix``: a
    name alone gives the thresholds' rules without the matrix file's own thresholds). ``cancelled``
    is looked at before each config (the job's cancel: JobCancelled)."""
    name = matrix if isinstance(matrix, str) else matrix.name
    file = None if isinstance(matrix, str) else matrix

    for attempt in store.attempts(f"job {job_id}: its runs planned"):
        with attempt as s:
            job = s.get(Job, job_id)
            build = ensure_build(s, ref)
            out = []
            for cfg in configs:
                if cancelled is not None and cancelled.is_set():
                    raise JobCancelled(job_id)
                limits = judging.config_limits(cfg, file, engine=engine, thresholds=thresholds)
                run = plan_run(s, job, build, name, cfg, limits)
                out.append(PlannedRun(run.id, build.id, run.status, cfg))
    return out


def record_progress(store: Store, event: RunEvent) -> None:
    """A run's start (``running``) or its engine's pid (the process group a restarted service
    stops), as its dispatcher reported them (``started``, ``engine``). A write still failing after
    its tries is logged, and the run goes on: its record says how it ended."""
    what = "its start" if event.kind == "started" else "its engine's pid"
    try:
        for attempt in store.attempts(f"run {event.run_id}: {what}"):
            with attempt as s:
                run = s.get(Run, event.run_id)
                if event.kind == "started":
                    run.status = RunStatus.RUNNING
                else:
                    run.engine_pid = event.pid
    except SQLAlchemyError:
        log.exception("run %d: %s could not be written", event.run_id, what)


def judged_copy(result: RunResult) -> RunResult:
    """``result`` with scenarios of its own (their metrics and samples shared), to judge."""
    return replace(result, scenarios=[replace(s) for s in result.scenarios])


def hand_back(result: RunResult, judged: RunResult) -> None:
    """``judged``'s verdicts and reasons (run and scenarios) set on ``result``."""
    result.verdict, result.reason = judged.verdict, judged.reason
    for scen, j in zip(result.scenarios, judged.scenarios, strict=True):
        scen.verdict, scen.reason = j.verdict, j.reason


def record_result(store: Store, results_dir: Path, job_id: str, run_id: int,
                  result: RunResult, thresholds: ThresholdsFile | None = None) -> str | None:
    """Judge a finished run and record it with its samples (``results_dir/JOB/RUN.parquet``) and
    its verdicts, in one transaction: ``judging.judge_run`` on the result as the harness measured
    it, against the limits stored on the run when it was planned (``verdicts.stored_limits``)
    and the history of its series (``verdicts.run_history``), before its rows are written;
    regressions are tracked when the job asks (``track``). Once recorded, the judged verdicts are
    handed back on ``result`` (what ``evalsvc run`` prints and exits with). A write that fails
    (its samples file, the store) fails the run instead, the error on the run where the store
    takes it, and leaves ``result`` as it was; returns that error, None when recorded.
    ``thresholds``: for the history settings (default ``evalsvc/configs/thresholds.yaml``)."""
    target = inside(results_dir, job_id, f"{run_id}.parquet")
    try:
        path = write_samples_parquet(result, target)
    except OSError as exc:  # a full disk, a file where a folder should be
        return fail_run(store, run_id, f"its samples could not be written to {target}: "
                                       f"{describe(exc)}")
    try:  # a lost connection is tried again first (the database server restarting)
        for attempt in store.attempts(f"run {run_id}: its record"):
            with attempt as s:  # judged, then the run and its verdicts, in one transaction
                run = s.get(Run, run_id)
                run.finished_at = utcnow()  # its place in its series (verdicts.order_key)
                judged = judged_copy(result)  # judged afresh on each try: ``result`` as measured
                names = [sc.scenario for sc in judged.scenarios if sc.verdict in judging.JUDGED]
                history = None
                if judged.verdict != Verdict.CANCELLED:  # judged on its fixed limits only
                    history = run_history(s, run, [sc.scenario for sc in judged.scenarios
                                                   if sc.verdict in judging.JUDGED
                                                   and sc.metrics], thresholds)
                judgements = judging.judge_run(judged, stored_limits(
                    run, [*names, judging.POOLED], thresholds), history)
                record_run(s, run.job, run.build, run.matrix, judged, path, judgements)
                spec = job_spec(run.job)
                if spec is not None and spec.track:
                    track(s, run, list(s.scalars(select(VerdictRow)
                                                 .where(VerdictRow.run_id == run.id)
                                                 .order_by(VerdictRow.id))))
    except (SQLAlchemyError, OSError) as exc:
        if path is not None:
            path.unlink(missing_ok=True)
        return fail_run(store, run_id, f"it could not be recorded in the store: {describe(exc)}")
    hand_back(result, judged)
    return None


def fail_run(store: Store, run_id: int, reason: str) -> str:
    """Mark a run failed (verdict error) where the store takes it; returns the job's error."""
    error = f"run {run_id}: {reason}"
    log.error("%s", error)

    try:
        for attempt in store.attempts(f"run {run_id}: its failure"):
            with attempt as s:
                run = s.get(Run, run_id)
                run.status, run.verdict, run.reason = "done", "error", reason
                run.engine_pid, run.finished_at = None, utcnow()
    except Exception:
        log.exception("run %d: its failure could not be written either", run_id)
    return error


def cancel_pending(session, job_id: str) -> None:
    """A job that ended without running them: its pending runs are cancelled."""
    session.execute(update(Run).where(Run.job_id == job_id, Run.status == RunStatus.PENDING)
                    .values(status=RunStatus.CANCELLED, finished_at=utcnow()))


def end_job(session, job_id: str, status: str, error: str | None
            ) -> tuple[str | None, str | None]:
    """Write the end of a running job: its pending runs are cancelled, and a run still marked
    running (its end could not be written) is an error. A job whose cancel was asked
    (``cancel_requested_at``, which a cancel writes only while the job runs) ends cancelled
    whatever ``status`` says: the store decides, so a cancel answered ``cancelling`` and the
    runner's end cannot disagree. A job ``done`` whose every run ended ``error`` is ``failed``
    instead, its error naming them (``all_errored``). A job of two builds that ends done is
    compared (``store_comparison``). Returns the status and error written (None, None if the job
    was not running)."""
    cancel_pending(session, job_id)
    session.execute(update(Run).where(Run.job_id == job_id, Run.status == RunStatus.RUNNING)
                    .values(status=RunStatus.DONE, verdict=Verdict.ERROR, engine_pid=None,
                            finished_at=utcnow(),
                            reason=f"it ended but could not be recorded: {error or 'unknown'}"))
    if status == JobStatus.DONE:
        every = all_errored(session, job_id)
        if every is not None:
            status, error = "failed", every
    asked = Job.cancel_requested_at.is_not(None)
    ended = session.execute(
        update(Job).where(Job.id == job_id, Job.status == JobStatus.RUNNING)
        .values(status=case((asked, "cancelled"), else_=status),
                error=case((asked, None), else_=error), finished_at=utcnow())).rowcount
    if not ended:
        return None, None
    written = tuple(session.execute(select(Job.status, Job.error).where(Job.id == job_id)).one())
    if written[0] == JobStatus.DONE:
        store_comparison(session, job_id)
    return written


def job_build_ids(session, job_id: str) -> list[int]:
    """The builds of a job's runs, in the order of its runs (as ``queries.job_detail`` lists
    them)."""
    return list(dict.fromkeys(session.scalars(select(Run.build_id).where(Run.job_id == job_id)
                                              .order_by(Run.id))))


def store_comparison(session, job_id: str) -> None:
    """A job of two builds that ended done: its comparison (the first build the baseline, the
    second the contender: ``verdicts.compare_builds``), judged once and stored on the job
    (``jobs.comparison``), which its readers serve. A comparison that cannot be judged is logged
    and left out (NULL: judged when read), never keeping the job from ending."""
    builds = job_build_ids(session, job_id)
    if len(builds) != 2:
        return
    try:
        rows = compare_builds(session, builds[0], builds[1])
    except SQLAlchemyError:
        raise  # the store's: the job's end is written again (JobService._finish)
    except Exception:  # never a job left unended for its comparison: judged when read instead
        log.exception("job %s: its comparison could not be judged", job_id)
        return
    session.execute(update(Job).where(Job.id == job_id)
                    .values(comparison=json_safe([r.model_dump() for r in rows])))


def json_safe(value):
    """``value`` as JSON every store takes: NumPy scalars as Python's, a non-finite float as None
    (PostgreSQL's JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str | bytes):  # a NumPy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


SHOWN_ERRORS = 3  # runs an all-errored job's error names


def all_errored(session, job_id: str) -> str | None:
    """When every run of a job ended ``error`` (none cancelled, at least one): the job's error,
    naming the first runs and their reasons; else None."""
    runs = session.execute(select(Run.id, Run.config, Run.status, Run.verdict, Run.reason)
                           .where(Run.job_id == job_id).order_by(Run.id)).all()
    if not runs or any(r.status != RunStatus.DONE or r.verdict != Verdict.ERROR for r in runs):
        return None
    named = "; ".join(f"run {r.id} ({r.config}): {r.reason or 'no reason recorded'}"
                      for r in runs[:SHOWN_ERRORS])
    more = f"; and {len(runs) - SHOWN_ERRORS} more" if len(runs) > SHOWN_ERRORS else ""
    return f"every run errored ({len(runs)} of {len(runs)}): {named}{more}"


def describe(exc: BaseException) -> str:
    """An error for a job, a run or a response: the driver's message for a database error (not the SQL)."""
    orig = getattr(exc, "orig", None)
    if isinstance(exc, DBAPIError) and orig is not None:
        exc = orig
    return f"{type(exc).__name__}: {exc}".strip()
