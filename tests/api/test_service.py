"""The service over HTTP against a real uvicorn server (``evalsvc serve`` in its own process):
the smoke job end to end on SQLite and PostgreSQL, a two-build job's comparison, a SIGKILLed service
resuming its job, cancel, and 50 concurrent submissions run in order of priority, then age."""

from __future__ import annotations

import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.pool import NullPool

from evalsvc.store.models import Run
from tests.api.conftest import FAKE_MATRIX
from tests.processes import exists

pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[1] / "data"
# the fake SGLang server; those started with no_buffer take 20 s to start (time enough to submit
# fifty jobs behind one on a loaded machine)
FAKE_ENV = {"EVALSVC_ENGINE_PYTHON": str(DATA / "fake-python"), "FAKE_SGLANG_PYTHON": sys.executable,
            "FAKE_SGLANG_MODE": "slow_start", "FAKE_SGLANG_START_SECONDS": "20",
            "FAKE_SGLANG_WHEN": "mamba_radix_cache_strategy=no_buffer"}


def when(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_smoke_job_end_to_end(service_factory, db_url):
    """`{"matrix": "smoke"}` alone: every config passes; results, history, compare and /metrics.
    On PostgreSQL with two engine slots (two runs at once)."""
    slots = "2" if db_url.startswith("postgresql") else "1"
    service = service_factory(db_url, EVALSVC_ENGINE_SLOTS=slots).start()
    job_id = service.submit({"matrix": "smoke"})
    job = service.wait(job_id, timeout=900)
    assert job["status"] == "done", job
    assert job["trigger"] == "api" and job["matrix"] == "smoke"
    assert len(job["runs"]) == 9 and job["progress"] == {"done": 9}
    assert all(r["verdict"] == "pass" for r in job["runs"]), job["runs"]

    commits = service.client.get("/api/v1/commits").json()
    assert len(commits) == 1 and commits[0]["verdicts"] == {"pass": 9}
    ref = commits[0]["ref"]
    results = service.client.get(f"/api/v1/commits/{ref}/results").json()
    assert {r["config"] for r in results["runs"]} == {r["config"] for r in job["runs"]}
    mtp = next(r for r in results["runs"] if r["config"] == "mamba2-eb-sync-c64-mtp")
    spec = next(s for s in mtp["scenarios"] if s["scenario"] == "speculative")
    assert spec["metrics"]["accept_length"]["value"] >= 3.2
    hit = next(s for s in mtp["scenarios"] if s["scenario"] == "prefill_hit")
    assert hit["metrics"]["kl_k3_mean"]["value"] < 1e-8
    assert hit["metrics"]["hit_coverage"]["value"] > 0.5  # the workload really hit the cache

    history = service.client.get("/api/v1/history", params={
        "config": "mamba2-eb-ov-c64", "scenario": "prefill_hit"}).json()
    assert [h["commit"] for h in history] == [ref] and history[0]["value"] < 1e-8
    by_fp = service.client.get("/api/v1/history", params={
        "fingerprint": history[0]["fingerprint"], "metric": "hit_coverage"}).json()
    assert {h["scenario"] for h in by_fp} == {"cold", "prefill_hit", "decode_hit", "branching",
                                              "chunked_hit"}

    compare = service.client.get("/api/v1/compare", params={"baseline": ref,
                                                             "contender": ref}).json()
    assert len(compare["rows"]) == sum(len(r["scenarios"]) for r in job["runs"])
    assert all(row["delta"] == 0 for row in compare["rows"])

    metrics = service.client.get("/metrics").text
    assert 'evalsvc_job_outcomes_total{status="done"} 1.0' in metrics
    assert "evalsvc_run_duration_seconds_count 9.0" in metrics
    assert "evalsvc_queue_length 0.0" in metrics
    assert "evalsvc_running_runs 0.0" in metrics
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught
    assert service.stop() in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in service.log()
    assert not service.engines()


def test_two_builds_yield_their_comparison(service_factory, tmp_path):
    """One config with and without a defect's patch: the job's comparison shows the KL delta."""
    service = service_factory(f"sqlite:///{tmp_path / 'two.db'}").start()
    job_id = service.submit({"matrix": "smoke", "configs": ["mamba2-eb-ov-c64"],
                             "builds": [{}, {"patches": ["defect:snapshot-race"]}]})
    job = service.wait(job_id, timeout=300)
    assert job["status"] == "done", job
    verdicts = {r["build"].partition("+")[2]: r["verdict"] for r in job["runs"]}
    assert verdicts == {"": "pass", "defect:snapshot-race": "fail"}
    rows = {row["scenario"]: row for row in job["comparison"]}
    assert rows["prefill_hit"]["delta"] > 1e-6
    assert rows["prefill_hit"]["ci_low"] is not None and rows["prefill_hit"]["paired_samples"] > 1
    ref = job["runs"][0]["build"].partition("+")[0]
    compare = service.client.get("/api/v1/compare", params={
        "baseline": ref, "contender": ref,
        "contender_patches": "defect:snapshot-race"}).json()
    assert {r["scenario"]: r["delta"] for r in compare["rows"]} == {
        s: r["delta"] for s, r in rows.items()}


def test_killed_service_resumes_without_repeating_runs(service_factory, tmp_path):
    """SIGKILL mid-job: its engine is stopped at the restart, the job completes, finished runs are
    kept as they were, nothing is duplicated."""
    db = f"sqlite:///{tmp_path / 'kill.db'}"
    configs = ["mamba2-noradix-sync-nochunk", "gdn-eb-ov-c64", "mamba2-nb-sync-c64"]
    service = service_factory(db).start()
    job_id = service.submit({"matrix": "smoke", "configs": configs})
    job = service.wait(job_id, timeout=300, until=lambda j: j["progress"].get("done", 0) >= 1
                       and j["progress"].get("running", 0) == 1)
    engine = create_engine(db, poolclass=NullPool)
    deadline = time.monotonic() + 60
    while True:  # the running run's engine is up and its process group is on the run's row
        with engine.connect() as conn:
            pids = conn.scalars(select(Run.engine_pid).where(Run.status == "running")).all()
        engines = service.engines()
        if pids and pids[0] and any(line.startswith(f"{pids[0]}:") for line in engines):
            break
        assert time.monotonic() < deadline, (pids, engines)
        time.sleep(0.2)
    before = service.job(job_id)
    finished = {r["id"]: service.client.get(f"/api/v1/runs/{r['id']}").json()
                for r in before["runs"] if r["status"] == "done"}
    assert finished
    [interrupted] = [r["id"] for r in before["runs"] if r["status"] == "running"]

    service.kill()
    orphans = [int(line.split(":")[0]) for line in engines]
    assert all(exists(pid) for pid in orphans), "the engine should outlive the killed service"

    service.start()  # the same database, data directory and process marker
    assert not any(exists(pid) for pid in orphans), "the restart left the orphaned engine running"
    job = service.wait(job_id, timeout=300)
    assert job["status"] == "done", job
    assert sorted(r["config"] for r in job["runs"]) == sorted(configs)
    assert all(r["status"] == "done" and r["verdict"] == "pass" for r in job["runs"])
    for run_id, detail in finished.items():  # not run again
        assert service.client.get(f"/api/v1/runs/{run_id}").json() == detail
    assert "resumes after a restart" in service.log(tail=None)  # among the requests since
    # the run done again wrote its engine log where the interrupted attempt had: that one is kept
    log_path = Path(service.client.get(f"/api/v1/runs/{interrupted}").json()["log_path"])
    assert log_path.is_file() and log_path.with_name(f"{log_path.name}.attempt-1").is_file()
    try:
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(Run)) == len(configs)
    finally:
        engine.dispose()


def test_cancel_stops_the_jobs_engines(service_factory, tmp_path):
    service = service_factory(f"sqlite:///{tmp_path / 'cancel.db'}").start()
    job_id = service.submit({"matrix": "smoke"})
    service.wait(job_id, timeout=300, until=lambda j: j["progress"].get("running", 0) == 1)
    deadline = time.monotonic() + 60
    while not service.engines() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert service.engines()
    resp = service.client.post(f"/api/v1/jobs/{job_id}/cancel")
    assert resp.status_code == 200 and resp.json()["status"] == "cancelling"
    job = service.wait(job_id, timeout=60)
    assert job["status"] == "cancelled"
    assert not any(r["status"] in ("pending", "running") for r in job["runs"]), job["runs"]
    assert not service.engines()
    # a cancelled job stays cancelled; an unknown one is a 404
    assert service.client.post(f"/api/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    assert service.client.post("/api/v1/jobs/no-such-job/cancel").status_code == 404


def test_fifty_concurrent_submissions_run_by_priority_then_age(service_factory, tmp_path):
    service = service_factory(f"sqlite:///{tmp_path / 'fifty.db'}", **FAKE_ENV).start()
    # a job that keeps the runner busy while the fifty arrive: its engine takes 10 s to start
    slow = {**FAKE_MATRIX, "include": [{"strategy": "no_buffer", "overlap": True}]}
    blocker = service.submit({"matrix": slow, "priority": -1000})
    service.wait(blocker, timeout=120, until=lambda j: j["status"] == "running")
    rng = random.Random(0)
    priorities = [rng.choice([-5, 0, 3, 10]) for _ in range(50)]
    with ThreadPoolExecutor(10) as pool:
        ids = list(pool.map(lambda p: service.submit({"matrix": FAKE_MATRIX, "priority": p}),
                            priorities))
    assert len(set(ids)) == 50
    listed = service.client.get("/api/v1/jobs", params={"limit": 1000}).json()
    assert {j["id"] for j in listed} == set(ids) | {blocker}
    assert service.job(blocker)["status"] == "running", "the fifty arrived after the blocker ended"

    for job_id in ids:
        assert service.wait(job_id, timeout=600)["status"] == "done"
    jobs = [service.job(i) for i in ids]
    assert all(len(j["runs"]) == 1 and j["runs"][0]["verdict"] == "pass" for j in jobs)
    started = [j["id"] for j in sorted(jobs, key=lambda j: when(j["started_at"]))]
    expected = [j["id"] for j in sorted(jobs, key=lambda j: (-j["priority"],
                                                              when(j["created_at"]), j["id"]))]
    assert started == expected
    assert all(when(j["started_at"]) >= when(service.job(blocker)["finished_at"]) for j in jobs)
