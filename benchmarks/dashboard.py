"""Dashboard pages: render each page over a long nightly history and time it.

    .venv/bin/python benchmarks/dashboard.py [--commits 1000] [--configs 40] [--repeats 10]
                                             [--postgres-url URL] [--skip-postgres] [--out PATH]

The history is the store benchmark's (``benchmarks/store.py``: one nightly job and one unpatched
build per commit, a run of every config with all six scenarios, their metrics and per-sample rows),
loaded into SQLite (a file in a temporary folder) and into a fresh PostgreSQL database created on
the server of ``--postgres-url`` and dropped afterwards. On top of it: an ``accept_length`` metric
per speculative scenario (the mean of its samples', as the harness records it), and for the newest
job what only files hold: an engine log per run (200 KB each; the job page shows their tails) and
the samples Parquet file of one run (24 tokens per sample; the drill-down reads it).

Each page is requested ``--repeats`` times after two warm-up requests through Starlette's test
client on the app of ``create_app`` (job runner off), each request a session of its own; reported
per page: median and p95 wall time (ms) of the whole request (queries, template, transfer) and the
page's size.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, select, text, update
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.store import (  # noqa: E402
    SAMPLES_PER_SCENARIO,
    after_load,
    load,
    make_configs,
    parse_args,
)
from evalsvc.app import create_app  # noqa: E402
from evalsvc.settings import Settings  # noqa: E402
from evalsvc.store.db import Store  # noqa: E402
from evalsvc.store.models import Build, Commit, Job, Run, SampleRow  # noqa: E402

TARGET_MS = 1000.0
TOKENS = 24
LOG_BYTES = 200_000


def add_accept_length(store: Store) -> None:
    """The speculative scenarios' ``accept_length`` metric: the mean of their samples'."""
    with store.session() as s:
        s.execute(text("INSERT INTO metrics (run_id, scenario, name, value) "
                       "SELECT run_id, scenario, 'accept_length', avg(accept_length) FROM samples "
                       "WHERE scenario = 'speculative' GROUP BY run_id, scenario"))


def add_files(store: Store, files: Path) -> dict[str, Any]:
    """Engine logs for the newest job's runs and a samples file for its first run; returns the
    job, its run and one of that run's samples, and the two newest commits."""
    rng = np.random.default_rng(0)
    with store.session() as s:
        job_id = s.scalar(select(Job.id).order_by(Job.created_at.desc()).limit(1))
        runs = s.execute(select(Run.id, Run.config, Run.requested_args).where(Run.job_id == job_id)
                         .order_by(Run.id)).all()
        line = "[2025-01-01 00:00:00 TP0] Decode batch. #running-req: 8, #token: 4096, " \
               "token usage: 0.06, gen throughput (token/s): 1234.56, #queue-req: 0\n"
        for run_id, config, _ in runs:
            log = files / f"{config}.log"
            log.write_text(line * (LOG_BYTES // len(line)))
            s.execute(update(Run).where(Run.id == run_id).values(log_path=str(log)))
        run_id, _, requested = runs[0]
        vocab = 259 if "mamba2" in requested["model_path"] else 1024
        samples = s.execute(select(SampleRow).where(SampleRow.run_id == run_id)).scalars().all()
        rows = []
        for sample in samples:
            dec = rng.normal(-1.0, 0.6, TOKENS).clip(max=0.0)
            rows.append({"scenario": sample.scenario, "sample_id": sample.sample_id,
                         "prompt_id": sample.prompt_id, "prompt_tokens": sample.prompt_tokens,
                         "cached_tokens": sample.cached_tokens,
                         "host_cached_tokens": sample.host_cached_tokens,
                         "completion_tokens": TOKENS, "hit": sample.hit,
                         "kl_k1_mean": sample.kl_k1_mean, "kl_k2_mean": sample.kl_k2_mean,
                         "kl_k3_mean": sample.kl_k3_mean, "kl_k3_max": sample.kl_k3_max,
                         "topk_kl_mean": sample.topk_kl_mean, "same_top_rate": sample.same_top_rate,
                         "first_divergence": 5, "accept_length": sample.accept_length,
                         "output_ids": rng.integers(0, vocab, TOKENS).tolist(),
                         "decode_logprobs": dec.tolist(),
                         "reference_logprobs": (dec - rng.exponential(1e-3, TOKENS)).tolist()})
        path = files / "samples.parquet"
        pd.DataFrame(rows).to_parquet(path, index=False)
        s.execute(update(Run).where(Run.id == run_id).values(samples_path=str(path)))
        s.execute(update(SampleRow).where(SampleRow.run_id == run_id).values(first_divergence=5))
        newest = s.scalars(select(Commit.ref).join(Build)
                           .order_by(Commit.committed_at.desc()).limit(2)).all()
    return {"job": job_id, "run": run_id, "sample": samples[0].sample_id,
            "scenario": samples[0].scenario, "contender": newest[0], "baseline": newest[1]}


def pages(found: dict[str, Any]) -> dict[str, str]:
    compare = f"/compare?baseline={found['baseline']}&contender={found['contender']}"
    sample = f"/runs/{found['run']}/samples/{found['sample']}?scenario={found['scenario']}"
    return {"overview": "/",
            "overview, one scenario": "/?scenario=prefill_hit", "commits": "/commits",
            "jobs": "/jobs", "job": f"/jobs/{found['job']}", "compare": compare, "sample": sample}


def time_pages(url: str, data_dir: Path, found: dict[str, Any], repeats: int) -> dict[str, Any]:
    settings = Settings(data_dir=data_dir, database_url=url, nightly=False)
    out = {}
    with TestClient(create_app(settings, start_runner=False)) as client:
        for name, path in pages(found).items():
            times = []
            for i in range(repeats + 2):
                t = time.perf_counter()
                resp = client.get(path)
                elapsed = (time.perf_counter() - t) * 1000.0
                assert resp.status_code == 200, (path, resp.status_code, resp.text[:500])
                if i >= 2:  # two warm-up requests
                    times.append(elapsed)
            times.sort()
            p95 = times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]
            out[name] = {"path": path, "median_ms": round(statistics.median(times), 1),
                         "p95_ms": round(p95, 1), "max_ms": round(times[-1], 1),
                         "kilobytes": round(len(resp.content) / 1024)}
            ok = "ok" if p95 < TARGET_MS else "OVER TARGET"
            print(f"  {name:30s} median {out[name]['median_ms']:7.1f} ms, p95 {p95:7.1f} ms, "
                  f"{out[name]['kilobytes']} KB [{ok}]", flush=True)
    return out


def bench(url: str, n_commits: int, configs: list[dict[str, Any]], repeats: int,
          tmp: Path) -> dict[str, Any]:
    store = Store(url)
    try:
        print(f"{store.engine.dialect.name}: loading {n_commits} commits x {len(configs)} configs",
              flush=True)
        loaded = load(store, n_commits, configs)
        add_accept_length(store)
        after_load(store)
        files = tmp / store.engine.dialect.name
        files.mkdir()
        found = add_files(store, files)
    finally:
        store.close()
    return {"url": make_url(url).render_as_string(hide_password=True), "load": loaded,
            "pages": time_pages(url, tmp / "data", found, repeats)}


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], repeats=10, out="dashboard.json")

    configs = make_configs(args.configs)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "commits": args.commits, "configs": args.configs,
        "samples_per_scenario": SAMPLES_PER_SCENARIO, "repeats": args.repeats,
        "target_ms": TARGET_MS, "databases": {}}
    tmp = Path(tempfile.mkdtemp(prefix="evalsvc-dashboard-bench-"))
    try:
        report["databases"]["sqlite"] = bench(f"sqlite:///{tmp / 'store.db'}", args.commits,
                                              configs, args.repeats, tmp)
        if not args.skip_postgres:
            name = f"evalsvc_bench_dashboard_{os.getpid()}"
            admin = create_engine(args.postgres_url, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
                report["machine"]["postgresql"] = conn.scalar(text("SHOW server_version"))
            try:
                url = make_url(args.postgres_url).set(database=name).render_as_string(
                    hide_password=False)
                report["databases"]["postgresql"] = bench(url, args.commits, configs,
                                                          args.repeats, tmp)
            finally:
                with admin.connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
                admin.dispose()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
