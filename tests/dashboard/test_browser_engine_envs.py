"""The job form in a browser starts real-engine jobs on either of two engine environments: a
service of its own (the session's dashboard has none) that finds the sglang-cpu environment and one
built for another release where their builders make them (tests/fake_envs.py: the fake SGLang
server behind each, reporting its environment's release). A write user posts the sglang-cpu matrix
from /jobs/new, choosing the environment and the model from the selects, once per environment;
both jobs run, each on its own environment."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from evalsvc.settings import Settings
from tests import fake_envs
from tests.dashboard.conftest import FINISHED, Page, served_in_a_thread, sign_in
from tests.processes import wait_no_processes

# one worker under pytest-xdist (--dist loadgroup), with the other browser tests
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dashboard")]

MARK = "EVALSVC_TEST_ENGINE_ENVS"  # marks the engines the jobs start (they inherit it)
WRITER = "carol-" + uuid.uuid4().hex
MATRIX, CONFIG, MODEL = "sglang-cpu", "qwen3-next-tiny-nb-sync-c4096", "qwen3-next-tiny"


@dataclass
class Served:
    url: str
    client: httpx.Client
    pythons: dict[str, Path]

    def wait(self, job_id: str, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while (job := self.client.get(f"/api/v1/jobs/{job_id}").json())["status"] not in FINISHED:
            assert time.monotonic() < deadline, f"job {job_id} still {job['status']}"
            time.sleep(0.5)
        return job


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("engine-envs")
    token = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAKE_SGLANG_PYTHON", sys.executable)
        mp.setenv(MARK, token)
        pythons = fake_envs.build_envs(tmp / "envs", mp)
        settings = Settings(data_dir=tmp / "data", database_url=f"sqlite:///{tmp / 'store.db'}",
                            nightly=False, engine_slots=1, session_secret=uuid.uuid4().hex,
                            users=[{"name": "carol", "role": "write", "token": WRITER}])
        with served_in_a_thread(settings, "engine-envs-server") as url, \
                httpx.Client(base_url=url, timeout=30,
                             headers={"Authorization": f"Bearer {WRITER}"}) as client:
            yield Served(url, client, pythons)
    left = wait_no_processes(MARK, token, timeout=10)
    assert not left, f"engines left behind: {left}"


@pytest.fixture
def tab(browser, served) -> Iterator[Page]:
    """A fresh tab signed in (through the sign-in page) as carol, role write; the test fails if
    the page logged an error to the console or threw."""
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    page = context.new_page()
    tab = Page(page, served.url)
    page.on("console", lambda msg: tab.errors.append(f"console: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: tab.errors.append(f"pageerror: {exc}"))
    sign_in(page, served.url, WRITER)
    yield tab
    context.close()
    assert not tab.errors, tab.errors


def post_from_the_form(tab: Page, engine_env: str) -> str:
    """The job form filled as a person does: the matrix first (the page reloads with its configs),
    then the environment, the model, one config and one prompt; the posted job's id."""
    page = tab.open("/jobs/new")
    form = page.locator("#job-form")
    with page.expect_navigation():
        form.locator('select[name="matrix"]').select_option(MATRIX)
    page.wait_for_load_state("networkidle")
    form = page.locator("#job-form")
    assert form.locator('select[name="matrix"]').input_value() == MATRIX
    form.locator("#engine-env").select_option(engine_env)
    form.locator("#model").select_option(MODEL)
    form.locator(f'input[name="configs"][value="{CONFIG}"]').check()
    form.locator('input[name="num_prompts"]').fill("1")
    form.locator('button[type="submit"]').click()
    page.wait_for_load_state("networkidle")
    assert page.locator("#form-error").count() == 0, page.locator("#form-error").inner_text()
    assert "/jobs/" in page.url and not page.url.endswith("/jobs/new"), page.url
    return page.url.rsplit("/", 1)[1]


def test_the_form_posts_a_job_on_each_engine_environment(tab, served):
    page = tab.open("/jobs/new")
    offered = page.locator("#engine-env option").evaluate_all("els => els.map(e => e.value)")
    assert offered == ["", *sorted((fake_envs.CPU_ENV, fake_envs.OTHER_ENV))], offered
    releases = {fake_envs.CPU_ENV: fake_envs.CPU_RELEASE,
                fake_envs.OTHER_ENV: fake_envs.OTHER_RELEASE}
    job_ids = {name: post_from_the_form(tab, name) for name in releases}
    for name, job_id in job_ids.items():
        job = served.wait(job_id)
        assert job["status"] == "done", job
        assert (job["spec"]["engine_env"], job["spec"]["model"], job["spec"]["configs"]) == (
            name, MODEL, [CONFIG]), job["spec"]
        assert job["spec"]["matrix"]["workload"]["num_prompts"] == 1
        # each run's build: the release its engine reported, the one its environment holds
        assert [r["build"] for r in job["runs"]] == [f"sgl-project/sglang=={releases[name]}"], \
            job["runs"]
        # each environment's python started its own job's engine and no other's
        assert fake_envs.calls(served.pythons[name]).count("sglang.launch_server") == 1
        page = tab.open(f"/jobs/{job_id}")
        assert page.locator("#job-facts .status .v-done").count() == 1
        assert page.locator("#job-facts .engine-env").inner_text() == f"{name} / {MODEL}"
