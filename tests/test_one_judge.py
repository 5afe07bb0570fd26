"""One judge (``judging.judge_run``): the only code that judges metrics, run once per run where it
is recorded (``jobs.record.record_result``) or where nothing is stored (``jobs.run.run_job``), and
behind a two-build job's stored comparison. Its source is scanned for who judges; and with the
judge patched, every verdict that reaches a reader changes: the stored run, scenario and metric
verdicts, the verdicts ``evalsvc run`` prints and exits with (recorded or not), and the stored
comparison, which the API serves without judging again."""

from __future__ import annotations

import ast
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rich.console import Console
from sqlalchemy import select

import evalsvc
from evalsvc import evaluate as evaluate_mod
from evalsvc import judging
from evalsvc.app import create_app
from evalsvc.cli import run_outcome
from evalsvc.engines.base import EngineSpec
from evalsvc.jobs import run as job_run
from evalsvc.jobs.record import end_job, plan_build_runs, record_result
from evalsvc.matrix import Config, load_matrix
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Job, Run, ScenarioRow, VerdictRow
from evalsvc.store.record import BuildRef, ensure_job
from evalsvc.types import RunResult
from tests.recorded import JobRecord
from tests.store.factories import build_ref, fingerprint_of, run_result

PACKAGE = Path(evalsvc.__file__).parent
PATCHED = "the patched judge"


def calls(name: str) -> dict[str, int]:
    """Per module of evalsvc/ (path relative to the package), the calls of a function ``name``
    (``name(...)`` or ``x.name(...)``)."""
    found: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        n = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call) and (
            (isinstance(node.func, ast.Name) and node.func.id == name)
            or (isinstance(node.func, ast.Attribute) and node.func.attr == name)))
        if n:
            found[str(path.relative_to(PACKAGE))] = n
    return found


def definitions(name: str) -> list[str]:
    return [str(path.relative_to(PACKAGE)) for path in sorted(PACKAGE.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.name == name]


def test_only_judging_judges_metrics_and_one_run_judge_is_called_where_runs_end():
    assert set(calls("judge_metric")) == {"judging.py"}
    assert set(calls("judge_scenario")) == {"judging.py"}
    assert definitions("judge_run") == ["judging.py"]
    # recorded (record_result), printed without a store or for a run that could not be recorded
    # (jobs/run.py's run_job), and a comparison (judge_comparison): the one judge each time
    assert set(calls("judge_run")) == {"judging.py", "jobs/record.py", "jobs/run.py"}
    assert calls("judge_run")["judging.py"] == 1  # judge_comparison's
    # nothing else decides a scenario's verdict: the harness measures
    harness = (PACKAGE / "harness.py").read_text()
    assert "judging" not in harness.split('"""', 2)[2].replace("``judging.judge_run``", "")


def patched_judge(result: RunResult, limits, history=None) -> list[judging.Judgement]:
    """A judge that says inconclusive for every scenario it would judge (and for the run)."""
    out = []
    for scen in result.scenarios:
        if scen.verdict in judging.JUDGED:
            scen.verdict, scen.reason = "inconclusive", PATCHED
            out.append(judging.Judgement(scen.scenario, "kl_k3_mean", "inconclusive",
                                         "threshold", value=scen.metrics.get("kl_k3_mean"),
                                         reason=PATCHED))
    if result.verdict not in judging.NOT_JUDGED:
        result.verdict, result.reason = "inconclusive", f"cold: {PATCHED}"
    return out


def measured(config: str, kls: dict[str, list[float]]) -> RunResult:
    """A run as the harness leaves it: every scenario measured, the run too."""
    result = run_result(config, kls)
    for scen in result.scenarios:
        scen.verdict, scen.reason = "measured", ""
    result.verdict, result.reason = "measured", ""
    return result


def config(name: str) -> Config:
    return Config(name=name, matrix="smoke", model="mamba2", settings={"strategy": "extra_buffer"},
                  args={"random_seed": 0}, fingerprint=fingerprint_of(name),
                  scenarios=("cold", "prefill_hit"))


@pytest.mark.parametrize("patch", [False, True])
def test_the_recorded_verdicts_are_the_judges(db_url, engines, tmp_path, monkeypatch, patch):
    """Recorded in ``evalsvc run``'s steps (``tests.recorded.JobRecord``): the stored run, scenario and
    metric verdicts, and the verdicts handed back to print and exit with, are the judge's."""
    if patch:
        monkeypatch.setattr(judging, "judge_run", patched_judge)
    store = Store(db_url)
    engines.append(store.engine)
    ref = BuildRef("sgl-project/sglang", sha="abc", committed_at=datetime(2026, 3, 1, tzinfo=UTC))
    record = JobRecord.start(store, tmp_path / "results", "cli-j", "cli", ref, load_matrix("smoke"),
                             [config("m-eb")], spec={"matrix_name": "smoke", "engine": "sglang"})
    result = measured("m-eb", {"cold": [1e-4] * 4, "prefill_hit": [8e-3] * 4})
    record.record(config("m-eb"), result)
    assert record.finish() == "done"
    want_scen = ({"cold": "inconclusive", "prefill_hit": "inconclusive"} if patch else
                 {"cold": "pass", "prefill_hit": "fail"})  # 5e-3 on SGLang
    want_run = "inconclusive" if patch else "fail"
    assert {s.scenario: s.verdict for s in result.scenarios} == want_scen
    assert result.verdict == want_run
    assert run_outcome([result], set())[0] == (0 if patch else 1)
    with store.session() as s:
        run = s.scalars(select(Run).where(Run.job_id == "cli-j")).one()
        assert run.verdict == want_run
        assert {r.scenario: r.verdict for r in s.scalars(
            select(ScenarioRow).where(ScenarioRow.run_id == run.id))} == want_scen
        reasons = {v.reason for v in s.scalars(select(VerdictRow).where(VerdictRow.run_id == run.id))}
        assert (reasons == {PATCHED}) == patch
        assert set(run.limits) == {"cold", "prefill_hit", "pooled"}  # stored when planned
        assert run.limits["prefill_hit"]["kl_k3_mean"]["max"] == 5e-3
    store.close()


@pytest.mark.parametrize("patch", [False, True])
def test_without_a_store_the_printed_verdicts_are_the_judges(tmp_path, monkeypatch, patch):
    """``evaluate`` with nothing stored (``evalsvc run --no-store``): the results it returns,
    its summary.json and the exit status come from the judge, with no history."""
    if patch:
        monkeypatch.setattr(judging, "judge_run", patched_judge)
    matrix = load_matrix("smoke")
    cfg = config("mamba2-eb")
    monkeypatch.setattr(job_run, "tokenized", lambda *a, **k: {cfg.model: []})
    monkeypatch.setattr(evaluate_mod, "run_config", lambda c, *a, **k: measured(
        c.name, {"cold": [1e-13] * 4, "prefill_hit": [1e-5] * 4}))
    [result] = evaluate_mod.evaluate(matrix, [cfg], [], EngineSpec(kind="embedded"),
                                     tmp_path / "out", Console(quiet=True))
    want = "inconclusive" if patch else "fail"  # 1e-5 above the embedded engine's 1e-8
    assert result.verdict == want
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {row["scenario"]: row["verdict"] for row in summary} == (
        {"cold": "inconclusive", "prefill_hit": "inconclusive"} if patch else
        {"cold": "pass", "prefill_hit": "fail"})
    assert run_outcome([result], set())[0] == (0 if patch else 1)


def two_build_job(store: Store, tmp_path: Path, job_id: str) -> None:
    """A job of two builds of one config, the contender's KL three times the baseline's on every
    sample, recorded and ended as the service does."""
    cfg = Config(name="mamba2-eb-ov-c64", matrix="smoke", model="hybrid-mamba2-tiny",
                 settings={"mtp": False}, args={"random_seed": 0},
                 fingerprint=fingerprint_of("mamba2-eb-ov-c64"), scenarios=("prefill_hit",))
    store.write(lambda s: ensure_job(s, job_id, "api", {"engine": "embedded"}))
    level = [1e-9 + 1e-10 * i for i in range(16)]  # under the embedded engine's 1e-8 thrice
    for ref, factor in ((build_ref("base"), 1.0), (build_ref("base", patches=["fix"]), 3.0)):
        [planned] = plan_build_runs(store, job_id, ref, load_matrix("smoke"), [cfg],
                                    engine="embedded")
        result = measured(cfg.name, {"prefill_hit": [v * factor for v in level]})
        assert record_result(store, tmp_path / "results", job_id, planned.run_id, result) is None
    store.write(lambda s: end_job(s, job_id, "done", None))


@pytest.mark.parametrize("patch", [False, True])
def test_a_two_build_jobs_comparison_is_judged_once_and_served_as_stored(tmp_path, monkeypatch,
                                                                        patch):
    url = f"sqlite:///{tmp_path / 'app.db'}"
    settings = Settings(data_dir=tmp_path / "data", database_url=url, nightly=False)
    with TestClient(create_app(settings, start_runner=False)) as client:
        if patch:
            monkeypatch.setattr(judging, "judge_run", patched_judge)
        store = Store(url)
        try:
            two_build_job(store, tmp_path, "two")
            with store.session() as s:
                [row] = s.get(Job, "two").comparison
        finally:
            store.close()
        if patch:
            assert (row["paired_verdict"], row["paired_reason"]) == ("inconclusive", PATCHED)
        else:  # under the limit on both builds, yet three times the KL on the same prompts
            assert row["paired_verdict"] == "regression", row["paired_reason"]

        def no_judging(*args, **kwargs):
            raise AssertionError("a GET judged")

        monkeypatch.setattr(judging, "judge_run", no_judging)
        job = client.get("/api/v1/jobs/two").json()
        assert job["comparison"] == [row]
