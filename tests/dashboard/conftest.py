"""The dashboard in a browser: the service on a real uvicorn server (in a thread, job runner on)
over a SQLite store that a real job fills, and Debian's chromium driven by Playwright.

The job is the smoke matrix's ``mamba2-eb-ov-c64`` and ``gdn-eb-ov-c64`` on 4 prompts, on two builds
of the embedded engine: as shipped, and with the snapshot-race defect (``prefill_hit``, ``branching`` and
``chunked_hit`` fail there). The job tracks regressions, as nightly jobs do: the defect build's
failures open one per config and scenario. It is submitted when the server starts; the first test
watches it run on the jobs page, the others wait for it to finish.

The service has users: alice (role write, a token) and bob (role read, the SHA-256 of his), and a
write token the tests' API client uses. Tabs are signed in as alice through the sign-in page
(``tab``; ``reader`` as bob). ``git_regression`` (asked for by the tests that bisect) adds a git
repository's good commit and the next one, which switches the snapshot-race defect on, run in a
tracked job of their own: a regression whose last good and first bad commits are neighbours.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from evalsvc.app import create_app
from evalsvc.settings import Settings
from tests.processes import wait_no_processes

CONFIGS = ["mamba2-eb-ov-c64", "gdn-eb-ov-c64"]
DEFECT = "defect:snapshot-race"
FAILING = ("prefill_hit", "branching", "chunked_hit")  # the defect build's failing scenarios
JOB = {"matrix": "smoke", "configs": CONFIGS, "workload": {"num_prompts": 4},
       "builds": [{}, {"patches": [DEFECT]}], "track": True}
MARK = "EVALSVC_TEST_DASHBOARD"  # marks the engines the job starts (they inherit it)
FINISHED = ("done", "failed", "cancelled")
ALICE, BOB = "alice-" + uuid.uuid4().hex, "bob-" + uuid.uuid4().hex
API_TOKEN = uuid.uuid4().hex
USERS = [{"name": "alice", "role": "write", "token": ALICE},
         {"name": "bob", "role": "read", "token_sha256": hashlib.sha256(BOB.encode()).hexdigest()}]
GIT_CONFIG = CONFIGS[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Dashboard:
    """The served app: its base URL, its store, the job filling it, and the git repository of
    ``git_regression``."""

    url: str
    database_url: str
    client: httpx.Client
    repo: Path
    job_id: str = ""
    job: dict[str, Any] = field(default_factory=dict)

    def wait(self, timeout: float = 300) -> dict[str, Any]:
        """The job once finished; fails the test unless it is done."""
        deadline = time.monotonic() + timeout
        while self.job.get("status") not in FINISHED:
            assert time.monotonic() < deadline, f"job {self.job_id} still {self.job.get('status')}"
            time.sleep(0.5)
            self.job = self.client.get(f"/api/v1/jobs/{self.job_id}").json()
        assert self.job["status"] == "done", self.job
        return self.job

    def wait_for(self, job_id: str, statuses: tuple[str, ...] = FINISHED,
                 timeout: float = 300) -> dict[str, Any]:
        """Another job, once its status is one of ``statuses``."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.client.get(f"/api/v1/jobs/{job_id}").json()
            if job["status"] in statuses:
                return job
            assert time.monotonic() < deadline, f"job {job_id} still {job['status']}"
            time.sleep(0.5)


def git(repo: Path, *args: str, day: int = 1) -> str:
    when = f"2026-02-{day:02d}T00:00:00Z"
    env = {"GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when, "PATH": "/usr/bin:/bin",
           "HOME": str(repo.parent)}
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def make_repo(repo: Path) -> tuple[str, str]:
    """A repository of two commits for the embedded engine: good, then bad (snapshot-race on)."""
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    shas = []
    for day, defects in ((1, {}), (2, {"snapshot-race": 1.0})):
        (repo / "evalsvc-engine.yaml").write_text(yaml.safe_dump({"defects": defects}))
        git(repo, "add", "-A", day=day)
        git(repo, "commit", "-qm", f"day {day}", day=day)
        shas.append(git(repo, "rev-parse", "HEAD"))
    return shas[0], shas[1]


@contextlib.contextmanager
def served_in_a_thread(settings: Settings, name: str) -> Iterator[str]:
    """The service of ``settings`` on a free loopback port, on a thread of this process (its
    engines inherit this process's environment): its URL, until it has stopped again."""
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1",
                                           port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(90)
    assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def dashboard(tmp_path_factory) -> Iterator[Dashboard]:
    tmp = tmp_path_factory.mktemp("dashboard")
    database_url = f"sqlite:///{tmp / 'store.db'}"
    repo = tmp / "engine-repo"
    make_repo(repo)
    # one engine at a time (whatever EVALSVC_ENGINE_SLOTS says): two cores, shared with the other
    # xdist worker
    settings = Settings(data_dir=tmp / "data", database_url=database_url, nightly=False,
                        engine_slots=1, users=USERS, api_token=API_TOKEN,
                        session_secret=uuid.uuid4().hex,
                        allowed_sources=["sglang==*", "pypi:*", f"git:{repo}@*",
                                         f"path:{tmp}/trees/*"])
    token = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MARK, token)
        with served_in_a_thread(settings, "dashboard-server") as url, \
                httpx.Client(base_url=url, timeout=30,
                             headers={"Authorization": f"Bearer {API_TOKEN}"}) as client:
            resp = client.post("/api/v1/jobs", json=JOB)
            assert resp.status_code == 201, resp.text
            yield Dashboard(url, database_url, client, repo, job_id=resp.json()["id"],
                            job=resp.json())
    left = wait_no_processes(MARK, token, timeout=10)
    assert not left, f"engines left behind: {left}"


@dataclass
class GitRegression:
    """The regression the git repository's bad commit opened: its id, and both commits."""

    id: int
    good: str
    bad: str


@pytest.fixture(scope="session")
def git_regression(dashboard) -> GitRegression:
    dashboard.wait()
    good, bad = (git(dashboard.repo, "rev-parse", ref) for ref in ("HEAD~1", "HEAD"))
    # 3 prompts: a fingerprint of its own (the other jobs' runs of the config, on newer commits,
    # would be the newest of its series, and only the newest moves a regression)
    resp = dashboard.client.post("/api/v1/jobs", json={
        "matrix": "smoke", "configs": [GIT_CONFIG], "workload": {"num_prompts": 3},
        "builds": [{"source": f"git:{dashboard.repo}@{good}"},
                   {"source": f"git:{dashboard.repo}@{bad}"}], "track": True})
    assert resp.status_code == 201, resp.text
    job = dashboard.wait_for(resp.json()["id"])
    assert job["status"] == "done", job
    found = [r for r in dashboard.client.get("/api/v1/regressions", params={"state": "open"}).json()
             if r["first_run"]["commit"].endswith(bad) and r["scenario"] == "prefill_hit"
             and r["metric"] == "kl_k3_mean"]
    assert len(found) == 1, found
    assert found[0]["last_good_run"]["commit"].endswith(good)
    return GitRegression(found[0]["id"], good, bad)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("the dashboard's browser tests need Debian's chromium (apt-get install -y "
                    "chromium; `make test` installs it)", pytrace=False)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=["--no-sandbox", "--headless"])
        yield b
        b.close()


@dataclass
class Page:
    """A browser tab on the dashboard that records console errors and uncaught exceptions."""

    page: Any
    base: str
    errors: list[str] = field(default_factory=list)

    def open(self, path: str) -> Any:
        resp = self.page.goto(self.base + path)
        assert resp is not None and resp.status == 200, (path, resp and resp.status)
        self.page.wait_for_load_state("networkidle")
        return self.page

    def expect_errors(self, status: int) -> None:
        """The console's lines about responses with ``status`` were expected: forget them."""
        self.errors = [e for e in self.errors if f"status of {status}" not in e]


def sign_in(page: Any, base: str, token: str) -> None:
    """Through the sign-in form, as a person does."""
    page.goto(f"{base}/login")
    page.fill('input[name="token"]', token)
    page.click('#sign-in-form button[type="submit"]')
    page.wait_for_load_state("networkidle")
    assert page.locator("#signed-in").count() == 1, page.content()[:2000]


@pytest.fixture(scope="session")
def signed_in(browser, dashboard) -> dict[str, Any]:
    """The browser state (its cookies) of alice and of bob, each signed in once."""
    states = {}
    for name, token in (("alice", ALICE), ("bob", BOB)):
        context = browser.new_context()
        sign_in(context.new_page(), dashboard.url, token)
        states[name] = context.storage_state()
        context.close()
    return states


def _tab(browser, dashboard, state: dict[str, Any] | None) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1300, "height": 900}, storage_state=state)
    page = context.new_page()
    tab = Page(page, dashboard.url)
    page.on("console", lambda msg: tab.errors.append(f"console: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: tab.errors.append(f"pageerror: {exc}"))
    yield tab
    context.close()
    assert not tab.errors, tab.errors


@pytest.fixture
def tab(browser, dashboard, signed_in) -> Iterator[Page]:
    """A fresh tab signed in as alice (role write); the test fails if the page logged an error
    to the console or threw."""
    yield from _tab(browser, dashboard, signed_in["alice"])


@pytest.fixture
def reader(browser, dashboard, signed_in) -> Iterator[Page]:
    """A fresh tab signed in as bob (role read)."""
    yield from _tab(browser, dashboard, signed_in["bob"])


@pytest.fixture
def stranger(browser, dashboard) -> Iterator[Page]:
    """A fresh tab that has not signed in."""
    yield from _tab(browser, dashboard, None)
