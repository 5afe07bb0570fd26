"""Verdicts in the store: judged runs, regressions opened, extended, resolved and triaged, and
the alerts they make (one per job and kind)."""

from __future__ import annotations

import json

import numpy as np
from sqlalchemy import select

from evalsvc.alerts import collect
from evalsvc.store.models import Alert, Regression, Run, ScenarioRow, VerdictRow
from evalsvc.store.record import record_results
from evalsvc.verdicts import triage_regression
from tests.store.factories import build_ref, job_spec, record_judged, run_result


def record(store, tmp_path, job_id, sha, hours, kls, track_it=True):
    result = run_result("mamba2-eb-ov-c64", {"prefill_hit": kls})
    spec = job_spec(engine="embedded", track=track_it)
    run_id = record_judged(store, tmp_path, job_id=job_id, trigger="nightly", spec=spec,
                           build=build_ref(sha, hours=hours), matrix="smoke", result=result)
    with store.session() as s:  # judged and tracked (track_it) where it was recorded
        collect(s, job_id, "http://dash")
    return run_id


def verdict_of(store, run_id, metric="kl_k3_mean", scenario="prefill_hit"):
    with store.session() as s:
        v = s.scalars(select(VerdictRow).where(VerdictRow.run_id == run_id, VerdictRow.scenario == scenario,
                                            VerdictRow.metric == metric)).one()
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


def test_a_comparison_of_two_builds_is_judged_by_paired_samples(store, tmp_path):
    """Two builds of one job ran the same prompts and seeds: the comparison pairs their samples.
    A contender whose KL is three times the baseline's on every prompt is a regression although
    both stay under the fixed limit; one drawn like the baseline passes."""
    from evalsvc.store.queries import find_build
    from evalsvc.verdicts import compare_builds

    rng = np.random.default_rng(12)
    level = rng.uniform(1e-10, 3e-9, 16)  # under the embedded engine's limit of 1e-8
    spec = job_spec(engine="embedded")
    for sha, patches, kls in (("base", [], level), ("base", ["fix"], level * 3),
                              ("other", [], level * np.exp(rng.normal(0, 0.05, 16)))):
        record_results(store, job_id=f"job-{sha}-{len(patches)}", trigger="api", spec=spec,
                       build=build_ref(sha, patches=patches), matrix="smoke",
                       results=[run_result("mamba2-eb-ov-c64", {"prefill_hit": list(kls)})],
                       results_dir=tmp_path)
    with store.session() as s:
        base = find_build(s, "sgl-project/sglang@base").id
        worse = find_build(s, "sgl-project/sglang@base", "fix").id
        alike = find_build(s, "sgl-project/sglang@other").id
        [row] = compare_builds(s, base, worse)
        assert (row.paired_verdict, row.paired_test) == ("regression", "paired_t"), row
        assert "against" in row.paired_reason
        # the whole judgement, for a page to show the test's own statistic and interval
        paired = row.paired
        assert (paired.metric, paired.method, paired.verdict) == (
            "kl_k3_mean", "history", "regression")
        assert paired.evidence["scale"] == "log" and paired.evidence["confidence"] > 0.9
        low, high = paired.evidence["location_interval"]
        assert 0 < low < high and paired.diff_low < paired.evidence["diff"]
        json.dumps(row.model_dump(mode="json"), allow_nan=False)  # as the API sends it
        [same] = compare_builds(s, base, alike)
        assert same.paired_verdict == "pass"
        [improved] = compare_builds(s, worse, base)
        assert improved.paired_verdict == "improvement"
        [other] = compare_builds(s, base, worse, metric="hit_coverage")
        assert other.paired_verdict is None and other.paired is None


def test_scenarios_where_one_defect_acts_are_judged_together_too(store, tmp_path):
    """A rise in two hit scenarios, each too small for its own 12 samples to be clear, is clear
    over their 24 pooled: a ``pooled`` regression, and the run fails for it."""
    from evalsvc.thresholds import MetricLimits, RuleBody, ThresholdsFile

    rng = np.random.default_rng(31)
    level = {s: np.exp(rng.normal(np.log(1e-3), 1.0, 12)) for s in ("prefill_hit", "branching")}
    spec = job_spec(engine="sglang", track=True)
    limits = ThresholdsFile(defaults=RuleBody(kl_k3_mean=MetricLimits(relative_effect=0.5)))

    def run(sha, hours, factor):
        kls = {s: list(v * factor * np.exp(rng.normal(0, 0.8, 12))) for s, v in level.items()}
        return record_judged(store, tmp_path, job_id=f"job-{sha}", trigger="nightly", spec=spec,
                             build=build_ref(sha, hours=hours), matrix="gpu",
                             result=run_result("gdn-nb-sync-c64", kls), thresholds=limits)

    for i in range(5):
        run(f"base{i}", i, 1.0)
    worse = run("worse", 10, 1.5)
    with store.session() as s:
        got = {(v.scenario, v.metric): v for v in
               s.scalars(select(VerdictRow).where(VerdictRow.run_id == worse))}
        assert got[("prefill_hit", "kl_k3_mean")].verdict == "pass", got[("prefill_hit", "kl_k3_mean")].reason
        assert got[("branching", "kl_k3_mean")].verdict == "pass", got[("branching", "kl_k3_mean")].reason
        pooled = got[("pooled", "kl_k3_mean")]
        assert (pooled.verdict, pooled.method) == ("regression", "history"), pooled.reason
        assert pooled.evidence["scenarios"] == ["prefill_hit", "branching"]
        assert pooled.evidence["pairs"] == 24
        run_row = s.get(Run, worse)
        assert run_row.verdict == "fail" and run_row.reason.startswith("pooled: prefill_hit, branching")
        assert s.scalars(select(Regression.scenario)).all() == ["pooled"]


def test_a_run_judged_from_the_store_says_where_its_extend_fails(store, tmp_path):
    """The extend's verdict, judged where the run is recorded: its reason names the positions,
    read from the samples' extend logprobs; without them it keeps the plain reason."""
    result = run_result("mamba2-eb-ov-c64", {"prefill_hit": [1e-13] * 4})
    [scen] = result.scenarios
    for i, row in enumerate(scen.samples):
        n = 48 - 8 * i  # extends of 48, 40, 32, 24 tokens
        served = [-1.0] * n
        reference = [-1.0 - 1e-6] * n
        reference[0] = -4.0  # position 0 only, as a kernel that drops the conv state does
        row.update(extend_ids=list(range(100, 100 + n)), extend_logprobs=served,
                   extend_reference_logprobs=reference, extend_tokens=n,
                   extend_kl_k3_mean=0.1, extend_kl_k3_max=2.05)
    scen.metrics["extend_kl_k3_mean"] = 0.1
    spec = job_spec(engine="embedded")

    def judged(job_id: str) -> VerdictRow:
        run_id = record_judged(store, tmp_path, job_id=job_id, trigger="api", spec=spec,
                               build=build_ref("e1"), matrix="smoke", result=result)
        with store.session() as s:
            v = s.scalars(select(VerdictRow).where(VerdictRow.run_id == run_id,
                                                VerdictRow.metric == "extend_kl_k3_mean")).one()
            s.expunge(v)
            return v

    v = judged("ext")
    assert (v.verdict, v.method) == ("regression", "threshold")
    assert v.reason == ("extend KL (k3) 0.1 above the limit 1e-08 (k3 2.05 at extend position 0 "
                        "of 24-48; positions 1+ at 5e-13)")
    for row in scen.samples:  # a result whose extends' logprobs are not at hand
        row.update(extend_logprobs=None, extend_reference_logprobs=None)
    assert judged("ext-bare").reason == "extend KL (k3) 0.1 above the limit 1e-08"


# the embedded engine's planted defects in one config where two act, where they always act there
# (tests/oracles/detection.py WHERE): deferred-ops-dropped on its prefix hits (prefill_hit,
# chunked_hit), host-load-race on its host tier
KNOWN_CONFIG = "gdn-nb-sync-c64-hicache"
PR = "https://github.com/sgl-project/sglang/pull/29068"


def planted(defect: str) -> list[str]:
    """The scenarios of KNOWN_CONFIG where a planted defect always acts."""
    from tests.oracles.detection import WHERE

    return sorted(s for c, s in WHERE[defect]["must"] if c == KNOWN_CONFIG)


def test_a_known_failure_holds_across_commits_and_new_defects_still_open_regressions(
        store, tmp_path):
    """deferred-ops-dropped fails prefill_hit and chunked_hit past the fixed limit. Triaged
    expected with a link, it holds for three more commits: those scenarios are expected (not pass,
    not fail), the link in their reasons, nothing opens and nothing alerts. host-load-race planted
    beside it opens a regression of host_tier and alerts; the known failure rising past its level
    by more than the effect floor opens one too; the fix resolves them all."""

    rng = np.random.default_rng(41)
    hits = planted("deferred-ops-dropped")
    assert hits == ["chunked_hit", "prefill_hit"] and planted("host-load-race") == ["host_tier"]

    def kls(defects: set[str], bad: float = 0.05) -> dict[str, list[float]]:
        """Per scenario, the samples' KL: float32 rounding where no defect acts, past the
        embedded engine's limit (1e-8) where one does."""
        out = {s: list(np.abs(rng.normal(1e-13, 2e-14, 8)))
               for s in ("cold", "prefill_hit", "chunked_hit", "host_tier")}
        if "deferred-ops-dropped" in defects:
            out.update({s: list(bad * np.exp(rng.normal(0, 0.1, 8))) for s in hits})
        if "host-load-race" in defects:
            out["host_tier"] = list(0.03 * np.exp(rng.normal(0, 0.1, 8)))
        return out

    spec = job_spec(engine="embedded", track=True)

    def record_commit(i: int, defects: set[str], bad: float = 0.05) -> int:
        run_id = record_judged(store, tmp_path, job_id=f"n{i}", trigger="nightly", spec=spec,
                               build=build_ref(f"c{i}", hours=i), matrix="smoke",
                               result=run_result(KNOWN_CONFIG, kls(defects, bad)))
        with store.session() as s:  # judged and tracked where it was recorded
            collect(s, f"n{i}", None)
        return run_id

    def scenarios(run_id: int) -> dict[str, tuple[str, str | None]]:
        with store.session() as s:
            return {r.scenario: (r.verdict, r.reason) for r in
                    s.scalars(select(ScenarioRow).where(ScenarioRow.run_id == run_id))}

    def open_regressions() -> set[tuple[str, str, str | None]]:
        with store.session() as s:
            return {(r.scenario, r.metric, r.triage) for r in
                    s.scalars(select(Regression).where(Regression.state == "open"))}

    def alerts() -> list[tuple[str, str, list[str]]]:
        """(job, kind, the scenarios of its regressions) of every alert so far."""
        with store.session() as s:
            return [(a.job_id, a.kind, sorted(s.get(Regression, i).scenario
                                              for i in a.regression_ids))
                    for a in s.scalars(select(Alert).order_by(Alert.id))]

    for i in range(3):
        record_commit(i, set())
    first = record_commit(3, {"deferred-ops-dropped"})
    assert {s: v for s, (v, _) in scenarios(first).items()} == {
        "cold": "pass", "prefill_hit": "fail", "chunked_hit": "fail", "host_tier": "pass"}
    assert open_regressions() == {("prefill_hit", "kl_k3_mean", None),
                                  ("chunked_hit", "kl_k3_mean", None),
                                  ("pooled", "kl_k3_mean", None)}
    assert alerts() == [("n3", "appeared", ["chunked_hit", "pooled", "prefill_hit"])]

    with store.session() as s:  # as the API and the dashboard's form triage them
        for reg in s.scalars(select(Regression)):
            triage_regression(s, reg.id, "expected", "the kernel path's known bug",
                                      link=PR)
        levels = {r.scenario: r.expected_level for r in s.scalars(select(Regression))}
    assert 0.04 < levels["prefill_hit"] < 0.07  # the opening run's KL (the worst it had seen)

    held = [record_commit(i, {"deferred-ops-dropped"}) for i in (4, 5, 6)]
    for run_id in held:
        got = scenarios(run_id)
        assert {s: v for s, (v, _) in got.items()} == {
            "cold": "pass", "prefill_hit": "expected", "chunked_hit": "expected",
            "host_tier": "pass"}, got
        assert got["prefill_hit"][1].startswith("known failure (regression #")
        assert PR in got["prefill_hit"][1] and "above the limit 1e-08" in got["prefill_hit"][1]
        assert verdict_of(store, run_id) == ("expected", "threshold")
        with store.session() as s:
            run = s.get(Run, run_id)
            assert run.verdict == "expected" and PR in run.reason
            pooled = s.scalars(select(VerdictRow).where(VerdictRow.run_id == run_id,
                                                     VerdictRow.scenario == "pooled")).one()
            assert pooled.verdict == "expected", pooled.reason
    assert open_regressions() == {("prefill_hit", "kl_k3_mean", "expected"),
                                  ("chunked_hit", "kl_k3_mean", "expected"),
                                  ("pooled", "kl_k3_mean", "expected")}
    with store.session() as s:
        assert {r.runs_seen for r in s.scalars(select(Regression))} == {4}
    assert len(alerts()) == 1  # nothing new to say

    # a second defect planted in the same config: its own regression, and an alert
    both = record_commit(7, {"deferred-ops-dropped", "host-load-race"})
    got = scenarios(both)
    assert (got["host_tier"][0], got["prefill_hit"][0], got["chunked_hit"][0]) == (
        "fail", "expected", "expected")
    with store.session() as s:
        assert s.get(Run, both).verdict == "fail"
    assert ("host_tier", "kl_k3_mean", None) in open_regressions()
    assert ("n7", "appeared", ["host_tier"]) in alerts()

    # the known failure ten times worse: past its level by more than the effect floor
    worse = record_commit(8, {"deferred-ops-dropped"}, bad=0.5)
    assert scenarios(worse)["prefill_hit"][0] == "fail"
    assert verdict_of(store, worse) == ("regression", "threshold")
    with store.session() as s:
        reason = s.scalars(select(VerdictRow.reason).where(
            VerdictRow.run_id == worse, VerdictRow.scenario == "prefill_hit",
            VerdictRow.metric == "kl_k3_mean")).one()
        assert "worse than the known failure" in reason
    assert ("prefill_hit", "kl_k3_mean", None) in open_regressions()
    assert ("prefill_hit", "kl_k3_mean", "expected") in open_regressions()
    [opened] = [a for a in alerts() if a[:2] == ("n8", "appeared")]
    assert "prefill_hit" in opened[2]
    assert ("n8", "resolved", ["host_tier"]) in alerts()  # host-load-race is gone

    # the fix lands: every regression of the config resolves, the known ones too
    fixed = record_commit(9, set())
    assert {v for v, _ in scenarios(fixed).values()} == {"pass"}
    assert open_regressions() == set()
    assert alerts()[-1][:2] == ("n9", "resolved")
