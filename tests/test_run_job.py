"""``jobs.run.run_job``, the one orchestrator: a job's phases on a dispatcher (here one that answers
at once, no engine), and both the job service and ``evalsvc run`` going through it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evalsvc.cli import app
from evalsvc.engines.base import EngineSpec
from evalsvc.jobs import run as job_run
from evalsvc.jobs.builds import ReadyBuild
from evalsvc.jobs.run import JobCancelled, JobOutcome, RunOptions, run_job
from evalsvc.jobs.spec import BuildSpec, JobSpec
from evalsvc.matrix import load_matrix
from evalsvc.types import RunEvent

CONFIGS = ["mamba2-eb-ov-c64", "mamba2-nb-sync-c64"]


class Answering:
    """A dispatcher whose runs end at once with the verdict asked of each config (an exception
    for one to raise)."""

    slots = 1

    def __init__(self, verdicts: dict[str, object] | None = None) -> None:
        self.verdicts = verdicts or {}
        self.tasks: list = []
        self.cancelled: list[str] = []

    def submit(self, task, events=None) -> Future:
        self.tasks.append(task)
        if events is not None:
            events.put(RunEvent(task.run_id, "started"))
        fut: Future = Future()
        verdict = self.verdicts.get(task.config.name, "pass")
        if isinstance(verdict, Exception):
            fut.set_exception(verdict)
        else:
            fut.set_result(task.outcome(verdict, ""))
        return fut

    def cancel_job(self, job_id: str) -> None:
        self.cancelled.append(job_id)

    def prepare_build(self, *args, **kwargs):
        raise AssertionError("no build is made here")

    def shutdown(self) -> None:
        pass


def smoke_job() -> JobSpec:
    matrix = load_matrix("smoke")
    return JobSpec(matrix_name="smoke", matrix=matrix, engine="embedded", builds=[BuildSpec()],
                   configs=CONFIGS)


def options(tmp_path: Path, **kwargs) -> RunOptions:
    engine = EngineSpec(kind="embedded")
    return RunOptions(engine=engine, log_dir=tmp_path / "logs",
                      builds=[ReadyBuild(engine, None, None)], **kwargs)


def test_a_job_without_a_store_runs_its_configs_in_order(tmp_path):
    dispatcher = Answering({CONFIGS[1]: "fail"})
    ended: list[tuple[str, str, str | None]] = []
    outcome = run_job("cli-x", smoke_job(), dispatcher, None, options(
        tmp_path, per_build_logs=False,
        on_result=lambda p, r, failure: ended.append((p.config.name, r.verdict, failure))))
    assert (outcome.status, outcome.error, outcome.failures) == ("done", None, [])
    assert [r.config for r in outcome.results] == CONFIGS
    assert ended == [(CONFIGS[0], "pass", None), (CONFIGS[1], "fail", None)]
    assert [t.run_id for t in dispatcher.tasks] == [0, 1]
    assert {t.log_dir for t in dispatcher.tasks} == {str(tmp_path / "logs")}
    assert all(t.job_id == "cli-x" and len(t.prompts) == 8 for t in dispatcher.tasks)


def test_a_run_that_raises_fails_the_job_naming_it_and_the_others_go_on(tmp_path):
    dispatcher = Answering({CONFIGS[0]: RuntimeError("its start could not be written")})
    outcome = run_job("api-x", smoke_job(), dispatcher, None, options(tmp_path))
    assert outcome.status == "failed"
    assert outcome.error == "run 0: RuntimeError: its start could not be written"
    assert outcome.unrecorded == {CONFIGS[0]}
    assert [(r.config, r.verdict) for r in outcome.results] == [(CONFIGS[0], "error"),
                                                                (CONFIGS[1], "pass")]
    assert [t.log_dir for t in dispatcher.tasks] == [str(tmp_path / "logs" / "build-0")] * 2


def test_a_cancelled_job_hands_no_run_over(tmp_path):
    dispatcher = Answering()
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(JobCancelled):
        run_job("api-x", smoke_job(), dispatcher, None, options(tmp_path, cancelled=cancelled))
    assert dispatcher.tasks == []


class Holding(Answering):
    """A dispatcher whose runs report their start and their engine's pid (40000 + the run id) at
    once, and end when the test ends them (``end``)."""

    def __init__(self) -> None:
        super().__init__()
        self.futures: dict[int, Future] = {}

    def submit(self, task, events=None) -> Future:
        events.put(RunEvent(task.run_id, "started"))
        events.put(RunEvent(task.run_id, "engine", 40000 + task.run_id))
        self.futures[task.run_id] = Future()
        self.tasks.append(task)
        return self.futures[task.run_id]

    def end(self, n: int) -> None:
        task = self.tasks[n]
        self.futures[task.run_id].set_result(task.outcome("pass", ""))


def test_a_dispatchers_reports_are_stored_and_each_run_recorded_as_it_ends(tmp_path, monkeypatch):
    """The dispatcher tells the job of its runs by values on the job's queue, never a call into
    the job or the service: the service's job shows each run ``running`` with its engine's pid
    while it runs, and records a run as soon as it ends (the second before the first, here)."""
    from sqlalchemy import select

    from evalsvc.jobs import JobCreate, JobService
    from evalsvc.settings import Settings
    from evalsvc.store.db import Store
    from evalsvc.store.models import Run

    monkeypatch.delenv("EVALSVC_DATABASE_URL", raising=False)
    settings = Settings(data_dir=tmp_path / "service")
    store = Store(settings.resolved_database_url())
    dispatcher = Holding()

    def runs() -> list[tuple[str, int | None, str | None]]:
        with store.session() as s:
            return [(r.status, r.engine_pid, r.verdict)
                    for r in s.scalars(select(Run).where(Run.job_id == job_id).order_by(Run.id))]

    def until(want) -> None:
        deadline = time.monotonic() + 30
        while runs() != want():
            assert time.monotonic() < deadline, runs()
            time.sleep(0.05)

    try:
        service = JobService(settings, store, dispatcher)
        job_id = service.submit(JobCreate(matrix="smoke", configs=CONFIGS))
        ended: list = []
        runner = threading.Thread(target=lambda: ended.append(service._execute(job_id)))
        runner.start()
        until(lambda: [("running", 40000 + t.run_id, None) for t in dispatcher.tasks] or None)
        first = dispatcher.tasks[0].run_id
        dispatcher.end(1)
        until(lambda: [("running", 40000 + first, None), ("done", None, "pass")])
        dispatcher.end(0)
        runner.join(30)
        assert ended == [("done", None)]
        assert runs() == [("done", None, "pass"), ("done", None, "pass")]
    finally:
        store.close()


def test_a_dry_run_answers_the_command_lines_and_launches_nothing(tmp_path):
    outcome = run_job("cli-x", smoke_job(), None, None, options(tmp_path, dry_run=True))
    assert len(outcome.commands) == 2
    assert all("--model-path" in argv for argv in outcome.commands)


def test_the_service_and_evalsvc_run_go_through_run_job(tmp_path, monkeypatch):
    """The service's runner and ``evalsvc run`` (--no-store, and --dry-run) call the same
    ``run_job``, each with the job as a JobSpec."""
    from evalsvc.jobs import JobCreate, JobService
    from evalsvc.settings import Settings
    from evalsvc.store.db import Store

    calls: list[tuple[str, JobSpec, RunOptions]] = []

    def recorded(job_id, spec, dispatcher, store, opts):
        calls.append((job_id, spec, opts))
        return JobOutcome("done", commands=[["engine"]])

    monkeypatch.setattr(job_run, "run_job", recorded)
    monkeypatch.setattr("evalsvc.children.exit_on_sigterm", lambda: None)
    monkeypatch.setenv("EVALSVC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("EVALSVC_DATABASE_URL", raising=False)

    settings = Settings(data_dir=tmp_path / "service")
    store = Store(settings.resolved_database_url())
    try:
        service = JobService(settings, store, Answering())
        job_id = service.submit(JobCreate(matrix="smoke", configs=CONFIGS))
        assert service._execute(job_id) == ("done", None)
    finally:
        store.close()
    runner = CliRunner()
    res = runner.invoke(app, ["run", "smoke", "--no-store", "--out", str(tmp_path / "out"),
                              *(f"--config={c}" for c in CONFIGS)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", "smoke", "--dry-run", *(f"--config={c}" for c in CONFIGS)])
    assert res.exit_code == 0, res.output
    assert '["engine"]' in res.output

    assert calls[0][0] == job_id
    assert all(isinstance(spec, JobSpec) and spec.matrix_name == "smoke"
               and spec.configs == CONFIGS for _, spec, _ in calls)
    service_opts, cli_opts, dry_opts = (opts for _, _, opts in calls)
    # the service's builds made where its runs go, its cancel and shutdown seen as events
    assert service_opts.builds is None and not service_opts.dry_run
    assert service_opts.builds_dir == settings.resolved_builds_dir()
    assert service_opts.stopping is service._stop and service_opts.counters is service.counters
    assert not service_opts.cancelled.is_set()
    assert cli_opts.trigger == "cli" and cli_opts.per_model_errors and not cli_opts.dry_run
    assert dry_opts.dry_run


def test_a_stored_jobs_matrix_is_parsed_in_one_place():
    """A job's spec (its matrix with it) is parsed from the store by ``jobs.spec.stored_spec``
    alone: nothing else in evalsvc validates a ``JobSpec``, and a ``MatrixFile`` is validated
    only where a matrix file is read (``matrix.py``) or a client's matrix submitted
    (``jobs/spec.py``). The migrations are history and read old shapes as they were."""
    import ast

    import evalsvc

    package = Path(evalsvc.__file__).parent
    calls: dict[str, set[str]] = {"JobSpec": set(), "MatrixFile": set()}
    for path in package.rglob("*.py"):
        rel = str(path.relative_to(package))
        if rel.startswith("store/migrations/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("model_validate", "model_validate_json")
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in calls):
                calls[node.func.value.id].add(rel)
    assert calls == {"JobSpec": {"jobs/spec.py"}, "MatrixFile": {"matrix.py", "jobs/spec.py"}}
