"""Screenshots of the dashboard's pages for the README (docs/dashboard-*.png).

    .venv/bin/python benchmarks/screenshots.py [--out docs]

Serves the app (uvicorn in a thread, job runner on) over a fresh SQLite store in a temporary
folder, with one user of role write (``reviewer``), who posts the same job as the browser tests
(the smoke matrix's mamba2-eb-ov-c64 and gdn-eb-ov-c64 on 4 prompts, clean and with the
snapshot-race defect, tracking regressions; about a minute) and acknowledges one of the
regressions it opens; those two configs get a synthetic history of 30 earlier commits (one of them
a regression) so the trends have something to show. Then Debian's chromium signs in as the
reviewer and photographs each page, the controls of a user of role write on them.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import numpy as np
import uvicorn
from playwright.sync_api import sync_playwright
from sqlalchemy import select

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.app import create_app  # noqa: E402
from evalsvc.settings import Settings  # noqa: E402
from evalsvc.store.db import Store  # noqa: E402
from evalsvc.store.models import Build, Commit, Run, SampleRow  # noqa: E402
from evalsvc.store.record import BuildRef  # noqa: E402
from tests.store.factories import record, run_result  # noqa: E402

CONFIGS = ["mamba2-eb-ov-c64", "gdn-eb-ov-c64"]
DEFECT = "defect:snapshot-race"
JOB = {"matrix": "smoke", "configs": CONFIGS, "workload": {"num_prompts": 4},
       "builds": [{}, {"patches": [DEFECT]}], "track": True}
TOKEN = secrets.token_hex(16)  # the reviewer's
HISTORY = 30
REGRESSION = 18  # the history commit where mamba2's prefill_hit and branching fail
VIEWPORT = {"width": 1280, "height": 960}


def serve(settings: Settings) -> tuple[uvicorn.Server, threading.Thread, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def kls(rng: np.random.Generator, broken: bool = False) -> list[float]:
    """Per-sample mean KL of 4 samples: a clean run's (about 2e-13 nats), or a broken one's."""
    return [0.02 if broken else float(v) for v in rng.lognormal(np.log(2e-13), 0.5, 4)]


def add_history(store: Store, results_dir: Path) -> None:
    """HISTORY daily commits before the job's, for the job's two configs (their fingerprints and
    models), with per-sample KL like a clean run's and one regression."""
    rng = np.random.default_rng(0)
    with store.session() as s:
        runs = s.execute(select(Run.config, Run.fingerprint, Run.model).distinct()).all()
        newest = s.scalar(select(Commit.committed_at))
    for i in range(HISTORY):
        results = []
        for config, fingerprint, model in runs:
            broken = i == REGRESSION and config.startswith("mamba2")
            r = run_result(config, {"cold": kls(rng), "prefill_hit": kls(rng, broken),
                                    "decode_hit": kls(rng), "branching": kls(rng, broken)},
                           fingerprint=fingerprint, seed=i)
            r.model = model
            results.append(r)
        build = BuildRef("evalsvc/embedded", version=f"0.0.{i + 1}",
                         committed_at=newest - timedelta(days=HISTORY - i))
        record(store, results_dir, f"nightly-0.0.{i + 1}", build, results)


def diverged_sample(store: Store) -> str:
    with store.session() as s:
        run_id, sample_id = s.execute(
            select(SampleRow.run_id, SampleRow.sample_id).join(Run).join(Build)
            .where(Build.patch_set == DEFECT, SampleRow.scenario == "prefill_hit",
                   SampleRow.first_divergence > 0).order_by(Run.id)).first()
    return f"/runs/{run_id}/samples/{sample_id}?scenario=prefill_hit"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="evalsvc-screenshots-"))
    database_url = f"sqlite:///{tmp / 'store.db'}"
    settings = Settings(data_dir=tmp / "data", database_url=database_url, nightly=False,
                        engine_slots=1, session_secret=secrets.token_hex(16),
                        users=[{"name": "reviewer", "role": "write", "token": TOKEN}])
    server, thread, url = serve(settings)
    try:
        with httpx.Client(base_url=url, timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as client, \
                sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                        args=["--no-sandbox", "--headless"])
            page = browser.new_page(viewport=VIEWPORT)

            def shoot(name: str, path: str, full_page: bool = False, height: int | None = None
                      ) -> None:
                page.goto(url + path)
                page.wait_for_load_state("networkidle")
                page.wait_for_timeout(500)  # the charts' transitions
                clip = {"x": 0, "y": 0, "width": VIEWPORT["width"], "height": height} if height \
                    else None
                page.screenshot(path=args.out / f"dashboard-{name}.png", full_page=full_page,
                                clip=clip)
                print(f"{args.out / f'dashboard-{name}.png'}: {path}", flush=True)

            shoot("login", "/login?next=/", height=300)
            page.fill('input[name="token"]', TOKEN)
            page.click('#sign-in-form button[type="submit"]')
            page.wait_for_load_state("networkidle")
            job_id = client.post("/api/v1/jobs", json=JOB).json()["id"]
            while client.get(f"/api/v1/jobs/{job_id}").json()["progress"].get("done", 0) < 2:
                time.sleep(1)
            shoot("jobs", "/jobs")  # half-way: live progress
            while client.get(f"/api/v1/jobs/{job_id}").json()["status"] != "done":
                time.sleep(1)
            store = Store(database_url)
            try:
                add_history(store, settings.results_dir())
                sample = diverged_sample(store)
            finally:
                store.close()
            ref = client.get("/api/v1/commits").json()[0]["ref"]  # the job's, the newest
            regression = next(r["id"] for r in client.get("/api/v1/regressions").json()
                              if r["scenario"] == "prefill_hit" and r["metric"] == "kl_k3_mean"
                              and r["config"] == CONFIGS[0])
            client.patch(f"/api/v1/regressions/{regression}", json={
                "triage": "acknowledged", "comment": "the snapshot race again: looking into it"})
            shoot("overview", "/")
            shoot("commits", "/commits")
            shoot("job", f"/jobs/{job_id}")
            shoot("compare", f"/compare?baseline={ref}&contender={ref}&contender_patches={DEFECT}",
                  full_page=True)
            shoot("regression", f"/regressions/{regression}", full_page=True)
            shoot("sample", sample)
            browser.close()
    finally:
        server.should_exit = True
        thread.join(90)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
