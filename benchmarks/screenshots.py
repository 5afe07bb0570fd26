"""Screenshots of the dashboard's pages for the README (docs/dashboard-*.png).

    .venv/bin/python benchmarks/screenshots.py [--out docs]

Serves the app (uvicorn in a thread, job runner on) over a fresh SQLite store in a temporary
folder, runs the same job as the browser tests (the smoke matrix's mamba2-eb-ov-c64 and
gdn-eb-ov-c64 on 4 prompts, clean and with the snapshot-race defect; about a minute), and gives
those two configs a synthetic history of 30 earlier commits (one of them a regression) so the
trends have something to show. Then Debian's chromium photographs each page.
"""

from __future__ import annotations

import argparse
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

from evalsvc.api.app import create_app  # noqa: E402
from evalsvc.settings import Settings  # noqa: E402
from evalsvc.store.db import Store  # noqa: E402
from evalsvc.store.models import Build, Commit, Run, Sample  # noqa: E402
from evalsvc.store.record import BuildRef  # noqa: E402
from tests.store.factories import record, run_result  # noqa: E402

CONFIGS = ["mamba2-eb-ov-c64", "gdn-eb-ov-c64"]
DEFECT = "defect:snapshot-race"
JOB = {"matrix": "smoke", "configs": CONFIGS, "workload": {"num_prompts": 4},
       "builds": [{}, {"patches": [DEFECT]}]}
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
            select(Sample.run_id, Sample.sample_id).join(Run).join(Build)
            .where(Build.patch_set == DEFECT, Sample.scenario == "prefill_hit",
                   Sample.first_divergence > 0).order_by(Run.id)).first()
    return f"/runs/{run_id}/samples/{sample_id}?scenario=prefill_hit"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="evalsvc-screenshots-"))
    database_url = f"sqlite:///{tmp / 'store.db'}"
    settings = Settings(data_dir=tmp / "data", database_url=database_url, nightly=False,
                        engine_slots=1)
    server, thread, url = serve(settings)
    try:
        with httpx.Client(base_url=url, timeout=30) as client, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                        args=["--no-sandbox", "--headless"])
            page = browser.new_page(viewport=VIEWPORT)

            def shoot(name: str, path: str) -> None:
                page.goto(url + path)
                page.wait_for_load_state("networkidle")
                page.wait_for_timeout(500)  # the charts' transitions
                page.screenshot(path=args.out / f"dashboard-{name}.png")
                print(f"{args.out / f'dashboard-{name}.png'}: {path}", flush=True)

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
            shoot("overview", "/")
            shoot("commits", "/commits")
            shoot("job", f"/jobs/{job_id}")
            shoot("compare", f"/compare?baseline={ref}&contender={ref}&contender_patches={DEFECT}")
            shoot("sample", sample)
            browser.close()
    finally:
        server.should_exit = True
        thread.join(90)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
