"""The app in process (``create_app(settings)`` under Starlette's test client, the job runner off):
validation refuses bad jobs naming the problem and stores nothing, bearer-token auth, reads, and
Schemathesis against the OpenAPI schema finding no 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from sqlalchemy import func, select
from typer.testing import CliRunner

from evalsvc.app import create_app
from evalsvc.cli import app as cli
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Build, Commit, Job, Run

FAKE_PYTHON = str(Path(__file__).parents[1] / "data" / "fake-python")


def make_client(tmp_path: Path, **overrides) -> TestClient:
    s = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'app.db'}",
                 nightly=False, **overrides)
    return TestClient(create_app(s, start_runner=False))


@pytest.fixture
def client(tmp_path) -> Iterator[TestClient]:
    with make_client(tmp_path, engine_python=FAKE_PYTHON) as c:
        yield c


def stored(tmp_path: Path) -> dict[str, int]:
    store = Store(f"sqlite:///{tmp_path / 'app.db'}")
    try:
        with store.session() as s:
            return {t.__name__: s.scalar(select(func.count()).select_from(t))
                    for t in (Job, Commit, Build, Run)}
    finally:
        store.close()


REFUSED = [
    ({"matrix": "no-such-matrix"}, ["no-such-matrix"]),
    ({"matrix": "smoke", "configs": ["mamba2-nope"]}, ["configs", "mamba2-nope"]),
    ({"matrix": "smoke", "builds": [{"patches": ["defect:nope"]}]},
     ["builds[0].patches", "defect:nope"]),
    ({"matrix": "smoke", "model": "/no/such/model"}, ["model", "/no/such/model",
                                                     "EVALSVC_MODELS_DIR"]),
    ({"matrix": "smoke", "builds": [{"source": "sglang==0.5.23"}]}, ["builds[0].source"]),
    ({"matrix": "smoke", "reference": {"config": "x"}}, ["reference"]),
    ({"matrix": "smoke", "workload": {"num_prompts": -3}}, ["workload", "num_prompts"]),
    ({"matrix": "smoke", "workload": {"dataset": "builtin:nope"}}, ["workload.dataset",
                                                                    "builtin:nope"]),
    ({"matrix": "smoke", "workload": {"dataset": "/etc/secrets.csv"}}, ["workload.dataset",
                                                                        "local file"]),
    ({"matrix": "smoke", "colour": "red"}, ["colour"]),
    ({"matrix": "smoke", "priority": 5000}, ["priority"]),
    ({"matrix": {"name": "inline"}}, ["matrix", "models"]),
    ({}, ["matrix", "Field required"]),
    ({"matrix": "mamba-full", "builds": [{"source": "git:https://example.com/x.git@abc"}]},
     ["builds[0].source", "not an allowed build source"]),
    ({"matrix": "mamba-full", "builds": [{"source": "sglang==0.5.23; touch /tmp/pwned"}]},
     ["builds.0.source", "not a version number"]),
    # what the compare page once pre-filled for a path: build: no release has such a version
    ({"matrix": "mamba-full", "builds": [{"source": "sglang==0.5.23"},
                                         {"source": "sglang==tree-ebeb8633e652"}]},
     ["builds.1.source", "'sglang==tree-ebeb8633e652'", "'tree-ebeb8633e652' is not a version "
      "number"]),
    ({"matrix": "mamba-full", "builds": [{"source": "pypi:latest"}]},
     ["builds.0.source", "'pypi:latest'", "not a version number"]),
    ({"matrix": "mamba-full", "builds": [{"source": "sglang=="}]},
     ["builds.0.source", "not a version number"]),
    ({"matrix": "mamba-full", "builds": [{"source": "sglang==0.5.23", "patches": ["pr-nope"]}]},
     ["builds[0].patches", "pr-nope"]),
    ({"matrix": "mamba-full", "builds": [{}, {}, {}]}, ["builds"]),
]


@pytest.mark.parametrize(("body", "named"), REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_bad_jobs_are_refused_naming_the_problem_and_nothing_is_stored(client, tmp_path, body,
                                                                        named):
    resp = client.post("/api/v1/jobs", json=body)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, str)
    for word in named:
        assert word in detail, detail
    assert client.get("/api/v1/jobs").json() == []
    assert stored(tmp_path) == {"Job": 0, "Commit": 0, "Build": 0, "Run": 0}
    assert not Path("/tmp/pwned").exists()


def test_sglang_jobs_need_an_sglang_environment(tmp_path):
    with make_client(tmp_path) as c:
        resp = c.post("/api/v1/jobs", json={"matrix": "mamba-full"})
    assert resp.status_code == 422 and "EVALSVC_ENGINE_PYTHON" in resp.json()["detail"]


def test_a_valid_job_is_queued_and_listed(client, tmp_path):
    resp = client.post("/api/v1/jobs", json={"matrix": "smoke", "priority": 7,
                                             "builds": [{}, {"patches": ["defect:snapshot-race"]}]})
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert job["status"] == "queued" and job["priority"] == 7 and job["trigger"] == "api"
    detail = client.get(f"/api/v1/jobs/{job['id']}").json()
    assert detail["spec"]["builds"][1]["patches"] == ["defect:snapshot-race"]
    assert detail["runs"] == [] and detail["comparison"] is None
    assert [j["id"] for j in client.get("/api/v1/jobs", params={"status": "queued"}).json()] == [
        job["id"]]
    assert client.get("/api/v1/jobs", params={"trigger": "nightly"}).json() == []
    assert stored(tmp_path)["Job"] == 1
    # a queued job is cancelled at once
    assert client.post(f"/api/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    assert client.get(f"/api/v1/jobs/{job['id']}").json()["status"] == "cancelled"


def test_jobs_count_their_errored_runs(client, tmp_path):
    """A job with one run of two errored is done and says how many errored; one whose only run
    errored is failed, naming it: in the list and in the job."""
    from datetime import UTC, datetime

    from evalsvc.matrix import Config
    from evalsvc.store.record import BuildRef
    from evalsvc.types import RunResult
    from tests.recorded import JobRecord
    from tests.store.factories import fingerprint_of, job_spec, run_result

    def config(name: str) -> Config:
        return Config(name=name, matrix="smoke", model="mamba2", settings={}, args={},
                      fingerprint=fingerprint_of(name), scenarios=("cold",))

    def errored(name: str) -> RunResult:
        return RunResult(config=name, fingerprint=fingerprint_of(name), model="m", settings={},
                         requested_args={}, verdict="error", reason="engine did not start")

    store = Store(f"sqlite:///{tmp_path / 'app.db'}")
    ref = BuildRef("sgl-project/sglang", sha="abc123", committed_at=datetime(2026, 3, 1, tzinfo=UTC))
    try:
        for job_id, names in (("cli-some", ["m-eb", "m-nb"]), ("cli-all", ["m-eb"])):
            record = JobRecord.start(store, tmp_path / "results", job_id, "cli", ref, "smoke",
                                     [config(n) for n in names], spec=job_spec())
            record.record(config("m-eb"), errored("m-eb"))
            if "m-nb" in names:
                record.record(config("m-nb"), run_result("m-nb", {"cold": [1e-13] * 3}))
            record.finish()
    finally:
        store.close()
    listed = {j["id"]: j for j in client.get("/api/v1/jobs").json()}
    assert {k: (j["status"], j["runs_errored"]) for k, j in listed.items()} == {
        "cli-some": ("done", 1), "cli-all": ("failed", 1)}
    assert listed["cli-some"]["error"] is None
    assert listed["cli-all"]["error"].startswith("every run errored (1 of 1): run ")
    some = client.get("/api/v1/jobs/cli-some").json()
    assert (some["status"], some["runs_errored"]) == ("done", 1)
    assert sorted(r["verdict"] for r in some["runs"]) == ["error", "pass"]
    assert client.get("/api/v1/jobs", params={"status": "failed"}).json()[0]["id"] == "cli-all"
    queued = client.post("/api/v1/jobs", json={"matrix": "smoke"}).json()
    assert queued["runs_errored"] == 0


def test_reads_of_matrices_and_missing_things(client):
    names = {m["name"]: m for m in client.get("/api/v1/matrices").json()}
    assert names["smoke"]["configs"] == 9 and names["smoke"]["engine"] == "embedded"
    smoke = client.get("/api/v1/matrices/smoke").json()
    assert len(smoke["configs"]) == 9 and all(c["fingerprint"] for c in smoke["configs"])
    assert client.get("/api/v1/matrices/nope").status_code == 404
    assert client.get("/api/v1/jobs/nope").status_code == 404
    assert client.get("/api/v1/runs/1").status_code == 404
    assert client.get("/api/v1/commits/v1/results").status_code == 404
    assert client.get("/api/v1/compare", params={"baseline": "a", "contender": "b"}
                      ).status_code == 404
    assert client.get("/api/v1/history").status_code == 422
    assert client.post("/api/v1/golden", json={"run_id": 1}).status_code == 404
    assert client.get("/healthz").json()["status"] == "ok"
    assert "evalsvc_queue_length 0.0" in client.get("/metrics").text
    assert client.get("/docs").status_code == 200


def test_writes_need_the_api_token_and_reads_the_read_token(tmp_path):
    with make_client(tmp_path, api_token="write-secret") as c:
        assert c.post("/api/v1/jobs", json={"matrix": "smoke"}).status_code == 401
        bad = {"Authorization": "Bearer nope"}
        assert c.post("/api/v1/jobs", json={"matrix": "smoke"}, headers=bad).status_code == 401
        good = {"Authorization": "Bearer write-secret"}
        resp = c.post("/api/v1/jobs", json={"matrix": "smoke"}, headers=good)
        assert resp.status_code == 201
        job_id = resp.json()["id"]
        assert c.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 401
        assert c.get("/api/v1/jobs").status_code == 200  # reads are open without a read token
    with make_client(tmp_path, api_token="write-secret", read_token="read-secret") as c:
        assert c.get("/api/v1/jobs").status_code == 401
        assert c.get("/api/v1/jobs", headers={"Authorization": "Bearer read-secret"}
                     ).status_code == 200
        assert c.get("/api/v1/jobs", headers=good).status_code == 200  # the write token reads
        assert c.post("/api/v1/jobs", json={"matrix": "smoke"},
                      headers={"Authorization": "Bearer read-secret"}).status_code == 401
        assert c.get("/healthz").status_code == 200


def test_serve_refuses_other_hosts_without_a_token(monkeypatch):
    monkeypatch.delenv("EVALSVC_API_TOKEN", raising=False)
    res = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    assert res.exit_code == 2
    assert "EVALSVC_API_TOKEN" in res.output and "loopback" in res.output


# ---- Schemathesis: no request the schema allows (or nearly allows) makes a 5xx ------------------

@pytest.fixture
def api_schema(tmp_path, db_url):
    app = create_app(Settings(data_dir=tmp_path / "data", database_url=db_url, nightly=False,
                              engine_python=FAKE_PYTHON), start_runner=False)
    with TestClient(app):  # runs the lifespan: the services stay up while the fuzzing runs
        yield schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.fuzz
def test_no_request_makes_a_server_error(api_schema):
    """On SQLite and on PostgreSQL (which refuses NUL in text): no 5xx from any operation."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 14
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=60, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(checks=[not_a_server_error])

        check()
