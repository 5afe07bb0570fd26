"""Acting from the dashboard's pages, in process (Starlette's test client, the runner off), on
SQLite and PostgreSQL: a triage, a cancel and a job posted through the forms go through the
service code the API uses and are recorded with the user and the time (as the API's are); the
regression, job and bisection pages show that history; read users get the pages without the
controls and are refused the forms' writes; no form is taken without its CSRF token; bad input
names the field and stores nothing."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from evalsvc.app import create_app
from evalsvc.builds import engine_envs, sglang_env
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import AuditEvent, Job, Regression, Run
from tests.dashboard.test_sign_in import ALICE, BOB, SECRET, USERS, csrf_of, sign_in
from tests.store.factories import (
    BASE_TIME,
    build_ref,
    fingerprint_of,
    job_spec,
    record,
    run_result,
    sglang_build_ref,
)

CONFIG = "mamba2-eb-ov-c64"
FAKE_PYTHON = str(Path(__file__).parents[1] / "data" / "fake-python")
WRITE_TOKEN = {"Authorization": "Bearer write-secret-token"}


@pytest.fixture
def regression_id(db_url, tmp_path) -> int:
    """An open, untriaged regression over one recorded run."""
    store = Store(db_url)
    try:
        record(store, tmp_path / "results", "job-a", build_ref("aaa111"),
               [run_result(CONFIG, {"cold": [1e-13, 2e-13]})])
        with store.session() as s:
            run_id = s.scalars(select(Run.id)).one()
            r = Regression(fingerprint=fingerprint_of(CONFIG), scenario="cold",
                           metric="kl_k3_mean", config=CONFIG, matrix="smoke", state="open",
                           first_run_id=run_id, last_run_id=run_id, runs_seen=1,
                           opened_at=BASE_TIME)
            s.add(r)
            s.flush()
            return r.id
    finally:
        store.close()


def make_client(tmp_path: Path, db_url: str, **overrides) -> TestClient:
    settings = Settings(data_dir=tmp_path / "data", database_url=db_url, nightly=False,
                        users=USERS, session_secret=SECRET, api_token="write-secret-token",
                        **overrides)
    return TestClient(create_app(settings, start_runner=False))


def counts(db_url: str) -> tuple[int, int]:
    """Audit events and jobs stored."""
    store = Store(db_url, migrate=False)
    try:
        with store.session() as s:
            return (s.scalar(select(func.count()).select_from(AuditEvent)),
                    s.scalar(select(func.count()).select_from(Job)))
    finally:
        store.close()


def history(html: str) -> list[tuple[str, str, str]]:
    """The page's history rows: (who, what, comment)."""
    section = html[html.index('id="history"'):]
    return [(who, re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", what)).strip(), comment.strip())
            for who, what, comment in re.findall(
                r'<td class="who">(.*?)</td>\s*<td class="what">(.*?)</td>\s*'
                r'<td class="comment">(.*?)</td>', section, re.S)]


def test_a_triage_from_the_page_is_recorded_with_the_user(tmp_path, db_url, regression_id):
    with make_client(tmp_path, db_url) as c:
        assert sign_in(c, ALICE).status_code == 303
        page = c.get(f"/regressions/{regression_id}")
        assert 'id="triage-form"' in page.text and 'id="bisect-form"' in page.text
        assert "Nobody has acted on it yet." in page.text
        resp = c.post(f"/regressions/{regression_id}/triage", follow_redirects=False,
                      data={"triage": "acknowledged", "comment": "looking into <it>",
                            "csrf_token": csrf_of(page.text)})
        assert resp.status_code == 303
        assert resp.headers["location"] == f"/regressions/{regression_id}#history"
        reg = c.get(f"/api/v1/regressions/{regression_id}").json()
        assert (reg["triage"], reg["comment"]) == ("acknowledged", "looking into <it>")

        # the API's triage goes through the same code, recorded under the token's user
        resp = c.patch(f"/api/v1/regressions/{regression_id}", headers=WRITE_TOKEN,
                       json={"triage": "expected", "comment": "an intended change"})
        assert resp.status_code == 200
        page = c.get(f"/regressions/{regression_id}").text
        assert history(page) == [
            ("alice", "triaged acknowledged", "looking into &lt;it&gt;"),
            ("api-token", "triaged expected (was acknowledged)", "an intended change")]
        events = c.get("/api/v1/audit", params={"target_type": "regression"}).json()
        assert [(e["user"], e["via"], e["action"], e["target_id"], e["details"]["triage"])
                for e in events] == [
            ("api-token", "api", "triage", str(regression_id), "expected"),
            ("alice", "dashboard", "triage", str(regression_id), "acknowledged")]
        assert all(e["at"].startswith("20") for e in events)
        listing = c.get("/regressions").text
        assert '<span class="triaged-by">api-token</span>' in listing


def test_bad_form_input_names_the_field_and_stores_nothing(tmp_path, db_url, regression_id):
    before = counts(db_url)
    with make_client(tmp_path, db_url) as c:
        assert sign_in(c, ALICE).status_code == 303
        csrf = csrf_of(c.get(f"/regressions/{regression_id}").text)
        for data, named in (({"triage": "bogus"}, "triage: Input should be"),
                            ({"triage": "fixed", "comment": "a\x00b"}, "comment: Value error"),
                            ({"triage": "fixed", "comment": "x" * 4001}, "comment: String")):
            resp = c.post(f"/regressions/{regression_id}/triage", data={**data, "csrf_token": csrf})
            assert resp.status_code == 422, resp.text
            assert named in resp.text, (named, re.search(r'id="form-error">(.*?)<', resp.text))
        # a bisection needs a good and a bad git commit, which this regression lacks
        resp = c.post(f"/regressions/{regression_id}/bisect", data={"csrf_token": csrf})
        assert resp.status_code == 422
        assert "regression_id: regression" in resp.text and "no good and bad git commits" in resp.text
        # a job on a config the matrix has not
        resp = c.post("/jobs", data={"matrix": "smoke", "configs": ["no-such-config"],
                                     "csrf_token": csrf})
        assert resp.status_code == 422
        assert "configs: no-such-config not in matrix smoke" in resp.text
        assert 'value="no-such-config"' not in resp.text  # the form shows the matrix's own
        resp = c.post("/jobs", data={"matrix": "smoke", "num_prompts": "many", "csrf_token": csrf})
        assert resp.status_code == 422 and "num_prompts" in resp.text
        resp = c.post("/jobs", data={"matrix": "smoke", "baseline_patches": "defect:nope",
                                     "csrf_token": csrf})
        assert resp.status_code == 422 and "builds[0].patches: unknown &#39;defect:nope&#39;" in resp.text
        # a release that is no version number: refused here, as by the API, not failed later
        resp = c.post("/jobs", data={"matrix": "smoke", "second_build": "1",
                                     "contender_source": "sglang==tree-ebeb8633e652",
                                     "csrf_token": csrf})
        assert resp.status_code == 422
        assert ("builds.1.source: Value error, &#39;sglang==tree-ebeb8633e652&#39;: "
                "&#39;tree-ebeb8633e652&#39; is not a version number") in resp.text
        reg = c.get(f"/api/v1/regressions/{regression_id}").json()
        assert reg["triage"] is None and reg["comment"] is None
    assert counts(db_url) == before


def test_no_form_is_taken_without_its_csrf_token(tmp_path, db_url, regression_id):
    with make_client(tmp_path, db_url) as c:
        assert sign_in(c, ALICE).status_code == 303
        c.post("/api/v1/jobs", json={"matrix": "smoke"}, headers=WRITE_TOKEN)
        before = counts(db_url)
        job_id = c.get("/api/v1/jobs").json()[0]["id"]
        forms = [(f"/regressions/{regression_id}/triage", {"triage": "fixed"}),
                 (f"/regressions/{regression_id}/bisect", {}),
                 ("/jobs", {"matrix": "smoke"}), (f"/jobs/{job_id}/cancel", {})]
        for path, data in forms:
            for csrf in ({}, {"csrf_token": "forged"}):
                resp = c.post(path, data={**data, **csrf}, follow_redirects=False)
                assert resp.status_code == 403, (path, csrf, resp.status_code)
                assert "csrf_token: missing, or not this session" in resp.text
        assert c.get(f"/api/v1/jobs/{job_id}").json()["status"] == "queued"
        assert c.get(f"/api/v1/regressions/{regression_id}").json()["triage"] is None
    assert counts(db_url) == before


def test_a_read_user_sees_no_controls_and_is_refused_the_writes(tmp_path, db_url, regression_id):
    with make_client(tmp_path, db_url) as c:
        c.post("/api/v1/jobs", json={"matrix": "smoke"}, headers=WRITE_TOKEN)
        job_id = c.get("/api/v1/jobs", headers=WRITE_TOKEN).json()[0]["id"]
        before = counts(db_url)
        assert sign_in(c, BOB).status_code == 303
        pages = {f"/regressions/{regression_id}": ("triage-form", "bisect-form"),
                 f"/jobs/{job_id}": ("cancel-form",), "/jobs/new": ("job-form",),
                 "/compare": ("post-job",), "/jobs": ("post-job",)}
        for path, controls in pages.items():
            html = c.get(path).text
            for control in controls:
                assert f'id="{control}"' not in html, (path, control)
        assert 'id="no-controls"' in c.get(f"/regressions/{regression_id}").text
        csrf = csrf_of(c.get("/").text)  # the sign-out form's: a forged form has a valid token
        for path, data in ((f"/regressions/{regression_id}/triage", {"triage": "fixed"}),
                           (f"/regressions/{regression_id}/bisect", {}),
                           ("/jobs", {"matrix": "smoke"}), (f"/jobs/{job_id}/cancel", {})):
            resp = c.post(path, data={**data, "csrf_token": csrf})
            assert resp.status_code == 403, (path, resp.text)
            assert resp.json()["detail"].startswith("bob has the read role")
        # bob's token on the API's writes: not a write token
        resp = c.patch(f"/api/v1/regressions/{regression_id}", json={"triage": "fixed"},
                       headers={"Authorization": f"Bearer {BOB}"})
        assert resp.status_code == 401
        assert c.get(f"/api/v1/jobs/{job_id}").json()["status"] == "queued"
    assert counts(db_url) == before


def test_posting_and_cancelling_a_job_from_the_pages_is_recorded(tmp_path, db_url):
    with make_client(tmp_path, db_url) as c:
        assert sign_in(c, ALICE).status_code == 303
        form = c.get("/jobs/new").text
        assert 'id="job-form"' in form
        configs = re.findall(r'name="configs" value="([^"]+)"', form)
        assert CONFIG in configs and len(configs) == 9  # the smoke matrix's
        resp = c.post("/jobs", follow_redirects=False, data={
            "matrix": "smoke", "configs": [CONFIG, "gdn-eb-ov-c64"], "baseline_source": "",
            "baseline_patches": "", "second_build": "1", "contender_source": "",
            "contender_patches": "defect:snapshot-race", "num_prompts": "2", "track": "1",
            "priority": "5", "csrf_token": csrf_of(form)})
        assert resp.status_code == 303
        job_id = resp.headers["location"].rsplit("/", 1)[1]
        job = c.get(f"/api/v1/jobs/{job_id}").json()
        assert (job["trigger"], job["status"], job["priority"]) == ("dashboard", "queued", 5)
        assert job["spec"]["configs"] == [CONFIG, "gdn-eb-ov-c64"] and job["spec"]["track"]
        assert [b["patches"] for b in job["spec"]["builds"]] == [[], ["defect:snapshot-race"]]
        assert job["spec"]["matrix"]["workload"]["num_prompts"] == 2

        page = c.get(f"/jobs/{job_id}").text
        resp = c.post(f"/jobs/{job_id}/cancel", data={"csrf_token": csrf_of(page)},
                      follow_redirects=False)
        assert resp.status_code == 303 and resp.headers["location"] == f"/jobs/{job_id}"
        assert c.get(f"/api/v1/jobs/{job_id}").json()["status"] == "cancelled"
        page = c.get(f"/jobs/{job_id}").text
        assert 'id="cancel-form"' not in page
        assert history(page) == [
            ("alice", "submitted the job (smoke: mamba2-eb-ov-c64, gdn-eb-ov-c64; 2 builds, "
                      "tracked)", ""),
            ("alice", "cancelled the job (cancelled)", "")]
        # cancelling it again changes nothing, and records nothing
        c.post(f"/jobs/{job_id}/cancel", data={"csrf_token": csrf_of(page)})
        assert len(history(c.get(f"/jobs/{job_id}").text)) == 2
        assert c.post("/jobs/no-such-job/cancel", data={"csrf_token": csrf_of(page)}
                      ).status_code == 404


def test_the_job_form_offers_the_engine_environments_and_models_the_api_lists(
        tmp_path, db_url, monkeypatch):
    """/jobs/new offers the same engine environments and models as the API, by name; what it
    posts is checked as the API checks it, and refused with the API's words."""
    monkeypatch.setattr(engine_envs, "SGLANG_CPU_ENV", tmp_path / "no-sglang-cpu")
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(tmp_path / "no-sglang-envs"))
    with make_client(tmp_path, db_url, engine_python=FAKE_PYTHON,
                     engine_envs={"other": FAKE_PYTHON}) as c:
        assert sign_in(c, ALICE).status_code == 303
        form = c.get("/jobs/new", params={"matrix": "mamba-full", "engine_env": "other"}).text
        envs = re.search(r'<select name="engine_env".*?</select>', form, re.S).group(0)
        assert re.findall(r'<option value="([^"]*)"', envs) == ["", "default", "other"]
        assert "default (default)" in envs and 'value="other" selected' in envs
        assert "other: sglang 0.5.23" in envs  # the fake environment's release
        models = re.search(r'<select name="model".*?</select>', form, re.S).group(0)
        assert re.findall(r'<option value="([^"]*)"', models) == [
            m["name"] for m in [{"name": ""}, *c.get("/api/v1/models").json()]]
        data = {"matrix": "mamba-full", "configs": [], "csrf_token": csrf_of(form)}
        resp = c.post("/jobs", follow_redirects=False,
                      data={**data, "engine_env": "other", "model": "qwen3-next-tiny"})
        assert resp.status_code == 303, resp.text
        job = c.get(f"/api/v1/jobs/{resp.headers['location'].rsplit('/', 1)[1]}").json()
        assert job["spec"]["engine_env"] == "other"
        assert {m["path"].rsplit("/", 1)[1] for m in job["spec"]["matrix"]["models"].values()} \
            == {"qwen3-next-tiny"}
        before = counts(db_url)
        for field, value, words in (
                ("engine_env", "nope", "engine_env: unknown engine environment &#39;nope&#39; "
                                       "(known: default, other)"),
                ("model", "/etc", "model: &#39;/etc&#39; is outside the directories models are "
                                  "served from")):
            resp = c.post("/jobs", data={**data, field: value})
            assert resp.status_code == 422 and words in resp.text, resp.text
            assert "EVALSVC_MODELS_DIR" in resp.text or field == "engine_env"
        assert counts(db_url) == before


def test_a_running_jobs_page_says_when_its_cancel_was_asked_also_once_it_ended(tmp_path,
                                                                                  db_url):
    """A cancel of a running job is asked, then the runner ends it: its page says when the cancel
    was asked while it runs, and still does once it has ended (without the pending step)."""
    with make_client(tmp_path, db_url) as c:
        assert sign_in(c, ALICE).status_code == 303
        job_id = c.post("/api/v1/jobs", headers=WRITE_TOKEN,
                        json={"matrix": "smoke", "configs": [CONFIG]}).json()["id"]
        store = Store(db_url, migrate=False)
        try:
            with store.session() as s:  # the runner has taken it up
                s.get(Job, job_id).status = "running"
            page = c.get(f"/jobs/{job_id}").text
            assert 'class="cancelling"' not in page and 'id="cancel-form"' in page
            c.post(f"/jobs/{job_id}/cancel", data={"csrf_token": csrf_of(page)})
            asked = re.search(r'<td class="cancelling">(.*?)</td>', c.get(f"/jobs/{job_id}").text)
            assert asked and asked.group(1).startswith("asked ")
            assert asked.group(1).endswith("the job stops at its next step")
            with store.session() as s:  # the runner has stopped it
                job = s.get(Job, job_id)
                job.status, job.finished_at = "cancelled", job.cancel_requested_at
        finally:
            store.close()
        page = c.get(f"/jobs/{job_id}").text
        ended = re.search(r'<td class="cancelling">(.*?)</td>', page)
        assert ended and ended.group(1) == asked.group(1).removesuffix(
            ": the job stops at its next step")
        assert "next step" not in ended.group(1) and 'id="cancel-form"' not in page


def test_the_job_form_is_prefilled_from_a_commit_and_a_comparison(tmp_path, db_url):
    store = Store(db_url)
    try:
        for patches in ([], ["pr-fix"]):
            record(store, tmp_path / "results", f"job-{len(patches)}",
                   build_ref("ccc333", patches=patches), [run_result(CONFIG, {"cold": [1e-13]})])
    finally:
        store.close()
    ref = "sgl-project/sglang@ccc333"
    with make_client(tmp_path, db_url) as c:
        assert sign_in(c, ALICE).status_code == 303
        commits = c.get("/commits").text
        link = re.search(r'class="post-job" href="([^"]+)"', commits).group(1)
        form = c.get(link.replace("&amp;", "&")).text
        assert 'name="baseline_source" size="56" value="git:sgl-project/sglang@ccc333"' in form
        assert 'name="second_build" value="1">' in form  # one build, unless asked for two
        compare = c.get("/compare", params={"baseline": ref, "contender": ref,
                                             "contender_patches": "pr-fix"}).text
        assert 'id="job-form"' in compare
        assert re.search(rf'name="configs" value="{CONFIG}" checked', compare)
        assert 'name="contender_patches" size="36" value="pr-fix"' in compare
        assert 'name="second_build" value="1" checked' in compare


def test_the_job_form_prefills_each_builds_own_source(tmp_path, db_url):
    """A comparison of two path: builds of SGLang (recorded with their trees' hashes for versions)
    pre-fills their path: sources, which the service takes; git and release builds pre-fill
    their git: source at the commit and their sglang==VERSION."""
    trees = {}
    for name, defects in (("clean", {}), ("defect", {"snapshot-race": 1.0})):
        trees[name] = tmp_path / "trees" / name
        trees[name].mkdir(parents=True)
        (trees[name] / "evalsvc-engine.yaml").write_text(yaml.safe_dump({"defects": defects}))
    sha = hashlib.sha1(b"main").hexdigest()
    builds = {"clean": sglang_build_ref("path", str(trees["clean"])),
              "defect": sglang_build_ref("path", str(trees["defect"]), hours=1),
              "git": sglang_build_ref("git", "https://github.com/sgl-project/sglang", sha, hours=2),
              "pypi": sglang_build_ref("pypi", "sglang", "0.5.17", hours=3)}
    store = Store(db_url)
    try:
        for name, build in builds.items():
            record(store, tmp_path / "results", f"job-{name}", build,
                   [run_result(CONFIG, {"cold": [1e-13, 2e-13]})])
    finally:
        store.close()
    clean, defect = builds["clean"].ref, builds["defect"].ref
    assert clean == f"{trees['clean']}==tree-{builds['clean'].version[5:]}"  # as SGLang's are
    with make_client(tmp_path, db_url, allowed_sources=[f"path:{tmp_path}/trees/*"]) as c:
        assert sign_in(c, ALICE).status_code == 303
        compare = c.get("/compare", params={"baseline": clean, "contender": defect}).text
        fields = dict(re.findall(r'name="((?:baseline|contender)_source)" size="56" '
                                 r'value="([^"]*)"', compare))
        assert fields == {"baseline_source": f"path:{trees['clean']}",
                          "contender_source": f"path:{trees['defect']}"}
        assert re.search(rf'name="configs" value="{CONFIG}" checked', compare)
        resp = c.post("/jobs", follow_redirects=False, data={
            "matrix": "smoke", "configs": [CONFIG], **fields, "second_build": "1",
            "num_prompts": "2", "csrf_token": csrf_of(compare)})
        assert resp.status_code == 303, resp.text[-3000:]
        job = c.get(f"/api/v1/jobs/{resp.headers['location'].rsplit('/', 1)[1]}").json()
        assert [b["source"] for b in job["spec"]["builds"]] == [
            f"path:{trees['clean']}", f"path:{trees['defect']}"]
        for name, source in (("git", f"git:https://github.com/sgl-project/sglang@{sha}"),
                             ("pypi", "sglang==0.5.17"), ("clean", f"path:{trees['clean']}")):
            form = c.get("/jobs/new", params={"baseline": builds[name].ref}).text
            assert f'name="baseline_source" size="56" value="{source}"' in form, name


def test_a_known_failure_triaged_with_its_link_shows_as_expected_on_the_pages(tmp_path, db_url):
    """A tracked config fails prefill_hit past its limit and opens a regression; triaged expected
    from its page with a link (a link that is not an http(s) URL is refused, naming the field),
    the next commit's run is expected there: on the overview and the job page the scenario's
    verdict is expected, not pass, with the regression and the link beside it."""
    from evalsvc.alerts import collect
    from tests.store.factories import record_judged

    link = "https://github.com/sgl-project/sglang/pull/29068"
    store = Store(db_url)
    spec = job_spec(engine="embedded", track=True)

    def nightly(i: int) -> int:
        run_id = record_judged(
            store, tmp_path / "results", job_id=f"n{i}", trigger="nightly", spec=spec,
            build=build_ref(f"c{i}", hours=i), matrix="smoke",
            result=run_result(CONFIG, {"cold": [1e-13, 2e-13], "prefill_hit": [0.05, 0.06]}))
        with store.session() as s:  # judged and tracked where it was recorded
            collect(s, f"n{i}")
        return run_id

    try:
        nightly(0)
        with store.session() as s:
            [reg_id] = s.scalars(select(Regression.id)).all()
        with make_client(tmp_path, db_url) as c:
            assert sign_in(c, ALICE).status_code == 303
            page = c.get(f"/regressions/{reg_id}").text
            assert 'name="link"' in page
            form = {"triage": "expected", "comment": "the kernel's varlen conv1d",
                    "csrf_token": csrf_of(page)}
            refused = c.post(f"/regressions/{reg_id}/triage",
                             data={**form, "link": "javascript:alert(1)"})
            assert refused.status_code == 422 and "link: Value error, an http(s) URL" in refused.text
            assert c.get(f"/api/v1/regressions/{reg_id}").json()["triage"] is None
            resp = c.post(f"/regressions/{reg_id}/triage", data={**form, "link": link},
                          follow_redirects=False)
            assert resp.status_code == 303
            reg = c.get(f"/api/v1/regressions/{reg_id}").json()
            assert (reg["triage"], reg["link"]) == ("expected", link)
            assert reg["expected_level"] == pytest.approx(0.055)
            assert f'href="{link}"' in c.get(f"/regressions/{reg_id}").text
            assert f'<div class="triage-link"><a href="{link}"' in c.get("/regressions").text
            # the API's triage takes the same link, and refuses the same
            resp = c.patch(f"/api/v1/regressions/{reg_id}", headers=WRITE_TOKEN,
                           json={"triage": "expected", "link": "ftp://example.com/x"})
            assert resp.status_code == 422 and "http(s) URL" in resp.text
            resp = c.patch(f"/api/v1/regressions/{reg_id}", headers=WRITE_TOKEN,
                           json={"triage": "expected", "comment": "the kernel's varlen conv1d",
                                 "link": link})
            assert resp.status_code == 200 and resp.json()["link"] == link
            assert resp.json()["expected_level"] == pytest.approx(0.055)

            run_id = nightly(1)
            scenarios = c.get(f"/api/v1/runs/{run_id}").json()["scenarios"]
            assert {s["scenario"]: s["verdict"] for s in scenarios} == {
                "cold": "pass", "prefill_hit": "expected"}
            overview = c.get("/").text
            cell = re.search(r'<td class="scenario" data-scenario="prefill_hit">(.*?)</td>',
                             overview, re.S).group(1)
            assert 'class="badge v-expected"' in cell
            assert f'/regressions/{reg_id}">#{reg_id}</a>' in cell
            assert f'class="known-link" href="{link}"' in cell and "PR #29068" in cell
            job = c.get("/jobs/n1").text
            cell = re.search(r'<td class="cell" data-scenario="prefill_hit"([^>]*)>(.*?)</td>',
                             job, re.S)
            # the metric the known failure holds leads the cell
            assert cell.group(1) == ' data-decided="kl_k3_mean"'
            assert 'class="badge v-expected"' in cell.group(2) and f'href="{link}"' in cell.group(2)
            assert c.get("/api/v1/regressions", params={"state": "open"}).json()[0]["runs_seen"] == 2
            assert [a["job_id"] for a in c.get("/api/v1/alerts").json()] == ["n0"]
    finally:
        store.close()
