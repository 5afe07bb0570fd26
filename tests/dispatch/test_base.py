"""The run as plain data, on whichever machine runs it: its SGLang build made there (from that
machine's builds cache, or built), checked to be the code the service recorded, and a build that
cannot be made there an error of that run alone."""

from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path

import pytest

from evalsvc.builds.build import BuildError, make_build, parse_source, resolve_commit
from evalsvc.dispatch.base import RunTask, build_request, engine_for, execute, prepare_build
from evalsvc.engines.base import EngineSpec
from evalsvc.harness import RunControl
from evalsvc.matrix import MatrixFile, expand
from tests.builds.test_build import git
from tests.processes import assert_gone

FAKE_PYTHON = str(Path(__file__).parents[1] / "data" / "fake-python")


def sglang_repository(root: Path) -> Path:
    """A git repository standing in for SGLang: its layout (python/sglang with srt/), branch main,
    one commit."""
    pkg = root / "python" / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.5.99'\n")
    (pkg / "srt" / "__init__.py").write_text("")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "first")
    return root


@pytest.fixture
def remote(tmp_path) -> Path:
    return sglang_repository(tmp_path / "remote")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Switches the builds cache, as if the code ran on another machine."""
    def use(name: str) -> Path:
        root = tmp_path / name / "builds"
        monkeypatch.setenv("EVALSVC_BUILDS_DIR", str(root))
        return root
    monkeypatch.setenv("FAKE_SGLANG_PYTHON", sys.executable)
    return use


def test_a_run_makes_its_build_where_it_runs(remote, machine):
    here = machine("service-side")
    info = prepare_build(f"git:{remote}@main", [], FAKE_PYTHON, here)
    manifest = info["manifest"]
    sha = git(remote, "rev-parse", "HEAD")
    request = build_request(info)
    # pinned to the commit: a branch that moves later cannot change what the runs execute
    assert request == {"source": f"git:{remote}@{sha}", "patches": [],
                       "package_hash": manifest["package_hash"]}
    assert manifest["base_env"]["executable"] == FAKE_PYTHON

    worker = machine("worker")  # an empty cache: the run builds it there
    spec = engine_for(EngineSpec(kind="sglang", python=FAKE_PYTHON), request, worker)
    site = spec.env["PYTHONPATH"].split(os.pathsep)[0]
    assert Path(site).is_relative_to(worker) and (Path(site) / "sglang" / "__init__.py").is_file()
    again = engine_for(EngineSpec(kind="sglang", python=FAKE_PYTHON), request, worker)
    assert again.env == spec.env  # found in that machine's cache


def test_other_code_than_recorded_is_refused(remote, machine):
    worker = machine("worker")
    request = build_request(prepare_build(f"git:{remote}@main", [], FAKE_PYTHON, worker))
    with pytest.raises(BuildError, match=r"other code \(package hash .*\) than the job recorded"):
        engine_for(EngineSpec(kind="sglang", python=FAKE_PYTHON),
                   {**request, "package_hash": "0" * 64}, worker)


def test_the_installed_sglang_is_checked_on_each_machine(machine):
    worker = machine("worker")
    assert prepare_build(None, [], FAKE_PYTHON, worker) == {"version": "0.5.23"}  # fake-site
    request = build_request({"version": "0.5.23"})
    spec = EngineSpec(kind="sglang", python=FAKE_PYTHON)
    assert engine_for(spec, request, worker) is spec
    with pytest.raises(BuildError, match=r"has sglang 0\.5\.23; the job's build is the installed "
                                         r"sglang 0\.5\.19"):
        engine_for(spec, {**request, "version": "0.5.19"}, worker)
    with pytest.raises(BuildError, match=r"has no sglang installed"):
        prepare_build(None, [], sys.executable, worker)


@pytest.mark.parametrize("python, message", [
    (None, r"this machine has no SGLang environment \(EVALSVC_ENGINE_PYTHON\)"),
    ("/nowhere/bin/python", r"the SGLang python /nowhere/bin/python is not on this machine"),
])
def test_a_machine_without_the_sglang_environment_says_so(machine, python, message):
    worker = machine("worker")
    with pytest.raises(BuildError, match=message):
        prepare_build("sglang==0.5.23", [], python, worker)
    with pytest.raises(BuildError, match=message):
        engine_for(EngineSpec(kind="sglang", python=python), {"source": None, "version": "0.5.23"},
                   worker)


def test_a_build_that_cannot_be_made_fails_that_run_alone(remote, machine, tmp_path):
    """execute: the run is an error naming the build, and no engine is started for it."""
    worker = machine("worker")
    matrix = MatrixFile.model_validate({
        "name": "fake", "engine": "sglang", "models": {"m": {"path": "/models/m"}},
        "include": [{"strategy": "extra_buffer", "overlap": True}], "scenarios": ["cold"]})
    config = expand(matrix, hardware="gpu")[0]
    task = RunTask.make("job-1", 7, matrix, config, EngineSpec(kind="sglang", python=FAKE_PYTHON),
                        [("p0", [1, 2, 3])], tmp_path / "logs",
                        build={"source": f"git:{remote}@{'f' * 40}", "patches": [],
                               "package_hash": "0" * 64})
    result = execute(task, builds_dir=worker)
    assert result.verdict == "error" and result.config == config.name
    assert result.reason.startswith("engine build: ") and "unknown commit" in result.reason
    assert result.command == [] and not (tmp_path / "logs").exists()


def test_a_full_sha_is_resolved_without_fetching(remote, machine):
    """A commit named by its full sha cannot move, so a mirror that has it is not fetched again
    (each run resolves its build's sha); a branch is fetched each time."""
    here = machine("service-side")
    first = git(remote, "rev-parse", "HEAD")
    mirror, sha = resolve_commit(parse_source(f"git:{remote}@{first}"), here)
    assert sha == first
    (remote / "python" / "sglang" / "more.py").write_text("x = 1\n")
    git(remote, "add", "-A")
    git(remote, "commit", "-qm", "second")
    second = git(remote, "rev-parse", "HEAD")
    assert resolve_commit(parse_source(f"git:{remote}@{first}"), here) == (mirror, first)
    assert git(mirror, "rev-parse", "main") == first  # not fetched
    assert resolve_commit(parse_source(f"git:{remote}@main"), here) == (mirror, second)
    # a full sha the mirror lacks is fetched
    (remote / "python" / "sglang" / "more.py").write_text("x = 2\n")
    git(remote, "commit", "-qam", "third")
    third = git(remote, "rev-parse", "HEAD")
    assert make_build(f"git:{remote}@{third}", root=here).manifest["commit"] == third


def test_a_run_carries_its_deadline(monkeypatch, tmp_path):
    """Decided where the run is planned: the matrix's run_timeout_s, else the service's setting."""
    body = {"name": "fake", "engine": "sglang", "models": {"m": {"path": "/models/m"}},
            "include": [{"strategy": "extra_buffer", "overlap": True}], "scenarios": ["cold"]}
    own = MatrixFile.model_validate({**body, "run_timeout_s": 90})
    plain = MatrixFile.model_validate(body)
    spec = EngineSpec(kind="sglang", python=FAKE_PYTHON)

    def make(matrix: MatrixFile, **kw) -> RunTask:
        return RunTask.make("job-1", 7, matrix, expand(matrix, hardware="gpu")[0], spec,
                            [("p0", [1, 2, 3])], tmp_path, **kw)

    monkeypatch.delenv("EVALSVC_RUN_TIMEOUT_S", raising=False)
    assert make(own, run_timeout_s=300).run_timeout_s == 90
    assert make(plain, run_timeout_s=300).run_timeout_s == 300
    assert make(plain).run_timeout_s == 1800
    monkeypatch.setenv("EVALSVC_RUN_TIMEOUT_S", "42")
    assert make(plain).run_timeout_s == 42
    with pytest.raises(ValueError, match="run_timeout_s"):
        MatrixFile.model_validate({**body, "run_timeout_s": 0})


def test_execute_ends_a_run_at_its_deadline(machine, tmp_path):
    """An engine that never becomes ready: the run is an error at its deadline, not after the
    engine's start-up timeout, and its process is gone."""
    machine("worker")
    matrix = MatrixFile.model_validate({
        "name": "fake", "engine": "sglang", "models": {"m": {"path": "/models/m"}},
        "include": [{"strategy": "extra_buffer", "overlap": True}], "scenarios": ["cold"]})
    spec = EngineSpec(kind="sglang", python=FAKE_PYTHON, startup_timeout=120, env={
        "FAKE_SGLANG_MODE": "slow_start", "FAKE_SGLANG_START_SECONDS": "120"})
    task = RunTask.make("job-1", 7, matrix, expand(matrix, hardware="gpu")[0], spec,
                        [("p0", [1, 2, 3])], tmp_path / "logs", run_timeout_s=3)
    pids = []
    events: queue.Queue = queue.Queue()
    control = RunControl(task.run_id, events)
    t0 = time.monotonic()
    result = execute(task, control)
    assert time.monotonic() - t0 < 3 + 15
    assert result.verdict == "error"
    assert result.reason == ("engine did not start: the run's deadline of 3 s (run_timeout_s) "
                             "passed: the engine did not start in time")
    while not events.empty():  # the engine's pid, handed up as a value
        event = events.get()
        assert (event.run_id, event.kind) == (7, "engine")
        pids.append(event.pid)
    assert pids
    assert_gone(pids)


def test_a_run_done_again_keeps_the_earlier_attempts_log(machine, tmp_path):
    """A run executed again (its service restarted meanwhile) writes its engine log where the
    first attempt did: the first attempt's log is kept beside it as ``.attempt-1``, a third
    attempt's predecessor as ``.attempt-2``."""
    machine("worker")
    matrix = MatrixFile.model_validate({
        "name": "fake", "engine": "sglang", "models": {"m": {"path": "/models/m"}},
        "include": [{"strategy": "extra_buffer", "overlap": True}], "scenarios": ["cold"]})
    spec = EngineSpec(kind="sglang", python=FAKE_PYTHON, env={
        "FAKE_SGLANG_MODE": "slow_start", "FAKE_SGLANG_START_SECONDS": "120"})
    task = RunTask.make("job-1", 7, matrix, expand(matrix, hardware="gpu")[0], spec,
                        [("p0", [1, 2, 3])], tmp_path / "logs", run_timeout_s=1)
    log_path = None
    for attempt in range(3):
        result = execute(task)
        assert result.verdict == "error"
        log_path = Path(result.log_path)
        assert log_path.is_file()
        log_path.write_text(f"attempt {attempt}\n" + log_path.read_text())
    assert sorted(p.name for p in log_path.parent.iterdir()) == [
        log_path.name, f"{log_path.name}.attempt-1", f"{log_path.name}.attempt-2"]
    assert log_path.read_text().startswith("attempt 2")
    for n in (1, 2):
        assert (log_path.parent / f"{log_path.name}.attempt-{n}").read_text().startswith(
            f"attempt {n - 1}")


def test_logs_brought_back_from_a_ray_worker_keep_the_earlier_attempts(tmp_path):
    """The Ray dispatcher writes a run's log brought back from its worker where the service
    keeps it: a log of an earlier attempt there is kept as ``.attempt-1``."""
    from types import SimpleNamespace

    from evalsvc.dispatch.ray_backend import RayDispatcher

    task = SimpleNamespace(log_dir=str(tmp_path / "logs"))
    for attempt in ("first", "second"):
        result = SimpleNamespace(log_path="/worker/tmp/run-7/m-eb.log")
        RayDispatcher._write_logs(None, task, result, {"/worker/tmp/run-7/m-eb.log":
                                                       attempt.encode()})
        assert result.log_path == str(tmp_path / "logs" / "m-eb.log")
    assert (tmp_path / "logs" / "m-eb.log").read_text() == "second"
    assert (tmp_path / "logs" / "m-eb.log.attempt-1").read_text() == "first"


def test_keep_earlier_moves_a_file_aside_to_the_first_free_attempt(tmp_path):
    from evalsvc.paths import keep_earlier

    log = tmp_path / "run.log"
    assert keep_earlier(log) is None
    for text in ("one", "two"):
        log.write_text(text)
        assert keep_earlier(log) is not None and not log.exists()
    assert (tmp_path / "run.log.attempt-1").read_text() == "one"
    assert (tmp_path / "run.log.attempt-2").read_text() == "two"


def test_a_task_travels_as_plain_data_and_comes_back_the_same(tmp_path):
    """``RunTask.to_wire`` (what the Ray dispatcher sends) is JSON, and ``from_wire`` reads back
    the same task: matrix, config and engine spec typed again."""
    import json

    from evalsvc.matrix import Config

    matrix = MatrixFile.model_validate({
        "name": "fake", "engine": "sglang", "models": {"m": {"path": "/models/m"}},
        "include": [{"strategy": "extra_buffer", "overlap": True}], "scenarios": ["cold"],
        "engine_env": {"SGLANG_USE_CPU_ENGINE": "1"}})
    spec = EngineSpec(kind="sglang", python=FAKE_PYTHON, env={"A": "1"}, env_name="env-1")
    task = RunTask.make("job-1", 7, matrix, expand(matrix, hardware="gpu")[0], spec,
                        [("p0", (1, 2, 3))], tmp_path / "logs", build={"source": None,
                                                                      "version": "0.5.9"},
                        run_timeout_s=60)
    wire = json.loads(json.dumps(task.to_wire()))
    back = RunTask.from_wire(wire)
    assert back == task
    assert isinstance(back.matrix, MatrixFile) and isinstance(back.config, Config)
    assert isinstance(back.engine, EngineSpec) and back.engine.env_name == "env-1"
    assert back.config.scenarios == ("cold",) and back.prompts == [("p0", [1, 2, 3])]
    assert back.run_timeout_s == 60 and back.outcome("error", "x").config == task.config.name
