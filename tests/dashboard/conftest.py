"""The dashboard in a browser: the service on a real uvicorn server (in a thread, job runner on)
over a SQLite store that a real job fills, and Debian's chromium driven by Playwright.

The job is the smoke matrix's ``mamba2-eb-ov-c64`` and ``gdn-eb-ov-c64`` on 4 prompts, on two builds
of the embedded engine: as shipped, and with the snapshot-race defect (``prefill_hit`` and
``branching`` fail there). The job tracks regressions, as nightly jobs do: the defect build's
failures open one per config and scenario. It is submitted when the server starts; the first test
watches it run on the jobs page, the others wait for it to finish.
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn

from evalsvc.api.app import create_app
from evalsvc.settings import Settings
from tests.processes import wait_no_processes

CONFIGS = ["mamba2-eb-ov-c64", "gdn-eb-ov-c64"]
DEFECT = "defect:snapshot-race"
JOB = {"matrix": "smoke", "configs": CONFIGS, "workload": {"num_prompts": 4},
       "builds": [{}, {"patches": [DEFECT]}], "track": True}
MARK = "EVALSVC_TEST_DASHBOARD"  # marks the engines the job starts (they inherit it)
FINISHED = ("done", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Dashboard:
    """The served app: its base URL, its store, and the job filling it."""

    url: str
    database_url: str
    client: httpx.Client
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


@pytest.fixture(scope="session")
def dashboard(tmp_path_factory) -> Iterator[Dashboard]:
    tmp = tmp_path_factory.mktemp("dashboard")
    database_url = f"sqlite:///{tmp / 'store.db'}"
    # one engine at a time (whatever EVALSVC_ENGINE_SLOTS says): two cores, shared with the other
    # xdist worker
    settings = Settings(data_dir=tmp / "data", database_url=database_url, nightly=False,
                        engine_slots=1)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                           log_level="warning"))
    token = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MARK, token)
        thread = threading.Thread(target=server.run, name="dashboard-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=30) as client:
            resp = client.post("/api/v1/jobs", json=JOB)
            assert resp.status_code == 201, resp.text
            dash = Dashboard(url, database_url, client, job_id=resp.json()["id"],
                             job=resp.json())
            try:
                yield dash
            finally:
                server.should_exit = True
                thread.join(90)
    assert not thread.is_alive(), "the server did not stop"
    left = wait_no_processes(MARK, token, timeout=10)
    assert not left, f"engines left behind: {left}"


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


@pytest.fixture
def tab(browser, dashboard) -> Iterator[Page]:
    """A fresh tab; the test fails if the page logged an error to the console or threw."""
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    page = context.new_page()
    tab = Page(page, dashboard.url)
    page.on("console", lambda msg: tab.errors.append(f"console: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: tab.errors.append(f"pageerror: {exc}"))
    yield tab
    context.close()
    assert not tab.errors, tab.errors

