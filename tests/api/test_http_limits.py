"""Request bodies against ``evalsvc serve`` in a process of its own (real uvicorn): a write
without the token is refused before its body is read, and a body over EVALSVC_MAX_BODY_BYTES is
refused with 413, from its Content-Length at once or, chunked, as it streams past the limit; the
service's memory does not grow by the body's size and nothing is stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Service

BODY_MB = 64  # far above the limit, and far above the growth allowed below
CHUNK = b"x" * (1024 * 1024)
LIMIT = 256 * 1024
ALLOWED_GROWTH = 16 * 1024 * 1024  # bytes the service's peak memory may grow by meanwhile


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def chunks(n_mb: int) -> Iterator[bytes]:
    """A JSON-looking body streamed chunked (no Content-Length), one MiB at a time."""
    yield b'{"matrix": "smoke", "padding": "'
    for _ in range(n_mb):
        yield CHUNK
    yield b'"}'


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("limits")
    service = Service(tmp, f"sqlite:///{tmp / 'limits.db'}", EVALSVC_API_TOKEN="write-secret",
                      EVALSVC_MAX_BODY_BYTES=str(LIMIT)).start()
    yield service
    service.stop()


def post(service: Service, content, token: str | None = None, **headers: str) -> httpx.Response:
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return service.client.post("/api/v1/jobs", content=content,
                               headers={"content-type": "application/json", **headers})


def stored_jobs(service: Service) -> list:
    return service.client.get("/api/v1/jobs").json()


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_large_body_without_the_token_is_refused_unread(service, token):
    before = peak_rss(service.proc.pid)
    resp = post(service, chunks(BODY_MB), token)
    assert resp.status_code == 401, resp.text
    grown = peak_rss(service.proc.pid) - before
    assert grown < ALLOWED_GROWTH, f"the service grew by {grown} bytes on a refused body"
    assert "EVALSVC_API_TOKEN" in resp.json()["detail"]
    assert stored_jobs(service) == []


def test_a_body_over_the_limit_is_refused_from_its_content_length(service):
    before = peak_rss(service.proc.pid)
    body = json.dumps({"matrix": "smoke", "padding": "x" * (BODY_MB * 1024 * 1024)}).encode()
    resp = post(service, body, "write-secret")
    assert resp.status_code == 413, resp.text
    assert str(LIMIT) in resp.json()["detail"]
    assert "EVALSVC_MAX_BODY_BYTES" in resp.json()["detail"]
    grown = peak_rss(service.proc.pid) - before
    assert grown < ALLOWED_GROWTH, f"the service grew by {grown} bytes on a refused body"
    assert stored_jobs(service) == []


def test_a_chunked_body_is_refused_once_it_streams_past_the_limit(service):
    before = peak_rss(service.proc.pid)
    resp = post(service, chunks(BODY_MB), "write-secret")
    assert resp.status_code == 413, resp.text
    assert "EVALSVC_MAX_BODY_BYTES" in resp.json()["detail"]
    grown = peak_rss(service.proc.pid) - before
    assert grown < ALLOWED_GROWTH, f"the service grew by {grown} bytes on a refused body"
    assert stored_jobs(service) == []


def test_a_body_just_over_the_limit_is_refused_and_one_at_it_taken(service):
    """A body padded with spaces one byte past the limit is refused, streamed or not; one at the
    limit is read (a golden run of no run: 404, no job runs for it)."""
    golden = json.dumps({"run_id": 1}).encode()
    over = golden + b" " * (LIMIT + 1 - len(golden))
    for content in (over, iter([over[:LIMIT], over[LIMIT:]])):
        resp = service.client.post("/api/v1/golden", content=content,
                                   headers={"content-type": "application/json",
                                            "Authorization": "Bearer write-secret"})
        assert resp.status_code == 413, resp.text
    at = golden + b" " * (LIMIT - len(golden))
    for content in (at, iter([at[:1000], at[1000:]])):
        resp = service.client.post("/api/v1/golden", content=content,
                                   headers={"content-type": "application/json",
                                            "Authorization": "Bearer write-secret"})
        assert resp.status_code == 404 and "no run 1" in resp.text, resp.text
