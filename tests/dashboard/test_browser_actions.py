"""Acting from the dashboard in chromium, on the served store of the browser tests (after them:
these change it): signing in and out, triaging a regression from its page and seeing who did it,
starting a bisection from a regression, posting a comparison job from the compare page and
following it to done (also for two path: builds), cancelling a running job, and being refused as
a read user or without the form's CSRF token."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest
import yaml

from evalsvc.store.db import Store
from tests.dashboard.conftest import ALICE, CONFIGS, DEFECT, GIT_CONFIG
from tests.store.factories import record, run_result, sglang_build_ref

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dashboard")]


def open_regression(dashboard, **where) -> int:
    """The id of the session job's open regression of ``where`` (config, scenario, metric)."""
    found = [r["id"] for r in dashboard.client.get("/api/v1/regressions",
                                                    params={"state": "open"}).json()
             if all(r[k] == v for k, v in where.items()) and r["patch_set"] == DEFECT]
    assert len(found) == 1, found
    return found[0]


def history(page) -> list[tuple[str, str, str]]:
    rows = page.locator("table.history tbody tr")
    return [(rows.nth(i).locator(".who").inner_text(), rows.nth(i).locator(".what").inner_text(),
             rows.nth(i).locator(".comment").inner_text()) for i in range(rows.count())]


def test_sign_in_and_out(stranger, dashboard):
    dashboard.wait()
    page = stranger.open("/regressions")  # no session: the sign-in page, coming back here
    assert page.url.startswith(f"{dashboard.url}/login?next=")
    page.fill('input[name="token"]', "not-" + ALICE)
    page.click('#sign-in-form button[type="submit"]')
    page.wait_for_load_state("networkidle")
    assert page.locator("#form-error").inner_text() == "token: not a token of this service"
    stranger.expect_errors(401)
    page.fill('input[name="token"]', ALICE)
    page.click('#sign-in-form button[type="submit"]')
    page.wait_for_load_state("networkidle")
    assert page.url == f"{dashboard.url}/regressions"
    assert page.locator("#signed-in").inner_text() == "alice write"
    cookie, = page.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax"
    page.click("nav form.sign-out button")
    page.wait_for_load_state("networkidle")
    assert page.url == f"{dashboard.url}/login"
    assert page.locator("#signed-in").count() == 0
    page = stranger.open("/jobs")
    assert page.url.startswith(f"{dashboard.url}/login?next=")


def test_triage_a_regression_from_its_page(tab, dashboard):
    """From the regressions list to a regression's page, acknowledged with a comment: the page
    and the list say who did it and when, and the API has it."""
    dashboard.wait()
    regression_id = open_regression(dashboard, config=CONFIGS[0], scenario="prefill_hit",
                                    metric="kl_k3_mean")
    page = tab.open("/regressions")
    page.click(f"#regression-{regression_id} a.regression-link")
    page.wait_for_load_state("networkidle")
    assert page.url == f"{dashboard.url}/regressions/{regression_id}"
    assert page.locator("#history .empty").inner_text() == "Nobody has acted on it yet."
    form = page.locator("#triage-form")
    form.locator('input[name="triage"][value="acknowledged"]').check()
    form.locator('textarea[name="comment"]').fill("snapshot race: looking into it")
    form.locator('button[type="submit"]').click()
    page.wait_for_load_state("networkidle")
    assert page.url == f"{dashboard.url}/regressions/{regression_id}#history"
    assert page.locator("#regression-facts .triage").inner_text() == "acknowledged"
    assert page.locator("#regression-facts .comment").inner_text() == (
        "snapshot race: looking into it")
    (who, what, comment), = history(page)
    assert (who, what, comment) == ("alice", "triaged acknowledged",
                                    "snapshot race: looking into it")
    assert page.locator("table.history .via").inner_text() == "dashboard"

    page = tab.open("/regressions")
    row = page.locator(f"#regression-{regression_id}")
    assert row.locator(".triage").inner_text() == "acknowledged"
    assert row.locator(".triaged-by").inner_text() == "alice"
    event, = dashboard.client.get("/api/v1/audit", params={
        "target_type": "regression", "target_id": regression_id}).json()
    assert (event["user"], event["action"], event["details"]["triage"]) == (
        "alice", "triage", "acknowledged")
    reg = dashboard.client.get(f"/api/v1/regressions/{regression_id}").json()
    assert (reg["triage"], reg["comment"]) == ("acknowledged", "snapshot race: looking into it")


def test_a_read_user_sees_no_controls_and_is_refused(reader, dashboard):
    """Bob (role read) reads the pages without their controls; the triage form sent as it would
    be (with his session's valid CSRF token) is refused with 403 and changes nothing."""
    dashboard.wait()
    regression_id = open_regression(dashboard, config=CONFIGS[1], scenario="branching",
                                    metric="kl_k3_mean")
    page = reader.open(f"/regressions/{regression_id}")
    assert page.locator("#signed-in").inner_text() == "bob read"
    assert page.locator("#triage-form, #bisect-form").count() == 0
    assert "need a user of role write" in page.locator("#no-controls").inner_text()
    for path in (f"/jobs/{dashboard.job_id}", "/jobs/new", "/commits", "/jobs"):
        reader.open(path)
        assert page.locator("form.card, #cancel-form, .post-job, #post-job").count() == 0, path
    csrf = page.locator("nav form.sign-out input[name=csrf_token]").get_attribute("value")
    resp = page.request.post(f"{dashboard.url}/regressions/{regression_id}/triage",
                             form={"triage": "fixed", "comment": "not mine", "csrf_token": csrf})
    assert resp.status == 403
    assert resp.json()["detail"].startswith("bob has the read role")
    reg = dashboard.client.get(f"/api/v1/regressions/{regression_id}").json()
    assert reg["triage"] is None
    assert dashboard.client.get("/api/v1/audit", params={"user": "bob"}).json() == []


def test_an_action_without_the_csrf_token_is_refused(tab, dashboard):
    """The triage form with its CSRF token removed, then with another one, as a page from
    another site would send it: 403 naming the token, and nothing stored."""
    dashboard.wait()
    regression_id = open_regression(dashboard, config=CONFIGS[1], scenario="prefill_hit",
                                    metric="kl_k3_mean")
    for tamper in ("el => el.remove()", "el => { el.value = 'forged' }"):
        page = tab.open(f"/regressions/{regression_id}")
        form = page.locator("#triage-form")
        form.locator("input[name=csrf_token]").evaluate(tamper)
        form.locator('input[name="triage"][value="fixed"]').check()
        form.locator('textarea[name="comment"]').fill("forged")
        with page.expect_response(f"**/regressions/{regression_id}/triage") as answer:
            form.locator('button[type="submit"]').click()
        assert answer.value.status == 403
        page.wait_for_load_state("networkidle")
        assert page.locator("h1").inner_text() == "Not allowed"
        assert page.locator("p.error").inner_text().startswith(
            "csrf_token: missing, or not this session's")
        tab.expect_errors(403)
    reg = dashboard.client.get(f"/api/v1/regressions/{regression_id}").json()
    assert reg["triage"] is None and reg["comment"] is None
    assert dashboard.client.get("/api/v1/audit", params={
        "target_type": "regression", "target_id": regression_id}).json() == []


def test_post_a_comparison_job_and_follow_it_to_done(tab, dashboard):
    """From the compare page of the job's two builds (unpatched, and with the defect), the same
    comparison again on one config and 2 prompts: the job's page follows it to done, links to
    its comparison, and says alice posted it."""
    dashboard.wait()
    page = tab.open("/commits")
    page.click(f"text=unpatched vs {DEFECT}")
    page.wait_for_load_state("networkidle")
    form = page.locator("#job-form")
    assert form.locator('select[name="matrix"]').input_value() == "smoke"
    assert form.locator('input[name="second_build"]').is_checked()
    assert form.locator('input[name="contender_patches"]').input_value() == DEFECT
    checked = form.locator('input[name="configs"]:checked')
    assert sorted(checked.nth(i).get_attribute("value") for i in range(checked.count())) == sorted(
        CONFIGS)
    form.locator(f'input[name="configs"][value="{CONFIGS[1]}"]').uncheck()
    form.locator('input[name="num_prompts"]').fill("2")
    form.locator('button[type="submit"]').click()
    page.wait_for_load_state("networkidle")
    assert page.url.startswith(f"{dashboard.url}/jobs/dashboard-")
    job_id = page.url.rsplit("/", 1)[1]
    facts = page.locator("#job-facts")
    (who, what, _), = history(page)
    assert (who, what) == ("alice", f"submitted the job (smoke: {CONFIGS[0]}; 2 builds)")
    # the page polls the job and reloads once it is done (the test never reloads it)
    page.wait_for_selector("#job-facts:not([data-poll-job]) .status .v-done", timeout=300_000)
    assert facts.locator(".progress-text").inner_text() == "2 / 2 runs"
    rows = page.locator("table.matrix tbody tr")
    assert rows.count() == 2
    assert page.locator('table.matrix [data-scenario="prefill_hit"] .badge').all_inner_texts() == [
        "pass", "fail"]
    page.click("#job-facts a[href*='/compare?']")
    page.wait_for_load_state("networkidle")
    assert page.locator(f'table.compare tr[data-config="{CONFIGS[0]}"]').count() > 0
    job = dashboard.client.get(f"/api/v1/jobs/{job_id}").json()
    assert (job["trigger"], job["status"], job["spec"]["configs"]) == (
        "dashboard", "done", [CONFIGS[0]])


def test_post_a_job_for_two_path_builds_from_their_compare_page(tab, dashboard):
    """The compare page of two path: builds (SGLang builds of two local trees, recorded as the
    service records them: the tree's hash for a version) pre-fills their own path: sources, and
    the job posted from it runs on them to done: the embedded engine reads each tree's settings,
    the second's with the snapshot-race defect."""
    dashboard.wait()
    trees, refs = dashboard.repo.parent / "trees", []
    store = Store(dashboard.database_url, migrate=False)
    try:
        for i, (name, defects) in enumerate((("clean", {}), ("defect", {"snapshot-race": 1.0}))):
            tree = trees / name
            tree.mkdir(parents=True)
            (tree / "evalsvc-engine.yaml").write_text(yaml.safe_dump({"defects": defects}))
            build = sglang_build_ref("path", str(tree), hours=i)
            record(store, dashboard.repo.parent / "results", f"path-builds-{name}", build,
                   [run_result(CONFIGS[0], {"cold": [1e-13] * 2, "prefill_hit": [1e-13] * 2})])
            refs.append(build.ref)
    finally:
        store.close()
    assert "==tree-" in refs[0]  # the tree's hash for a version
    page = tab.open("/compare?" + urlencode({"baseline": refs[0], "contender": refs[1]}))
    form = page.locator("#job-form")
    assert form.locator('input[name="baseline_source"]').input_value() == f"path:{trees / 'clean'}"
    assert form.locator('input[name="contender_source"]').input_value() == (
        f"path:{trees / 'defect'}")
    assert form.locator('input[name="second_build"]').is_checked()
    checked = form.locator('input[name="configs"]:checked')
    assert [checked.nth(i).get_attribute("value") for i in range(checked.count())] == [CONFIGS[0]]
    form.locator('input[name="num_prompts"]').fill("2")
    form.locator('button[type="submit"]').click()
    page.wait_for_load_state("networkidle")
    assert page.url.startswith(f"{dashboard.url}/jobs/dashboard-"), page.content()[:3000]
    job_id = page.url.rsplit("/", 1)[1]
    page.wait_for_selector("#job-facts:not([data-poll-job]) .status .v-done", timeout=300_000)
    assert page.locator('table.matrix [data-scenario="prefill_hit"] .badge').all_inner_texts() == [
        "pass", "fail"]
    job = dashboard.client.get(f"/api/v1/jobs/{job_id}").json()
    assert job["status"] == "done"
    assert [b["source"] for b in job["spec"]["builds"]] == [
        f"path:{trees / 'clean'}", f"path:{trees / 'defect'}"]


def test_start_a_bisection_from_a_regression(tab, dashboard, git_regression):
    """The git repository's bad commit is the next after the good one: the bisection that the
    regression's page starts reuses the stored run of the bad end and names it the first bad
    commit; the bisection and the regression pages say alice started it."""
    page = tab.open(f"/regressions/{git_regression.id}")
    assert page.locator(".last-good code").inner_text() == git_regression.good[:10]
    page.locator('#bisect-form button[type="submit"]').click()
    page.wait_for_load_state("networkidle")
    assert page.url.startswith(f"{dashboard.url}/bisections/bisect-")
    bisect_id = page.url.rsplit("/", 1)[1]
    (who, what, _), = history(page)
    assert who == "alice"
    assert what == f"started bisection {bisect_id} (1 candidate, {GIT_CONFIG} / prefill_hit)"
    bisection = dashboard.client.get(f"/api/v1/bisections/{bisect_id}").json()
    for _ in range(120):
        if bisection["status"] in ("done", "failed"):
            break
        page.wait_for_timeout(500)
        bisection = dashboard.client.get(f"/api/v1/bisections/{bisect_id}").json()
    assert (bisection["status"], bisection["first_bad"]) == ("done", git_regression.bad)
    assert bisection["regression_id"] == git_regression.id
    assert [s["reused"] for s in bisection["steps"]] == [True]
    page = tab.open(f"/bisections/{bisect_id}")
    assert page.locator("#first-bad code").inner_text() == git_regression.bad
    page = tab.open(f"/regressions/{git_regression.id}")
    assert page.locator(f"td.bisections a[href$='{bisect_id}']").count() == 1
    assert [w for w, _, _ in history(page)] == ["alice"]


def test_cancel_a_running_job(tab, dashboard):
    """A job posted from /jobs/new, cancelled from its page while it runs: it ends cancelled,
    and its page says who posted and who cancelled it, and when the cancel was asked (also once
    the job has ended: the runner may stop it before the page after the click renders)."""
    dashboard.wait()
    page = tab.open("/jobs")
    page.click("#post-job")
    page.wait_for_load_state("networkidle")
    form = page.locator("#job-form")
    form.locator(f'input[name="configs"][value="{CONFIGS[1]}"]').check()
    form.locator('input[name="num_prompts"]').fill("2")
    form.locator('button[type="submit"]').click()
    page.wait_for_load_state("networkidle")
    job_id = page.url.rsplit("/", 1)[1]
    assert dashboard.wait_for(job_id, ("running", *("done", "failed", "cancelled")))[
        "status"] == "running"
    page = tab.open(f"/jobs/{job_id}")
    page.locator('#cancel-form button[type="submit"]').click()
    page.wait_for_load_state("networkidle")
    assert "asked" in page.locator("#job-facts .cancelling").inner_text()
    assert page.locator("#cancel-form").count() == 0
    page.wait_for_selector("#job-facts:not([data-poll-job]) .status .v-cancelled", timeout=120_000)
    asked = page.locator("#job-facts .cancelling").inner_text()
    assert asked.startswith("asked ") and "next step" not in asked, asked
    assert [(w, what) for w, what, _ in history(page)] == [
        ("alice", f"submitted the job (smoke: {CONFIGS[1]}; 1 build)"),
        ("alice", "cancelled the job (cancelling)")]
    assert dashboard.wait_for(job_id)["status"] == "cancelled"
