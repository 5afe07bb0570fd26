"""The pages in process (Starlette's test client) over a store of hand-built runs: what each page
shows, filters, 404s, the read token, and escaping."""

from __future__ import annotations

import html as html_lib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pandas as pd
import pytest
from fastapi.testclient import TestClient

from evalsvc.api.app import create_app
from evalsvc.dashboard.views import compare_verdict
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from tests.store.factories import build_ref, record, run_result

MAMBA, GDN = "mamba2-eb-ov-c64", "gdn-eb-ov-c64"
CLEAN = [1e-13, 2e-13, 1.5e-13]
BROKEN = [0.05, 0.04, 0.06]  # above the factories' threshold: fail
LOG = "engine up\n<script>alert('log')</script>\nlast line\n"


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
    finally:
        store.close()
    return tmp


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
    # mamba2's newest run is the patched build's (recorded last on the newest commit): a pass
    assert re.search(rf'data-config="{MAMBA}">.*?pr-fix.*?v-pass', html, re.S)
    data = page_data(html)
    assert [c[1] for c in data["commits"]] == ["aaa111", "bbb222", "ccc333", "rel444"]
    charts = {c["config"]: c for c in data["charts"]}
    assert set(charts) == {MAMBA, GDN}
    assert charts[MAMBA]["threshold"] == 1e-8  # configs/smoke.yaml
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
    ("error", "pass", "inconclusive")])
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


@pytest.mark.parametrize("path", [
    "/jobs/no-such-job", "/runs/999999", "/runs/999999/samples/a",
    "/runs/1/samples/no-such-sample", "/runs/1/samples/a?scenario=host_tier"])
def test_unknown_things_are_404(client, path):
    resp = client.get(path, follow_redirects=False)
    assert resp.status_code == 404 and "Not found" in resp.text


def test_pages_need_the_read_token(store_dir):
    with make_client(store_dir, api_token="write-secret", read_token="read-secret") as c:
        for path in ("/", "/commits", "/jobs", "/jobs/job-aaa111", "/compare", "/runs/1",
                     "/runs/1/samples/a?scenario=cold"):
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
