"""Bisection: what it refuses (naming the field), and `evalsvc bisect` run here end to end."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select
from typer.testing import CliRunner

from evalsvc.bisect import BisectCreate, Bisector
from evalsvc.builds import engine_envs, sglang_env
from evalsvc.cli import app as cli
from evalsvc.dispatch.local import LocalDispatcher
from evalsvc.jobs import JobError, JobService
from evalsvc.matrix import expand, load_matrix
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Bisection, Job
from tests.builds.test_build import git

FAKE_PYTHON = str(Path(__file__).parent / "data" / "fake-python")


def make_repo(path: Path, defects: list[bool]) -> list[str]:
    """A repository whose i-th commit switches snapshot-race on when ``defects[i]``."""
    path.mkdir()
    shas = []

    def git(*args, day=0):
        when = f"2026-03-{day + 1:02d}T00:00:00Z"
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
                               *args], cwd=path, check=True, capture_output=True, text=True,
                              env={"GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when,
                                   "PATH": "/usr/bin:/bin"}).stdout.strip()

    git("init", "-q", "-b", "main")
    for i, on in enumerate(defects):
        (path / "evalsvc-engine.yaml").write_text(yaml.safe_dump(
            {"defects": {"snapshot-race": 1.0} if on else {}}))
        (path / "CHANGES").write_text(f"c{i}\n")
        git("add", "-A", day=i)
        git("commit", "-qm", f"c{i}", day=i)
        shas.append(git("rev-parse", "HEAD"))
    return shas


@pytest.fixture
def bisector(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALSVC_DATA_DIR", str(tmp_path / "data"))
    settings = Settings(data_dir=tmp_path / "data",
                        database_url=f"sqlite:///{tmp_path / 'b.db'}")
    store = Store(settings.resolved_database_url())
    jobs = JobService(settings, store, LocalDispatcher(1, settings.resolved_builds_dir()))
    yield Bisector(store, jobs)
    jobs.stop()
    store.close()


def test_bad_bisections_are_refused_naming_the_field(tmp_path, bisector):
    good, mid, bad = make_repo(tmp_path / "repo", [False, False, True])
    base = {"repository": str(tmp_path / "repo"), "good": good, "bad": bad,
            "config": "mamba2-eb-ov-c64", "scenario": "prefill_hit"}

    def refused(match, trusted=True, **change):
        with pytest.raises(JobError, match=match):
            bisector.submit(BisectCreate(**{**base, **change}), start=False, trusted=trusted)

    refused(r"builds\[0\].source: .* is not an allowed build source", trusted=False)
    refused(r"scenario: unknown 'warm'", scenario="warm")
    refused(r"config: 'nope' not in matrix smoke", config="nope")
    refused(r"scenario: config mamba2-eb-ov-c64 does not run 'host_tier'", scenario="host_tier")
    refused(r"metric: unknown 'speed'", metric="speed")
    refused(r"good: no commit 'f00dfeed'", good="f00dfeed")
    refused(r"good: .* is not an ancestor of bad", good=bad, bad=good)
    refused(r"bad: the same commit as good", bad=good)
    refused(r"repository: required", repository=None)
    refused(r"regression_id: no regression 7", regression_id=7)
    refused(r"engine_env: only for engine sglang", engine_env="default")
    with bisector.store.session() as s:  # nothing stored
        assert s.query(Bisection).count() == 0 and s.query(Job).count() == 0
    bisect_id = bisector.submit(BisectCreate(**base), start=False, trusted=True)
    with bisector.store.session() as s:
        assert s.get(Bisection, bisect_id).candidates == [mid, bad]


def test_the_steps_of_an_sglang_bisection_run_in_its_engine_environment(tmp_path, monkeypatch):
    """The bisection names its environment (else it takes the service's default when it is
    made), and every step's job runs there."""
    repo = tmp_path / "sglang"
    (repo / "python" / "sglang").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    shas = []
    for i in range(3):
        (repo / "python" / "sglang" / "__init__.py").write_text(f"__version__ = '0.5.9{i}'\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", f"c{i}")
        shas.append(git(repo, "rev-parse", "HEAD"))
    monkeypatch.setattr(engine_envs, "SGLANG_CPU_ENV", tmp_path / "no-sglang-cpu")
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(tmp_path / "no-sglang-envs"))
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'b.db'}",
                        engine_python=FAKE_PYTHON, engine_envs={"other": FAKE_PYTHON})
    store = Store(settings.resolved_database_url())
    bisector = Bisector(store, JobService(settings, store, None))
    config = expand(load_matrix("mamba-full"))[0].name
    base = {"repository": str(repo), "good": shas[0], "bad": shas[2], "matrix": "mamba-full",
            "config": config, "scenario": "prefill_hit"}
    try:
        for named, expected in (("other", "other"), (None, "default")):
            bisect_id = bisector.submit(BisectCreate(**base, engine_env=named), start=False,
                                        trusted=True)
            with store.session() as s:
                spec = dict(s.get(Bisection, bisect_id).spec)
            assert spec["engine_env"] == expected
            job_id = bisector._submit_step(bisect_id, spec, shas[1])
            with store.session() as s:
                assert s.get(Job, job_id).spec["engine_env"] == expected
        with pytest.raises(JobError, match=r"engine_env: unknown engine environment 'nope' "
                                           r"\(known: default, other\)"):
            bisector.submit(BisectCreate(**base, engine_env="nope"), start=False, trusted=True)
    finally:
        store.close()


def test_a_bisection_over_sglangs_releases_searches_the_releases_between(tmp_path,
                                                                         monkeypatch):
    """``repository: pypi:sglang``: the candidates are the index's releases after good up to bad,
    oldest first, and each step builds its release."""
    import evalsvc.bisect as bisect_module

    monkeypatch.setattr(bisect_module, "releases",
                        lambda package: ["0.5.23", "0.5.22", "0.5.21", "0.5.20.post1", "0.5.20"])
    monkeypatch.setattr(engine_envs, "SGLANG_CPU_ENV", tmp_path / "no-sglang-cpu")
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(tmp_path / "no-sglang-envs"))
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'b.db'}",
                        engine_python=FAKE_PYTHON)
    store = Store(settings.resolved_database_url())
    bisector = Bisector(store, JobService(settings, store, None))
    config = expand(load_matrix("mamba-full"))[0].name
    base = {"repository": "pypi:sglang", "good": "0.5.20", "bad": "0.5.22",
            "matrix": "mamba-full", "config": config, "scenario": "prefill_hit"}
    try:
        for change, match in (({"good": "0.5.99"}, r"good: no release '0.5.99' of sglang"),
                              ({"good": "0.5.22", "bad": "0.5.20"},
                               r"good: release 0.5.22 is not older than bad 0.5.20")):
            with pytest.raises(JobError, match=match):
                bisector.submit(BisectCreate(**{**base, **change}), start=False, trusted=True)
        bisect_id = bisector.submit(BisectCreate(**base), start=False, trusted=True)
        with store.session() as s:
            assert s.get(Bisection, bisect_id).candidates == ["0.5.20.post1", "0.5.21", "0.5.22"]
            spec = dict(s.get(Bisection, bisect_id).spec)
        job_id = bisector._submit_step(bisect_id, spec, "0.5.21")
        with store.session() as s:
            assert s.get(Job, job_id).spec["builds"][0]["source"] == "sglang==0.5.21"
    finally:
        store.close()


@pytest.mark.slow
def test_a_resumed_bisection_waits_for_the_step_it_had_submitted(tmp_path, bisector):
    """A restart in the middle of a step: the step's job is still queued, and the resumed
    bisection waits for it instead of running the commit twice."""
    good, mid, bad = make_repo(tmp_path / "repo", [False, True, True])
    bisect_id = bisector.submit(BisectCreate(
        repository=str(tmp_path / "repo"), good=good, bad=bad, config="mamba2-eb-ov-c64",
        scenario="prefill_hit", workload={"num_prompts": 4}), start=False, trusted=True)
    with bisector.store.session() as s:
        spec = dict(s.get(Bisection, bisect_id).spec)
    before_restart = bisector._submit_step(bisect_id, spec, bad)
    bisector.jobs.start()  # the restarted service's job runner, then its bisections
    assert bisector.run(bisect_id) == mid
    with bisector.store.session() as s:
        b = s.get(Bisection, bisect_id)
        jobs = [(j.id, j.spec["bisection_sha"]) for j in s.query(Job).order_by(Job.created_at)]
        assert b.steps[0]["job_id"] == before_restart and not b.steps[0]["reused"]
        assert [sha for _, sha in jobs] == [bad, mid] and b.runs_used == 2


@pytest.mark.slow
def test_evalsvc_bisect_finds_the_first_bad_commit_here(tmp_path, monkeypatch):
    shas = make_repo(tmp_path / "repo", [False, False, False, True, True])
    monkeypatch.setenv("EVALSVC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EVALSVC_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    out = CliRunner().invoke(cli, ["bisect", "--repo", str(tmp_path / "repo"), "--good", shas[0],
                                   "--bad", shas[-1], "--config", "mamba2-eb-ov-c64",
                                   "--scenario", "prefill_hit", "--num-prompts", "4"])
    assert out.exit_code == 0, out.output
    assert "bisection bisect-" in out.output and "4 candidate commits" in out.output
    runs = int(out.output.split(f"first bad commit: {shas[3]} (")[1].split(" run")[0])
    assert runs <= math.ceil(math.log2(4)) + 1
    assert out.output.count(" bad  ") + out.output.count(" good ") == runs


def test_evalsvc_bisect_dispatches_where_the_settings_say(tmp_path, monkeypatch):
    """EVALSVC_RAY_ADDRESS sends a local bisection's runs to Ray: without the ray extra that is
    an error naming it, before anything is stored."""
    shas = make_repo(tmp_path / "repo", [False, True])
    monkeypatch.setenv("EVALSVC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("EVALSVC_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")
    monkeypatch.setenv("EVALSVC_RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the ray extra were not installed
    out = CliRunner().invoke(cli, ["bisect", "--repo", str(tmp_path / "repo"), "--good", shas[0],
                                   "--bad", shas[-1], "--config", "mamba2-eb-ov-c64",
                                   "--scenario", "prefill_hit"])
    assert out.exit_code == 2, out.output
    assert "EVALSVC_RAY_ADDRESS is set but ray is not installed" in out.output
    assert not (tmp_path / "cli.db").exists()


def test_a_known_failure_is_bad_for_its_own_bisection_and_good_for_a_worse_one(tmp_path,
                                                                                 bisector):
    """A step's run that fails as a known failure does (scenario and metric ``expected``) is a
    bad commit when the bisection searches that known failure (or names no regression), and a
    good one when it searches the regression that went past it."""
    from evalsvc.bisect import BisectSpec
    from evalsvc.store.models import Regression, Run, ScenarioRow, VerdictRow
    from evalsvc.store.record import record_results
    from tests.store.factories import build_ref, job_spec, run_result

    spec = job_spec(engine="embedded")
    [run_id] = record_results(bisector.store, job_id="step", trigger="bisect", spec=spec,
                              build=build_ref("c1"), matrix="smoke",
                              results=[run_result("mamba2-eb-ov-c64", {"prefill_hit": [0.05] * 4})],
                              results_dir=tmp_path)
    with bisector.store.session() as s:
        run = s.get(Run, run_id)
        s.scalars(select(ScenarioRow).where(ScenarioRow.run_id == run_id)).one().verdict = "expected"
        s.add(VerdictRow(run_id=run_id, scenario="prefill_hit", metric="kl_k3_mean",
                      verdict="expected", method="threshold", value=0.05))
        regs = {}
        for triage in ("expected", None):
            reg = Regression(fingerprint=run.fingerprint, scenario="prefill_hit",
                             metric="kl_k3_mean", config=run.config, matrix="smoke",
                             state="open", first_run_id=run_id, last_run_id=run_id,
                             triage=triage)
            s.add(reg)
            s.flush()
            regs[triage] = reg.id

    def judged(regression_id, metric="kl_k3_mean"):
        step = BisectSpec(repository="r", good="a", bad="b", matrix="smoke",
                          config="mamba2-eb-ov-c64", scenario="prefill_hit", metric=metric,
                          regression_id=regression_id, candidates=["b"])
        return bisector._judge(step, run_id, "c1")[:2]

    assert judged(regs["expected"]) == (True, "expected")
    assert judged(None, metric=None) == (True, "expected")
    assert judged(regs[None]) == (False, "expected")
