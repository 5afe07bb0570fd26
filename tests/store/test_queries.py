"""Reads: metric history, latest run per config, build comparison, job and run detail, golden runs."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone

import numpy as np
import pytest

from evalsvc.metrics import paired_difference_ci
from evalsvc.store.db import Store
from evalsvc.store.queries import (
    commit_summaries,
    compare,
    find_build,
    golden_runs,
    job_detail,
    latest_per_config,
    metric_history,
    run_detail,
    scenario_verdicts,
    set_golden,
)
from tests.store.factories import BASE_TIME, as_utc, build_ref, fingerprint_of, record, run_result

CONFIGS = ("cfg-a", "cfg-b", "cfg-c")
SCENARIOS = ("cold", "prefill_hit")
INSERTION_ORDER = (2, 0, 4, 1, 3)  # commit i was made at BASE_TIME + i hours
PATCHES = ["fix-b", "fix-a"]


def commit_time(i: int) -> datetime:
    when = BASE_TIME + timedelta(hours=i)
    # commit 1 in another zone: 06:00+05:00 (01:00 UTC) must not sort after 04:00 UTC
    return when.astimezone(timezone(timedelta(hours=5))) if i == 1 else when


def kl(i: int, config: str, scenario: str, patched: bool = False) -> float:
    """The value recorded for commit i: different per commit, config, scenario and patch."""
    return ((i + 1) * 1e-3 + CONFIGS.index(config) * 1e-4 + (1e-5 if scenario == "prefill_hit" else 0)
            + (0.5 if patched else 0))


@dataclass
class History:
    store: Store
    runs: dict[tuple[int, str, bool], int] = field(default_factory=dict)  # (commit, config, patched)


def ref(i: int) -> str:
    return f"sgl-project/sglang@c{i}"


@pytest.fixture(scope="module")
def history(module_db_url, tmp_path_factory) -> Iterator[History]:
    """5 commits (recorded out of time order; commit 4 on a release branch), 3 configs of matrix
    smoke with 2 scenarios each, a patched build of commit 2, and a config of matrix full on
    commits 0 and 1. Shared by the module's tests on one database: they only read it."""
    store = Store(module_db_url)
    results_dir = tmp_path_factory.mktemp("results")
    h = History(store)
    for i in INSERTION_ORDER:
        build = build_ref(f"c{i}", committed_at=commit_time(i), branch="release" if i == 4 else "main")
        results = [run_result(c, {s: [kl(i, c, s)] * 3 for s in SCENARIOS}) for c in CONFIGS]
        ids = record(store, results_dir, f"job-c{i}", build, results)
        h.runs.update({(i, c, False): rid for c, rid in zip(CONFIGS, ids, strict=True)})
        if i < 2:
            [h.runs[(i, "cfg-full", False)]] = record(
                store, results_dir, f"job-full-c{i}", build,
                [run_result("cfg-full", {"cold": [kl(i, "cfg-a", "cold")] * 3})], matrix="full")
    build = build_ref("c2", committed_at=commit_time(2), patches=PATCHES)
    results = [run_result(c, {s: [kl(2, c, s, True)] * 3 for s in SCENARIOS}) for c in CONFIGS]
    ids = record(store, results_dir, "job-c2-patched", build, results)
    h.runs.update({(2, c, True): rid for c, rid in zip(CONFIGS, ids, strict=True)})
    yield h
    store.close()


def test_metric_history_of_a_fingerprint_in_commit_time_order(history):
    with history.store.session() as s:
        rows = metric_history(s, fingerprint=fingerprint_of("cfg-a"))
    assert [(r.commit, r.scenario) for r in rows] == [
        (ref(i), sc) for i in range(5) for sc in SCENARIOS]
    assert [r.value for r in rows] == pytest.approx(
        [kl(i, "cfg-a", sc) for i in range(5) for sc in SCENARIOS])
    assert [as_utc(r.committed_at) for r in rows[::2]] == [
        BASE_TIME + timedelta(hours=i) for i in range(5)]
    first = rows[0]
    assert set(first.model_dump()) == {"commit", "sha", "version", "committed_at", "patch_set", "run_id",
                          "fingerprint", "config", "scenario", "value", "ci_low", "ci_high", "count"}
    assert (first.sha, first.version, first.patch_set, first.config) == ("c0", None, "", "cfg-a")
    assert first.run_id == history.runs[(0, "cfg-a", False)]
    assert first.count == 3 and first.ci_low <= first.value <= first.ci_high


def test_metric_history_by_config_name_and_scenario(history):
    with history.store.session() as s:
        by_fp = metric_history(s, fingerprint=fingerprint_of("cfg-b"), scenario="cold")
        by_name = metric_history(s, config="cfg-b", scenario="cold")
        other = metric_history(s, "hit_coverage", config="cfg-b", scenario="prefill_hit")
        limited = metric_history(s, config="cfg-b", scenario="cold", limit=2)
    assert by_fp == by_name
    assert [r.run_id for r in by_name] == [history.runs[(i, "cfg-b", False)] for i in range(5)]
    assert {r.scenario for r in by_name} == {"cold"}
    assert [r.value for r in other] == [1.0] * 5 and {r.count for r in other} == {None}
    assert limited == by_name[:2]


def test_metric_history_filters_by_patch_set(history):
    with history.store.session() as s:
        patched = metric_history(s, config="cfg-c", scenario="cold", patch_set="fix-a,fix-b")
        both = metric_history(s, config="cfg-c", scenario="cold", patch_set=None)
        none = metric_history(s, config="cfg-c", patch_set="fix-a")
    assert [(r.commit, r.patch_set) for r in patched] == [(ref(2), "fix-a,fix-b")]
    assert patched[0].value == pytest.approx(kl(2, "cfg-c", "cold", True))
    assert [(r.commit, r.patch_set) for r in both] == [
        (ref(0), ""), (ref(1), ""), (ref(2), ""), (ref(2), "fix-a,fix-b"), (ref(3), ""), (ref(4), "")]
    assert none == []


def test_metric_history_needs_a_fingerprint_or_config(history):
    with history.store.session() as s, pytest.raises(ValueError, match="fingerprint or a config"):
        metric_history(s)


def test_latest_per_config(history):
    with history.store.session() as s:
        rows = latest_per_config(s)
    # commit 4 is the newest though commit 3's runs were recorded last; the patched build of
    # commit 2 is a series of its own, not hidden behind the newer unpatched commits
    assert [(r.config, r.commit, r.patch_set) for r in rows] == [
        (c, ref(i), p) for c in CONFIGS for i, p in ((4, ""), (2, "fix-a,fix-b"))] + [
        ("cfg-full", ref(1), "")]
    assert [r.run_id for r in rows] == [
        history.runs[(i, c, patched)] for c in CONFIGS for i, patched in ((4, False), (2, True))
    ] + [history.runs[(1, "cfg-full", False)]]
    a = rows[0]
    assert set(a.model_dump()) == {"run_id", "config", "fingerprint", "commit", "patch_set",
                                   "verdict", "scenarios"}
    assert a.fingerprint == fingerprint_of("cfg-a") and a.patch_set == ""
    assert a.verdict == "pass" and a.scenarios == {"cold": "pass", "prefill_hit": "pass"}


def test_latest_per_config_by_matrix_and_branch(history):
    with history.store.session() as s:
        smoke = latest_per_config(s, matrix="smoke")
        full = latest_per_config(s, matrix="full")
        main = latest_per_config(s, branch="main")
        main_smoke = latest_per_config(s, matrix="smoke", branch="main")
        release = latest_per_config(s, branch="release")
        nothing = latest_per_config(s, matrix="nightly")
    assert [(r.config, r.commit) for r in smoke] == [
        (c, ref(i)) for c in CONFIGS for i in (4, 2)]
    assert [(r.config, r.commit) for r in full] == [("cfg-full", ref(1))]
    assert [(r.config, r.commit) for r in main] == [
        (c, ref(i)) for c in CONFIGS for i in (3, 2)] + [("cfg-full", ref(1))]
    assert [(r.config, r.commit) for r in main_smoke] == [
        (c, ref(i)) for c in CONFIGS for i in (3, 2)]
    assert [r.run_id for r in release] == [history.runs[(4, c, False)] for c in CONFIGS]
    assert nothing == []


def test_latest_per_config_same_commit_newest_recording_wins(store, results_dir):
    build = build_ref("c0")
    [first] = record(store, results_dir, "job-1", build, [run_result("cfg-a", {"cold": [1e-4] * 3})])
    [older] = record(store, results_dir, "job-0", build_ref("old", hours=-1),
                     [run_result("cfg-a", {"cold": [1e-4] * 3})])
    [again] = record(store, results_dir, "job-2", build, [run_result("cfg-a", {"cold": [0.2] * 3})])
    with store.session() as s:
        [a] = latest_per_config(s)
    assert a.run_id == again and again not in (first, older)
    assert a.verdict == "fail" and a.scenarios == {"cold": "fail"}


def test_find_build(history):
    with history.store.session() as s:
        plain, patched = find_build(s, ref(2)), find_build(s, ref(2), "fix-a,fix-b")
        assert plain.id != patched.id and plain.commit_id == patched.commit_id
        assert find_build(s, "sgl-project/sglang@nope") is None


# --- compare ---------------------------------------------------------------------------------

N = 40


def compare_pair(store, results_dir, base_kls, cont_kls, *, cont_ids=None, cont_samples=True,
                 configs=("cfg-a",)):
    """A baseline build (commit base) and a contender (commit base + patch), one run per config."""
    base = build_ref("base", hours=0)
    cont = build_ref("base", hours=0, patches=["fix"])
    record(store, results_dir, "job-base", base, [run_result(c, {"cold": base_kls}) for c in configs])
    record(store, results_dir, "job-cont", cont,
           [run_result(configs[0], {"cold": cont_kls}, sample_ids=cont_ids, with_samples=cont_samples)])
    with store.session() as s:
        return find_build(s, base.ref).id, find_build(s, base.ref, "fix").id


def shifted(shift: float, noise: float, seed: int = 1):
    """Per-sample values that differ a lot between samples (difficulty) and a contender shifted by
    ``shift`` plus a little noise."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(1e-3, 1e-2, N)
    return base, base + shift + rng.normal(0, noise, N)


@pytest.mark.parametrize("shift", [2e-4, -2e-4])
def test_compare_paired_interval_contains_the_shift_and_excludes_zero(store, results_dir, shift):
    base, cont = shifted(shift, noise=2e-5)
    b, c = compare_pair(store, results_dir, list(base), list(cont))
    with store.session() as s:
        [row] = compare(s, b, c)
    assert row.config == "cfg-a" and row.scenario == "cold"
    assert row.fingerprint == fingerprint_of("cfg-a")
    assert row.baseline == pytest.approx(base.mean())
    assert row.contender == pytest.approx(cont.mean())
    assert row.delta == pytest.approx(row.contender - row.baseline)
    assert row.paired_samples == N
    assert row.ci_low <= shift <= row.ci_high
    assert row.ci_low <= row.delta <= row.ci_high
    assert (row.ci_low > 0) if shift > 0 else (row.ci_high < 0)
    # much narrower than the spread between samples: the pairing took the difficulty out
    assert row.ci_high - row.ci_low < 1e-4


def test_compare_pairs_samples_by_id_not_order(store, results_dir):
    base, cont = shifted(2e-4, noise=2e-5)
    ids = [f"s{i:03d}" for i in range(N)]
    order = np.random.default_rng(5).permutation(N)
    b, c = compare_pair(store, results_dir, list(base), [cont[i] for i in order],
                        cont_ids=[ids[i] for i in order])
    with store.session() as s:
        [row] = compare(s, b, c)
    assert row.paired_samples == N
    assert row.ci_low <= 2e-4 <= row.ci_high and row.ci_low > 0
    assert row.ci_high - row.ci_low < 1e-4


def test_compare_small_shift_interval_contains_zero(store, results_dir):
    base, cont = shifted(0.0, noise=2e-5)
    b, c = compare_pair(store, results_dir, list(base), list(cont))
    with store.session() as s:
        [row] = compare(s, b, c)
    assert row.ci_low <= 0 <= row.ci_high


def test_compare_without_samples_has_no_interval(store, results_dir):
    base, cont = shifted(2e-4, noise=2e-5)
    b, c = compare_pair(store, results_dir, list(base), list(cont), cont_samples=False,
                        configs=("cfg-a", "cfg-b"))
    with store.session() as s:
        rows = compare(s, b, c)
        other_metric = compare(s, b, b, metric="hit_coverage")
    [row] = rows  # cfg-b has no contender run: not compared
    assert row.delta == pytest.approx(cont.mean() - base.mean())
    assert (row.ci_low, row.ci_high, row.paired_samples) == (None, None, 0)
    # a metric without per-sample values: values and delta, no interval
    assert [(r.config, r.delta, r.ci_low) for r in other_metric] == [
        ("cfg-a", 0.0, None), ("cfg-b", 0.0, None)]


def test_compare_with_disjoint_samples_has_no_interval(store, results_dir):
    base, cont = shifted(2e-4, noise=2e-5)
    b, c = compare_pair(store, results_dir, list(base), list(cont),
                        cont_ids=[f"other-{i}" for i in range(N)])
    with store.session() as s:
        [row] = compare(s, b, c)
    assert row.delta is not None and row.ci_low is None and row.paired_samples == 0


def test_compare_intervals_are_paired_difference_ci(store, results_dir):
    """Every row's interval is ``paired_difference_ci`` (n_boot 1000, seed 0) of its samples in
    sample-id order, whatever the number of configs, scenarios and samples per run."""
    rng = np.random.default_rng(11)
    sizes = {"cfg-a": 40, "cfg-b": 40, "cfg-c": 17, "cfg-d": 2}
    shifts = {"cold": 3e-4, "prefill_hit": -1e-4}
    base_vals = {(c, sc): rng.uniform(1e-3, 1e-2, n) for c, n in sizes.items() for sc in shifts}
    cont_vals = {k: v + shifts[k[1]] + rng.normal(0, 5e-5, v.size) for k, v in base_vals.items()}
    for job, patches, vals in (("job-base", [], base_vals), ("job-cont", ["fix"], cont_vals)):
        record(store, results_dir, job, build_ref("base", patches=patches),
               [run_result(c, {sc: list(vals[(c, sc)]) for sc in shifts}) for c in sizes])
    with store.session() as s:
        rows = compare(s, find_build(s, "sgl-project/sglang@base").id,
                       find_build(s, "sgl-project/sglang@base", "fix").id)
    assert [(r.config, r.scenario) for r in rows] == [(c, sc) for c in sizes for sc in sorted(shifts)]
    for r in rows:
        b, c = base_vals[(r.config, r.scenario)], cont_vals[(r.config, r.scenario)]
        _, low, high = paired_difference_ci(b, c, confidence=0.95, n_boot=1000)
        assert (r.ci_low, r.ci_high) == pytest.approx((low, high), rel=1e-12, abs=1e-15)
        assert r.paired_samples == b.size
        assert r.delta == pytest.approx(c.mean() - b.mean())


def test_compare_across_commits(history):
    with history.store.session() as s:
        rows = compare(s, find_build(s, ref(0)).id, find_build(s, ref(3)).id)
    assert [(r.config, r.scenario) for r in rows] == [(c, sc) for c in CONFIGS for sc in SCENARIOS]
    for r in rows:
        config, scen = r.config, r.scenario
        assert r.delta == pytest.approx(kl(3, config, scen) - kl(0, config, scen))
        # every sample of a run has the same value: a degenerate interval at the shift
        assert r.ci_low == pytest.approx(r.delta) and r.ci_high == pytest.approx(r.delta)
        assert r.paired_samples == 3


# --- details and golden runs -----------------------------------------------------------------


def test_job_detail(history):
    with history.store.session() as s:
        d = job_detail(s, "job-c3")
        assert job_detail(s, "no-such-job") is None
    assert set(d.model_dump()) == {"id", "trigger", "status", "priority", "spec", "created_at", "started_at",
                      "finished_at", "cancel_requested_at", "error", "runs_errored", "runs"}
    assert (d.id, d.trigger, d.status, d.priority, d.spec, d.error,
            d.runs_errored) == ("job-c3", "cli", "done", 0, {"matrix": "smoke"}, None, 0)
    assert as_utc(d.started_at) <= as_utc(d.finished_at)
    assert as_utc(d.finished_at) <= datetime.now(UTC)
    assert d.cancel_requested_at is None  # never cancelled
    assert [r.config for r in d.runs] == list(CONFIGS)
    run = d.runs[0]
    assert set(run.model_dump()) == {"id", "config", "fingerprint", "build_id", "build", "status", "verdict",
                        "reason", "scenarios"}
    assert run.build.startswith("sgl-project/sglang") and "+" not in run.build  # unpatched
    assert run.id == history.runs[(3, "cfg-a", False)]
    assert (run.status, run.verdict, run.reason) == ("done", "pass", None)
    assert run.scenarios == {"cold": "pass", "prefill_hit": "pass"}


def test_run_detail(history):
    rid = history.runs[(2, "cfg-b", True)]
    with history.store.session() as s:
        d = run_detail(s, rid)
        assert run_detail(s, 10**9) is None
        assert scenario_verdicts(s, rid) == {"cold": "fail", "prefill_hit": "fail"}
    assert d.id == rid and d.job_id == "job-c2-patched"
    assert (d.config, d.matrix, d.model, d.fingerprint) == (
        "cfg-b", "smoke", "hybrid-mamba2-tiny", fingerprint_of("cfg-b"))
    assert (d.commit, d.patch_set, d.status, d.verdict) == (ref(2), "fix-a,fix-b", "done", "fail")
    assert "above" in d.reason
    assert d.settings["strategy"] == "extra_buffer" and d.reference == {"kind": "same_server"}
    assert d.command[:3] == ["python", "-m", "evalsvc.cli"]
    assert d.samples_path.endswith(f"job-c2-patched/{fingerprint_of('cfg-b')}.parquet")
    assert [x.scenario for x in d.scenarios] == list(SCENARIOS)
    cold = d.scenarios[0]
    assert (cold.verdict, cold.seconds) == ("fail", 1.25)
    k3 = cold.metrics["kl_k3_mean"]
    assert set(k3.model_dump()) == {"value", "ci_low", "ci_high", "count"}
    assert k3.value == pytest.approx(kl(2, "cfg-b", "cold", True)) and k3.count == 3
    assert cold.metrics["hit_coverage"].value == 0.0
    assert cold.metrics["hit_coverage"].ci_low is None  # every metric has the same shape
    assert cold.metrics["first_divergence_min"].value == 0.0
    assert "kl_k3_ci_low" not in cold.metrics


def test_set_golden_replaces_the_golden_run_of_a_fingerprint(store, results_dir):
    runs = {}
    for i in range(3):
        ids = record(store, results_dir, f"job-{i}", build_ref(f"c{i}", hours=i),
                     [run_result(c, {"cold": [1e-4] * 2}) for c in ("cfg-b", "cfg-a")])
        runs.update({(i, "cfg-b"): ids[0], (i, "cfg-a"): ids[1]})
    with store.session() as s:
        assert golden_runs(s) == []
        first = set_golden(s, runs[(0, "cfg-b")], label="first")
        set_golden(s, runs[(1, "cfg-a")])
        assert (first.fingerprint, first.run_id, first.label) == (fingerprint_of("cfg-b"), runs[(0, "cfg-b")],
                                                                  "first")
    with store.session() as s:
        again = set_golden(s, runs[(2, "cfg-b")], label="after the fix")
        assert again.id == first.id  # replaced in place: one golden run per fingerprint
    with store.session() as s:
        rows = golden_runs(s)
    assert [r.model_dump() for r in rows] == [
        {"fingerprint": fingerprint_of("cfg-a"), "run_id": runs[(1, "cfg-a")], "label": None,
         "config": "cfg-a"},
        {"fingerprint": fingerprint_of("cfg-b"), "run_id": runs[(2, "cfg-b")], "label": "after the fix",
         "config": "cfg-b"}]


def test_set_golden_of_an_unknown_run(history):
    with history.store.session() as s, pytest.raises(KeyError, match="no run 42"):
        set_golden(s, 42)


def test_commit_summaries_count_each_configs_latest_run(store, results_dir):
    """A config evaluated again counts once, with its newest verdict; per build (patch set)."""
    build = build_ref("c" * 40)
    record(store, results_dir, "job-1", build, [run_result("cfg-a", {"cold": [0.5, 0.5]}),
                                                run_result("cfg-b", {"cold": [1e-6, 1e-6]})])
    record(store, results_dir, "job-2", build, [run_result("cfg-a", {"cold": [1e-6, 1e-6]})])
    patched = build_ref("c" * 40, patches=["pr37165-clear-deferred-mamba-metadata"])
    record(store, results_dir, "job-3", patched, [run_result("cfg-a", {"cold": [0.5, 0.5]})])
    with store.session() as s:
        (summary,) = commit_summaries(s)
    assert summary.builds == {"": {"pass": 2},
                                 "pr37165-clear-deferred-mamba-metadata": {"fail": 1}}
