"""The job service: where the store and the dispatcher meet.

A job is validated (``jobs.spec``) and persisted when it is submitted (``JobService.submit``),
then executed by the job runner thread in order of priority, then age (``jobs.run.run_job``, as
``evalsvc run`` runs its job too): its builds are made, its configs planned (``jobs.plan``) into
pending runs, the runs dispatched to the engine slots, and each finished run recorded in a
transaction of its own. Whoever waits on a job is woken when the
service writes its end (``wait_end``). Everything lives in the database, so a restarted service
resumes what did not finish: runs already recorded are never repeated, and engines left behind by
a killed service (their process groups are remembered on the run) are stopped first.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update

from evalsvc.alerts import collect, deliver
from evalsvc.builds.engine_envs import python_of
from evalsvc.counters import Counters
from evalsvc.engines.base import EngineSpec
from evalsvc.engines.registry import engine_kind, is_engine_process
from evalsvc.jobs import run as job_run
from evalsvc.jobs.record import cancel_pending, describe, end_job
from evalsvc.jobs.run import JobCancelled, RunOptions
from evalsvc.jobs.spec import JobCreate, mint_id, stored_spec, validate_job
from evalsvc.logs import log_context
from evalsvc.paths import inside
from evalsvc.settings import Settings
from evalsvc.store import audit
from evalsvc.store.audit import Actor
from evalsvc.store.db import Store
from evalsvc.store.lock import StoreLock
from evalsvc.store.models import Job, Run, utcnow
from evalsvc.store.record import ensure_job
from evalsvc.types import JobStatus, RunStatus

log = logging.getLogger("evalsvc.jobs")


class JobService:
    def __init__(self, settings: Settings, store: Store, dispatcher) -> None:
        self.settings = settings
        self.store = store
        self.dispatcher = dispatcher
        self.counters = Counters()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cancelled: set[str] = set()  # running jobs whose cancel the store holds
        self._asking: dict[str, int] = {}  # cancels of a job writing the store now (how many)
        # the running job's cancel as its phases look at it (RunOptions.cancelled): set while
        # the job is in either of the two above
        self._flags: dict[str, threading.Event] = {}
        self._lock = threading.Lock()  # guards the three; never held while the store is used
        self._asked = threading.Condition(self._lock)  # notified when a cancel's write ended
        self._store_lock: StoreLock | None = None
        self._failing: str | None = None  # the error the runner is waiting out, if any
        self._ended = threading.Condition()  # notified when this service wrote a job's end
        self._ends = 0  # how many it wrote

    # ---- submission ------------------------------------------------------------------------
    def submit(self, body: JobCreate, trigger: str = "api", extra: dict[str, Any] | None = None,
               trusted: bool = False, actor: Actor | None = None) -> str:
        """Validate and queue a job. ``trusted``: from the operator's own configuration (nightly
        schedules), whose build sources need not be on the allowed list. ``actor``: the person
        submitting it (an audit event, stored with the job)."""
        spec = validate_job(body, self.settings, trusted)
        if extra:
            spec = spec.model_copy(update=extra)  # the submitter's keys (validated there)
        stored = spec.stored()
        job_id = mint_id(trigger)
        with self.store.session() as s:
            ensure_job(s, job_id, trigger, stored, priority=body.priority, status=JobStatus.QUEUED)
            if actor is not None:
                audit.record(s, actor, "submit", "job", job_id, details={
                    "matrix": spec.matrix_name, "configs": spec.configs,
                    "builds": stored["builds"], "track": spec.track})
        log.info("job %s queued (%s, %d build(s))", job_id, spec.matrix_name, len(spec.builds))
        self._wake.set()
        return job_id

    def normalize(self, body: JobCreate, trusted: bool = False) -> dict[str, Any]:
        """The job as stored (``JobSpec.stored``), validated (``spec.validate_job``); JobError."""
        return validate_job(body, self.settings, trusted).stored()

    # ---- control ---------------------------------------------------------------------------
    def cancel(self, job_id: str, actor: Actor | None = None) -> str | None:
        """Cancel a queued or running job; returns its status, None if there is no such job.

        A queued job is ``cancelled`` at once and never starts; a running one answers
        ``cancelling`` and ends ``cancelled``: the runner stops it at its next phase, its
        engines are stopped and its pending runs are cancelled. Each is one conditional update,
        so a cancel and the runner taking the job up cannot both win; and the store has the last
        word on a running job's end (``end_job``: a job whose cancel it holds ends cancelled).
        The runner is told first, in memory, and looks at that inside its own transactions too
        (planning a job's runs): a cancel never waits for a transaction that waits for it (no
        lock is held while the store is written), and the runner writes the end of a job it
        stopped so only once the cancel's own write is in. ``actor``: the person cancelling it (an
        audit event, in the transaction of the update; none when the job had ended already and
        nothing changed)."""
        now = utcnow()
        with self._lock:  # the runner stops at its next look, inside a transaction too
            self._asking[job_id] = self._asking.get(job_id, 0) + 1
            self._flag(job_id)
        running = 0
        try:
            with self.store.session() as s:
                queued = s.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED)
                                   .values(status=JobStatus.CANCELLED, finished_at=now)).rowcount
                if queued:
                    if actor is not None:
                        audit.record(s, actor, "cancel", "job", job_id,
                                     details={"status": "cancelled"})
                    self._count("cancelled")
                else:
                    running = s.execute(
                        update(Job).where(Job.id == job_id, Job.status == JobStatus.RUNNING,
                                          Job.trigger != "cli")  # evalsvc run records it
                        .values(cancel_requested_at=now)).rowcount
                    if not running:
                        status = s.scalar(select(Job.status).where(Job.id == job_id))
                    elif actor is not None:
                        audit.record(s, actor, "cancel", "job", job_id,
                                     details={"status": "cancelling"})
        finally:  # an error: the job goes on, unless its runner stopped it meanwhile
            with self._lock:
                if running:
                    self._cancelled.add(job_id)
                self._asking[job_id] -= 1
                if not self._asking[job_id]:
                    del self._asking[job_id]
                self._flag(job_id)
                self._asked.notify_all()
        if queued:  # its end committed
            self._ended_one()
            log.info("job %s cancelled before it started", job_id)
            return "cancelled"
        if not running:
            return status
        if self.dispatcher is not None:
            self.dispatcher.cancel_job(job_id)
        log.info("job %s cancelling", job_id)
        return "cancelling"

    def start(self, lock: StoreLock | None = None) -> None:
        """Take the store's lock (StoreLocked if another service holds it; ``lock``: one taken
        already), recover what a killed service left, and start the runner thread."""
        if lock is None:
            lock = StoreLock(self.store.url)
            lock.acquire()
        self._store_lock = lock
        try:
            self.recover()
            self.deliver_alerts()
        except BaseException:
            self._release_lock()
            raise
        self._thread = threading.Thread(target=self._loop, name="job-runner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.dispatcher is not None:  # None: a service that only submits
            self.dispatcher.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._release_lock()

    def _release_lock(self) -> None:
        lock, self._store_lock = self._store_lock, None
        if lock is not None:
            lock.release()

    def runner_problem(self) -> str | None:
        """Why the runner cannot take up or finish jobs (its thread ended, or it meets an error
        it is waiting out), None when it can or was never started (a service that submits)."""
        if self._thread is None:
            return None
        if not self._thread.is_alive():
            return "the job runner thread is not running (queued jobs do not start)"
        if self._failing is not None:
            return f"the job runner meets an error, and tries again: {self._failing}"
        return None

    def recover(self) -> None:
        """After a restart: stop engines a killed service left, requeue unfinished work.

        A job found running was taken up by a runner that died with it. One taken up
        ``runner_max_attempts`` times is failed rather than run again (it may be what kills the
        service, e.g. out of memory); one whose cancel was asked ends cancelled. Jobs that
        ``evalsvc run`` is recording (trigger cli) are its own: they are left alone."""
        limit = self.settings.runner_max_attempts
        now = utcnow()
        with self.store.session() as s:
            ours = select(Job.id).where(Job.trigger != "cli")
            for run in s.scalars(select(Run).where(Run.status == RunStatus.RUNNING,
                                                   Run.job_id.in_(ours))):
                if run.engine_pid:
                    kill_engine_group(run.engine_pid)
                run.status, run.engine_pid = "pending", None
            for job in s.scalars(select(Job).where(Job.status == JobStatus.RUNNING,
                                                   Job.trigger != "cli")):
                if job.cancel_requested_at is not None:
                    job.status, job.finished_at = "cancelled", now
                    log.info("job %s cancelled (asked before the restart)", job.id)
                elif job.attempts >= limit:
                    job.status, job.finished_at = "failed", now
                    job.error = (f"the service stopped while running this job {job.attempts} "
                                 "times (killed or crashed, e.g. out of memory): not tried again "
                                 f"(EVALSVC_RUNNER_MAX_ATTEMPTS={limit})")
                    log.error("job %s failed: %s", job.id, job.error)
                else:
                    job.status = JobStatus.QUEUED
                    log.info("job %s resumes after a restart", job.id)
                    continue
                self._count(job.status)
                cancel_pending(s, job.id)
        self._ended_one()

    # ---- a job's end -----------------------------------------------------------------------
    def ends(self) -> int:
        """How many job ends this service wrote (a job done, failed or cancelled)."""
        with self._ended:
            return self._ends

    def wait_end(self, seen: int, timeout: float) -> int:
        """Wait until this service wrote a job's end after the ``seen``-th (``ends()``, taken
        before looking at the job), at most ``timeout`` seconds; returns ``ends()``."""
        with self._ended:
            self._ended.wait_for(lambda: self._ends != seen, timeout)
            return self._ends

    def _ended_one(self) -> None:
        with self._ended:
            self._ends += 1
            self._ended.notify_all()

    def queue_length(self) -> int:
        with self.store.session() as s:
            return s.scalar(select(func.count()).select_from(Job).where(Job.status == JobStatus.QUEUED))

    def running_runs(self) -> int:
        with self.store.session() as s:
            return s.scalar(select(func.count()).select_from(Run).where(Run.status == RunStatus.RUNNING))

    # ---- the runner ------------------------------------------------------------------------
    def _loop(self) -> None:
        """Takes up jobs until stopped. Any error (the store unreachable, a full disk) is logged
        and the loop goes on after a pause, longer while the error persists (up to 30 s)."""
        pause = 0.0
        while not self._stop.is_set():
            try:
                if not self._step():
                    return
                pause, self._failing = 0.0, None
            except Exception as exc:
                pause = min(max(2 * pause, 1.0), 30.0)
                self._failing = describe(exc)
                log.exception("job runner: an error; trying again in %.0f s", pause)
                self._stop.wait(pause)

    def _step(self) -> bool:
        """Take up the next job and run it to its end; False: the service is shutting down."""
        if self._store_lock is not None:  # still this service's store (a restarted PostgreSQL)
            self._store_lock.keep()
        job_id = self._next_job()
        if job_id is None:
            self._wake.wait(1.0)
            self._wake.clear()
            return True
        with log_context(job=job_id):
            try:
                status, error = self._execute(job_id)
            except JobCancelled:
                status, error = "cancelled", None
            except Exception as exc:
                log.exception("job %s failed", job_id)
                status, error = "failed", describe(exc)
                if self.dispatcher is not None:  # none of its runs goes on without it
                    self.dispatcher.cancel_job(job_id)
        if self._stop.is_set() and status != JobStatus.CANCELLED and not self._is_cancelled(job_id):
            self._interrupted(job_id)
            return False  # shutting down: the job stays running and resumes after a restart
        self._finish(job_id, status, error)
        self._alert(job_id)
        return True

    def _next_job(self) -> str | None:
        """Take up the first queued job (priority, then age): one conditional update, so a job
        cancelled meanwhile is not taken. Counts the attempt on the job."""
        while not self._stop.is_set():
            with self.store.session() as s:
                job_id = s.scalar(select(Job.id).where(Job.status == JobStatus.QUEUED)
                                  .order_by(Job.priority.desc(), Job.created_at, Job.id).limit(1))
                if job_id is None:
                    return None
                taken = s.execute(update(Job).where(Job.id == job_id, Job.status == JobStatus.QUEUED)
                                  .values(status=JobStatus.RUNNING, attempts=Job.attempts + 1)).rowcount
                if taken:
                    s.execute(update(Job).where(Job.id == job_id, Job.started_at.is_(None))
                              .values(started_at=utcnow()))
                    return job_id
        return None

    def _finish(self, job_id: str, status: str, error: str | None) -> None:
        """Write the job's end, trying again while the store refuses (until the service stops).
        A job whose cancel was answered ``cancelling`` ends cancelled (the store decides, in the
        update that ends it: ``end_job``), one whose every run errored failed. Its runs not started
        are cancelled; one still marked running ended unrecorded (the store refused it): an
        error."""
        counted = False
        pause = 1.0
        with self._lock:  # a cancel writing the store now goes first: it answers cancelling
            self._asked.wait_for(lambda: job_id not in self._asking, timeout=60)
        while True:
            if self._is_cancelled(job_id):
                status, error = "cancelled", None
            try:
                self._failing = None  # set again below if this write fails too
                with self.store.session() as s:
                    ended, _ = end_job(s, job_id, status, error)
                    if not counted:  # before the commit: who sees the job finished sees it counted
                        self._count(ended or status)
                        counted = True
                with self._lock:
                    self._cancelled.discard(job_id)
                    self._flags.pop(job_id, None)
                self._ended_one()
                log.info("job %s %s", job_id, ended or status)
                return
            except Exception as exc:
                self._failing = f"writing the end of job {job_id}: {describe(exc)}"
                if self._stop.is_set():
                    log.exception("job %s: its end (%s) could not be written; it resumes after "
                                  "the restart", job_id, status)
                    return
                log.exception("job %s: its end (%s) could not be written; trying again in %.0f s",
                              job_id, status, pause)
                self._stop.wait(pause)
                pause = min(2 * pause, 30.0)

    def _interrupted(self, job_id: str) -> None:
        """A job left running by a clean shutdown: that attempt does not count against it."""
        try:
            with self.store.session() as s:
                s.execute(update(Job).where(Job.id == job_id, Job.attempts > 0)
                          .values(attempts=Job.attempts - 1))
        except Exception:
            log.exception("job %s: its attempt could not be given back", job_id)

    def _execute(self, job_id: str) -> tuple[str, str | None]:
        """Run a job's phases (``jobs.run.run_job``: workload, tokens, builds, plan, runs, record)
        on the service's dispatcher; the cancel flag is looked at between them and in their
        loops (JobCancelled)."""
        with self.store.session() as s:
            stored = s.get(Job, job_id).spec
        spec = stored_spec(stored, strict=True)  # the matrix made once
        base = EngineSpec(kind=spec.engine)
        if engine_kind(spec.engine).uses_engine_envs:  # the environment named when submitted
            base = EngineSpec(kind=spec.engine, python=python_of(self.settings, spec.engine_env),
                              env_name=spec.engine_env)
        with self._lock:  # a cancel asked already is set on it
            cancelled = self._flags[job_id] = threading.Event()
            self._flag(job_id)
        outcome = job_run.run_job(job_id, spec, self.dispatcher, self.store, RunOptions(
            engine=base, log_dir=inside(self.settings.data_dir, "logs", job_id),
            results_dir=self.settings.results_dir(), run_timeout_s=self.settings.run_timeout_s,
            builds_dir=self.settings.resolved_builds_dir(),
            cancelled=cancelled, stopping=self._stop, counters=self.counters))
        return outcome.status, outcome.error

    def _alert(self, job_id: str) -> None:
        try:
            with self.store.session() as s:
                collect(s, job_id, self.settings.public_url)
            self.deliver_alerts()
        except Exception:  # an alert that cannot be made or sent never fails the job
            log.exception("job %s: alerts", job_id)

    def deliver_alerts(self) -> int:
        return deliver(self.store, self.settings.alert_webhook)

    def _flag(self, job_id: str) -> None:
        """The running job's cancel flag set as its cancel stands (with ``_lock`` held)."""
        flag = self._flags.get(job_id)
        if flag is None:
            return
        if job_id in self._cancelled or job_id in self._asking:
            flag.set()
        else:
            flag.clear()

    def _is_cancelled(self, job_id: str) -> bool:
        """Whether the job's cancel was asked of this service (answered, or being written): read
        from memory, never from the store, so the runner may look inside its own transactions."""
        with self._lock:  # held for these sets alone, never across the store
            return job_id in self._cancelled or job_id in self._asking

    def _count(self, status: str) -> None:
        self.counters.outcomes[status] = self.counters.outcomes.get(status, 0) + 1


def kill_engine_group(pid: int) -> None:
    """Stop an engine a killed service left running (only if it still is one of ours)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return
    if not is_engine_process(cmdline):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        time.sleep(1.0)
