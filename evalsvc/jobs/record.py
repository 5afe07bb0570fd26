"""A job's runs in the store: planned before they run, and each finished run recorded and judged in
one transaction. One way for the job service and ``evalsvc run``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from sqlalchemy import case, select, update
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from evalsvc.matrix import Config
from evalsvc.paths import inside
from evalsvc.store.db import Store
from evalsvc.store.models import Job, Run, utcnow
from evalsvc.store.record import (
    BuildRef,
    ensure_build,
    ensure_job,
    plan_run,
    record_run,
    write_samples_parquet,
)
from evalsvc.types import RunResult
from evalsvc.verdicts import judge_and_track

log = logging.getLogger("evalsvc.jobs")


class PlannedRun(NamedTuple):
    run_id: int
    build_id: int
    status: str  # pending, or what a run the job had already is at
    config: Config


def plan_build_runs(store: Store, job_id: str, ref: BuildRef, matrix: str, configs: list[Config],
                    check: Callable[[], None] | None = None) -> list[PlannedRun]:
    """The runs of ``configs`` on one build of a job, planned in one transaction (pending; a run
    the job has already is found, whatever its status), in order. ``check()`` is called before
    each config (the service's cancel)."""
    def planned(s) -> list[PlannedRun]:
        job = s.get(Job, job_id)
        build = ensure_build(s, ref)
        out = []
        for cfg in configs:
            if check is not None:
                check()
            run = plan_run(s, job, build, matrix, cfg)
            out.append(PlannedRun(run.id, build.id, run.status, cfg))
        return out

    return store.write(planned, f"job {job_id}: its runs planned")


def record_result(store: Store, results_dir: Path, job_id: str, run_id: int,
                  result: RunResult) -> str | None:
    """Record a finished run with its samples (``results_dir/JOB/RUN.parquet``) and its verdicts,
    in one transaction; regressions are tracked when the job asks (``track``). A write that fails
    (its samples file, the store) fails the run instead, the error on the run where the store
    takes it; returns that error, None when recorded."""
    target = inside(results_dir, job_id, f"{run_id}.parquet")
    try:
        path = write_samples_parquet(result, target)
    except OSError as exc:  # a full disk, a file where a folder should be
        return fail_run(store, run_id, f"its samples could not be written to {target}: "
                                       f"{describe(exc)}")

    def recorded(s) -> None:  # the run and its verdicts in one transaction
        run = s.get(Run, run_id)
        record_run(s, run.job, run.build, run.matrix, result, path)
        judge_and_track(s, run_id)

    try:  # a lost connection is retried first (the database server restarting)
        store.write(recorded, f"run {run_id}: its record")
    except (SQLAlchemyError, OSError) as exc:
        if path is not None:
            path.unlink(missing_ok=True)
        return fail_run(store, run_id, f"it could not be recorded in the store: {describe(exc)}")
    return None


def fail_run(store: Store, run_id: int, reason: str) -> str:
    """Mark a run failed (verdict error) where the store takes it; returns the job's error."""
    error = f"run {run_id}: {reason}"
    log.error("%s", error)

    def failed(s) -> None:
        run = s.get(Run, run_id)
        run.status, run.verdict, run.reason = "done", "error", reason
        run.engine_pid, run.finished_at = None, utcnow()

    try:
        store.write(failed, f"run {run_id}: its failure")
    except Exception:
        log.exception("run %d: its failure could not be written either", run_id)
    return error


def cancel_pending(session, job_id: str) -> None:
    """A job that ended without running them: its pending runs are cancelled."""
    session.execute(update(Run).where(Run.job_id == job_id, Run.status == "pending")
                    .values(status="cancelled", finished_at=utcnow()))


def end_job(session, job_id: str, status: str, error: str | None) -> str | None:
    """Write the end of a running job: its pending runs are cancelled, and a run still marked
    running (its end could not be written) is an error. A job whose cancel was asked
    (``cancel_requested_at``, which a cancel writes only while the job runs) ends cancelled
    whatever ``status`` says: the store decides, so a cancel answered ``cancelling`` and the
    runner's end cannot disagree. Returns the status written, None if the job was not running."""
    cancel_pending(session, job_id)
    session.execute(update(Run).where(Run.job_id == job_id, Run.status == "running")
                    .values(status="done", verdict="error", engine_pid=None, finished_at=utcnow(),
                            reason=f"it ended but could not be recorded: {error or 'unknown'}"))
    asked = Job.cancel_requested_at.is_not(None)
    ended = session.execute(
        update(Job).where(Job.id == job_id, Job.status == "running")
        .values(status=case((asked, "cancelled"), else_=status),
                error=case((asked, None), else_=error), finished_at=utcnow())).rowcount
    if not ended:
        return None
    return session.scalar(select(Job.status).where(Job.id == job_id))


class JobRecord:
    """A job that runs outside the service (``evalsvc run``), in the store as it runs: the job and
    its runs planned when it starts, each run recorded and judged as it ends (``record_result``),
    and the job's end when it stops: done, failed naming the runs that could not be recorded, or
    cancelled when it stopped before its runs ended (Ctrl-C)."""

    def __init__(self, store: Store, results_dir: Path, job_id: str, runs: dict[str, int]) -> None:
        self.store, self.results_dir, self.job_id = store, results_dir, job_id
        self.run_ids = list(runs.values())  # in the order of the configs
        self.runs = runs  # fingerprint -> run id, of the runs not recorded yet
        self.failures: list[str] = []

    @classmethod
    def start(cls, store: Store, results_dir: Path, job_id: str, trigger: str, ref: BuildRef,
              matrix: str, configs: list[Config], spec: dict) -> JobRecord:
        store.write(lambda s: ensure_job(s, job_id, trigger, spec), f"job {job_id}: its start")
        planned = plan_build_runs(store, job_id, ref, matrix, configs)
        return cls(store, results_dir, job_id, {p.config.fingerprint: p.run_id for p in planned})

    def record(self, config: Config, result: RunResult) -> None:
        failure = record_result(self.store, self.results_dir, self.job_id,
                                self.runs.pop(config.fingerprint), result)
        if failure is not None:
            self.failures.append(failure)

    def finish(self) -> None:
        status = "cancelled" if self.runs else "failed" if self.failures else "done"
        error = "; ".join(self.failures) or None
        self.store.write(lambda s: end_job(s, self.job_id, status, error),
                         f"job {self.job_id}: its end")


def describe(exc: BaseException) -> str:
    """An error for a job, a run or a response: the driver's message for a database error (not the SQL)."""
    orig = getattr(exc, "orig", None)
    if isinstance(exc, DBAPIError) and orig is not None:
        exc = orig
    return f"{type(exc).__name__}: {exc}".strip()
