"""Verdicts in the store: judged runs, regressions opened, extended, resolved and triaged, and
the alerts they make (one per job and kind)."""

from __future__ import annotations

import numpy as np
from sqlalchemy import select

from evalsvc.alerts import collect
from evalsvc.store.models import Alert, Regression, Run, ScenarioRow, Verdict
from evalsvc.store.record import record_results
from evalsvc.verdicts import judge_run, track
from tests.store.factories import build_ref, run_result


def record(store, tmp_path, job_id, sha, hours, kls, track_it=True):
    result = run_result("mamba2-eb-ov-c64", {"prefill_hit": kls})
    spec = {"matrix": {"name": "smoke", "engine": "embedded"}, "engine": "embedded",
            "track": track_it}
    [run_id] = record_results(store, job_id=job_id, trigger="nightly", spec=spec,
                              build=build_ref(sha, hours=hours), matrix="smoke", results=[result],
                              results_dir=tmp_path)
    with store.session() as s:
        verdicts = judge_run(s, run_id)
        run = s.get(Run, run_id)
        if track_it:
            track(s, run, verdicts)
        collect(s, job_id, "http://dash")
    return run_id


def verdict_of(store, run_id, metric="kl_k3_mean"):
    with store.session() as s:
        v = s.scalars(select(Verdict).where(Verdict.run_id == run_id,
                                            Verdict.metric == metric)).one()
        return v.verdict, v.method


def test_regressions_open_once_extend_and_resolve_with_one_alert_each(store, tmp_path):
    rng = np.random.default_rng(8)
    clean = [list(np.abs(rng.normal(1e-13, 2e-14, 8))) for _ in range(6)]
    ids = [record(store, tmp_path, f"n{i}", f"c{i}", i, clean[i]) for i in range(4)]
    assert [verdict_of(store, r) for r in ids] == [("pass", "threshold")] * 3 + [("pass", "history")]
    bad1 = record(store, tmp_path, "n4", "c4", 4, list(np.abs(rng.normal(5e-9, 1e-9, 8))))
    assert verdict_of(store, bad1) == ("regression", "history")
    with store.session() as s:  # the history regression fails the scenario and the run
        assert s.get(Run, bad1).verdict == "fail"
        assert s.scalars(select(ScenarioRow.verdict).where(ScenarioRow.run_id == bad1)).one() == "fail"
    bad2 = record(store, tmp_path, "n5", "c5", 5, [3e-8] * 8)
    assert verdict_of(store, bad2) == ("regression", "threshold")
    with store.session() as s:
        [reg] = s.scalars(select(Regression)).all()
        assert (reg.state, reg.first_run_id, reg.last_run_id, reg.runs_seen) == ("open", bad1, bad2, 2)
        assert reg.last_good_run_id == ids[-1]
    good = record(store, tmp_path, "n6", "c6", 6, clean[4])
    assert verdict_of(store, good) == ("pass", "history")  # flagged runs are not the baseline
    with store.session() as s:
        reg = s.scalars(select(Regression)).one()
        assert (reg.state, reg.resolved_run_id) == ("resolved", good)
        alerts = s.scalars(select(Alert).order_by(Alert.id)).all()
        assert [(a.job_id, a.kind) for a in alerts] == [("n4", "appeared"), ("n6", "resolved")]
        assert "mamba2-eb-ov-c64 / prefill_hit / KL at c4 (last good c3)" in alerts[0].payload["text"]
        assert "http://dash/runs/" in alerts[0].payload["text"]
        collect(s, "n4", None)  # again: nothing new
        assert len(s.scalars(select(Alert)).all()) == 2


def test_an_older_commit_evaluated_later_never_moves_a_regression(store, tmp_path):
    rng = np.random.default_rng(9)
    for i in range(3):
        record(store, tmp_path, f"n{i}", f"c{i}", i * 10, list(np.abs(rng.normal(1e-13, 2e-14, 8))))
    record(store, tmp_path, "n3", "c3", 30, [3e-8] * 8)
    # a bisection step on a commit between c2 and c3 that passes
    step = record(store, tmp_path, "b1", "c2b", 25, list(np.abs(rng.normal(1e-13, 2e-14, 8))))
    assert verdict_of(store, step)[0] == "pass"
    with store.session() as s:
        assert s.scalars(select(Regression.state)).one() == "open"


def test_expected_triage_makes_the_new_level_the_baseline(store, tmp_path):
    rng = np.random.default_rng(10)
    for i in range(3):
        record(store, tmp_path, f"n{i}", f"c{i}", i, list(np.abs(rng.normal(1e-13, 2e-14, 8))))
    level = lambda: list(np.abs(rng.normal(5e-9, 1e-10, 8)))  # noqa: E731
    first = record(store, tmp_path, "n3", "c3", 3, level())
    assert verdict_of(store, first)[0] == "regression"
    with store.session() as s:
        s.scalars(select(Regression)).one().triage = "expected"
    later = [record(store, tmp_path, f"n{i}", f"c{i}", i, level()) for i in range(4, 8)]
    assert [verdict_of(store, r)[0] for r in later] == ["pass"] * 4
    with store.session() as s:  # the new level passing closes it
        assert s.scalars(select(Regression.state)).one() == "resolved"
