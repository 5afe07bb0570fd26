"""Recording results: what lands in which table, idempotence, one transaction per run."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pandas as pd
import pytest
from sqlalchemy import event, select
from sqlalchemy.exc import IntegrityError

from evalsvc.store.models import Build, Commit, Job, Metric, Run, SampleRow, ScenarioRow
from evalsvc.store.queries import find_build
from evalsvc.store.record import BuildRef
from tests.store.factories import (
    as_utc,
    build_ref,
    counts,
    fingerprint_of,
    record,
    run_result,
)

KLS = {"cold": [1e-4, 2e-4, 3e-4], "prefill_hit": [5e-2, 1e-1, 2e-2]}


def test_records_commit_build_job_runs_scenarios_metrics_samples(store, results_dir):
    build = build_ref("a1b2c3", hours=5, patches=["fix-b", "fix-a", "fix-b"])
    results = [run_result("mamba2-xbuf-overlap", KLS), run_result("mamba2-nobuf-sync", KLS, seed=7)]
    ids = record(store, results_dir, "job-1", build, results)
    assert len(ids) == 2 and len(set(ids)) == 2

    assert counts(store) == {"commits": 1, "builds": 1, "jobs": 1, "runs": 2, "scenarios": 4,
                             "metrics": 2 * 2 * len(_stored_metric_names(results[0], "cold")),
                             "samples": 12, "golden_runs": 0}
    with store.session() as s:
        commit = s.scalars(select(Commit)).one()
        assert (commit.ref, commit.repository, commit.sha, commit.version, commit.branch) == (
            "sgl-project/sglang@a1b2c3", "sgl-project/sglang", "a1b2c3", None, "main")
        assert as_utc(commit.committed_at) == build.committed_at
        b = s.scalars(select(Build)).one()
        assert b.commit_id == commit.id
        assert b.patch_set == "fix-a,fix-b"  # sorted, de-duplicated
        assert (b.probes, b.base_env, b.manifest) == (build.probes, build.base_env, build.manifest)
        job = s.get(Job, "job-1")
        assert (job.trigger, job.status, job.spec) == ("cli", "done", {"matrix": "smoke"})
        assert job.started_at is not None and job.finished_at is not None

        runs = s.scalars(select(Run).order_by(Run.id)).all()
        assert [r.id for r in runs] == ids
        for run, res in zip(runs, results, strict=True):
            assert (run.job_id, run.build_id, run.config, run.fingerprint, run.matrix, run.model) == (
                "job-1", b.id, res.config, res.fingerprint, "smoke", "hybrid-mamba2-tiny")
            assert (run.settings, run.requested_args, run.resolved_args, run.command) == (
                res.settings, res.requested_args, res.resolved_args, res.command)
            assert run.reference == {"kind": "same_server"}
            assert (run.status, run.verdict) == ("done", "fail")
            assert "above" in run.reason
            assert (run.startup_seconds, run.seconds, run.log_path) == (2.5, 12.0, res.log_path)
            assert run.finished_at is not None

            scen = {x.scenario: x for x in run.scenarios}
            assert {k: v.verdict for k, v in scen.items()} == {"cold": "pass", "prefill_hit": "fail"}
            assert scen["cold"].reason is None and "above" in scen["prefill_hit"].reason
            assert scen["cold"].seconds == 1.25

            metrics = {(m.scenario, m.name): m for m in run.metrics}
            for sr in res.scenarios:
                assert {n for (sc, n) in metrics if sc == sr.scenario} == _stored_metric_names(
                    res, sr.scenario)
                kl = metrics[(sr.scenario, "kl_k3_mean")]
                assert kl.value == pytest.approx(sr.metrics["kl_k3_mean"])
                assert kl.ci_low == pytest.approx(sr.metrics["kl_k3_ci_low"])
                assert kl.ci_high == pytest.approx(sr.metrics["kl_k3_ci_high"])
                assert kl.ci_low <= kl.value <= kl.ci_high
                assert kl.count == 3
                other = metrics[(sr.scenario, "hit_coverage")]
                assert (other.ci_low, other.ci_high, other.count) == (None, None, None)
            assert metrics[("cold", "first_divergence_min")].value is None
            assert metrics[("prefill_hit", "first_divergence_min")].value == 0.0
            assert metrics[("prefill_hit", "samples_diverged")].value == 3.0

            samples = {(x.scenario, x.sample_id): x for x in run.samples}
            assert len(samples) == 6
            for sr in res.scenarios:
                for row in sr.samples:
                    got = samples[(sr.scenario, row["sample_id"])]
                    for key in ("prompt_id", "prompt_tokens", "cached_tokens", "host_cached_tokens",
                                "completion_tokens", "hit", "first_divergence", "accept_length"):
                        assert getattr(got, key) == row[key], key
                    for key in ("kl_k1_mean", "kl_k2_mean", "kl_k3_mean", "kl_k3_max", "topk_kl_mean",
                                "same_top_rate"):
                        assert getattr(got, key) == pytest.approx(row[key]), key
            assert samples[("cold", "s000")].hit is False
            assert samples[("prefill_hit", "s000")].hit is True


def _stored_metric_names(result, scenario: str) -> set[str]:
    """Scalar metrics of a scenario, less the KL interval keys (columns of kl_k3_mean's row)."""
    [sr] = [x for x in result.scenarios if x.scenario == scenario]
    return {k for k, v in sr.metrics.items()
            if (v is None or isinstance(v, int | float))
            and k not in ("kl_k3_ci_low", "kl_k3_ci_high", "kl_k3_n_samples")}


def test_parquet_per_run_holds_the_token_arrays(store, results_dir):
    results = [run_result("cfg-a", KLS), run_result("cfg-b", KLS, seed=3)]
    ids = record(store, results_dir, "job-pq", build_ref("abc"), results)
    with store.session() as s:
        runs = [s.get(Run, i) for i in ids]
        paths = [r.samples_path for r in runs]
    for path, res in zip(paths, results, strict=True):
        assert path == str(results_dir / "job-pq" / f"{res.fingerprint}.parquet")
        df = pd.read_parquet(path)
        assert len(df) == 6
        assert {"scenario", "sample_id", "output_ids", "decode_logprobs", "reference_logprobs",
                "kl_k3_mean", "prompt_tokens"} <= set(df.columns)
        for sr in res.scenarios:
            for row in sr.samples:
                [got] = df[(df.scenario == sr.scenario) & (df.sample_id == row["sample_id"])].itertuples()
                assert list(got.output_ids) == row["output_ids"]
                assert list(got.decode_logprobs) == pytest.approx(row["decode_logprobs"])
                assert list(got.reference_logprobs) == pytest.approx(row["reference_logprobs"])
    assert sorted(p.name for p in (results_dir / "job-pq").iterdir()) == sorted(
        f"{r.fingerprint}.parquet" for r in results)


def test_a_run_without_samples_has_no_parquet(store, results_dir):
    [rid] = record(store, results_dir, "job-ns", build_ref("abc"),
                   [run_result("cfg-a", KLS, with_samples=False)])
    with store.session() as s:
        assert s.get(Run, rid).samples_path is None
        assert s.scalars(select(SampleRow)).all() == []
    assert not (results_dir / "job-ns").exists()


def test_rerecording_a_run_replaces_it(store, results_dir):
    build = build_ref("abc", patches=["p"])
    first = [run_result("cfg-a", KLS), run_result("cfg-b", KLS)]
    ids = record(store, results_dir, "job-1", build, first)
    before = counts(store)

    again = [run_result("cfg-a", KLS), run_result("cfg-b", KLS)]
    assert record(store, results_dir, "job-1", build, again) == ids
    assert counts(store) == before

    # changed results for one of them: fewer samples, other values, another verdict
    changed = run_result("cfg-a", {"cold": [1e-5, 2e-5]})
    assert record(store, results_dir, "job-1", build_ref("abc", patches=["p", "p"]), [changed]) == ids[:1]
    after = counts(store)
    assert after == {**before, "scenarios": before["scenarios"] - 1,
                     "metrics": before["metrics"] - len(_stored_metric_names(first[0], "prefill_hit")),
                     "samples": before["samples"] - 4}
    with store.session() as s:
        run = s.get(Run, ids[0])
        assert run.verdict == "pass" and run.reason is None
        assert [x.scenario for x in run.scenarios] == ["cold"]
        assert sorted(x.kl_k3_mean for x in run.samples) == pytest.approx([1e-5, 2e-5])
        kl = s.scalars(select(Metric).where(Metric.run_id == run.id, Metric.name == "kl_k3_mean")).one()
        assert kl.value == pytest.approx(1.5e-5) and kl.count == 2
        assert s.get(Run, ids[1]).verdict == "fail"  # the other run is untouched
    assert len(pd.read_parquet(results_dir / "job-1" / f"{changed.fingerprint}.parquet")) == 2

    # the same config in another job is another run
    [other] = record(store, results_dir, "job-2", build, [run_result("cfg-a", KLS)])
    assert other not in ids
    assert counts(store)["runs"] == before["runs"] + 1 and counts(store)["jobs"] == 2


def test_same_commit_and_patches_in_any_order_is_one_build(store, results_dir):
    record(store, results_dir, "j1", build_ref("abc", patches=["b", "a"]), [run_result("c", KLS)])
    record(store, results_dir, "j2", build_ref("abc", patches=["a", "b", "a"]), [run_result("c", KLS)])
    assert counts(store)["builds"] == 1 and counts(store)["commits"] == 1


def test_two_builds_of_one_commit_with_different_patch_sets(store, results_dir):
    [r1] = record(store, results_dir, "j1", build_ref("abc"), [run_result("c", KLS)])
    [r2] = record(store, results_dir, "j2", build_ref("abc", patches=["fix-a"]), [run_result("c", KLS)])
    [r3] = record(store, results_dir, "j3", build_ref("abc", patches=["fix-a", "fix-b"]),
                  [run_result("c", KLS)])
    assert counts(store)["commits"] == 1 and counts(store)["builds"] == 3
    with store.session() as s:
        plain = find_build(s, "sgl-project/sglang@abc")
        one = find_build(s, "sgl-project/sglang@abc", "fix-a")
        two = find_build(s, "sgl-project/sglang@abc", "fix-a,fix-b")
        assert len({plain.id, one.id, two.id}) == 3
        assert plain.commit_id == one.commit_id == two.commit_id
        assert [s.get(Run, r).build_id for r in (r1, r2, r3)] == [plain.id, one.id, two.id]
        assert find_build(s, "sgl-project/sglang@abc", "fix-b") is None


def test_a_release_is_a_commit_too(store, results_dir):
    ref = BuildRef(repository="sgl-project/sglang", version="0.5.14",
                   committed_at=datetime(2026, 2, 1, tzinfo=UTC))
    record(store, results_dir, "j1", ref, [run_result("c", KLS)])
    with store.session() as s:
        c = s.scalars(select(Commit)).one()
        assert (c.ref, c.sha, c.version) == ("sgl-project/sglang==0.5.14", None, "0.5.14")


def test_commit_times_are_stored_as_utc(store, results_dir):
    """A commit time with an offset (git's own form) means the same instant on either database."""
    plus5 = timezone(timedelta(hours=5))
    record(store, results_dir, "j1", build_ref("early", committed_at=datetime(2026, 3, 1, 9, tzinfo=plus5)),
           [run_result("c", KLS)])  # 04:00 UTC
    record(store, results_dir, "j2", build_ref("late", committed_at=datetime(2026, 3, 1, 6, tzinfo=UTC)),
           [run_result("c", KLS)])
    with store.session() as s:
        commits = s.scalars(select(Commit).order_by(Commit.committed_at)).all()
        assert [c.sha for c in commits] == ["early", "late"]
        assert as_utc(commits[0].committed_at) == datetime(2026, 3, 1, 4, tzinfo=UTC)


def test_a_commit_keeps_its_first_time_and_branch(store, results_dir):
    record(store, results_dir, "j1", build_ref("abc", hours=1, branch="main"), [run_result("c", KLS)])
    record(store, results_dir, "j2", build_ref("abc", hours=9, branch=None, patches=["x"]),
           [run_result("c", KLS)])
    with store.session() as s:
        c = s.scalars(select(Commit)).one()
        assert as_utc(c.committed_at).hour == 1 and c.branch == "main"


def test_a_sample_the_database_rejects_leaves_nothing_of_its_run(store, results_dir):
    build = build_ref("abc")
    [good] = record(store, results_dir, "job-1", build, [run_result("cfg-a", KLS)])
    before = counts(store)

    bad = run_result("cfg-b", KLS)
    bad.scenarios[1].samples[-1]["prompt_tokens"] = None  # NOT NULL, on the last row written
    with pytest.raises(IntegrityError):
        record(store, results_dir, "job-1", build, [run_result("cfg-c", KLS), bad])
    after = counts(store)
    assert after == {**before, "runs": 2, "scenarios": 4, "metrics": 2 * before["metrics"],
                     "samples": 12}  # cfg-c went in before the failing run; cfg-b left nothing
    with store.session() as s:
        assert s.scalars(select(Run.config).order_by(Run.id)).all() == ["cfg-a", "cfg-c"]
        assert s.get(Run, good).verdict == "fail"
    # no file of the failed run, staged or final
    assert sorted(p.name for p in (results_dir / "job-1").iterdir()) == sorted(
        f"{fingerprint_of(c)}.parquet" for c in ("cfg-a", "cfg-c"))


def _fail_on_sample_insert(store, *, after_runs: int):
    """Raise on the samples INSERT of the ``after_runs``-th run INSERT: the run, its scenarios and
    metrics were written in that transaction already."""
    seen = {"runs": 0}

    def before_execute(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO RUNS"):
            seen["runs"] += 1
        if statement.lstrip().upper().startswith("INSERT INTO SAMPLES") and seen["runs"] >= after_runs:
            raise RuntimeError("disk gone half-way")

    event.listen(store.engine, "before_cursor_execute", before_execute)
    return lambda: event.remove(store.engine, "before_cursor_execute", before_execute)


def test_a_run_failing_half_way_leaves_no_partial_rows(store, results_dir):
    build = build_ref("abc")
    results = [run_result("cfg-a", KLS), run_result("cfg-b", KLS, seed=1), run_result("cfg-c", KLS)]
    remove = _fail_on_sample_insert(store, after_runs=2)
    try:
        with pytest.raises(RuntimeError, match="half-way"):
            record(store, results_dir, "job-1", build, results)
    finally:
        remove()
    c = counts(store)
    per_run_metrics = 2 * len(_stored_metric_names(results[0], "cold"))
    assert c == {"commits": 1, "builds": 1, "jobs": 1, "runs": 1, "scenarios": 2,
                 "metrics": per_run_metrics, "samples": 6, "golden_runs": 0}
    with store.session() as s:
        assert s.scalars(select(Run.config)).all() == ["cfg-a"]
        assert {x.run_id for x in s.scalars(select(ScenarioRow))} == {
            s.scalars(select(Run.id)).one()}
        assert s.get(Job, "job-1").status != "done"
    assert sorted(p.name for p in (results_dir / "job-1").iterdir()) == [
        f"{results[0].fingerprint}.parquet"]

    # recorded again, it completes: the job is whole
    record(store, results_dir, "job-1", build, results)
    assert counts(store)["runs"] == 3
    with store.session() as s:
        assert s.get(Job, "job-1").status == "done"


def test_a_failed_rerecording_keeps_the_recorded_run(store, results_dir):
    build = build_ref("abc")
    first = run_result("cfg-a", KLS)
    [rid] = record(store, results_dir, "job-1", build, [first])
    before = counts(store)
    path = results_dir / "job-1" / f"{first.fingerprint}.parquet"
    tokens = pd.read_parquet(path).output_ids.map(list).tolist()

    remove = _fail_on_sample_insert(store, after_runs=0)
    try:
        with pytest.raises(RuntimeError, match="half-way"):
            record(store, results_dir, "job-1", build, [run_result("cfg-a", {"cold": [0.5]}, seed=9)])
    finally:
        remove()
    assert counts(store) == before
    with store.session() as s:
        run = s.get(Run, rid)
        assert len(run.samples) == 6 and len(run.scenarios) == 2
        assert sorted(x.kl_k3_mean for x in run.samples) == pytest.approx(
            sorted(KLS["cold"] + KLS["prefill_hit"]))
    # the Parquet file still holds the recorded run's tokens
    assert pd.read_parquet(path).output_ids.map(list).tolist() == tokens


def test_fingerprints_are_per_config():
    assert fingerprint_of("a") != fingerprint_of("b")
