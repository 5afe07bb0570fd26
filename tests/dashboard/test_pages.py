"""The pages in process (Starlette's test client) over a store of hand-built runs (with verdicts,
regressions and bisections written as rows): what each page shows, filters, 404s, the read token,
and escaping."""

from __future__ import annotations

import hashlib
import html as html_lib
import json
import re
import shlex
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pandas as pd
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from evalsvc.app import create_app
from evalsvc.dashboard.views import (
    bisection_view,
    compare_decision,
    compare_verdict,
    deciding_verdict,
)
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Bisection, Regression, Run, VerdictRow
from evalsvc.store.reads import BisectionRead, VerdictRead
from tests.store.factories import (
    BASE_TIME,
    build_ref,
    fingerprint_of,
    job_spec,
    record,
    run_result,
)

MAMBA, GDN = "mamba2-eb-ov-c64", "gdn-eb-ov-c64"
CLEAN = [1e-13, 2e-13, 1.5e-13]
BROKEN = [0.05, 0.04, 0.06]  # above the factories' threshold: fail
LOG = "engine up\n<script>alert('log')</script>\nlast line\n"
COMMENT = "<b>snapshot race</b> in the extra buffer: looking"
# the bisection's candidates (good exclusive .. bad inclusive): the third is the first bad one
SHAS = [hashlib.sha1(f"c{i}".encode()).hexdigest() for i in range(5)]
GOOD_SHA = hashlib.sha1(b"good").hexdigest()
DONE, FAILED = "bisect-20260301-000000-aaaa1111", "bisect-20260302-000000-bbbb2222"
FAILED_WHY = "commit 0123456789ab: run 7 cannot decide (inconclusive: hit coverage 0.00 below 0.50)"


def results(config: str, model: str, prefill: list[float], log: Path | None = None):
    r = run_result(config, {"cold": CLEAN, "prefill_hit": prefill}, sample_ids=["a", "b", "c"])
    r.model = model
    r.log_path = str(log) if log else None
    return r


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    """Three commits on main (the newest with mamba2's prefill_hit broken, and a patched build
    that fixes it) and one on a release branch."""
    tmp = tmp_path_factory.mktemp("pages")
    log = tmp / "engine.log"
    log.write_text(LOG)
    store = Store(f"sqlite:///{tmp / 'store.db'}")
    try:
        for i, sha in enumerate(("aaa111", "bbb222")):
            record(store, tmp / "results", f"job-{sha}", build_ref(sha, hours=i),
                   [results(MAMBA, "mamba2", CLEAN), results(GDN, "gdn", CLEAN)])
        record(store, tmp / "results", "job-ccc333", build_ref("ccc333", hours=2),
               [results(MAMBA, "mamba2", BROKEN, log), results(GDN, "gdn", CLEAN)])
        record(store, tmp / "results", "job-ccc333-fix",
               build_ref("ccc333", hours=2, patches=["pr-fix"]), [results(MAMBA, "mamba2", CLEAN)])
        record(store, tmp / "results", "job-rel", build_ref("rel444", hours=3, branch="release"),
               [results(GDN, "gdn", CLEAN)])
        add_verdicts(store)
    finally:
        store.close()
    return tmp


def add_verdicts(store: Store) -> None:
    """Verdicts, regressions and bisections over the recorded runs, as the verdict and bisection
    code write them (the numbers made up, to be found on the pages):

    * open, acknowledged (with a comment): mamba2's prefill_hit KL at ccc333, a history verdict,
      last good bbb222, bisected (``DONE``: first bad SHAS[2]);
    * open, untriaged, opened later: gdn's prefill_hit KL at rel444, a change point;
    * resolved and fixed: gdn's cold KL, opened at aaa111 and closed by bbb222, no verdict kept;
    * a failed bisection (``FAILED``) of no regression."""
    with store.session() as s:
        ids = {(r.job_id, r.config): r.id for r in s.scalars(select(Run))}
        bad, good, first = (ids[("job-ccc333", MAMBA)], ids[("job-bbb222", MAMBA)],
                            ids[("job-aaa111", MAMBA)])
        rel = ids[("job-rel", GDN)]
        s.add_all([
            VerdictRow(run_id=bad, scenario="prefill_hit", metric="kl_k3_mean", verdict="regression",
                    method="history", value=0.05, baseline=1.5e-13, diff_low=0.0412,
                    diff_high=0.0588, threshold=2.5e-9, p_value=3.2e-5,
                    evidence={"baseline_runs": [first, good], "n": 3, "n_baseline": 6,
                              "confidence": 0.95, "test": "welch", "diff": 0.05},
                    reason="mean KL (k3) 0.05 against 1.5e-13 over 2 earlier runs"),
            VerdictRow(run_id=bad, scenario="cold", metric="kl_k3_mean", verdict="pass",
                    method="threshold", value=1.5e-13, threshold=1e-8,
                    evidence={"history_runs": 2}),
            VerdictRow(run_id=rel, scenario="prefill_hit", metric="kl_k3_mean", verdict="regression",
                    method="change_point", value=2e-12, baseline=1.4e-13, diff_low=-1e-14,
                    diff_high=4e-12, threshold=3e-12, p_value=0.004,
                    evidence={"change_point": {"index": 2, "before": 1.5e-13, "after": 2e-12,
                                               "p_value": 0.004, "first_run_id": None}},
                    reason="mean KL (k3) shifted from 1.5e-13 to 2e-12 1 runs ago (p = 0.004)")])
        acked = Regression(fingerprint=fingerprint_of(MAMBA), scenario="prefill_hit",
                           metric="kl_k3_mean", config=MAMBA, matrix="smoke", state="open",
                           first_run_id=bad, last_run_id=bad, last_good_run_id=good, runs_seen=1,
                           triage="acknowledged", comment=COMMENT,
                           triaged_at=BASE_TIME + timedelta(hours=5),
                           opened_at=BASE_TIME + timedelta(hours=2))
        untriaged = Regression(fingerprint=fingerprint_of(GDN), scenario="prefill_hit",
                               metric="kl_k3_mean", config=GDN, matrix="smoke", state="open",
                               first_run_id=rel, last_run_id=rel, runs_seen=1,
                               opened_at=BASE_TIME + timedelta(hours=3))
        gdn_first, gdn_next = ids[("job-aaa111", GDN)], ids[("job-bbb222", GDN)]
        fixed = Regression(fingerprint=fingerprint_of(GDN), scenario="cold", metric="kl_k3_mean",
                           config=GDN, matrix="smoke", state="resolved", first_run_id=gdn_first,
                           last_run_id=gdn_first, resolved_run_id=gdn_next, runs_seen=1,
                           triage="fixed", comment="fixed by pr-fix", opened_at=BASE_TIME,
                           resolved_at=BASE_TIME + timedelta(hours=1))
        s.add_all([acked, untriaged, fixed])
        s.flush()
        steps = [  # the bad end run, the midpoint's stored run reused, then the next midpoint
            {"sha": SHAS[4], "run_id": bad, "job_id": "job-ccc333", "reused": False, "bad": True,
             "verdict": "regression", "reason": "mean KL (k3) 0.05 above the limit"},
            {"sha": SHAS[1], "run_id": good, "job_id": None, "reused": True, "bad": False,
             "verdict": "pass", "reason": ""},
            {"sha": SHAS[2], "run_id": bad, "job_id": "job-ccc333", "reused": False, "bad": True,
             "verdict": "regression", "reason": "mean KL (k3) 0.05 above the limit"}]
        spec = {"matrix": "smoke", "config": MAMBA, "scenario": "prefill_hit"}
        s.add_all([
            Bisection(id=DONE, repository="https://github.com/sgl-project/sglang", good=GOOD_SHA,
                      bad=SHAS[4], matrix="smoke", config=MAMBA, scenario="prefill_hit",
                      metric="kl_k3_mean", spec=spec, status="done", candidates=SHAS, steps=steps,
                      first_bad=SHAS[2], runs_used=2, regression_id=acked.id,
                      created_at=BASE_TIME + timedelta(hours=6),
                      finished_at=BASE_TIME + timedelta(hours=7)),
            Bisection(id=FAILED, repository="https://github.com/sgl-project/sglang", good=GOOD_SHA,
                      bad=SHAS[1], matrix="smoke", config=GDN, scenario="prefill_hit", metric=None,
                      spec=spec, status="failed", candidates=SHAS[:2], steps=[], runs_used=0,
                      error=FAILED_WHY, created_at=BASE_TIME + timedelta(hours=8))])


def make_client(store_dir: Path, **overrides) -> TestClient:
    settings = Settings(data_dir=store_dir / "data", database_url=f"sqlite:///{store_dir / 'store.db'}",
                        nightly=False, **overrides)
    return TestClient(create_app(settings, start_runner=False))


@pytest.fixture(scope="module")
def client(store_dir) -> Iterator[TestClient]:
    with make_client(store_dir) as c:
        yield c


def page_data(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="page-data">(.*?)</script>', html, re.S)
    assert match, "no chart data in the page"
    return json.loads(match.group(1))


def run_id(client: TestClient, job_id: str, config: str) -> int:
    job = client.get(f"/api/v1/jobs/{job_id}").json()
    return next(r["id"] for r in job["runs"] if r["config"] == config)


def test_overview_shows_latest_verdicts_and_trends(client):
    resp = client.get("/")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    html = resp.text
    # one row per config and patch set: mamba2's unpatched build fails on the newest commit, and
    # its patched build (recorded last) passes there; neither hides the other
    rows = re.findall(r'<tr data-config="([^"]+)" data-patch-set="([^"]*)">', html)
    assert rows == [(GDN, ""), (MAMBA, ""), (MAMBA, "pr-fix")]
    unpatched = html[html.index(f'data-config="{MAMBA}" data-patch-set=""'):]
    unpatched = unpatched[:unpatched.index("</tr>")]
    patched = html[html.index(f'data-config="{MAMBA}" data-patch-set="pr-fix"'):]
    patched = patched[:patched.index("</tr>")]
    assert "ccc333" in unpatched and 'data-scenario="prefill_hit"><span class="badge v-fail"' in unpatched
    assert "ccc333" in patched and 'data-scenario="prefill_hit"><span class="badge v-pass"' in patched
    data = page_data(html)
    assert [c[1] for c in data["commits"]] == ["aaa111", "bbb222", "ccc333", "rel444"]
    charts = {c["config"]: c for c in data["charts"]}
    assert set(charts) == {MAMBA, GDN}
    assert charts[MAMBA]["threshold"] == 1e-8  # evalsvc/configs/smoke.yaml
    series = {s["name"]: s for s in charts[MAMBA]["series"]}
    assert set(series) == {"cold", "prefill_hit", "cold [pr-fix]", "prefill_hit [pr-fix]"}
    broken = series["prefill_hit"]
    assert broken["c"] == [0, 1, 2] and broken["fail"] == [2]  # the marker on the third commit
    assert broken["y"][2] == pytest.approx(0.05, rel=1e-3)
    assert series["cold"]["fail"] == [] and series["prefill_hit [pr-fix]"]["fail"] == []


def test_overview_filters(client):
    data = page_data(client.get("/", params={"model": "gdn"}).text)
    assert [c["config"] for c in data["charts"]] == [GDN]
    html = client.get("/", params={"scenario": "prefill_hit", "metric": "hit_coverage"}).text
    data = page_data(html)
    assert data["metric"] == "hit_coverage" and not data["log"]
    assert {s["name"].split(" ")[0] for c in data["charts"] for s in c["series"]} == {"prefill_hit"}
    assert all(c["threshold"] is None for c in data["charts"])  # the KL band only
    assert '<th>cold</th>' not in html and '<th>prefill_hit</th>' in html
    data = page_data(client.get("/", params={"branch": "release"}).text)
    assert [c[1] for c in data["commits"]] == ["rel444"]
    data = page_data(client.get("/", params={"commits": 2}).text)
    assert [c[1] for c in data["commits"]] == ["ccc333", "rel444"]
    empty = client.get("/", params={"matrix": "no-such-matrix", "model": ""})
    assert "No results match these filters" in empty.text and page_data(empty.text)["charts"] == []
    for bad in ({"metric": "nope"}, {"scenario": "nope"}):
        resp = client.get("/", params=bad)
        assert resp.status_code == 422 and "nope" in resp.text


def test_commits_page(client):
    html = client.get("/commits").text
    refs = re.findall(r'<tr data-commit="([^"]+)">', html)
    assert refs == ["sgl-project/sglang@rel444", "sgl-project/sglang@ccc333",
                    "sgl-project/sglang@bbb222", "sgl-project/sglang@aaa111"]
    newest_main = html[html.index('data-commit="sgl-project/sglang@ccc333"'):
                       html.index('data-commit="sgl-project/sglang@bbb222"')]
    assert re.search(r'data-patch-set="">.*?fail 1.*?pass 1', newest_main, re.S)
    assert re.search(r'data-patch-set="pr-fix">.*?pass 1', newest_main, re.S)
    assert "contender_patches=pr-fix" in newest_main
    assert client.get("/commits", params={"page": 2}).text.count("<tr data-commit") == 0
    assert re.findall(r'<tr data-commit="([^"]+)">',
                      client.get("/commits", params={"branch": "release"}).text) == [
        "sgl-project/sglang@rel444"]


def test_compare_lists_regressions_first_with_a_permalink(client):
    params = {"baseline": "sgl-project/sglang@bbb222", "contender": "sgl-project/sglang@ccc333"}
    html = client.get("/compare", params=params).text
    rows = re.findall(r'data-config="([^"]+)" data-scenario="([^"]+)" data-verdict="([^"]+)"', html)
    assert rows[0] == (MAMBA, "prefill_hit", "regression")
    assert sorted(rows[1:]) == [(GDN, "cold", "pass"), (GDN, "prefill_hit", "pass"),
                                (MAMBA, "cold", "pass")]
    permalink = html_lib.unescape(re.search(r'id="permalink" href="([^"]+)"', html).group(1))
    assert permalink.startswith("http://testserver/compare?")
    assert dict(parse_qsl(urlsplit(permalink).query)) == params
    # the regression was decided by the contender's own verdict: its history test's interval
    r = html[html.index(f'data-config="{MAMBA}" data-scenario="prefill_hit"'):]
    r = r[:r.index("</tr>")]
    assert re.search(r'<td class="decision" data-source="contender" data-metric="kl_k3_mean" '
                     r'data-method="history"', r)
    assert '<div class="interval">interval [0.0412, 0.0588] at 95%</div>' in r
    fixed = client.get("/compare", params={**params, "baseline": params["contender"],
                                           "contender_patches": "pr-fix"}).text
    assert re.findall(r'data-verdict="([^"]+)"', fixed) == ["improvement", "pass"]
    form = client.get("/compare").text
    assert 'name="baseline"' in form and "sgl-project/sglang@aaa111" in form
    missing = client.get("/compare", params={**params, "contender_patches": "nope"})
    assert missing.status_code == 404 and "contender: no build of" in missing.text


@pytest.mark.parametrize(("base", "cont", "verdict"), [
    ("pass", "fail", "regression"), ("fail", "pass", "improvement"), ("pass", "pass", "pass"),
    ("fail", "fail", "fail"), ("inconclusive", "fail", "inconclusive"), ("pass", None, "inconclusive"),
    ("error", "pass", "inconclusive"), ("pass", "expected", "regression"),
    ("expected", "pass", "improvement"), ("expected", "expected", "expected"),
    ("fail", "expected", "expected"), ("expected", "fail", "fail")])
def test_compare_verdict(base, cont, verdict):
    assert compare_verdict(base, cont) == verdict


def test_job_page_shows_builds_runs_and_an_escaped_log(client):
    html = client.get("/jobs/job-ccc333").text
    assert re.search(r"<th>probe answers</th><td class=\"probes\"><div><code>sglang</code>: 0.5.14",
                     html)
    assert "&#34;files&#34;: 3" in html  # the manifest, as JSON
    rid = run_id(client, "job-ccc333", MAMBA)
    section = html[html.index(f'id="run-{rid}"'):]
    assert re.search(r'data-arg="chunked_prefill_size">.*?"requested"><code>64</code>.*?'
                     r'"resolved"><code>64</code>', section, re.S)
    assert "&lt;script&gt;alert(&#39;log&#39;)&lt;/script&gt;" in section
    assert "<script>alert" not in html
    assert re.search(r'<tr class="diverged">\s*<td>prefill_hit</td>', section)
    assert client.get(f"/runs/{rid}", follow_redirects=False).headers["location"] == (
        f"/jobs/job-ccc333#run-{rid}")
    jobs = client.get("/jobs").text
    assert jobs.index("job-rel") < jobs.index("job-aaa111")
    assert "job-rel" not in client.get("/jobs", params={"status": "running"}).text


def test_sample_page_marks_the_first_divergence(client, store_dir):
    rid = run_id(client, "job-ccc333", MAMBA)
    resp = client.get(f"/runs/{rid}/samples/b", params={"scenario": "prefill_hit"})
    assert resp.status_code == 200
    ids = pd.read_parquet(next((store_dir / "results" / "job-ccc333").glob("*.parquet")))
    ids = ids.set_index(["scenario", "sample_id"]).loc[("prefill_hit", "b"), "output_ids"]
    marked = re.search(r'<a class="token first-divergence selected"\s+id="first-divergence" '
                       r'data-position="0" data-id="(\d+)".*?>\[(\d+)\]</a>', resp.text, re.S)
    assert marked and int(marked.group(1)) == int(marked.group(2)) == ids[0]
    assert "tokenizer is not on this machine" in resp.text  # no model_path in these runs
    data = page_data(resp.text)
    assert data["first"] == 0 and len(data["k3"]) == len(ids)
    at = client.get(f"/runs/{rid}/samples/b", params={"scenario": "prefill_hit", "position": 3})
    assert "At position 3" in at.text
    assert client.get(f"/runs/{rid}/samples/b", params={"position": 99}).status_code == 422
    assert client.get(f"/runs/{rid}/samples/b").status_code == 422  # in two scenarios


def test_sample_page_lists_the_extend_tokens_coloured_by_kl(tmp_path):
    result = run_result(MAMBA, {"prefill_hit": CLEAN}, sample_ids=["a", "b", "c"])
    row = result.scenarios[0].samples[1]
    served = [-0.5, -1.25, -2.0, -0.75]
    reference = [-3.5, -1.25, -2.0, -0.75 - 1e-7]  # position 0 far off
    row.update(extend_ids=[301, 302, 303, 304], extend_logprobs=served,
               extend_reference_logprobs=reference, extend_tokens=4,
               extend_kl_k3_mean=0.5, extend_kl_k3_max=2.05)
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        record(store, tmp_path / "results", "job-ext", build_ref("ddd444"), [result])
    finally:
        store.close()
    with make_client(tmp_path) as c:
        rid = run_id(c, "job-ext", MAMBA)
        html = c.get(f"/runs/{rid}/samples/b", params={"scenario": "prefill_hit"}).text
        assert '<a href="#extend">extend tokens</a>' in html
        start = html.index('id="extend-tokens"')
        table = html[start:html.index("</table>", start)]
        rows = re.findall(r'<tr id="extend-\d+" data-position="(\d+)">(.*?)</tr>', table, re.S)
        assert [int(p) for p, _ in rows] == [0, 1, 2, 3]
        first, last = rows[0][1], rows[3][1]
        assert "<code>[301]</code>" in first and "<td>-0.5</td><td>-3.5</td>" in first
        assert re.search(r'class="k3" style="background: hsl\(0, 70%, 65%\)">2\.05<', first)
        assert "[304]" in last and 'hsl(0, 70%' not in last  # a low k3 is not red
        # the chart draws the extend's per-token KL beside the generated tokens'
        data = page_data(html)
        assert len(data["extend_k3"]) == 4 and len(data["k3"]) == 4
        assert data["extend_k3"][0] == pytest.approx(2.05, rel=1e-2)
        assert data["extend_k3"][1:3] == [0.0, 0.0] and 0 < data["extend_k3"][3] < 1e-12
        assert 'id="token-chart-note"' in html
        # a sample without an extend has no such section
        other = c.get(f"/runs/{rid}/samples/a", params={"scenario": "prefill_hit"}).text
        assert 'id="extend-tokens"' not in other and "extend tokens" not in other
        assert page_data(other)["extend_k3"] == [] and 'id="token-chart-note"' not in other


EXTEND_WHY = ("extend KL (k3) 0.0032 above the limit 0.0005 (k3 0.19 at extend position 0 of "
              "40; positions 1+ at 1e-05)")
DEFECT = "defect:deferred-ops-dropped"


def with_extend(config: str, extend: float, fail: bool, cold: list[float] = CLEAN):
    """A run whose prefill_hit has an extend of mean KL ``extend``; ``fail``: its verdict is a
    fail on the extend's KL (the generated tokens' KL clean), as real SGLang's defect build's.
    ``cold``: the per-sample KL of its cold scenario."""
    r = run_result(config, {"cold": cold, "prefill_hit": CLEAN}, sample_ids=["a", "b", "c"])
    r.model = "mamba2" if config == MAMBA else "gdn"
    sc = next(sc for sc in r.scenarios if sc.scenario == "prefill_hit")
    sc.metrics.update(extend_kl_k3_mean=extend, extend_kl_k3_ci_low=extend * 0.7,
                      extend_kl_k3_ci_high=extend * 1.4, extend_kl_k3_n_samples=3)
    if fail:
        sc.verdict, sc.reason = "fail", EXTEND_WHY
        r.verdict, r.reason = "fail", f"prefill_hit: {EXTEND_WHY}"
    return r


@pytest.fixture(scope="module")
def extend_client(tmp_path_factory) -> Iterator[TestClient]:
    """One commit, clean and with a defect patch that fails prefill_hit on the extend's KL only:
    mamba2's run with its metric verdicts stored (as ``verdicts.judge_run`` writes them), gdn's
    with its scenario verdict alone. The defect build's mamba2 also has its cold KL a billion
    times the clean one's, far within the limit: a regression only the paired test sees."""
    tmp = tmp_path_factory.mktemp("extend")
    store = Store(f"sqlite:///{tmp / 'store.db'}")
    try:
        record(store, tmp / "results", "job-ext-clean", build_ref("eee555"),
               [with_extend(MAMBA, 2e-5, False), with_extend(GDN, 2e-5, False)])
        record(store, tmp / "results", "job-ext-defect", build_ref("eee555", patches=[DEFECT]),
               [with_extend(MAMBA, 3.2e-3, True, cold=[1e-4, 2e-4, 1.5e-4]),
                with_extend(GDN, 3.2e-3, True)])
        with store.session() as s:
            bad = s.scalar(select(Run.id).where(Run.job_id == "job-ext-defect",
                                                Run.config == MAMBA))
            s.add_all([
                VerdictRow(run_id=bad, scenario="prefill_hit", metric="kl_k3_mean", verdict="pass",
                        method="threshold", value=1.5e-13, threshold=5e-3),
                VerdictRow(run_id=bad, scenario="prefill_hit", metric="extend_kl_k3_mean",
                        verdict="regression", method="threshold", value=3.2e-3, threshold=5e-4,
                        reason=EXTEND_WHY)])
    finally:
        store.close()
    with make_client(tmp) as c:
        yield c


def cell(html: str, run: int, scenario: str) -> str:
    """A job page's matrix cell: run ``run``, scenario ``scenario``."""
    at = html.index(f'<tr data-run="{run}">')
    at = html.index(f'data-scenario="{scenario}"', at)
    return html[html.rindex("<td", 0, at):html.index("</td>", at)]


def test_a_matrix_cell_shows_the_metric_that_decided_its_verdict(extend_client):
    html = extend_client.get("/jobs/job-ext-defect").text
    why = html_lib.escape(EXTEND_WHY)
    for config in (MAMBA, GDN):  # with its metric verdicts stored, and from its reason alone
        c = cell(html, run_id(extend_client, "job-ext-defect", config), "prefill_hit")
        assert c.startswith('<td class="cell" data-scenario="prefill_hit" '
                            'data-decided="extend_kl_k3_mean">')
        lines = re.findall(r'<div class="([a-z ]+)" data-metric="([a-z0-9_]+)" title="([^"]*)">'
                           r'(.*?)</div>', c, re.S)
        # the extend's KL first, labelled, with the verdict's reason on hover
        assert [(cls, metric) for cls, metric, _, _ in lines] == [
            ("metric decided", "extend_kl_k3_mean"), ("metric", "kl_k3_mean"),
            ("metric", "hit_coverage")]
        _, _, title, text = lines[0]
        assert title == why
        assert re.fullmatch(r'extend KL 0\.0032 <span class="ci">\[0\.0022, 0\.0045\]</span>',
                            text.strip()), text
        assert lines[1][3].startswith("KL 1.5e-13") and "generated tokens" in lines[1][2]
        assert f'<span class="badge v-fail" title="{why}">fail</span>' in c
        # the scenario that passed shows the generated tokens' KL first, as before
        cold = cell(html, run_id(extend_client, "job-ext-defect", config), "cold")
        assert "data-decided" not in cold and "extend KL" not in cold
        assert re.search(r'<div class="metric" data-metric="kl_k3_mean"[^>]*>KL ', cold)
    clean = extend_client.get("/jobs/job-ext-clean").text
    c = cell(clean, run_id(extend_client, "job-ext-clean", MAMBA), "prefill_hit")
    assert "data-decided" not in c and "extend KL" not in c and "v-pass" in c


def decision(html: str, config: str, scenario: str) -> tuple[dict[str, str], str]:
    """A compare row's "decided by" cell: its data- attributes and title, and its text."""
    r = html[html.index(f'data-config="{config}" data-scenario="{scenario}"'):]
    r = r[r.index('<td class="decision"'):]
    r = r[:r.index("</td>")]
    attrs = dict(re.findall(r'(data-[a-z]+|title)="([^"]*)"', r[:r.index(">")]))
    return attrs, re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", r[r.index(">") + 1:])).strip()


def test_compare_shows_the_verdicts_own_test_and_labels_the_other_figures(extend_client):
    html = extend_client.get("/compare", params={
        "baseline": "sgl-project/sglang@eee555", "contender": "sgl-project/sglang@eee555",
        "contender_patches": DEFECT}).text
    rows = re.findall(r'data-config="([^"]+)" data-scenario="([^"]+)" data-verdict="([^"]+)"', html)
    assert sorted(rows) == [(GDN, "cold", "pass"), (GDN, "prefill_hit", "regression"),
                            (MAMBA, "cold", "regression"), (MAMBA, "prefill_hit", "regression")]
    # the figures of the chosen metric say what they are: for reading, not the verdict's test
    assert "kl_k3_mean, for reading (not the verdict's test)" in html
    assert "95% bootstrap interval of it" in html and "difference of the means" in html

    # failed on the extend: the contender's own verdict, its metric, statistic and limit, while
    # the generated tokens' KL columns show no difference
    attrs, text = decision(html, MAMBA, "prefill_hit")
    assert attrs == {"data-source": "contender", "data-metric": "extend_kl_k3_mean",
                     "data-method": "threshold", "title": html_lib.escape(EXTEND_WHY)}
    assert text == ("the contender's own verdict: fail extend_kl_k3_mean , fixed limit "
                    "value 0.0032, limit 0.0005 no interval: a fixed limit")
    r = html[html.index(f'data-config="{MAMBA}" data-scenario="prefill_hit"'):]
    assert '<td class="delta">0</td>' in r[:r.index("</tr>")]
    # without stored metric verdicts: the metric its reason names, and the reason
    attrs, text = decision(html, GDN, "prefill_hit")
    assert (attrs["data-source"], attrs["data-metric"], attrs["data-method"]) == (
        "contender", "extend_kl_k3_mean", "")
    assert text == f"the contender's own verdict: fail {EXTEND_WHY}"

    # both runs pass their limits, and the paired test finds the regression: its own test,
    # statistic and the interval it decided on
    attrs, text = decision(html, MAMBA, "cold")
    assert (attrs["data-source"], attrs["data-metric"], attrs["data-method"]) == (
        "paired", "kl_k3_mean", "history")
    assert attrs["title"].startswith("mean KL (k3) 0.00015 against 1.5e-13 over 1 earlier runs")
    assert text.startswith("paired test of the two builds kl_k3_mean , paired t-test on the log "
                           "scale mean difference 0.00015 (0.00015 against 1.5e-13), effect floor")
    low, high = map(float, re.search(r"interval \[([-\d.e+]+), ([-\d.e+]+)\] on the log scale "
                                     r"at 99.9%", text).groups())
    assert 0 < low < high  # on the log scale: it excludes no change
    # a pass: the paired test that found no regression, with its interval
    attrs, text = decision(html, GDN, "cold")
    assert (attrs["data-source"], attrs["data-method"]) == ("paired", "history")
    assert "interval [0, 0] on the log scale at 99.9%" in text


@pytest.mark.parametrize(("base", "cont", "verdict", "paired", "source", "why"), [
    ("fail", "pass", "improvement", None, "baseline", "mean KL (k3) 1 above 0.01"),
    ("pass", None, "inconclusive", None, "contender", "the contender run has no verdict of cold"),
    ("inconclusive", "pass", "inconclusive", None, "baseline", "hit coverage 0.00 below 0.50"),
    ("pass", "pass", "pass", None, "both", "no paired test of hit_coverage"),
    ("pass", "pass", "pass", {"metric": "kl_k3_mean", "method": "threshold", "reason": None,
                              "evidence": {"history": "too few samples (1 against 1)"}},
     "both", "no paired test of hit_coverage: too few samples (1 against 1)")])
def test_compare_decision(base, cont, verdict, paired, source, why):
    results = {(1, "cold"): (base, "mean KL (k3) 1 above 0.01" if base == "fail"
                             else "hit coverage 0.00 below 0.50")}
    if cont is not None:
        results[(2, "cold")] = (cont, None)
    # the paired judgement as compare_builds gives it: a stored verdict's read model (of the
    # fields the decision reads)
    row = {"scenario": "cold", "metric": "hit_coverage", "baseline_run": 1, "contender_run": 2,
           "baseline_verdict": base, "contender_verdict": cont, "verdict": verdict,
           "paired": None if paired is None else VerdictRead.model_construct(**paired)}
    d = compare_decision(row, results, {})
    assert (d["source"], d["reason"]) == (source, why)


@pytest.mark.parametrize(("verdict", "reason", "judged", "decided"), [
    ("pass", "", [], None), ("error", "engine died", [], None),
    ("fail", "mean KL (k3) 0.05 above the limit 1e-08", [], "kl_k3_mean"),
    ("fail", "not bit-exact under deterministic inference: extend KL (k3) 3e-07, 100.0% of "
             "tokens exact", [], "extend_kl_k3_mean"),
    ("fail", "accept length 1.200 below the floor 2.000", [], "accept_length"),
    ("fail", "no speculative counters in the responses", [], "accept_length"),
    ("inconclusive", "hit coverage 0.00 below 0.50: the cache path was not exercised", [],
     "hit_coverage"),
    # the stored verdicts decide, in judging's order: the generated tokens' KL before the extend's
    ("fail", "x", [{"metric": "extend_kl_k3_mean", "verdict": "regression", "method": "history"},
                   {"metric": "kl_k3_mean", "verdict": "regression", "method": "threshold"}],
     "kl_k3_mean"),
    ("fail", "x", [{"metric": "kl_k3_mean", "verdict": "pass", "method": "threshold"},
                   {"metric": "accept_length", "verdict": "regression", "method": "history"}],
     "accept_length")])
def test_deciding_verdict(verdict, reason, judged, decided):
    # the scenario's stored verdicts as the store reads them (of the fields deciding_verdict reads)
    judged = [VerdictRead.model_construct(**v) for v in judged]
    assert deciding_verdict(verdict, reason, judged)[0] == decided


def regression_ids(client: TestClient) -> dict[tuple[str, str], int]:
    return {(r["config"], r["scenario"]): r["id"] for r in client.get("/api/v1/regressions").json()}


def row(html: str, attr: str, value: object) -> str:
    """The table row (``<tr ...>`` .. ``</tr>``) whose ``attr`` is ``value``."""
    at = html.index(f'{attr}="{value}"')
    start = html.rindex("<tr", 0, at)
    return html[start:html.index("</tr>", at)]


def test_overview_counts_the_open_regressions(client):
    html = client.get("/").text
    summary = re.search(r'<p class="open-regressions has-open">(.*?)</p>', html, re.S).group(1)
    assert re.search(r'href="http://testserver/regressions">2 open regressions</a>, '
                     r'<span class="untriaged-count">1 untriaged</span>', summary)


def test_regressions_page_shows_open_ones_first_with_triage_and_evidence(client):
    ids = regression_ids(client)
    acked, untriaged, fixed = ids[(MAMBA, "prefill_hit")], ids[(GDN, "prefill_hit")], ids[(GDN, "cold")]
    resp = client.get("/regressions")
    assert resp.status_code == 200
    html = resp.text
    assert 'href="http://testserver/regressions">Regressions</a>' in html  # in the nav
    # open (newest first), then resolved
    assert re.findall(r'<tr id="regression-(\d+)"', html) == [str(untriaged), str(acked), str(fixed)]
    assert (html.index("<h2>Open (2)</h2>") < html.index(f'id="regression-{acked}"')
            < html.index("<h2>Resolved (1)</h2>") < html.index(f'id="regression-{fixed}"'))

    bad, good = run_id(client, "job-ccc333", MAMBA), run_id(client, "job-bbb222", MAMBA)
    a = row(html, "data-regression", acked)
    assert '<span class="badge v-open">open</span>' in a
    assert '<span class="triage triage-acknowledged">acknowledged</span>' in a
    assert ('<div class="comment">&lt;b&gt;snapshot race&lt;/b&gt; in the extra buffer: looking'
            '</div>') in a and "<b>snapshot race" not in html
    assert "2026-03-01 05:00 UTC" in a  # triaged at
    assert re.search(rf'class="first-bad"><a href="/runs/{bad}"[^>]*><code>ccc333</code>', a)
    assert re.search(rf'class="last-good"><a href="/runs/{good}"[^>]*><code>bbb222</code>', a)
    # the evidence of the verdict that opened it
    assert ('<span class="method">history</span>: <span class="value">0.05</span> vs baseline '
            '<span class="baseline">1.5e-13</span>') in a
    assert 'difference <span class="interval">[0.0412, 0.0588]</span> at 95%, 3 samples vs 6' in a
    assert 'effect floor <span class="threshold">2.5e-09</span>' in a
    assert 'p = <span class="p-value">3.2e-05</span>' in a
    assert f'<a href="/runs/{good}">{good}</a>' in a  # a baseline run
    assert re.search(rf'href="http://testserver/bisections/{DONE}">{DONE}</a> '
                     rf'<span class="badge v-done">done</span> first bad <code>{SHAS[2][:10]}</code>', a)

    u = row(html, "data-regression", untriaged)
    assert '<span class="triage triage-untriaged">untriaged</span>' in u and 'class="comment"' not in u
    assert 'class="last-good"><span class="muted">-</span>' in u
    assert '<span class="method">change_point</span>: <span class="value">2e-12</span>' in u
    assert 'effect floor <span class="threshold">3e-12</span>' in u
    assert 'p = <span class="p-value">0.004</span>' in u
    assert "change point: 1.5e-13 → 2e-12 at this run" in u
    assert '<td class="bisections"><span class="muted">none</span>' in u

    f = row(html, "data-regression", fixed)
    assert '<span class="badge v-resolved">resolved</span>' in f
    assert '<span class="triage triage-fixed">fixed</span>' in f and "fixed by pr-fix" in f
    resolver = run_id(client, "job-bbb222", GDN)
    assert f'resolved 2026-03-01 01:00 UTC by <a href="/runs/{resolver}">run {resolver}</a>' in f
    assert "no verdict recorded" in f

    # how to triage: the dashboard does not write
    curl = html_lib.unescape(re.search(r'<pre id="triage-curl">(.*?)</pre>', html, re.S).group(1))
    assert curl == (f"curl -X PATCH http://testserver/api/v1/regressions/{untriaged} -H "
                    """'content-type: application/json' -d '{"triage": "acknowledged", """
                    """"comment": "looking into it"}'""")
    assert "Authorization" not in curl  # this service has no write token


def test_the_triage_command_works_against_the_api(store_dir, tmp_path):
    """The curl a regression's row shows, sent as it is (on a copy of the store), triages it."""
    (tmp_path / "store.db").write_bytes((store_dir / "store.db").read_bytes())
    with make_client(tmp_path, api_token="write-secret") as c:
        fixed = regression_ids(c)[(GDN, "cold")]
        html = c.get("/regressions").text
        command = html_lib.unescape(re.search(r'<pre>(curl .*?)</pre>',
                                              row(html, "data-regression", fixed), re.S).group(1))
        args = shlex.split(command.replace("$EVALSVC_API_TOKEN", "write-secret"))
        assert args[:3] == ["curl", "-X", "PATCH"]
        url = args[3]
        headers = dict(h.split(": ", 1) for flag, h in zip(args[4::2], args[5::2], strict=True)
                       if flag == "-H")
        assert headers["Authorization"] == "Bearer write-secret"
        body = args[args.index("-d") + 1]
        resp = c.request("PATCH", url, headers=headers, content=body)
        assert resp.status_code == 200, resp.text
        assert (resp.json()["triage"], resp.json()["comment"]) == ("acknowledged", "looking into it")
        f = row(c.get("/regressions").text, "data-regression", fixed)
        assert '<span class="triage triage-acknowledged">acknowledged</span>' in f
        assert "looking into it" in f and "fixed by pr-fix" not in f


def test_bisections_page_lists_them_newest_first(client):
    acked = regression_ids(client)[(MAMBA, "prefill_hit")]
    html = client.get("/bisections").text
    assert 'href="http://testserver/bisections">Bisections</a>' in html  # in the nav
    assert re.findall(r'<tr data-bisection="([^"]+)"', html) == [FAILED, DONE]
    done = row(html, "data-bisection", DONE)
    assert '<span class="badge v-done">done</span>' in done
    assert '<td class="runs-used">2 <span class="muted">of at most 4</span></td>' in done
    assert f'<code class="first-bad" title="{SHAS[2]}">{SHAS[2][:10]}</code>' in done
    assert f'href="http://testserver/regressions#regression-{acked}">#{acked}</a>' in done
    assert "mamba2-eb-ov-c64 / prefill_hit / kl_k3_mean" in done
    failed = row(html, "data-bisection", FAILED)
    assert f'<span class="error" title="{html_lib.escape(FAILED_WHY)}">failed</span>' in failed
    assert "gdn-eb-ov-c64 / prefill_hit / any failure" in failed


def test_bisection_page_shows_its_steps_and_the_first_bad_commit(client):
    bad, good = run_id(client, "job-ccc333", MAMBA), run_id(client, "job-bbb222", MAMBA)
    html = client.get(f"/bisections/{DONE}").text
    assert f'<td id="first-bad"><code class="first-bad">{SHAS[2]}</code></td>' in html
    assert f'<code class="good">{GOOD_SHA}</code>' in html and f'<code class="bad">{SHAS[4]}</code>' in html
    assert re.search(r'class="candidates-count">5<', html)
    assert ('2 of at most <span class="bound">4</span> <span class="muted">(ceil(log2(5)) = 3, '
            '+ 1: the bad end was run; 1 stored run reused)</span>') in html
    steps = re.findall(r'<tr class="step ([a-z -]+)" data-sha="([0-9a-f]+)"', html)
    assert steps == [("bad", SHAS[4]), ("good", SHAS[1]), ("bad first-bad", SHAS[2])]
    first = row(html, "data-sha", SHAS[4])
    assert 'href="http://testserver/jobs/job-ccc333">job job-ccc333</a>' in first
    assert f'<a href="/runs/{bad}">run {bad}</a>' in first
    assert "mean KL (k3) 0.05 above the limit" in first
    reused = row(html, "data-sha", SHAS[1])
    assert "stored run (reused)" in reused and f'<a href="/runs/{good}">run {good}</a>' in reused
    assert f"{SHAS[2][:10]}</code> <strong>first bad</strong>" in row(html, "data-sha", SHAS[2])
    assert re.findall(r'<li class="candidate ([a-z_]+)"><code>([0-9a-f]+)</code>', html) == [
        ("untested", SHAS[0]), ("good", SHAS[1]), ("first_bad", SHAS[2]), ("untested", SHAS[3]),
        ("bad", SHAS[4])]

    failed = client.get(f"/bisections/{FAILED}").text
    assert f'<td id="first-bad"><span class="error">{html_lib.escape(FAILED_WHY)}</span>' in failed
    assert "No steps yet." in failed and 'class="first-bad"' not in failed


@pytest.mark.parametrize(("n", "steps", "bound"), [
    (5, [], 3), (4, [], 2), (1, [{"sha": "c0", "reused": False, "bad": True}], 1),
    (5, [{"sha": "c4", "reused": True, "bad": True}], 3),
    (5, [{"sha": "c4", "reused": False, "bad": True}], 4), (0, [], None)])
def test_bisection_bound(n, steps, bound):
    candidates = [f"c{i}" for i in range(n)]
    b = bisection_view(BisectionRead(
        id="b1", status="running", repository="/repo", good="g", matrix="smoke", config="cfg",
        scenario="cold", metric=None, runs_used=0, error=None, regression_id=None,
        created_at=BASE_TIME, finished_at=None,
        candidates=candidates, bad=candidates[-1] if n else "c0", steps=steps, first_bad=None))
    assert b.bound == bound


def test_run_page_lists_the_verdicts(client):
    rid = run_id(client, "job-ccc333", MAMBA)
    html = client.get("/jobs/job-ccc333").text
    section = html[html.index(f'id="run-{rid}"'):]
    section = section[:section.index("</section>")]
    regression = row(section, "data-scenario", "prefill_hit")
    assert regression.startswith('<tr class="row-regression" data-scenario="prefill_hit" '
                                 'data-metric="kl_k3_mean" data-verdict="regression">')
    cells = dict(re.findall(r'<td class="([a-z-]+)">(.*?)</td>', regression, re.S))
    assert cells == {"method": "history", "value": "0.05",
                     "baseline": '1.5e-13 <span class="muted">(2 runs)</span>',
                     "interval": '[0.0412, 0.0588] <span class="muted">95%</span>',
                     "threshold": '2.5e-09 <span class="muted">effect floor</span>',
                     "p-value": "3.2e-05",
                     "reason": "mean KL (k3) 0.05 against 1.5e-13 over 2 earlier runs"}
    passed = row(section, "data-scenario", "cold")
    assert 'class="row-pass"' in passed and '<td class="threshold">1e-08 <span class="muted">limit' in passed
    other = run_id(client, "job-ccc333", GDN)
    other_section = html[html.index(f'id="run-{other}"'):]
    assert "No verdicts recorded for this run." in other_section[:other_section.index("</section>")]


def test_empty_store_says_so(tmp_path):
    with make_client(tmp_path) as c:
        assert re.search(r'<p class="open-regressions">\s*<a href="[^"]+">No open regressions</a>',
                         c.get("/").text)
        html = c.get("/regressions").text
        assert "No open regressions." in html and "No resolved regressions." in html
        assert "api/v1/regressions/REGRESSION_ID" in html
        assert "No bisections." in c.get("/bisections").text


def test_jobs_show_how_many_of_their_runs_errored(tmp_path):
    """A job done with one errored run of two: the list and its page say 1 of 2 errored; a job
    without errored runs says nothing of them."""
    from evalsvc.types import RunResult

    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        errored = RunResult(config=GDN, fingerprint=fingerprint_of(GDN), model="gdn",
                            settings={}, requested_args={}, verdict="error",
                            reason="engine did not start")
        record(store, tmp_path / "results", "job-some", build_ref("aaa111"),
               [results(MAMBA, "mamba2", CLEAN), errored])
        record(store, tmp_path / "results", "job-clean", build_ref("bbb222", hours=1),
               [results(MAMBA, "mamba2", CLEAN)])
    finally:
        store.close()
    with make_client(tmp_path) as c:
        jobs = c.get("/jobs").text
        row = jobs[jobs.index('data-job="job-some"'):]
        row = row[:row.index("</tr>")]
        assert re.search(r'<td class="status"><span class="badge v-done">done</span> '
                         r'<span class="runs-errored" title="[^"]+">1 of 2 runs errored</span>',
                         row), row
        page = c.get("/jobs/job-some").text
        assert '<span class="runs-errored"' in page and "1 of 2 runs errored" in page
        clean = jobs[jobs.index('data-job="job-clean"'):]
        assert "errored" not in clean[:clean.index("</tr>")]
        assert "errored" not in c.get("/jobs/job-clean").text


def test_a_jobs_page_reads_its_spec_typed(tmp_path):
    """The job's facts come from its stored spec read as a ``JobSpec`` (the matrix's name, the
    engine, the configs, the SGLang environment and model asked); a spec of an older shape, which
    is no ``JobSpec``, says so instead of printing the raw data."""
    from evalsvc.store.record import ensure_job

    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        with store.session() as s:
            ensure_job(s, "job-typed", "api", job_spec(
                engine="sglang", configs=[MAMBA], engine_env="cpu-0.5.17", model="qwen3-next-tiny"),
                status="done")
            ensure_job(s, "job-old", "api", {"matrix": "a-matrix-no-longer-there"},
                       status="done")
    finally:
        store.close()
    with make_client(tmp_path) as c:
        html = c.get("/jobs/job-typed").text
        assert f"<th>matrix</th><td>smoke, engine sglang, configs {MAMBA}</td>" in html
        assert '<td class="engine-env">cpu-0.5.17 / qwen3-next-tiny</td>' in html
        old = c.get("/jobs/job-old").text
        assert "a job spec of an older shape, not readable as a job" in old
        assert "a-matrix-no-longer-there" not in old


@pytest.mark.parametrize("path", [
    "/jobs/no-such-job", "/runs/999999", "/runs/999999/samples/a",
    "/runs/1/samples/no-such-sample", "/runs/1/samples/a?scenario=host_tier",
    "/bisections/no-such-bisection"])
def test_unknown_things_are_404(client, path):
    resp = client.get(path, follow_redirects=False)
    assert resp.status_code == 404 and "Not found" in resp.text


def test_pages_need_the_read_token(store_dir):
    with make_client(store_dir, api_token="write-secret", read_token="read-secret") as c:
        for path in ("/", "/commits", "/jobs", "/jobs/job-aaa111", "/compare", "/runs/1",
                     "/runs/1/samples/a?scenario=cold", "/regressions", "/bisections",
                     f"/bisections/{DONE}"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            for token in ("read-secret", "write-secret"):
                resp = c.get(path, headers={"Authorization": f"Bearer {token}"},
                             follow_redirects=False)
                assert resp.status_code in (200, 303), (path, resp.status_code)
        # the assets hold no results: served without a token
        assert c.get("/static/dashboard.css").status_code == 200
        plotly = c.get("/vendor/plotly.min.js")
        assert plotly.status_code == 200 and len(plotly.content) > 1_000_000
        assert plotly.headers["content-type"].startswith("text/javascript")

