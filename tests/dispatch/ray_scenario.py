"""The smoke job through the service on a Ray cluster, against the same job on the local dispatcher.

    unshare --net .venv/bin/python -m tests.dispatch.ray_scenario REPORT.json WORKDIR

Runs inside a network namespace of its own whose only interface is loopback (it checks), since
Ray binds to the machine's address even when asked for loopback. SQLite stores (PostgreSQL on the
machine is not reachable from the namespace). Steps, timed:

1. ``local``: a service with the local dispatcher (two engine slots) runs the trimmed smoke job,
   while the cluster starts: a head without slots and one CPU-only worker advertising two
   ``engine_slot`` (tracked by unit, so each task gets a slot id), token authentication on.
2. ``ray``: a service with ``EVALSVC_RAY_ADDRESS=ray://...`` (a Ray Client, as in
   ``docker/compose.yaml``) runs the same job; two runs at once, each engine's
   ``CUDA_VISIBLE_DEVICES`` sampled; the Ray worker of one run is SIGKILLed once its engine serves
   (Ray starts the run again).
   Then an SGLang job (the fake SGLang server of ``tests/data``) with a git source: the service has
   no SGLang environment, the worker node has one (``EVALSVC_ENGINE_PYTHON``) and makes the build
   in its own data directory; a second job whose patch does not apply to that source fails, naming
   the patch and the node.
3. ``kill_twice``: a one-run job whose worker is killed in both attempts: the run is an error that
   says so, and the job ends failed (its only run errored).
   ``too_wide``: a run with ``tp_size`` 4, more slots than any node offers: an error at once.
4. ``cancel``: a job cancelled while its engines run.
5. ``restart``: the Ray service SIGKILLed mid-job (Ray then kills its tasks' workers, and their
   engines die with them), then started again with the head's GCS address (a driver on the
   cluster's network, the other form of ``EVALSVC_RAY_ADDRESS``): the job resumes.

Every observation goes to the report (a JSON object) for the test to judge; an exception ends the
scenario with its traceback in ``error``. The cluster and the services are stopped in any case,
and whatever marked process was left is listed in ``left_behind``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

from evalsvc.store.db import Store
from evalsvc.store.queries import job_builds
from evalsvc.tls import tls_context
from tests.api.conftest import Service
from tests.api.test_service import FAKE_MATRIX
from tests.builds.test_build import git
from tests.dispatch.raycluster import (
    RayCluster,
    cmdline,
    listening,
    loopback_only,
    marked_pids,
)
from tests.dispatch.test_base import sglang_repository

CONFIGS = ["mamba2-eb-ov-c64", "gdn-eb-ov-c64", "mamba2-nb-sync-c64"]
JOB = {"matrix": "smoke", "configs": CONFIGS, "workload": {"num_prompts": 4}}
RETRIED = "gdn-eb-ov-c64"  # the run whose Ray worker is killed once
KILLED = "mamba2-noradix-sync-nochunk"  # the run whose worker is killed in both attempts
SLOTS = 2
WIDE_MATRIX = {"name": "wide", "engine": "embedded",
               "models": {"m": {"path": "hybrid-mamba2-tiny", "tp_size": 2 * SLOTS}},
               "include": [{"strategy": "extra_buffer", "overlap": True}],
               "workload": {"num_prompts": 2, "max_new_tokens": 4}, "scenarios": ["cold"]}
FAKE_PYTHON = str(Path(__file__).parents[1] / "data" / "fake-python")
PATCH = "pr37165-clear-deferred-mamba-metadata"  # does not apply to the stand-in SGLang tree
RUN_LOG = re.compile(r"evalsvc-ray-runs/(\d+)-\d+-[^/]*/([^/]+)\.log$")


class Report(dict):
    def step(self, name: str):
        report = self

        @contextlib.contextmanager
        def timed():
            t0 = time.monotonic()
            try:
                yield
            finally:
                report.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 1)

        return timed()


def engines(token: str) -> list[dict[str, Any]]:
    """The embedded engines the cluster's workers started: pid, run, config, devices, worker."""
    found = []
    for pid in marked_pids(token):
        if "evalsvc.engines.embedded" not in cmdline(pid):
            continue
        try:
            target = os.readlink(f"/proc/{pid}/fd/1")
            env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text(
                errors="replace").split("\0") if "=" in e)
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ppid, nice = int(stat[1]), int(stat[16])
        except (OSError, ValueError):
            continue
        m = RUN_LOG.search(target)
        port = re.search(r"--port (\d+)", cmdline(pid))
        found.append({"pid": pid, "run": int(m[1]) if m else None, "config": m[2] if m else None,
                      "devices": env.get("CUDA_VISIBLE_DEVICES"), "worker": ppid,
                      "ray_env": sorted(k for k in env if k.startswith("RAY_")),
                      "omp": env.get("OMP_NUM_THREADS"), "nice": nice,
                      "worker_cmd": cmdline(ppid)[:80], "port": int(port[1]) if port else None})
    return found


def serving(engine: dict[str, Any]) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{engine['port']}/health_generate",
                         timeout=2, verify=tls_context()).status_code == 200
    return False


def wait_engine(token: str, config: str, exclude: set[int], timeout: float = 180) -> dict:
    """An engine of ``config`` (not one of ``exclude``) that serves requests."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in engines(token):
            if e["config"] == config and e["pid"] not in exclude and serving(e):
                return e
        time.sleep(0.2)
    raise TimeoutError(f"no engine of {config} served within {timeout:.0f} s")


def gone_within(pid: int, timeout: float) -> float | None:
    """Seconds until ``pid`` is gone (None: still there after ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return time.monotonic() - t0
        if state == "Z":
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def kill_worker(engine: dict[str, Any]) -> dict[str, Any]:
    """SIGKILL the Ray worker process that runs an engine; how long its engine outlived it."""
    assert engine["worker_cmd"].startswith("ray::"), engine
    os.kill(engine["worker"], signal.SIGKILL)
    return {"worker": engine["worker"], "engine": engine["pid"], "run": engine["run"],
            "engine_gone_after": gone_within(engine["pid"], 20)}


def results(service: Service, job: dict[str, Any]) -> dict[str, Any]:
    """Per config: fingerprint, verdict, reason, every scenario metric's value, the log's size."""
    out = {}
    for r in job["runs"]:
        d = service.client.get(f"/api/v1/runs/{r['id']}").json()
        log_path = d["log_path"]
        out[r["config"]] = {
            "fingerprint": d["fingerprint"], "status": d["status"], "verdict": d["verdict"],
            "reason": d["reason"],
            "metrics": {s["scenario"]: {k: v["value"] for k, v in s["metrics"].items()}
                        for s in d["scenarios"]},
            "log_path": log_path,
            "log_bytes": Path(log_path).stat().st_size if log_path and Path(log_path).exists()
            else None,
            "log_in_data_dir": bool(log_path) and str(service.data_dir.resolve())
            in str(Path(log_path).resolve()),
            "samples": bool(d["samples_path"]) and Path(d["samples_path"]).exists()}
    return out


def placements(service: Service) -> list[str]:
    text = service.log_path.read_text(errors="replace")
    return re.findall(r"run (\d+) started \(attempt (\d+)\) on (.*)", text)


def builds_of(service: Service, job_id: str) -> list[dict[str, Any]]:
    store = Store(service.env["EVALSVC_DATABASE_URL"])
    try:
        with store.session() as s:
            return json.loads(json.dumps([b.model_dump() for b in job_builds(s, job_id)],
                                         default=str))
    finally:
        store.close()


def main(report_path: Path, work: Path) -> int:
    report = Report()
    services: list[Service] = []
    cluster: RayCluster | None = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up when the test is killed
    try:
        loopback_only()
        report["interfaces"] = [name for _, name in __import__("socket").if_nameindex()]
        report["omp"] = os.environ.get("OMP_NUM_THREADS")  # what the engines should inherit
        cluster = RayCluster(work / "logs")
        t_all = time.monotonic()

        # 1. the local dispatcher, while the cluster starts
        local = Service(work / "local", f"sqlite:///{work / 'local.db'}",
                        EVALSVC_ENGINE_SLOTS=str(SLOTS))
        services.append(local)
        (work / "local").mkdir(parents=True, exist_ok=True)
        local.start()
        t_local = time.monotonic()
        local_job = local.submit(JOB)
        with report.step("cluster"):
            cluster.start()
            # the node's own SGLang environment (the fake server) and data directory (builds)
            cluster.add_worker(SLOTS, env={"EVALSVC_ENGINE_PYTHON": FAKE_PYTHON,
                                           "FAKE_SGLANG_PYTHON": sys.executable,
                                           "EVALSVC_DATA_DIR": str(work / "worker-data")})
            report["cluster_resources"] = cluster.wait_resources(SLOTS)
        job = local.wait(local_job, timeout=600)
        report["seconds"]["local_job"] = round(time.monotonic() - t_local, 1)
        report["local"] = {"status": job["status"], "runs": results(local, job)}
        local.stop()

        # 2. the same job on the cluster; one run's worker killed once
        ray = Service(work / "ray", f"sqlite:///{work / 'ray.db'}",
                      EVALSVC_RAY_ADDRESS=cluster.client_address,
                      EVALSVC_RAY_SLOT_RESOURCE="engine_slot", EVALSVC_RAY_RETRIES="1",
                      EVALSVC_ALLOWED_SOURCES="git:*", **cluster.driver_env)
        services.append(ray)
        (work / "ray").mkdir(parents=True, exist_ok=True)
        with report.step("ray_service_start"):
            ray.start(timeout=180)
        seen: list[list[dict[str, Any]]] = []
        stop_sampling = threading.Event()

        def sample() -> None:
            while not stop_sampling.wait(0.2):
                now = [e for e in engines(cluster.token) if e["run"] is not None]
                if now:
                    seen.append(now)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t_ray = time.monotonic()
        ray_job = ray.submit(JOB)
        engine = wait_engine(cluster.token, RETRIED, set())
        time.sleep(1.5)  # mid-run: its scenarios are under way
        report["retry"] = kill_worker(engine)
        job = ray.wait(ray_job, timeout=600)
        report["seconds"]["ray_job"] = round(time.monotonic() - t_ray, 1)
        stop_sampling.set()
        sampler.join()
        report["ray"] = {"status": job["status"], "runs": results(ray, job)}
        report["engines_seen"] = seen
        report["listening"] = listening()
        report["placements"] = placements(ray)
        report["connect_retries"] = ray.log_path.read_text(errors="replace").count(
            "connecting to the Ray cluster at")

        # 2b. SGLang jobs: builds made on the worker, over the worker's SGLang environment
        with report.step("sglang"):
            repo = sglang_repository(work / "sglang-repo")
            sha = git(repo, "rev-parse", "HEAD")
            source = f"git:{repo}@main"
            good = ray.submit({"matrix": FAKE_MATRIX, "builds": [{"source": source}]})
            bad = ray.submit({"matrix": FAKE_MATRIX,
                              "builds": [{"source": source, "patches": [PATCH]}]})
            job = ray.wait(good, timeout=300)
            bad_job = ray.wait(bad, timeout=300)
            report["sglang"] = {
                "status": job["status"], "error": job["error"], "sha": sha,
                "runs": results(ray, job), "builds": builds_of(ray, good),
                "worker_builds": sorted(p.parent.name for p in
                                        (work / "worker-data" / "builds").glob("*/manifest.json")),
                "service_builds": sorted(p.name for p in (ray.data_dir / "builds").glob("*")),
                "bad": {"status": bad_job["status"], "error": bad_job["error"],
                        "runs": len(bad_job["runs"])}}

        # 3. a run whose worker dies in both attempts
        with report.step("kill_twice"):
            kill_job = ray.submit({**JOB, "configs": [KILLED]})
            first = wait_engine(cluster.token, KILLED, set())
            kills = [kill_worker(first)]
            second = wait_engine(cluster.token, KILLED, {first["pid"]})
            kills.append(kill_worker(second))
            job = ray.wait(kill_job, timeout=300)
            report["kill_twice"] = {"status": job["status"], "kills": kills,
                                    "runs": results(ray, job)}

        # 3b. a run that needs more slots than any node offers (tp_size 4, two slots a node)
        with report.step("too_wide"):
            t_wide = time.monotonic()
            wide_job = ray.submit({"matrix": WIDE_MATRIX})
            job = ray.wait(wide_job, timeout=120)
            report["too_wide"] = {"status": job["status"], "runs": list(results(ray, job).values()),
                                  "seconds": round(time.monotonic() - t_wide, 1)}

        # 4. cancel while its engines run
        with report.step("cancel"):
            cancel_job = ray.submit(JOB)
            wait_engine(cluster.token, CONFIGS[0], set())
            resp = ray.client.post(f"/api/v1/jobs/{cancel_job}/cancel")
            job = ray.wait(cancel_job, timeout=120)
            deadline = time.monotonic() + 30
            while (left := engines(cluster.token)) and time.monotonic() < deadline:
                time.sleep(0.2)
            report["cancel"] = {"response": resp.json(), "status": job["status"],
                                "runs": [(r["config"], r["status"], r["verdict"])
                                         for r in job["runs"]], "engines_left": left}

        # 5. the service killed mid-job, then started again
        with report.step("restart"):
            restart_job = ray.submit({**JOB, "configs": CONFIGS[:2]})
            first = wait_engine(cluster.token, CONFIGS[0], set())
            ray.kill()
            gone = gone_within(first["pid"], 60)
            # started again as a driver on the GCS address (before: a Ray Client): both forms
            ray.env["EVALSVC_RAY_ADDRESS"] = cluster.address
            ray.start(timeout=180)
            job = ray.wait(restart_job, timeout=600)
            report["restart"] = {"engine": first["pid"], "engine_gone_after": gone,
                                 "status": job["status"], "runs": results(ray, job),
                                 "resumed": "resumes after a restart"
                                 in ray.log_path.read_text(errors="replace")}
        runs_dir = cluster.tmp / "evalsvc-ray-runs"
        report["run_dirs_left"] = sorted(p.name for p in runs_dir.iterdir())
        report["seconds"]["total"] = round(time.monotonic() - t_all, 1)
    except BaseException:  # noqa: BLE001 - anything, SIGTERM's exit included, goes to the report
        report["error"] = traceback.format_exc()
    finally:
        for service in services:
            try:
                code = service.stop()
                report.setdefault("service_exit", []).append(code)
            except BaseException:  # noqa: BLE001 - reported; the cluster is stopped regardless
                report.setdefault("cleanup_errors", []).append(traceback.format_exc())
        if services:
            report["service_log_tail"] = services[-1].log()[-4000:]
        if cluster is not None:
            report["left_behind"] = cluster.stop(keep_logs="error" in report)
            report["after_stop"] = [f"{p}: {cmdline(p)[:200]}" for p in cluster.pids()]
        report_path.write_text(json.dumps(report, indent=1, default=str))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
