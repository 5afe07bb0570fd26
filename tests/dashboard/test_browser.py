"""Every page in chromium over a store filled by a real job (clean and snapshot-race builds of the
embedded engine): no console errors, charts drawn, the regression on the overview and the compare
page, the first divergent token marked, arguments and manifests on the job page, live progress,
the regressions the job opened and their runs."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from sqlalchemy import select

from evalsvc.store.db import Store
from evalsvc.store.models import Build, Run, SampleRow
from evalsvc.tokenization import load_tokenizer
from tests.dashboard.conftest import CONFIGS, DEFECT, FAILING

# one worker under pytest-xdist (--dist loadgroup): one job fills the store, and the first test
# watches it run
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dashboard")]

TREND_CHARTS = """() => Array.from(document.querySelectorAll('.chart[data-metric="kl_k3_mean"]'))
  .map(el => ({config: el.closest('section').querySelector('h3').firstChild.textContent.trim(),
               traces: el.data.map(t => ({name: t.name, y: t.y})),
               shapes: el.layout.shapes.map(s => [s.type, s.y1]),
               paths: el.querySelectorAll('svg path').length}))"""


def test_jobs_page_follows_the_running_job_until_it_is_done(tab, dashboard):
    """Opened right after the job was submitted: the page polls the job and reloads once it is
    done, showing its verdicts (the test never reloads it)."""
    page = tab.open("/jobs")
    row = f'tr[data-job="{dashboard.job_id}"]'
    assert page.locator(f"{row}[data-poll-job]").count() == 1, "the job finished before the test"
    page.wait_for_selector(f"{row}:not([data-poll-job]) .status .v-done", timeout=300_000)
    assert page.locator(f"{row} .progress-text").inner_text() == "4 / 4 runs"
    assert page.locator(f"{row} .v-fail").inner_text() == "fail 2"
    assert page.locator(f"{row} .v-pass").inner_text() == "pass 2"
    dashboard.wait()


def test_overview_shows_latest_verdicts_trends_and_the_regression(tab, dashboard):
    dashboard.wait()
    page = tab.open("/")
    for config in CONFIGS:  # a row per build: the clean one passes, the defect build fails
        assert page.locator(f'table.latest tr[data-config="{config}"]').count() == 2
        clean = page.locator(f'table.latest tr[data-config="{config}"][data-patch-set=""]')
        assert clean.locator("td").nth(2).inner_text() == "-"
        assert clean.locator('[data-scenario="prefill_hit"]').inner_text() == "pass"
        row = page.locator(f'table.latest tr[data-config="{config}"][data-patch-set="{DEFECT}"]')
        assert row.locator("td").nth(2).inner_text() == DEFECT
        assert row.locator('[data-scenario="prefill_hit"]').inner_text() == "fail"
        assert row.locator('[data-scenario="cold"]').inner_text() == "pass"
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length === 2")
    charts = page.evaluate(TREND_CHARTS)
    assert sorted(c["config"] for c in charts) == sorted(CONFIGS)
    for c in charts:
        assert c["paths"] > 0
        assert ["line", 1e-8] in c["shapes"]  # the pass band ends at the smoke threshold
        traces = {t["name"]: t["y"] for t in c["traces"]}
        assert max(traces["prefill_hit"]) < 1e-8 < min(traces[f"prefill_hit [{DEFECT}]"])
        # the regression markers: the failing scenarios of the defect build, nothing else
        assert sorted(traces["fail"]) == sorted(y for s in FAILING for y in traces[f"{s} [{DEFECT}]"])

    page = tab.open("/?scenario=prefill_hit&model=gdn")
    assert page.locator("table.latest tbody tr").count() == 2  # clean and defect builds
    assert page.locator("table.latest thead th").all_inner_texts()[-1] == "prefill_hit"
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length === 1")
    (chart,) = page.evaluate(TREND_CHARTS)
    assert chart["config"] == "gdn-eb-ov-c64"
    assert {t["name"] for t in chart["traces"]} == {"prefill_hit", f"prefill_hit [{DEFECT}]", "fail"}


def test_compare_lists_the_regressions_first(tab, dashboard):
    dashboard.wait()
    page = tab.open("/commits")
    page.click(f"text=unpatched vs {DEFECT}")
    page.wait_for_load_state("networkidle")
    assert "contender_patches=defect" in page.url
    assert page.locator("#permalink").inner_text() == page.url
    rows = page.locator("table.compare tbody tr")
    verdicts = [rows.nth(i).get_attribute("data-verdict") for i in range(rows.count())]
    n = len(CONFIGS) * len(FAILING)
    assert verdicts == ["regression"] * n + ["pass"] * 4, verdicts  # cold and decode_hit pass
    regressed = {(rows.nth(i).get_attribute("data-config"), rows.nth(i).get_attribute("data-scenario"))
                 for i in range(n)}
    assert regressed == {(c, s) for c in CONFIGS for s in FAILING}
    first = rows.nth(0)
    assert float(first.locator(".delta").inner_text()) > 1e-6


def _diverged_sample(dashboard) -> tuple[int, str, int, int, str]:
    """A prefill_hit sample of the defect build that diverged (latest first divergence first):
    run id, sample id, first divergence, the token id there, and that token's text."""
    store = Store(dashboard.database_url)
    try:
        with store.session() as s:
            run, sample = s.execute(
                select(Run, SampleRow).join(SampleRow, SampleRow.run_id == Run.id).join(Build)
                .where(Build.patch_set == DEFECT, SampleRow.scenario == "prefill_hit",
                       SampleRow.first_divergence.is_not(None))
                .order_by(SampleRow.first_divergence.desc(), Run.id)).first()
            run_id, sample_id, first = run.id, sample.sample_id, sample.first_divergence
            path, model = run.samples_path, run.requested_args["model_path"]
    finally:
        store.close()
    ids = pd.read_parquet(path).set_index("sample_id").loc[sample_id, "output_ids"]
    token = int(ids[first])
    return run_id, sample_id, first, token, load_tokenizer(model).decode([token])


def test_drilldown_marks_the_first_divergent_token(tab, dashboard):
    dashboard.wait()
    run_id, sample_id, first, token, text = _diverged_sample(dashboard)
    page = tab.open(f"/runs/{run_id}/samples/{sample_id}?scenario=prefill_hit")
    marked = page.locator(".token.first-divergence")
    assert marked.count() == 1
    assert marked.get_attribute("id") == "first-divergence"
    assert int(marked.get_attribute("data-position")) == first
    assert int(marked.get_attribute("data-id")) == token
    assert marked.text_content() == text
    assert page.locator(".tokens .token").count() == 24  # max_new_tokens of the smoke workload
    page.wait_for_selector("#token-chart.js-plotly-plot")
    assert page.locator("#token-chart svg path").count() > 0
    # the extend's per-token KL beside the generated tokens', one bar per token of each
    traces = page.evaluate("document.getElementById('token-chart').data.map(t => [t.name, t.x.length])")
    extend = page.locator("#extend-tokens tbody tr").count()
    assert extend > 0 and traces == [["extend", extend], ["generated", 24]]
    assert page.locator("h2", has_text="At position").inner_text() == f"At position {first}"

    # both sides' top-k at that position, most likely first, the generated token among them
    top = page.locator("table.topk tbody tr")
    assert top.count() == 5  # TOP_K of the scenarios
    for col in (3, 6):  # probability columns of decode and reference
        probs = [float(top.nth(i).locator("td").nth(col).inner_text()) for i in range(5)]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    assert page.locator(f'table.topk td.generated[data-id="{token}"]').count() >= 1

    page.locator('.token[data-position="0"]').click()  # another position, by its token
    page.wait_for_load_state("networkidle")
    assert page.url.endswith("position=0")
    assert page.locator(".token.selected").get_attribute("data-position") == "0"
    assert page.locator(".token.first-divergence").get_attribute("data-position") == str(first)


def test_job_page_shows_the_matrix_resolved_arguments_and_builds(tab, dashboard):
    job = dashboard.wait()
    page = tab.open(f"/jobs/{dashboard.job_id}")
    rows = page.locator("table.matrix tbody tr")
    assert rows.count() == 4
    cells = {}
    for i in range(4):
        tds = rows.nth(i).locator("td")
        key = (tds.nth(0).inner_text(), DEFECT in tds.nth(1).inner_text())
        cells[key] = rows.nth(i).locator('[data-scenario="prefill_hit"] .badge').inner_text()
    assert cells == {(c, defect): "fail" if defect else "pass" for c in CONFIGS
                     for defect in (False, True)}
    # every run's every scenario: cold, prefill_hit, decode_hit, branching, chunked_hit
    assert page.locator("table.matrix td.cell", has_text="KL").count() == 4 * 5
    # the failing cells show the metric that failed first, with the verdict's reason on hover
    decided = page.locator("table.matrix td.cell[data-decided] .decided")
    assert decided.count() == len(CONFIGS) * len(FAILING)
    for i in range(decided.count()):
        line = decided.nth(i)
        assert line.get_attribute("data-metric") == "kl_k3_mean"  # before the extend's
        assert line.inner_text().startswith("KL ")
        assert "mean KL (k3)" in line.get_attribute("title")

    builds = page.locator("section.build")
    assert builds.count() == 2
    assert builds.nth(1).locator(".patches").inner_text().strip() == DEFECT
    assert builds.nth(0).locator(".patches").inner_text().strip() == "none"
    assert builds.nth(1).locator("details.manifest").count() == 1

    run_id = job["runs"][0]["id"]
    run = page.locator(f"#run-{run_id}")
    strategy = run.locator('tr[data-arg="mamba_radix_cache_strategy"]')
    assert strategy.locator(".requested").inner_text() == '"extra_buffer"'
    assert strategy.locator(".resolved").inner_text() == '"extra_buffer"'
    model = run.locator('tr[data-arg="model_path"]')
    assert model.get_attribute("class") == "differs"  # a shipped name resolved to its directory
    assert model.locator(".resolved").inner_text().endswith('hybrid-mamba2-tiny"')
    run.locator("details.log summary").click()
    assert re.search(r"Uvicorn running|Application startup complete",
                     run.locator("pre.log").inner_text())


def test_commits_page_shows_each_builds_verdicts(tab, dashboard):
    dashboard.wait()
    page = tab.open("/commits")
    assert page.locator("table.commits tbody tr").count() == 1
    unpatched = page.locator('.build[data-patch-set=""]')
    defect = page.locator(f'.build[data-patch-set="{DEFECT}"]')
    assert unpatched.locator(".badge").all_inner_texts() == ["pass 2"]
    assert defect.locator(".badge").all_inner_texts() == ["fail 2"]


def test_regressions_page_links_each_regression_to_its_run(tab, dashboard):
    """The tracked job's defect build opened a regression per config, failing scenario and metric
    (the generated tokens' KL and the extend's); the first bad commit's link leads to the run,
    whose verdicts show the regression."""
    job = dashboard.wait()
    page = tab.open("/")
    n = len(CONFIGS) * len(FAILING) * 2
    assert page.locator(".open-regressions").inner_text() == f"{n} open regressions, {n} untriaged"
    page.click(".open-regressions a")
    page.wait_for_load_state("networkidle")
    assert page.url.endswith("/regressions")
    rows = page.locator("table.regressions tr.regression")
    assert rows.count() == n
    found = {tuple(rows.nth(i).get_attribute(f"data-{a}") for a in ("config", "scenario", "metric"))
             for i in range(n)}
    assert found == {(c, s, m) for c in CONFIGS for s in FAILING
                     for m in ("kl_k3_mean", "extend_kl_k3_mean")}
    assert rows.locator(".triage").all_inner_texts() == ["untriaged"] * n
    assert page.locator("#triage-curl").inner_text().startswith(
        f"curl -X PATCH {dashboard.url}/api/v1/regressions/")

    defect_runs = {r["id"]: r for r in job["runs"] if DEFECT in r["build"]}
    row = page.locator(f'tr.regression[data-config="{CONFIGS[0]}"][data-scenario="prefill_hit"]'
                        '[data-metric="kl_k3_mean"]')
    assert row.locator(".evidence .method").inner_text() in ("threshold", "bit_exact")
    link = row.locator(".first-bad a")
    run_id = int(link.get_attribute("href").rsplit("/", 1)[1])
    assert defect_runs[run_id]["config"] == CONFIGS[0]
    link.click()
    page.wait_for_load_state("networkidle")
    assert page.url.endswith(f"/jobs/{dashboard.job_id}#run-{run_id}")
    verdict = page.locator(f'#run-{run_id} table.verdicts tr[data-scenario="prefill_hit"]'
                           '[data-metric="kl_k3_mean"]')
    assert verdict.get_attribute("class") == "row-regression"
    assert verdict.locator(".badge").inner_text() == "regression"
    assert verdict.is_visible()
