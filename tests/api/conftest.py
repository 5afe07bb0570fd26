"""The service as users run it: ``evalsvc serve`` in a process of its own (real uvicorn), on a
database of the test's own, its engines marked so the tests can find them."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from evalsvc.paths import MODELS_DIR
from tests.processes import marked_processes, wait_no_processes

MARK = "EVALSVC_TEST_SERVICE"  # marks the service's processes (its engines inherit it)
FINISHED = ("done", "failed", "cancelled")
# a one-config matrix on the fake SGLang server (a shipped model directory for its tokenizer)
FAKE_MATRIX = {
    "name": "fake", "engine": "sglang",
    "models": {"m": {"path": str(MODELS_DIR / "hybrid-mamba2-tiny")}},
    "include": [{"strategy": "extra_buffer", "overlap": True}],
    "workload": {"num_prompts": 2, "max_new_tokens": 4},
    "scenarios": ["cold"],
}


def _die_with_the_tests() -> None:
    """In the child: SIGTERM when the test process dies (a killed pytest leaves no service)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """``evalsvc serve`` in a new session; ``start``/``stop`` (SIGTERM)/``kill`` (SIGKILL)."""

    def __init__(self, tmp_path: Path, db_url: str, **env: str) -> None:
        self.token = uuid.uuid4().hex
        self.data_dir = tmp_path / "data"
        self.log_path = tmp_path / "service.log"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("EVALSVC_") or k.startswith("EVALSVC_TEST_")}
        self.env.update({"EVALSVC_DATA_DIR": str(self.data_dir), "EVALSVC_DATABASE_URL": db_url,
                         "EVALSVC_NIGHTLY": "false", MARK: self.token, **env})
        self.proc: subprocess.Popen | None = None
        self.client: httpx.Client | None = None

    def start(self, timeout: float = 120) -> Service:
        port = free_port()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "evalsvc.cli", "serve", "--port", str(port)],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                preexec_fn=_die_with_the_tests)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client.get("/healthz").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, f"the service exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"the service did not come up:\n{self.log()}"
            time.sleep(0.2)

    def log(self, tail: int | None = 6000) -> str:
        """The service's log: its last ``tail`` characters (for messages), or all of it (None)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text if tail is None else text[-tail:]

    def engines(self) -> list[str]:
        return marked_processes(MARK, self.token)

    def kill(self) -> None:
        """SIGKILL the service process alone: its engines (process groups of their own) stay."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.client.close()

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"the service did not stop on SIGTERM:\n{self.log()}") from None
        finally:
            self.client.close()

    # ---- REST helpers ----------------------------------------------------------------------
    def submit(self, body: dict[str, Any], **headers: str) -> str:
        resp = self.client.post("/api/v1/jobs", json=body, headers=headers)
        assert resp.status_code == 201, resp.text
        return resp.json()["id"]

    def job(self, job_id: str) -> dict[str, Any]:
        resp = self.client.get(f"/api/v1/jobs/{job_id}")
        assert resp.status_code == 200, resp.text
        return resp.json()

    def wait(self, job_id: str, timeout: float = 600, until=None) -> dict[str, Any]:
        """Polls the job until it finished (or ``until(job)`` holds)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if (until(job) if until else job["status"] in FINISHED):
                return job
            assert self.proc.poll() is None, f"the service exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"job {job_id} still {job['status']}:\n{self.log()}"
            time.sleep(0.5)


@pytest.fixture
def service_factory(tmp_path: Path) -> Iterator:
    """Makes services on a database; every one is stopped afterwards and leaves no engine."""
    made: list[Service] = []

    def make(db_url: str, **env: str) -> Service:
        service = Service(tmp_path, db_url, **env)
        made.append(service)
        return service

    yield make
    for service in made:
        service.stop()
    for service in made:
        left = wait_no_processes(MARK, service.token, timeout=10)
        assert not left, f"engines left behind: {left}"
