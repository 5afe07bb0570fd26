"""From a defect landing in a tracked repository to its first bad commit, through the service.

A local git repository stands for the tracked branch; its ``evalsvc-engine.yaml`` is the engine
settings file the embedded engine's build reads, and one commit in the middle of its history
switches a defect on. The service runs with a webhook that records what it receives. Nightly
firings (``evalsvc nightly --once``, a process of its own) evaluate the branch head as it moves:
the first nightly on a bad commit opens a regression and the webhook hears of it once; the next
nightly, still bad, adds nothing; bisection over the API finds exactly the commit that switched
the defect on, in ceil(log2(n)) + 1 runs or fewer; a commit that switches it off resolves the
regression, and the webhook hears that once too.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

CONFIG, SCENARIO = "mamba2-eb-ov-c64", "prefill_hit"  # where snapshot-race acts


class Webhook:
    """A Slack-style incoming webhook on loopback that keeps every JSON body it receives."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Repo:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.day = 0
        path.mkdir()
        self.git("init", "-q", "-b", "main")

    def git(self, *args: str) -> str:
        when = f"2026-02-{self.day + 1:02d}T00:00:00Z"
        env = {"GIT_AUTHOR_DATE": when, "GIT_COMMITTER_DATE": when, "PATH": "/usr/bin:/bin",
               "HOME": str(self.path.parent)}
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
                               *args], cwd=self.path, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    def commit(self, defect: bool, message: str) -> str:
        self.day += 1
        settings = {"defects": {"snapshot-race": 1.0}} if defect else {"defects": {}}
        (self.path / "evalsvc-engine.yaml").write_text(yaml.safe_dump(settings))
        (self.path / "CHANGES").write_text(message + "\n")
        self.git("add", "-A")
        self.git("commit", "-qm", message)
        return self.git("rev-parse", "HEAD")


@pytest.fixture
def webhook():
    hook = Webhook()
    yield hook
    hook.close()


def test_a_defect_is_flagged_alerted_once_bisected_and_resolved(tmp_path, service_factory,
                                                                webhook, db_url):
    repo = Repo(tmp_path / "engine-repo")
    nightly = tmp_path / "nightly.yaml"
    nightly.write_text(yaml.safe_dump({"schedules": [{
        "name": "tracked", "cron": "0 2 * * *", "matrix": "smoke",
        "source": {"git": {"repository": str(repo.path), "branch": "main"}},
        "configs": [CONFIG], "workload": {"num_prompts": 4}}]}))
    service = service_factory(db_url, EVALSVC_ALERT_WEBHOOK=webhook.url,
                              EVALSVC_PUBLIC_URL="http://dashboard.example",
                              EVALSVC_NIGHTLY_FILE=str(nightly)).start()
    api = service.client

    def fire_nightly() -> str:
        out = subprocess.run([sys.executable, "-m", "evalsvc.cli", "nightly", "--once"],
                             env=service.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        job_id = out.stdout.split("submitted job ")[1].split()[0]
        job = service.wait(job_id)
        assert job["status"] == "done", job
        return job_id

    def open_regressions() -> list[dict]:
        return api.get("/api/v1/regressions", params={"state": "open"}).json()

    def hooks(n: int) -> list[dict]:  # delivery follows the job's end: wait for it a moment
        deadline = time.monotonic() + 10
        while len(webhook.received) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        return webhook.received

    # a good first nightly
    commits = [repo.commit(defect=False, message="c0")]
    fire_nightly()
    assert open_regressions() == [] and hooks(0) == []

    # eight commits land; the fifth switches the defect on; the next nightly sees the head
    for i in range(1, 9):
        commits.append(repo.commit(defect=i >= 5, message=f"c{i}"))
    first_bad = commits[5]
    job_bad = fire_nightly()
    # the defect acts on prefix hits, and on branches for some prompts: on the generated tokens'
    # KL and first on the extend's (and on those scenarios together)
    regs = open_regressions()
    assert {(r["config"], r["metric"]) for r in regs} == {(CONFIG, "kl_k3_mean"),
                                                          (CONFIG, "extend_kl_k3_mean")}
    [reg] = [r for r in regs if r["scenario"] == SCENARIO and r["metric"] == "kl_k3_mean"]
    assert {r["first_run"]["id"] for r in regs} == {reg["first_run"]["id"]}
    assert reg["first_run"]["sha"] == commits[8] and reg["last_good_run"]["sha"] == commits[0]
    assert reg["evidence"]["verdict"] == "regression" and reg["evidence"]["value"] > 1e-8
    [alert] = hooks(1)  # one message for all that the job opened
    assert f"{len(regs)} regression(s) appeared" in alert["text"]
    assert f"{CONFIG} / {SCENARIO} / KL at {commits[8][:10]} (last good {commits[0][:10]})" \
        in alert["text"]
    assert alert["blocks"][0]["text"]["text"] == alert["text"]  # Slack's layout too
    # the service records the delivery once the webhook has answered: wait for that a moment
    deadline = time.monotonic() + 10
    while True:
        stored = api.get("/api/v1/alerts").json()
        if all(a["delivered_at"] for a in stored) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [(a["job_id"], a["kind"], a["delivered_at"] is not None) for a in stored] == [
        (job_bad, "appeared", True)]

    # still bad at the next head: the same regression, no second alert
    commits.append(repo.commit(defect=True, message="c9"))
    fire_nightly()
    again = open_regressions()
    assert {r["id"] for r in again} == {r["id"] for r in regs}
    assert {r["runs_seen"] for r in again} == {2}
    time.sleep(1)
    assert len(webhook.received) == 1

    # triage it, and bisect it from the regression itself
    resp = api.patch(f"/api/v1/regressions/{reg['id']}",
                     json={"triage": "acknowledged", "comment": "snapshot race is back"})
    assert resp.status_code == 200 and resp.json()["triage"] == "acknowledged"
    resp = api.post("/api/v1/bisections", json={"regression_id": reg["id"]})
    assert resp.status_code == 201, resp.text
    bisection = resp.json()
    n = len(bisection["candidates"])
    assert bisection["candidates"] == commits[1:9] and n == 8
    deadline = time.monotonic() + 300
    while bisection["status"] not in ("done", "failed"):
        assert time.monotonic() < deadline, bisection
        time.sleep(1)
        bisection = api.get(f"/api/v1/bisections/{bisection['id']}").json()
    assert bisection["status"] == "done", bisection["error"]
    assert bisection["first_bad"] == first_bad
    assert bisection["runs_used"] <= math.ceil(math.log2(n)) + 1
    assert bisection["steps"][0] == {**bisection["steps"][0], "sha": commits[8], "reused": True}
    ran = [s["sha"] for s in bisection["steps"] if not s["reused"]]
    assert len(ran) == bisection["runs_used"] and first_bad in ran
    # the bisection's runs of older commits did not move the regression
    assert {r["runs_seen"] for r in open_regressions()} == {2}

    # the fix lands: the regression resolves, and the webhook hears it once
    commits.append(repo.commit(defect=False, message="c10: fix"))
    fire_nightly()
    assert open_regressions() == []
    resolved = api.get("/api/v1/regressions", params={"state": "resolved"}).json()
    assert {r["id"] for r in resolved} == {r["id"] for r in regs}
    assert {r["resolved_run"]["sha"] for r in resolved} == {commits[10]}
    assert [r["triage"] for r in resolved if r["id"] == reg["id"]] == ["acknowledged"]
    assert len(hooks(2)) == 2 and "regression(s) resolved" in webhook.received[1]["text"]
    page = api.get(f"/bisections/{bisection['id']}")
    assert page.status_code == 200 and first_bad[:10] in page.text
