"""Nightly schedules: `evalsvc nightly --once` resolves each schedule's newest commit or version,
skips what a nightly job already covers, and submits a job with trigger nightly; the service
registers the enabled schedules on their crons; bad schedule files are refused naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select
from typer.testing import CliRunner

from evalsvc.cli import app as cli
from evalsvc.dispatch.local import LocalDispatcher
from evalsvc.jobs import JobService
from evalsvc.nightly import NightlyError, NightlyScheduler, load_schedules
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Job
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


def once() -> str:
    res = CliRunner().invoke(cli, ["nightly", "--once"])
    assert res.exit_code == 0, res.output
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
    jobs = JobService(settings, store, LocalDispatcher(1))
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
    assert res.exit_code == 0
    assert "gone: error:" in res.output and "no-such-repo" in res.output
    assert nightly_jobs(env) == []
