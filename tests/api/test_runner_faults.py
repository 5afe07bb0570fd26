"""The job runner under faults: cancel in every phase of a job and against the runner taking it up,
a job that takes the service down with it, a second service on a port or a store in use, and
writes the store or the data directory refuse (the runner goes on, /healthz and POST say so).

The runs go to the fake SGLang server (``tests/data/fake_sglang.py``): cheap engines that serve in
about a second."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, event, func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

import evalsvc.evaluate
import evalsvc.jobs
import evalsvc.workloads
from evalsvc.app import create_app
from evalsvc.cli import app as cli
from evalsvc.dispatch.local import LocalDispatcher
from evalsvc.jobs import JobCreate, JobService
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Job, Run
from evalsvc.store.record import ensure_job
from tests.api.conftest import FAKE_MATRIX as MATRIX
from tests.api.conftest import free_port
from tests.processes import exists

DATA = Path(__file__).parents[1] / "data"
FAKE_PYTHON = str(DATA / "fake-python")
FINISHED = ("done", "failed", "cancelled")


@pytest.fixture
def fake_engine(monkeypatch, tmp_path) -> Path:
    """The fake SGLang server for runs; returns the file collecting its pids (one line each)."""
    pids = tmp_path / "engine-pids"
    monkeypatch.setenv("FAKE_SGLANG_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_SGLANG_PIDFILE", str(pids))
    return pids


def settings_for(tmp_path: Path, url: str | None = None, **overrides) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=url or f"sqlite:///{tmp_path / 's.db'}",
                    engine_python=FAKE_PYTHON, nightly=False, **overrides)


@pytest.fixture
def runner(tmp_path, fake_engine) -> Iterator[Callable[..., JobService]]:
    """Makes a job service with a running runner (a local engine slot); stopped afterwards."""
    made: list[JobService] = []

    def make(url: str | None = None, **overrides) -> JobService:
        settings = settings_for(tmp_path, url, **overrides)
        jobs = JobService(settings, Store(settings.resolved_database_url()),
                          LocalDispatcher(1, settings.resolved_builds_dir()))
        made.append(jobs)
        jobs.start()
        return jobs

    yield make
    for jobs in made:
        jobs.stop()
        jobs.store.close()


def job_row(store: Store, job_id: str) -> Job:
    with store.session() as s:
        return s.get(Job, job_id)


def runs_of(store: Store, job_id: str) -> list[Run]:
    with store.session() as s:
        return list(s.scalars(select(Run).where(Run.job_id == job_id).order_by(Run.id)))


def wait_job(store: Store, job_id: str, timeout: float = 120,
             until: Callable[[Job], bool] | None = None) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job = job_row(store, job_id)
        if (until(job) if until else job.status in FINISHED):
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job.status}"
        time.sleep(0.1)


# ---- cancel ---------------------------------------------------------------------------------
# the functions of a job's phases, by where the runner finds them
TRACED = {"load_prompts": evalsvc.workloads, "tokenized": evalsvc.jobs.run,
          "ready_build": evalsvc.jobs.run, "expand": evalsvc.jobs.plan,
          "plan_run": evalsvc.jobs.record}


class Phases:
    """Records the runner's calls of each phase's function, and holds the ``nth`` call of one of
    them until ``release()`` (the real function runs then). ``entered`` is set when the runner
    got there; ``after`` lists the calls that began after the held one."""

    def __init__(self, monkeypatch, hold: str, nth: int) -> None:
        self.entered, self._open = threading.Event(), threading.Event()
        self.calls: list[str] = []
        self.after: list[str] = []
        for name, owner in TRACED.items():
            monkeypatch.setattr(owner, name, self._traced(name, getattr(owner, name), hold, nth))

    def _traced(self, name: str, real, hold: str, nth: int):
        def traced(*args, **kwargs):
            if threading.current_thread().name != "job-runner":
                return real(*args, **kwargs)  # submit validates with the same functions
            (self.after if self.entered.is_set() else self.calls).append(name)
            if name == hold and self.calls.count(name) == nth and not self.entered.is_set():
                self.entered.set()
                assert self._open.wait(60), "the held phase was never released"
            return real(*args, **kwargs)
        return traced

    def release(self) -> None:
        self._open.set()


PHASES = {  # where a job spends its time before its runs reach the engines
    "loading the workload": ("load_prompts", 1),
    "tokenizing": ("tokenized", 1),
    "preparing its build": ("ready_build", 1),
    "expanding its configs": ("expand", 1),
    "preparing its second build, a run planned": ("ready_build", 2),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_cancel_stops_a_job_in_every_phase(runner, fake_engine, monkeypatch, phase):
    """Cancelled before its runs reached the dispatcher: answered cancelling, it goes through no
    further phase and ends cancelled; no engine starts and the run it had planned is cancelled."""
    hold, nth = PHASES[phase]
    phases = Phases(monkeypatch, hold, nth)
    jobs = runner()
    job_id = jobs.submit(JobCreate(matrix=MATRIX, builds=[{}, {}]))
    assert phases.entered.wait(60), f"the job never got to {phase}"
    assert jobs.cancel(job_id) == "cancelling"
    phases.release()
    job = wait_job(jobs.store, job_id)
    assert (job.status, job.error) == ("cancelled", None)
    assert phases.after == [], f"phases after the cancel: {phases.after}"
    runs = runs_of(jobs.store, job_id)
    assert all(r.status == "cancelled" for r in runs), [(r.id, r.status) for r in runs]
    assert len(runs) == phases.calls.count("plan_run")
    assert not fake_engine.exists(), "an engine started for a cancelled job"
    # the runner goes on with the next job
    assert wait_job(jobs.store, jobs.submit(JobCreate(matrix=MATRIX))).status == "done"


def test_a_job_answered_cancelled_never_starts(runner, fake_engine):
    """Rounds of 50 concurrent submit-then-cancel on SQLite against a real runner: a job answered
    cancelled never starts a run; one answered cancelling ends cancelled."""
    jobs = runner()

    def submit_then_cancel(_: int) -> tuple[str, str | None]:
        job_id = jobs.submit(JobCreate(matrix=MATRIX))
        return job_id, jobs.cancel(job_id)

    answers: dict[str, str | None] = {}
    for _ in range(8):  # unfixed, about one job in 200 was answered cancelled and then ran
        with ThreadPoolExecutor(50) as pool:
            answers.update(pool.map(submit_then_cancel, range(50)))
    assert set(answers.values()) <= {"cancelled", "cancelling"}, answers
    for job_id, answer in answers.items():
        job = wait_job(jobs.store, job_id, timeout=60)
        assert job.status == "cancelled", (job_id, answer, job.status)
        if answer == "cancelled":
            assert job.started_at is None and job.attempts == 0, job_id
            assert runs_of(jobs.store, job_id) == [], job_id
    assert not fake_engine.exists(), "an engine started for a cancelled job"


# a matrix of 256 configs (the most one job may run): its runs are planned in one transaction
PLANNED = {**MATRIX, "include": [], "axes": {"chunked_prefill": list(range(64, 64 + 256))}}


def cancel_in_thread(jobs: JobService, job_id: str) -> tuple[threading.Thread, dict]:
    """``jobs.cancel(job_id)`` in a thread of its own: its answer (or error) and when it came."""
    out: dict = {}

    def cancel() -> None:
        try:
            out["status"] = jobs.cancel(job_id)
        except Exception as exc:  # noqa: BLE001 - the test names it
            out["error"] = exc
        out["at"] = time.monotonic()

    thread = threading.Thread(target=cancel, daemon=True)
    thread.start()
    return thread, out


def test_a_cancel_while_the_runs_are_planned_answers_at_once(runner, fake_engine, monkeypatch,
                                                             db_url):
    """A cancel that comes while the runner is inside the transaction planning the job's runs (a
    run written: SQLite's write lock held) is answered within a second of the runner going on,
    the planning stops, and the job ends cancelled with no run executed. Unfixed on SQLite, the
    cancel held the service's lock while it waited for the store, and the runner waited for that
    lock inside its transaction: the cancel failed after 30 s and the job ran."""
    phases = Phases(monkeypatch, "plan_run", 2)
    jobs = runner(db_url)
    job_id = jobs.submit(JobCreate(matrix=PLANNED))
    assert phases.entered.wait(60), "the job never got to planning its runs"
    thread, answer = cancel_in_thread(jobs, job_id)
    time.sleep(0.5)  # the cancel is waiting for the store (SQLite) or answered (PostgreSQL)
    released = time.monotonic()
    phases.release()
    thread.join(10)
    assert not thread.is_alive(), "the cancel did not answer within 10 s"
    assert "error" not in answer, answer
    assert answer["status"] in ("cancelling", "cancelled"), answer
    assert answer["at"] - released < 1.0, f"answered {answer['at'] - released:.2f} s later"
    job = wait_job(jobs.store, job_id, timeout=60)
    assert (job.status, job.error) == ("cancelled", None)
    assert phases.after.count("plan_run") <= 1, "the planning went on after the cancel"
    runs = runs_of(jobs.store, job_id)
    assert all(r.status == "cancelled" for r in runs), [(r.id, r.status) for r in runs]
    assert not fake_engine.exists(), "an engine started for a cancelled job"


def test_a_cancel_right_after_submitting_a_large_job_answers_at_once(runner, fake_engine,
                                                                     db_url):
    """The race as a client meets it: a job of 256 configs submitted, then cancelled at once
    (wherever its runner is: taking it up, tokenizing, planning). The cancel answers within a
    second and the job ends cancelled without running anything."""
    jobs = runner(db_url)
    for _ in range(3):
        job_id = jobs.submit(JobCreate(matrix=PLANNED))
        time.sleep(0.05)  # the runner takes it up
        asked = time.monotonic()
        assert jobs.cancel(job_id) in ("cancelled", "cancelling")
        assert time.monotonic() - asked < 1.0, f"answered {time.monotonic() - asked:.2f} s later"
        job = wait_job(jobs.store, job_id, timeout=60)
        assert (job.status, job.error) == ("cancelled", None)
        assert all(r.status == "cancelled" for r in runs_of(jobs.store, job_id))
    assert not fake_engine.exists(), "an engine started for a cancelled job"


def test_a_cancel_asked_before_the_service_died_is_kept(runner, monkeypatch):
    """A job answered cancelling when its service died (its runner never got to act on it): the
    next service ends it cancelled instead of running it again."""
    phases = Phases(monkeypatch, "tokenized", 1)
    first = runner()
    job_id = first.submit(JobCreate(matrix=MATRIX))
    assert phases.entered.wait(60)
    assert first.cancel(job_id) == "cancelling"
    first._release_lock()  # the service is gone as far as the store can tell: its lock dropped
    second = runner()
    job = job_row(second.store, job_id)
    assert job.status == "cancelled" and job.finished_at is not None
    phases.release()  # the dead service's runner never writes over it
    first.stop()
    assert job_row(second.store, job_id).status == "cancelled"


# ---- a job that takes the service down ------------------------------------------------------
def test_recovery_leaves_jobs_evalsvc_run_records_alone(tmp_path, runner):
    """``evalsvc run`` records its job as running until all its runs are in: a service starting
    meanwhile neither requeues nor runs it, and it cannot be cancelled there."""
    settings = settings_for(tmp_path)
    store = Store(settings.resolved_database_url())
    try:
        with store.session() as s:
            ensure_job(s, "cli-recording", "cli", {"matrix_name": "fake", "matrix": MATRIX,
                                                   "engine": "sglang", "builds": [{}],
                                                   "configs": None})
    finally:
        store.close()
    jobs = runner()
    time.sleep(1.5)  # a runner polls each second
    job = job_row(jobs.store, "cli-recording")
    assert (job.status, job.attempts, job.error) == ("running", 0, None)
    assert jobs.cancel("cli-recording") == "running"


# ---- a second service -----------------------------------------------------------------------
# the fake server takes this long to start: its run is out, its engine up, while the test acts
SLOW_ENGINE = {"EVALSVC_ENGINE_PYTHON": FAKE_PYTHON, "FAKE_SGLANG_PYTHON": sys.executable,
               "FAKE_SGLANG_MODE": "slow_start", "FAKE_SGLANG_START_SECONDS": "60"}


def store_engine(url: str, engines: list[Engine]) -> Engine:
    engine = create_engine(url, poolclass=NullPool)
    engines.append(engine)
    return engine


def wait_engine_up(engine: Engine, job_id: str, timeout: float = 120) -> int:
    """The job's running run has its engine's process group on its row: the pid."""
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            pid = conn.scalar(select(Run.engine_pid).where(Run.job_id == job_id,
                                                           Run.status == "running"))
        if pid and exists(pid):
            return pid
        assert time.monotonic() < deadline, f"no engine came up for job {job_id}"
        time.sleep(0.2)


def rows(engine: Engine) -> tuple[list, list]:
    with engine.connect() as conn:
        jobs = conn.execute(select(Job.id, Job.status, Job.attempts, Job.started_at,
                                   Job.finished_at, Job.error).order_by(Job.id)).all()
        runs = conn.execute(select(Run.id, Run.status, Run.engine_pid, Run.verdict,
                                   Run.finished_at).order_by(Run.id)).all()
    return jobs, runs


def serve(env: dict[str, str], port: int, timeout: float = 90) -> tuple[int, str]:
    """``evalsvc serve --port PORT`` to its end: exit status and output (killed at the timeout:
    a second service that came up)."""
    proc = subprocess.Popen([sys.executable, "-m", "evalsvc.cli", "serve", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"a second service on port {port} kept running:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.slow
def test_a_second_service_exits_and_changes_nothing(service_factory, db_url, engines, tmp_path):
    """While a service runs a job: another on its port, then another on its store, exit non-zero
    naming the port, then the store, and leave its engine and every row as they were.
    ``evalsvc run`` records into the same store meanwhile."""
    service = service_factory(db_url, **SLOW_ENGINE).start()
    job_id = service.submit({"matrix": MATRIX})
    db = store_engine(db_url, engines)
    pid = wait_engine_up(db, job_id)
    before = rows(db)

    port = service.client.base_url.port
    code, out = serve(service.env, port)
    assert rows(db) == before and exists(pid), out
    assert code != 0 and f"--port {port}" in out and "in use" in out, out
    code, out = serve(service.env, free_port())
    assert rows(db) == before and exists(pid), out
    assert code != 0, out
    assert "is in use by another evalsvc service" in out, out
    assert make_url(db_url).database in out, out
    assert service.client.get("/healthz").status_code == 200

    matrix_file = tmp_path / "fake.yaml"
    matrix_file.write_text(yaml.safe_dump(MATRIX))
    env = {"EVALSVC_DATABASE_URL": db_url, "EVALSVC_DATA_DIR": str(tmp_path / "cli-data"),
           "FAKE_SGLANG_PYTHON": sys.executable, "FAKE_SGLANG_MODE": "ok"}
    res = CliRunner().invoke(cli, ["run", str(matrix_file), "--engine", "sglang",
                                   "--engine-python", FAKE_PYTHON, "--out", str(tmp_path / "out")],
                             env=env)
    assert res.exit_code == 0, res.output
    jobs, _ = rows(db)
    cli_jobs = [j for j in jobs if j.id.startswith("cli-")]
    assert [j.status for j in cli_jobs] == ["done"]
    assert [j for j in jobs if j.id == job_id] == [j for j in before[0] if j.id == job_id]
    assert exists(pid)


@pytest.mark.slow
def test_a_job_that_takes_the_service_down_is_failed_after_max_attempts(service_factory,
                                                                        tmp_path, engines):
    """A service killed while running a job, again and again (as a job that runs it out of
    memory would): after EVALSVC_RUNNER_MAX_ATTEMPTS times the next start fails the job, saying
    so. A clean stop does not count."""
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    service = service_factory(url, EVALSVC_RUNNER_MAX_ATTEMPTS="2", **SLOW_ENGINE).start()
    job_id = service.submit({"matrix": MATRIX})
    db = store_engine(url, engines)
    wait_engine_up(db, job_id)
    service.stop()  # a clean stop: the job stays for the next start, uncounted
    [job], _ = rows(db)
    assert (job.status, job.attempts) == ("running", 0)
    for attempt in (1, 2):
        service.start()
        pid = wait_engine_up(db, job_id)
        [job], _ = rows(db)
        assert (job.status, job.attempts) == ("running", attempt)
        service.kill()
    service.start()
    assert not exists(pid), "the start-up left the killed service's engine running"
    [job], [run] = rows(db)
    assert job.status == "failed" and job.finished_at is not None, job
    assert "2 times" in job.error and "EVALSVC_RUNNER_MAX_ATTEMPTS=2" in job.error, job.error
    assert run.status == "cancelled" and run.engine_pid is None
    assert service.job(job_id)["status"] == "failed"
    time.sleep(1.5)  # the runner does not take it up again
    assert rows(db)[0] == [job]


# ---- runs that error -------------------------------------------------------------------------
def test_a_job_whose_runs_all_errored_is_failed_and_one_with_some_is_done(runner, monkeypatch):
    """The engines of no_buffer configs die at start: a job of that config alone fails, naming
    its run and the reason; a job with it and a config that serves is done, one run errored."""
    monkeypatch.setenv("FAKE_SGLANG_MODE", "die_at_start")
    monkeypatch.setenv("FAKE_SGLANG_WHEN", "mamba_radix_cache_strategy=no_buffer")
    jobs = runner()
    dies = {**MATRIX, "include": [{"strategy": "no_buffer", "overlap": True}]}
    both = {**MATRIX, "include": [*MATRIX["include"], *dies["include"]]}
    alone = wait_job(jobs.store, jobs.submit(JobCreate(matrix=dies)))
    [run] = runs_of(jobs.store, alone.id)
    assert (run.status, run.verdict) == ("done", "error")
    assert alone.status == "failed", alone.error
    assert alone.error.startswith(f"every run errored (1 of 1): run {run.id} ({run.config}): ")
    assert "die_at_start" in alone.error  # the engine's own words, from the run's reason
    mixed = wait_job(jobs.store, jobs.submit(JobCreate(matrix=both)))
    assert (mixed.status, mixed.error) == ("done", None)
    assert sorted(r.verdict for r in runs_of(jobs.store, mixed.id)) == ["error", "pass"]
    assert jobs.counters.outcomes == {"failed": 1, "done": 1}


# ---- writes that fail ------------------------------------------------------------------------
def test_samples_that_cannot_be_written_fail_the_run_and_the_runner_goes_on(tmp_path, runner):
    """A file where the results directory should be: the run fails naming the path and the error,
    the job fails naming the run, and the next job runs once the directory can be made."""
    jobs = runner()
    results = jobs.settings.results_dir()
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("not a directory")
    job_id = jobs.submit(JobCreate(matrix=MATRIX))
    job = wait_job(jobs.store, job_id)
    [run] = runs_of(jobs.store, job_id)
    assert (run.status, run.verdict) == ("done", "error")
    assert str(results / job_id / f"{run.id}.parquet") in run.reason
    assert "NotADirectoryError" in run.reason
    assert job.status == "failed" and f"run {run.id}: " in job.error and str(results) in job.error
    assert jobs.runner_problem() is None
    results.unlink()
    job = wait_job(jobs.store, jobs.submit(JobCreate(matrix=MATRIX)))
    assert job.status == "done"
    [run] = runs_of(jobs.store, job.id)
    assert run.verdict == "pass" and Path(run.samples_path).is_file()


def test_a_run_the_store_cannot_take_fails_and_the_runner_goes_on(tmp_path, runner, monkeypatch,
                                                                  fake_engine):
    """Another process holds the SQLite store's write lock while a run is out: recording the run
    fails, the job's end is written once the store takes writes again (the job failed, naming
    the error; its run an error), and the runner takes up the next job."""
    monkeypatch.setenv("FAKE_SGLANG_MODE", "slow_start")  # time to lock the store while it starts
    monkeypatch.setenv("FAKE_SGLANG_START_SECONDS", "3")
    jobs = runner()
    job_id = jobs.submit(JobCreate(matrix=MATRIX))
    wait_job(jobs.store, job_id, until=lambda j: any(r.engine_pid  # its engine is starting
                                                      for r in runs_of(jobs.store, job_id)))

    def impatient(conn, _record) -> None:  # "database is locked" at once, not after 30 s
        conn.execute("PRAGMA busy_timeout=100")

    event.listen(jobs.store.engine, "connect", impatient)
    jobs.store.engine.dispose()
    holder = sqlite3.connect(make_url(jobs.store.url).database, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        deadline = time.monotonic() + 60
        while not fake_engine.exists() or any(
                exists(int(pid)) for pid in fake_engine.read_text().split()):
            assert time.monotonic() < deadline, "the run's engine did not come and go"
            time.sleep(0.1)
        time.sleep(2.5)  # the runner meets the locked store a few times
        assert jobs._thread.is_alive()
        assert "database is locked" in jobs.runner_problem()  # what /healthz says
        assert job_row(jobs.store, job_id).status == "running"
    finally:
        holder.rollback()
        holder.close()
    event.remove(jobs.store.engine, "connect", impatient)
    job = wait_job(jobs.store, job_id, timeout=60)
    assert job.status == "failed" and "database is locked" in job.error, job.error
    [run] = runs_of(jobs.store, job_id)
    assert (run.status, run.verdict, run.engine_pid) == ("done", "error", None)
    assert "could not be recorded" in run.reason
    assert wait_job(jobs.store, jobs.submit(JobCreate(matrix=MATRIX))).status == "done"
    assert jobs.runner_problem() is None


def test_the_store_unreachable_is_a_503_and_the_runner_goes_on(request, tmp_path, fake_engine,
                                                               engines, postgres_admin):
    """PostgreSQL refuses the service's connections for a while: /healthz and POST answer 503
    naming the store, the runner thread lives through it, and once the store is back a job
    submitted runs."""
    from tests.conftest import database

    with database(request, "postgresql", tmp_path, engines) as url:
        name = make_url(url).database
        app = create_app(settings_for(tmp_path, url))
        with TestClient(app, raise_server_exceptions=False) as client:
            assert client.get("/healthz").status_code == 200
            with postgres_admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
                conn.execute(text(  # all but the service's lock: its store is gone, not its lock
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n "
                    "AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory')"),
                    {"n": name})
            try:
                resp = client.get("/healthz")
                assert resp.status_code == 503, resp.text
                assert "the store" in resp.json()["detail"] and name in resp.json()["detail"]
                resp = client.post("/api/v1/jobs", json={"matrix": MATRIX})
                assert resp.status_code == 503, resp.text
                assert "the store cannot be used now" in resp.json()["detail"], resp.text
                time.sleep(2.5)  # the runner meets the refusals
                assert app.state.services.jobs._thread.is_alive()
            finally:
                with postgres_admin.connect() as conn:
                    conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            deadline = time.monotonic() + 30
            while client.get("/healthz").status_code != 200:
                assert time.monotonic() < deadline, "the service did not recover"
                time.sleep(0.2)
            resp = client.post("/api/v1/jobs", json={"matrix": MATRIX})
            assert resp.status_code == 201, resp.text
            job_id = resp.json()["id"]
            deadline = time.monotonic() + 120
            while (job := client.get(f"/api/v1/jobs/{job_id}").json())["status"] not in FINISHED:
                assert time.monotonic() < deadline, job
                time.sleep(0.2)
            assert job["status"] == "done", job
            with client.app.state.services.store.session() as s:
                assert s.scalar(select(func.count()).select_from(Job)) == 1  # nothing half-stored


def test_healthz_is_503_when_the_runner_thread_is_dead(tmp_path, fake_engine):
    with TestClient(create_app(settings_for(tmp_path))) as client:
        assert client.get("/healthz").status_code == 200
        jobs = client.app.state.services.jobs
        jobs._stop.set()
        jobs._wake.set()
        jobs._thread.join(30)
        resp = client.get("/healthz")
        assert resp.status_code == 503
        assert "job runner" in resp.json()["detail"]
