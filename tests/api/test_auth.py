"""What each token guards (the app in process, the job runner off): with a read token the API,
the dashboard, metrics and the API docs need it or the write token and only ``/healthz`` and the
dashboard's assets stay open; writes need the write token, checked before the body is read; a
service with a read token but no write token takes no writes; and parameters a database cannot
store are refused with 422 naming them, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import select

from evalsvc.app import create_app
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Build, Regression, Run
from tests.store.factories import BASE_TIME, build_ref, fingerprint_of, record, run_result

READ = {"Authorization": "Bearer read-secret"}
WRITE = {"Authorization": "Bearer write-secret"}
WRONG = {"Authorization": "Bearer wrong"}


def make_client(tmp_path: Path, db_url: str | None = None, **overrides) -> TestClient:
    s = Settings(data_dir=tmp_path / "data", database_url=db_url or f"sqlite:///{tmp_path / 'a.db'}",
                 nightly=False, **overrides)
    return TestClient(create_app(s, start_runner=False))


GUARDED_READS = ["/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
                 "/api/v1/jobs", "/api/v1/matrices", "/", "/jobs", "/commits", "/regressions",
                 "/no-such-page"]


def test_a_read_token_guards_docs_metrics_the_api_and_the_dashboard(tmp_path):
    with make_client(tmp_path, api_token="write-secret", read_token="read-secret") as c:
        for path in GUARDED_READS:
            for headers in ({}, WRONG, {"Authorization": "Basic cmVhZC1zZWNyZXQ="}):
                resp = c.get(path, headers=headers)
                assert resp.status_code == 401, (path, headers, resp.status_code)
                assert resp.headers["www-authenticate"] == "Bearer"
                assert "EVALSVC_READ_TOKEN" in resp.json()["detail"]
            for headers in (READ, WRITE):
                resp = c.get(path, headers=headers)
                assert resp.status_code == (404 if path == "/no-such-page" else 200), path
        assert "evalsvc_queue_length" in c.get("/metrics", headers=READ).text
        # open: liveness, and the dashboard's assets (no results in them)
        assert c.get("/healthz").json()["status"] == "ok"
        assert c.get("/static/dashboard.css").status_code == 200
        assert c.head("/healthz").status_code in (200, 405)


def test_without_a_read_token_reads_docs_and_metrics_are_open(tmp_path):
    with make_client(tmp_path, api_token="write-secret") as c:
        for path in ("/metrics", "/docs", "/openapi.json", "/api/v1/jobs", "/"):
            assert c.get(path).status_code == 200, path


def test_a_read_token_without_a_write_token_takes_no_writes(tmp_path):
    with make_client(tmp_path, read_token="read-secret") as c:
        for headers in ({}, READ, WRONG):
            resp = c.post("/api/v1/jobs", json={"matrix": "smoke"}, headers=headers)
            assert resp.status_code == 403, resp.text
            assert "EVALSVC_API_TOKEN" in resp.json()["detail"]
            assert "writes are off" in resp.json()["detail"]
            assert c.patch("/api/v1/regressions/1", json={"triage": None},
                           headers=headers).status_code == 403
            assert c.post("/api/v1/golden", json={"run_id": 1}, headers=headers
                          ).status_code == 403
        assert c.get("/api/v1/jobs", headers=READ).json() == []


def test_writes_are_refused_before_their_body_is_read(tmp_path):
    """A malformed body without the token is a 401, not a 422 from parsing it; with the read
    token it is a 401 too."""
    with make_client(tmp_path, api_token="write-secret", read_token="read-secret") as c:
        for headers in ({}, READ, WRONG):
            resp = c.post("/api/v1/jobs", content=b"{not json",
                          headers={**headers, "content-type": "application/json"})
            assert resp.status_code == 401, resp.text
            assert "EVALSVC_API_TOKEN" in resp.json()["detail"]
            resp = c.post("/api/v1/jobs/x/cancel", headers=headers)
            assert resp.status_code == 401, resp.text
        # the write token gets through to the body's validation
        resp = c.post("/api/v1/jobs", content=b"{not json",
                      headers={**WRITE, "content-type": "application/json"})
        assert resp.status_code == 422
        assert c.get("/api/v1/jobs", headers=READ).json() == []


UNSTORABLE = [
    ("/api/v1/jobs", {"status": "a\x00b"}, "query.status"),
    ("/api/v1/jobs", {"trigger": "\x00"}, "query.trigger"),
    ("/api/v1/commits", {"branch": "main\x00"}, "query.branch"),
    ("/api/v1/commits/v1/results", {"patch_set": "\x00"}, "query.patch_set"),
    ("/api/v1/commits/v1%00/results", {}, "path"),
    ("/api/v1/history", {"config": "x", "metric": "\x00"}, "query.metric"),
    ("/api/v1/history", {"fingerprint": "\x00"}, "query.fingerprint"),
    ("/api/v1/history", {"config": "x", "scenario": "\x00"}, "query.scenario"),
    ("/api/v1/compare", {"baseline": "\x00", "contender": "b"}, "query.baseline"),
    ("/api/v1/compare", {"baseline": "a", "contender": "b", "contender_patches": "\x00"},
     "query.contender_patches"),
    ("/", {"matrix": "\x00"}, "query.matrix"),
    ("/commits", {"branch": "\x00"}, "query.branch"),
    ("/jobs", {"status": "\x00"}, "query.status"),
    ("/compare", {"baseline": "\x00", "contender": "b"}, "query.baseline"),
    ("/runs/1/samples/a%00", {}, "path"),
]


def test_parameters_a_database_cannot_store_are_refused_naming_them(tmp_path, db_url):
    with make_client(tmp_path, db_url) as c:
        for path, params, named in UNSTORABLE:
            resp = c.get(path, params=params)
            assert resp.status_code == 422, (path, params, resp.status_code, resp.text[:300])
            detail = resp.json()["detail"]
            assert detail.startswith(named) and "NUL" in detail, detail
        # the same requests without the NUL are fine
        assert c.get("/api/v1/jobs", params={"status": "ab"}).json() == []
        assert c.get("/api/v1/history", params={"config": "x", "metric": "m"}).json() == []
        assert c.get("/commits", params={"branch": "main"}).status_code == 200


def test_body_texts_a_database_cannot_store_are_refused_and_nothing_changes(tmp_path, db_url):
    """A golden run's label and a triage comment with NUL or a lone surrogate (JSON's \\ud800)
    are refused with 422 naming the field; the run and the regression stay as they were."""
    store = Store(db_url)
    try:
        record(store, tmp_path / "results", "job-a", build_ref("aaa111"),
               [run_result("mamba2-eb-ov-c64", {"cold": [1e-13, 2e-13]})])
        with store.session() as s:
            run_id = s.scalars(select(Run.id)).one()
            regression = Regression(fingerprint=fingerprint_of("mamba2-eb-ov-c64"),
                                    scenario="cold", metric="kl_k3_mean",
                                    config="mamba2-eb-ov-c64", matrix="smoke", state="open",
                                    first_run_id=run_id, last_run_id=run_id, runs_seen=1,
                                    opened_at=BASE_TIME)
            s.add(regression)
            s.flush()
            regression_id = regression.id
    finally:
        store.close()
    json_header = {"content-type": "application/json"}
    with make_client(tmp_path, db_url) as c:
        for bad in ('"a\\u0000b"', '"a\\ud800b"'):
            resp = c.post("/api/v1/golden", headers=json_header,
                          content=f'{{"run_id": {run_id}, "label": {bad}}}')
            assert resp.status_code == 422, resp.text
            assert resp.json()["detail"].startswith("body.label"), resp.text
            resp = c.patch(f"/api/v1/regressions/{regression_id}", headers=json_header,
                           content=f'{{"triage": "acknowledged", "comment": {bad}}}')
            assert resp.status_code == 422, resp.text
            assert resp.json()["detail"].startswith("body.comment"), resp.text
        assert c.get("/api/v1/golden").json() == []
        reg = c.get(f"/api/v1/regressions/{regression_id}").json()
        assert reg["triage"] is None and reg["comment"] is None
        # plain text is taken
        resp = c.post("/api/v1/golden", json={"run_id": run_id, "label": "ok ✓"})
        assert resp.status_code == 201 and resp.json()["label"] == "ok ✓"


UNPARSEABLE = [
    (b'\xff\xfe{"matrix": "smoke"}', "UTF-8"),
    (b'{"matrix": "sm\xe9oke"}', "UTF-8"),
    (b'{"matrix": "smoke", "priority": ' + b"9" * 5000 + b"}", "digits"),
    (b'{"matrix": "smoke", "workload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
]


def test_unparseable_bodies_are_refused_with_422_naming_the_body(tmp_path):
    """Bodies json cannot decode for another reason than its syntax (bytes that are not UTF-8,
    an integer of thousands of digits, nesting past the recursion limit) are 422s naming the
    body and why, like a syntax error, not FastAPI's bare 400."""
    with make_client(tmp_path, api_token="write-secret") as c:
        for body, why in UNPARSEABLE:
            resp = c.post("/api/v1/jobs", content=body,
                          headers={**WRITE, "content-type": "application/json"})
            assert resp.status_code == 422, resp.text
            detail = resp.json()["detail"]
            assert detail.startswith("body: not valid JSON") and why in detail, detail
        assert c.get("/api/v1/jobs").json() == []


def test_a_content_length_over_the_limit_is_refused_before_the_route(tmp_path):
    with make_client(tmp_path, api_token="write-secret", max_body_bytes=100) as c:
        body = b'{"matrix": "smoke"}' + b" " * 100
        resp = c.post("/api/v1/jobs", content=body,
                      headers={**WRITE, "content-type": "application/json"})
        assert resp.status_code == 413 and "100 bytes" in resp.json()["detail"]
        resp = c.post("/api/v1/jobs", content=b"{}", headers={**WRITE, "content-length": "2x"})
        assert resp.status_code == 400 and "Content-Length" in resp.json()["detail"]
        assert c.get("/api/v1/jobs").json() == []


def test_server_paths_in_errors_are_redacted_for_readers_without_the_write_role(tmp_path):
    """A job's error and its run's reason, log and samples files name server paths: a reader
    without the write role sees those under the data directory relative to it, and any other by
    its last part; the write token sees them as stored, on the API and on the job's page."""
    data = (tmp_path / "data").resolve()
    samples = data / "results" / "cli-x" / "1.parquet"
    error = (f"run 1: its samples could not be written to {samples}: OSError: [Errno 28] No "
             f"space left on device; engine: /opt/secret-env/bin/python exited 1")
    with make_client(tmp_path, api_token="write-secret", read_token="read-secret") as c:
        store = c.app.state.services.store
        [run_id] = record(store, data / "results", "cli-x", build_ref("aaa111"),
                          [run_result("m-eb", {"cold": [1e-4] * 4})])
        with store.session() as s:
            run = s.get(Run, run_id)
            run.reason, run.log_path = error, str(data / "logs" / "cli-x" / "m-eb.log")
            run.job.error = error
        seen = ("run 1: its samples could not be written to <data>/results/cli-x/1.parquet: "
                "OSError: [Errno 28] No space left on device; engine: .../python exited 1")

        for headers, want in ((READ, seen), (WRITE, error)):
            [job] = c.get("/api/v1/jobs", headers=headers).json()
            assert job["error"] == want
            detail = c.get("/api/v1/jobs/cli-x", headers=headers).json()
            assert detail["error"] == want and detail["runs"][0]["reason"] == want
            run = c.get(f"/api/v1/runs/{run_id}", headers=headers).json()
            assert run["reason"] == want
            results = c.get("/api/v1/commits/sgl-project/sglang@aaa111/results",
                            headers=headers).json()
            assert results["runs"][0]["reason"] == want
        run = c.get(f"/api/v1/runs/{run_id}", headers=READ).json()
        assert run["log_path"] == "<data>/logs/cli-x/m-eb.log"
        assert run["samples_path"].startswith("<data>/results/cli-x/")

        page = c.get("/jobs/cli-x", headers=READ).text
        assert "/opt/secret-env" not in page and str(data) not in page
        assert "&lt;data&gt;/results/cli-x/1.parquet" in page
        assert "/opt/secret-env/bin/python" in c.get("/jobs/cli-x", headers=WRITE).text
        assert str(data) not in c.get("/jobs", headers=READ).text


def test_a_runs_command_arguments_and_log_are_redacted_for_readers_without_the_write_role(
        tmp_path):
    """A run's command line, its arguments asked for and resolved, its reference server's command
    and its engine log's tail name the engine's environment and the model's directory: a reader
    without the write role sees them by their last part, on the API and on the job's page; the
    write token sees them as stored."""
    data = (tmp_path / "data").resolve()
    python, model = "/opt/secret-env/bin/python", "/srv/private-models/qwen3-next-tiny"
    command = [python, "-m", "sglang.launch_server", "--model-path", model, "--port", "30000"]
    log = data / "logs" / "cli-y" / "m-eb.log"
    log.parent.mkdir(parents=True)
    log.write_text(f'Traceback:\n  File "/opt/secret-env/lib/python3.11/site-packages/sglang/'
                   f'srt/server_args.py", line 9\nloading {model}/model.safetensors\n')
    with make_client(tmp_path, api_token="write-secret", read_token="read-secret") as c:
        store = c.app.state.services.store
        [run_id] = record(store, data / "results", "cli-y", build_ref("bbb222"),
                          [run_result("m-eb", {"cold": [1e-4] * 4})])
        with store.session() as s:
            run = s.get(Run, run_id)
            run.command, run.log_path = command, str(log)
            run.requested_args = {"model_path": model, "chunked_prefill_size": 64}
            run.resolved_args = {"model_path": model, "chunked_prefill_size": 64,
                                 "tokenizer_path": model}
            run.reference = {"kind": "config", "command": command}
            build = s.get(Build, run.build_id)
            build.base_env = {"python": python, "version": "0.5.17"}
            build.manifest = {"kind": "path", "location": "/srv/private-src/sglang"}

        read = c.get(f"/api/v1/runs/{run_id}", headers=READ).json()
        assert read["command"] == [".../python", "-m", "sglang.launch_server", "--model-path",
                                   ".../qwen3-next-tiny", "--port", "30000"]
        assert read["requested_args"] == {"model_path": ".../qwen3-next-tiny",
                                          "chunked_prefill_size": 64}
        assert read["resolved_args"]["tokenizer_path"] == ".../qwen3-next-tiny"
        assert read["reference"]["command"] == read["command"]
        assert "/opt/secret-env" not in str(read) and "/srv/private-models" not in str(read)
        written = c.get(f"/api/v1/runs/{run_id}", headers=WRITE).json()
        assert written["command"] == command and written["requested_args"]["model_path"] == model
        assert written["reference"]["command"] == command

        page = c.get("/jobs/cli-y", headers=READ).text
        assert "/opt/secret-env" not in page and "/srv/private-models" not in page
        assert ".../server_args.py" in page and ".../model.safetensors" in page
        assert ".../qwen3-next-tiny" in page
        assert "/srv/private-src" not in page and ".../sglang" in page  # the build's manifest
        page = c.get("/jobs/cli-y", headers=WRITE).text
        assert "/opt/secret-env/lib/python3.11" in page and f"{model}/model.safetensors" in page
        assert "/srv/private-src/sglang" in page


def test_redaction_leaves_urls_fractions_and_rates_alone():
    from evalsvc.web.redact import redact_paths

    text = ("POST http://127.0.0.1:30000/generate: 500 after 3.5 tokens/s, 1/2 of the prompts; "
            "see /srv/evalsvc/data/logs/j/m.log. Model '/home/alice/models/m' (/srv/evalsvc/data)")
    assert redact_paths(text, "/srv/evalsvc/data") == (
        "POST http://127.0.0.1:30000/generate: 500 after 3.5 tokens/s, 1/2 of the prompts; "
        "see <data>/logs/j/m.log. Model '.../m' (<data>)")
