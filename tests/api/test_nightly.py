"""Nightly schedules: `evalsvc nightly --once` resolves each schedule's newest commit or version,
skips what a nightly job already covers, and submits a job with trigger nightly; the service
registers the enabled schedules on their crons; bad schedule files are refused naming the key."""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select
from typer.testing import CliRunner

from evalsvc.cli import app as cli
from evalsvc.dispatch.local import LocalDispatcher
from evalsvc.engines.base import EngineSpec
from evalsvc.jobs import JobService
from evalsvc.jobs.builds import ready_build
from evalsvc.nightly import NightlyError, NightlyScheduler, Schedule, fire, load_schedules
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Job, Run
from tests.builds.test_build import git

FAKE_PYTHON = str(Path(__file__).parents[1] / "data" / "fake-python")


@pytest.fixture
def tracked(tmp_path) -> Path:
    """A git repository standing in for SGLang's remote, branch main."""
    root = tmp_path / "remote"
    (root / "python" / "sglang").mkdir(parents=True)
    (root / "python" / "sglang" / "__init__.py").write_text("__version__ = '0.5.99'\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "first")
    return root


def write_schedules(path: Path, repo: Path) -> Path:
    path.write_text(yaml.safe_dump({"schedules": [
        {"name": "embedded", "cron": "30 1 * * *", "source": {"embedded": {}}, "matrix": "smoke",
         "patch_sets": [[], ["defect:snapshot-race"]]},
        {"name": "git-main", "cron": "0 2 * * *", "matrix": "mamba-full",
         "source": {"git": {"repository": str(repo), "branch": "main"}},
         "patch_sets": [[], ["pr37165-clear-deferred-mamba-metadata"]]},
        {"name": "off", "cron": "0 3 * * *", "enabled": False, "source": {"embedded": {}},
         "matrix": "smoke"},
    ]}))
    return path


@pytest.fixture
def env(tmp_path, tracked, monkeypatch) -> str:
    db = f"sqlite:///{tmp_path / 'nightly.db'}"
    monkeypatch.setenv("EVALSVC_DATABASE_URL", db)
    monkeypatch.setenv("EVALSVC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EVALSVC_ENGINE_PYTHON", FAKE_PYTHON)
    monkeypatch.setenv("EVALSVC_NIGHTLY_FILE", str(write_schedules(tmp_path / "n.yaml", tracked)))
    return db


def nightly_jobs(db: str) -> list[Job]:
    store = Store(db)
    try:
        with store.session() as s:
            jobs = s.scalars(select(Job).order_by(Job.created_at)).all()
            s.expunge_all()
            return list(jobs)
    finally:
        store.close()


def once(exit_code: int = 0) -> str:
    res = CliRunner().invoke(cli, ["nightly", "--once"])
    assert res.exit_code == exit_code, res.output
    return res.output


def test_once_submits_the_newest_and_skips_what_was_evaluated(env, tracked):
    out = once()
    assert "embedded: submitted job nightly-" in out and "git-main: submitted job nightly-" in out
    assert "off:" not in out
    jobs = nightly_jobs(env)
    assert [j.trigger for j in jobs] == ["nightly", "nightly"]
    by_key = {j.spec["nightly_key"].split(":", 1)[0]: j for j in jobs}
    head = git(tracked, "rev-parse", "HEAD")
    git_job = by_key["git-main"]
    assert [b["source"] for b in git_job.spec["builds"]] == [f"git:{tracked}@{head}"] * 2
    assert [b["patches"] for b in git_job.spec["builds"]] == [
        [], ["pr37165-clear-deferred-mamba-metadata"]]
    assert by_key["embedded"].spec["matrix_name"] == "smoke"
    assert all(j.status == "queued" for j in jobs)

    out = once()  # nothing new
    assert "embedded: newest already evaluated" in out and "git-main: newest already evaluated" in out
    assert len(nightly_jobs(env)) == 2

    (tracked / "python" / "sglang" / "new.py").write_text("x = 1\n")
    git(tracked, "add", "-A")
    git(tracked, "commit", "-qm", "second")
    out = once()  # a new commit on main: only the git schedule fires
    assert "git-main: submitted job" in out and "embedded: newest already evaluated" in out
    jobs = nightly_jobs(env)
    assert len(jobs) == 3
    assert jobs[-1].spec["builds"][0]["source"] == f"git:{tracked}@{git(tracked, 'rev-parse', 'HEAD')}"


def test_nightly_runs_go_where_the_settings_send_them(env, monkeypatch):
    """With EVALSVC_RAY_ADDRESS set, --once alone submits without touching the cluster, and
    --wait runs the jobs on it: without the ray extra that is an error naming it, and the jobs
    stay queued for the service."""
    monkeypatch.setenv("EVALSVC_RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the ray extra were not installed
    res = CliRunner().invoke(cli, ["nightly", "--once", "--wait", "--schedule", "embedded"])
    assert res.exit_code == 2, res.output
    assert "embedded: submitted job" in res.output
    assert "EVALSVC_RAY_ADDRESS is set but ray is not installed" in res.output
    assert [j.status for j in nightly_jobs(env)] == ["queued"]
    assert "git-main: submitted job" in once()


def test_a_schedule_names_its_engine_environment(env, tracked, tmp_path, monkeypatch):
    monkeypatch.setenv("EVALSVC_ENGINE_ENVS", json.dumps({"other": FAKE_PYTHON}))
    monkeypatch.setenv("EVALSVC_DISCOVER_ENGINE_ENVS", "false")
    path = tmp_path / "envs.yaml"
    path.write_text(yaml.safe_dump({"schedules": [
        {"name": name, "cron": "0 2 * * *", "matrix": "mamba-full", "engine_env": engine_env,
         "source": {"git": {"repository": str(tracked), "branch": "main"}}}
        for name, engine_env in (("named", "other"), ("default", None), ("unknown", "nope"))]}))
    monkeypatch.setenv("EVALSVC_NIGHTLY_FILE", str(path))
    out = once(exit_code=4)  # the schedule that could not fire: the others were submitted
    assert "named: submitted job" in out and "default: submitted job" in out
    assert ("unknown: error: engine_env: unknown engine environment 'nope' (known: default, "
            "other)") in out
    by_key = {j.spec["nightly_key"].split(":", 1)[0]: j for j in nightly_jobs(env)}
    assert {k: j.spec["engine_env"] for k, j in by_key.items()} == {"named": "other",
                                                                    "default": "default"}


def test_a_failed_nightly_job_is_tried_again(env):
    once()
    store = Store(env)
    try:
        with store.session() as s:
            for job in s.scalars(select(Job)):
                job.status = "failed"
    finally:
        store.close()
    out = once()
    assert re.findall(r"^([\w-]+): submitted job", out, flags=re.M) == ["embedded", "git-main"]


def test_the_service_registers_the_enabled_schedules(env, tmp_path):
    settings = Settings()
    store = Store(settings.resolved_database_url())
    jobs = JobService(settings, store, LocalDispatcher(1, settings.resolved_builds_dir()))
    scheduler = NightlyScheduler.start(settings, jobs, store)
    try:
        registered = {j.id: j for j in scheduler.scheduler.get_jobs()}
        assert set(registered) == {"embedded", "git-main"}
        fire_at = registered["git-main"].next_run_time
        assert (fire_at.hour, fire_at.minute, fire_at.utcoffset().total_seconds()) == (2, 0, 0)
    finally:
        scheduler.stop()
        jobs.dispatcher.shutdown()
        store.close()


@pytest.mark.parametrize(("schedule", "named"), [
    ({"name": "x", "cron": "61 * * * *", "source": {"embedded": {}}, "matrix": "smoke"},
     "schedules[x].cron"),
    ({"name": "x", "cron": "0 1 * * *", "source": {}, "matrix": "smoke"}, "exactly one of"),
    ({"name": "x", "cron": "0 1 * * *", "source": {"embedded": {}}, "matrix": "smoke",
      "when": "later"}, "when"),
])
def test_bad_schedule_files_are_refused_naming_the_key(tmp_path, schedule, named):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"schedules": [schedule]}))
    with pytest.raises(NightlyError, match=r"bad\.yaml") as err:
        load_schedules(path)
    assert named in str(err.value)


def test_once_reports_a_schedule_it_cannot_resolve(env, tmp_path, monkeypatch):
    path = tmp_path / "gone.yaml"
    path.write_text(yaml.safe_dump({"schedules": [
        {"name": "gone", "cron": "0 2 * * *", "matrix": "mamba-full",
         "source": {"git": {"repository": str(tmp_path / "no-such-repo")}}}]}))
    monkeypatch.setenv("EVALSVC_NIGHTLY_FILE", str(path))
    res = CliRunner().invoke(cli, ["nightly", "--once"])
    assert res.exit_code == 4, res.output  # for cron and CI: a schedule that did not fire
    assert "gone: error:" in res.output and "no-such-repo" in res.output
    assert nightly_jobs(env) == []


@pytest.fixture
def settings_repo(tmp_path) -> Path:
    """A git repository carrying the embedded engine's settings file, branch main."""
    root = tmp_path / "engine-settings"
    root.mkdir()
    (root / "evalsvc-engine.yaml").write_text("defects:\n  snapshot-race: 1.0\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "snapshot-race on")
    return root


def embedded_git_schedule(repo: Path) -> Schedule:
    return Schedule.model_validate({
        "name": "embedded-git", "cron": "0 1 * * *", "matrix": "smoke",
        "source": {"git": {"repository": str(repo), "branch": "main"}},
        "patch_sets": [[], ["defect:host-load-race"]],
        "configs": ["mamba2-eb-ov-c64"], "workload": {"num_prompts": 4, "max_new_tokens": 8}})


def test_a_git_source_serves_an_embedded_matrix_with_configs_and_workload(env, settings_repo):
    settings = Settings()
    store = Store(settings.resolved_database_url())
    jobs = JobService(settings, store, LocalDispatcher(1, settings.resolved_builds_dir()))
    try:
        job_id = fire(embedded_git_schedule(settings_repo), jobs, store)
        assert job_id is not None
        with store.session() as s:
            spec = s.get(Job, job_id).spec
        head = git(settings_repo, "rev-parse", "HEAD")
        assert spec["engine"] == "embedded" and spec["matrix_name"] == "smoke"
        assert [b["source"] for b in spec["builds"]] == [f"git:{settings_repo}@{head}"] * 2
        assert [b["patches"] for b in spec["builds"]] == [[], ["defect:host-load-race"]]
        assert spec["configs"] == ["mamba2-eb-ov-c64"]
        assert spec["matrix"]["workload"]["num_prompts"] == 4
        assert spec["matrix"]["workload"]["max_new_tokens"] == 8
        # the builds the job will run: the commit's settings, then the patch on top
        envs, refs, _ = zip(*(ready_build(EngineSpec(kind="embedded"), b, None,
                                          settings.resolved_builds_dir())
                              for b in spec["builds"]), strict=True)
        assert [e.env for e in envs] == [{"EVALSVC_ENGINE_DEFECTS": "snapshot-race"},
                                         {"EVALSVC_ENGINE_DEFECTS": "snapshot-race,host-load-race"}]
        assert {r.sha for r in refs} == {head}
        assert fire(embedded_git_schedule(settings_repo), jobs, store) is None  # evaluated
    finally:
        jobs.dispatcher.shutdown()
        store.close()


@pytest.mark.slow
def test_a_nightly_embedded_git_job_runs_the_commits_settings(env, settings_repo, tmp_path):
    """End to end: the nightly job's engines run with the commit's defects, and its runs are
    recorded on the commit (full sha, committer date)."""
    settings = Settings()
    store = Store(settings.resolved_database_url())
    jobs = JobService(settings, store, LocalDispatcher(1, settings.resolved_builds_dir()))
    try:
        job_id = fire(embedded_git_schedule(settings_repo), jobs, store)
        jobs.start()
        deadline = time.monotonic() + 300
        while True:
            with store.session() as s:
                job = s.get(Job, job_id)
                if job.status not in ("queued", "running"):
                    break
            assert time.monotonic() < deadline, "the nightly job did not finish"
            time.sleep(0.5)
        assert (job.status, job.error) == ("done", None)
        head = git(settings_repo, "rev-parse", "HEAD")
        stamp = git(settings_repo, "show", "-s", "--format=%cI", "HEAD")
        with store.session() as s:
            runs = s.scalars(select(Run).where(Run.job_id == job_id).order_by(Run.id)).all()
            assert [r.status for r in runs] == ["done", "done"]
            for run in runs:
                commit = run.build.commit
                assert (commit.sha, commit.repository) == (head, str(settings_repo))
                assert commit.committed_at.replace(tzinfo=UTC) == datetime.fromisoformat(stamp)
            assert [r.build.patch_set for r in runs] == ["", "defect:host-load-race"]
        logs = sorted((settings.data_dir / "logs" / job_id).rglob("*.log"))
        assert len(logs) == 2
        assert "defects switched on: snapshot-race\n" in logs[0].read_text()
        assert "defects switched on: snapshot-race, host-load-race\n" in logs[1].read_text()
    finally:
        jobs.stop()
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("patches, exit_code", [([], 0), (["defect:snapshot-race"], 1)])
def test_once_wait_exits_with_what_its_runs_found(env, tmp_path, monkeypatch, patches, exit_code):
    """``--once --wait`` runs the jobs here and exits as ``evalsvc run`` does: 0 when every run
    passed, 1 when one failed its verdict (a defect switched on where it acts)."""
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump({"schedules": [
        {"name": "embedded", "cron": "30 1 * * *", "source": {"embedded": {}}, "matrix": "smoke",
         "patch_sets": [patches], "configs": ["mamba2-eb-ov-c64"],
         "workload": {"num_prompts": 4, "max_new_tokens": 8}}]}))
    monkeypatch.setenv("EVALSVC_NIGHTLY_FILE", str(path))
    res = CliRunner().invoke(cli, ["nightly", "--once", "--wait"])
    assert res.exit_code == exit_code, res.output
    verdict = "fail" if exit_code else "pass"
    assert re.search(rf"job nightly-\S+: done \(1 {verdict}\)", res.output), res.output
