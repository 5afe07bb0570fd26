"""``evalsvc export``: a job's results, or a commit range's, as Parquet or CSV."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd
import pytest
from typer.testing import CliRunner

from evalsvc.cli import app
from evalsvc.store.db import Store
from tests.store.factories import build_ref, fingerprint_of, record, run_result

CONFIGS = ("cfg-a", "cfg-b")
SCENARIOS = ("cold", "prefill_hit")
REPO = "sgl-project/sglang"
KEY_COLUMNS = ["commit", "committed_at", "patch_set", "job_id", "run_id", "config", "fingerprint",
               "scenario", "verdict"]


def ref(i: int) -> str:
    return f"{REPO}@c{i}"


def value(i: int, config: str, scenario: str) -> float:
    return (i + 1) * 1e-3 + CONFIGS.index(config) * 1e-4 + (1e-5 if scenario == "prefill_hit" else 0)


@dataclass
class Data:
    url: str
    metric_names: set[str]


@pytest.fixture(scope="module")
def data(module_db_url, tmp_path_factory) -> Iterator[Data]:
    """Commits c0..c4 an hour apart, recorded out of order, each a job of 2 configs x 2 scenarios;
    a patched build of c2; and a commit of another repository inside the time range."""
    store = Store(module_db_url)
    results_dir = tmp_path_factory.mktemp("results")
    try:
        for i in (3, 0, 4, 2, 1):
            record(store, results_dir, f"job-c{i}", build_ref(f"c{i}", hours=i),
                   [run_result(c, {s: [value(i, c, s)] * 2 for s in SCENARIOS}) for c in CONFIGS])
        record(store, results_dir, "job-c2-patched", build_ref("c2", hours=2, patches=["fix"]),
               [run_result("cfg-a", {"cold": [0.5, 0.5]})])
        record(store, results_dir, "job-other", build_ref("o1", hours=2.5, repository="other/repo"),
               [run_result("cfg-a", {"cold": [1e-4, 1e-4]})])
    finally:
        store.close()
    example = run_result("x", {"cold": [1e-3, 1e-3]}).scenarios[0].metrics
    names = {k for k, v in example.items() if v is None or isinstance(v, int | float)} - {
        "kl_k3_ci_low", "kl_k3_ci_high", "kl_k3_n_samples"}
    yield Data(module_db_url, names)


def export(data: Data, monkeypatch, tmp_path, *args: str):
    monkeypatch.setenv("EVALSVC_DATABASE_URL", data.url)
    monkeypatch.setenv("EVALSVC_DATA_DIR", str(tmp_path / "data"))
    return CliRunner().invoke(app, ["export", *args])


def test_export_a_job_to_parquet(data, monkeypatch, tmp_path):
    out = tmp_path / "out" / "job.parquet"
    res = export(data, monkeypatch, tmp_path, str(out), "--job", "job-c3")
    assert res.exit_code == 0, res.output
    assert f"{out}: 4 rows" in res.stdout
    df = pd.read_parquet(out)
    assert list(df.columns[:len(KEY_COLUMNS)]) == KEY_COLUMNS
    assert set(df.columns) - set(KEY_COLUMNS) == data.metric_names
    assert [(r.config, r.scenario) for r in df.itertuples()] == [(c, s) for c in CONFIGS for s in SCENARIOS]
    assert set(df.commit) == {ref(3)} and set(df.job_id) == {"job-c3"} and set(df.patch_set) == {""}
    assert list(df.fingerprint) == [fingerprint_of(c) for c in CONFIGS for _ in SCENARIOS]
    assert df.run_id.nunique() == 2 and set(df.verdict) == {"pass"}
    assert list(df.kl_k3_mean) == pytest.approx([value(3, c, s) for c in CONFIGS for s in SCENARIOS])
    assert list(df.hit_coverage) == [0.0, 1.0, 0.0, 1.0]
    assert list(df.first_divergence_min) == [0.0] * 4


def test_export_a_commit_range_to_csv(data, monkeypatch, tmp_path):
    out = tmp_path / "range.csv"
    res = export(data, monkeypatch, tmp_path, str(out), "--since", ref(1), "--until", ref(3))
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out, keep_default_na=False)
    # inclusive, in commit-time order (not recording order), every repository and patch set
    assert list(dict.fromkeys(df.commit)) == [ref(1), ref(2), "other/repo@o1", ref(3)]
    assert len(df) == 3 * 4 + 1 + 1
    patched = df[df.patch_set == "fix"]
    assert list(patched.job_id) == ["job-c2-patched"] and list(patched.kl_k3_mean) == [0.5]
    other = df[df.commit == "other/repo@o1"]
    assert list(other.first_divergence_min) == [""]  # a metric stored as NULL: an empty cell
    c2 = df[(df.commit == ref(2)) & (df.patch_set == "")]
    assert list(c2.kl_k3_mean) == pytest.approx([value(2, c, s) for c in CONFIGS for s in SCENARIOS])

    res = export(data, monkeypatch, tmp_path, str(out), "--since", ref(1), "--until", ref(3),
                 "--repository", REPO)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out, keep_default_na=False)
    assert list(dict.fromkeys(df.commit)) == [ref(1), ref(2), ref(3)] and len(df) == 13


def test_export_open_ended_ranges(data, monkeypatch, tmp_path):
    out = tmp_path / "r.csv"
    assert export(data, monkeypatch, tmp_path, str(out), "--since", ref(3)).exit_code == 0
    assert list(dict.fromkeys(pd.read_csv(out).commit)) == [ref(3), ref(4)]
    assert export(data, monkeypatch, tmp_path, str(out), "--until", ref(0)).exit_code == 0
    assert list(dict.fromkeys(pd.read_csv(out).commit)) == [ref(0)]


def test_export_unknown_commit_ref_exits_2_naming_it(data, monkeypatch, tmp_path):
    out = tmp_path / "x.csv"
    res = export(data, monkeypatch, tmp_path, str(out), "--since", ref(1), "--until", f"{REPO}@nope")
    assert res.exit_code == 2
    assert f"{REPO}@nope" in res.stderr
    assert not out.exists()


def test_export_bad_extension_exits_2(data, monkeypatch, tmp_path):
    out = tmp_path / "x.json"
    res = export(data, monkeypatch, tmp_path, str(out), "--job", "job-c3")
    assert res.exit_code == 2
    assert "x.json" in res.stderr and ".parquet or .csv" in res.stderr
    assert not out.exists()


def test_export_nothing_matching_exits_1(data, monkeypatch, tmp_path):
    out = tmp_path / "x.parquet"
    res = export(data, monkeypatch, tmp_path, str(out), "--job", "no-such-job")
    assert res.exit_code == 1
    assert "no results" in res.stderr
    assert not out.exists()
