"""Results store: load a long nightly history, then time the two reads the dashboard leans on.

    .venv/bin/python benchmarks/store.py [--commits 1000] [--configs 40] [--postgres-url URL]
                                         [--skip-postgres] [--repeats 20] [--out PATH]

The same synthetic history goes into SQLite (a file in a temporary folder) and PostgreSQL (a fresh
database on the server of ``--postgres-url``, dropped afterwards), each migrated by ``Store(url)``:
one nightly job per commit, one unpatched build per commit, and per build one run of every config
with all six scenarios. Per run and scenario: a scenario row, the scalar metrics of METRIC_NAMES
(``kl_k3_mean`` with its interval and sample count, as ``record.metric_rows`` stores it) and
SAMPLES_PER_SCENARIO per-sample rows whose sample ids repeat from build to build, so ``compare``
has pairs to bootstrap. Rows go in with Core bulk inserts (``session.execute(insert(table), dicts)``),
one transaction per batch of commits.

Timed, each ``--repeats`` times after a warm-up, in a fresh session every time:

* history: ``metric_history(session, "kl_k3_mean", fingerprint=..., scenario=...)``, one config's
  value over every commit;
* compare: ``compare(session, baseline_build, contender_build)``, the newest two commits' builds,
  every config x scenario with a paired bootstrap interval over the shared samples;
* for information (no target, fewer repeats): ``latest_per_config(session)``, which ranks every run.

Each statement the two reads send is EXPLAINed (``EXPLAIN QUERY PLAN`` / ``EXPLAIN ANALYZE``) and the
plans are kept in the results file with the timings (median and p95, ms), load times and row counts.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy
from sqlalchemy import create_engine, event, func, insert, make_url, select, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.matrix import SCENARIOS, config_name  # noqa: E402
from evalsvc.metrics import paired_difference_ci  # noqa: E402
from evalsvc.store.db import Store  # noqa: E402
from evalsvc.store.models import Build, Commit, Job, Metric, Run, SampleRow, ScenarioRow  # noqa: E402
from evalsvc.store.queries import compare, latest_per_config, metric_history  # noqa: E402
from evalsvc.store.reads import ScenarioComparison  # noqa: E402

METRIC_NAMES = ("kl_k3_mean", "kl_k1_mean", "kl_k2_mean", "kl_k3_token_mean", "kl_k3_p50", "kl_k3_p99",
                "kl_k3_max", "topk_kl_mean", "same_top_rate", "hit_coverage")
SAMPLES_PER_SCENARIO = 8
BATCH_COMMITS = 25
TARGET_MS = 50.0
HISTORY_SCENARIO = "prefill_hit"
REPOSITORY = "sgl-project/sglang"
MATRIX = "mamba-full"
TABLES = {"commits": Commit, "builds": Build, "jobs": Job, "runs": Run, "scenarios": ScenarioRow,
          "metrics": Metric, "samples": SampleRow}


# ---------------------------------------------------------------- synthetic configs and rows

def make_configs(n: int) -> list[dict[str, Any]]:
    """n distinct configs over the matrix axes, with the JSON a real run carries."""
    axes = itertools.product(("mamba2", "gdn"), ("nb", "eb", "auto", "noradix"), (True, False),
                             (None, 64, 0), (False, True), (False, True))
    combos = list(axes)
    picked = [combos[(i * 37) % len(combos)] for i in range(n)]  # spread over the axes
    out, seen = [], set()
    for i, (model, radix, overlap, chunked, hicache, mtp) in enumerate(picked):
        settings = {"model": model, "radix_cache": radix != "noradix",
                    "strategy": {"nb": "no_buffer", "eb": "extra_buffer"}.get(radix, "auto"),
                    "overlap": overlap, "chunked_prefill": chunked, "hicache": hicache, "mtp": mtp,
                    "deterministic": False}
        name = config_name(settings)
        if name in seen:
            name = f"{name}-v{i}"
        seen.add(name)
        path = f"hybrid-{'mamba2' if model == 'mamba2' else 'gdn'}-tiny"
        requested = {"model_path": path, "mamba_track_interval": 64, "random_seed": 0,
                     "mamba_radix_cache_strategy": settings["strategy"],
                     "chunked_prefill_size": chunked, "disable_overlap_schedule": not overlap,
                     "enable_hierarchical_cache": hicache,
                     "speculative_algorithm": "EAGLE" if mtp else None}
        resolved = {**requested, "host": "127.0.0.1", "port": 30000 + i, "page_size": 1, "tp_size": 1,
                    "dp_size": 1, "max_running_requests": 64, "max_total_tokens": 65536,
                    "max_mamba_cache_size": 512, "mamba_ssm_dtype": "float32", "dtype": "auto",
                    "hicache_ratio": None, "hicache_size": 0, "hicache_write_policy": "write_through",
                    "hicache_io_backend": "kernel", "hicache_mem_layout": "layer_first",
                    "speculative_num_steps": 3 if mtp else None, "context_length": 8192,
                    "enable_deterministic_inference": False, "log_level": "info", "status": "ready",
                    "max_total_num_tokens": 65536, "max_req_input_len": 65535, "load_format": "auto",
                    "version": "0.5.6", "engine": "sglang", "avg_spec_accept_length": None}
        command = ["python3", "-m", "sglang.launch_server", "--model-path", path, "--port", str(30000 + i)]
        for k, v in requested.items():
            if k != "model_path" and v not in (None, False):
                command += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
        fingerprint = hashlib.sha256(json.dumps([i, settings], sort_keys=True).encode()).hexdigest()[:16]
        out.append({"config": name, "model": model, "fingerprint": fingerprint, "settings": settings,
                    "requested_args": requested, "resolved_args": resolved, "command": command})
    return out


class Generator:
    """Rows of commits [first, last), deterministic in the commit index (seeded per batch)."""

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        self.configs = configs
        self.t0 = datetime(2025, 1, 1, tzinfo=UTC)

    def batch(self, first: int, last: int) -> dict[str, list[dict[str, Any]]]:
        rng = np.random.default_rng(first)
        n_cfg, n_scen, n_s = len(self.configs), len(SCENARIOS), SAMPLES_PER_SCENARIO
        rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}
        for c in range(first, last):
            cid = c + 1
            sha = hashlib.sha1(f"commit-{c}".encode()).hexdigest()
            at = self.t0 + timedelta(hours=c)
            job_id = f"nightly-{c:06d}"
            rows["commits"].append({"id": cid, "ref": f"{REPOSITORY}@{sha}", "repository": REPOSITORY,
                                    "sha": sha, "version": None, "committed_at": at, "branch": "main"})
            rows["builds"].append({"id": cid, "commit_id": cid, "patch_set": "",
                                   "probes": {"python": "3.11.9", "torch": "2.9.1", "cuda": "12.8"},
                                   "base_env": {"image": "lmsysorg/sglang:v0.5.6"},
                                   "manifest": {"sglang": sha[:12], "patches": []}, "created_at": at})
            rows["jobs"].append({"id": job_id, "trigger": "nightly", "status": "done", "priority": 0,
                                 "spec": {"matrix": MATRIX, "ref": f"{REPOSITORY}@{sha}", "patches": []},
                                 "created_at": at, "started_at": at, "error": None,
                                 "finished_at": at + timedelta(minutes=50)})
        # per (commit, config, scenario, sample) KL values: a config-specific level, noise, rare spikes
        shape = (last - first, n_cfg, n_scen, n_s)
        level = np.exp(rng.normal(-27.6, 0.5, size=(1, n_cfg, n_scen, 1)))  # ~1e-12 nats
        k3 = level * rng.lognormal(0.0, 0.6, size=shape)
        k3 *= np.where(rng.random(size=(*shape[:3], 1)) < 0.002, 1e7, 1.0)  # a rare defect
        k1 = k3 * rng.uniform(0.5, 1.5, size=shape)
        k2 = k3 * rng.uniform(0.9, 1.1, size=shape)
        k3max = k3 * rng.uniform(2.0, 20.0, size=shape)
        topk = k3 * rng.uniform(0.8, 1.0, size=shape)
        same_top = 1.0 - rng.uniform(0.0, 1e-3, size=shape)
        cached = rng.integers(0, 200, size=shape)
        prompt_tokens = cached + rng.integers(16, 400, size=shape)
        hits = cached > 20
        accept = rng.uniform(1.8, 3.4, size=shape)
        seconds = rng.uniform(1.0, 20.0, size=shape[:3])
        for ci, c in enumerate(range(first, last)):
            cid = c + 1
            for k, cfg in enumerate(self.configs):
                run_id = c * n_cfg + k + 1
                at = self.t0 + timedelta(hours=c, minutes=1 + k)
                rows["runs"].append({
                    "id": run_id, "job_id": f"nightly-{c:06d}", "build_id": cid, "config": cfg["config"],
                    "matrix": MATRIX, "model": cfg["model"], "fingerprint": cfg["fingerprint"],
                    "settings": cfg["settings"], "requested_args": cfg["requested_args"],
                    "resolved_args": cfg["resolved_args"], "reference": {"kind": "same_server"},
                    "command": cfg["command"], "status": "done", "verdict": "pass", "reason": None,
                    "startup_seconds": 40.0 + k % 7, "seconds": float(seconds[ci, k].sum()),
                    "log_path": f"results/nightly-{c:06d}/logs/{cfg['config']}.log",
                    "samples_path": f"results/nightly-{c:06d}/{cfg['fingerprint']}.parquet",
                    "created_at": at, "finished_at": at + timedelta(minutes=1)})
                for j, scen in enumerate(SCENARIOS):
                    v3, v1, v2 = k3[ci, k, j], k1[ci, k, j], k2[ci, k, j]
                    mean = float(v3.mean())
                    half = 2.0 * float(v3.std(ddof=1)) / math.sqrt(n_s)
                    rows["scenarios"].append({"run_id": run_id, "scenario": scen, "verdict": "pass",
                                              "reason": None, "seconds": float(seconds[ci, k, j])})
                    values = {"kl_k3_mean": mean, "kl_k1_mean": float(v1.mean()),
                              "kl_k2_mean": float(v2.mean()), "kl_k3_token_mean": mean * 1.01,
                              "kl_k3_p50": float(np.median(v3)) * 0.7,
                              "kl_k3_p99": float(k3max[ci, k, j].max()) * 0.8,
                              "kl_k3_max": float(k3max[ci, k, j].max()),
                              "topk_kl_mean": float(topk[ci, k, j].mean()),
                              "same_top_rate": float(same_top[ci, k, j].mean()),
                              "hit_coverage": float(hits[ci, k, j].mean())}
                    for name in METRIC_NAMES:
                        kl = name == "kl_k3_mean"
                        rows["metrics"].append({
                            "run_id": run_id, "scenario": scen, "name": name, "value": values[name],
                            "ci_low": max(mean - half, 0.0) if kl else None,
                            "ci_high": mean + half if kl else None, "count": n_s if kl else None})
                    for s in range(n_s):
                        rows["samples"].append({
                            "run_id": run_id, "scenario": scen, "sample_id": f"{scen}-{s}",
                            "prompt_id": f"demo-{(s * 7 + j) % 20:02d}",
                            "prompt_tokens": int(prompt_tokens[ci, k, j, s]),
                            "cached_tokens": int(cached[ci, k, j, s]),
                            "host_cached_tokens": int(cached[ci, k, j, s]) if scen == "host_tier" else 0,
                            "completion_tokens": 24, "hit": bool(hits[ci, k, j, s]),
                            "kl_k1_mean": float(v1[s]), "kl_k2_mean": float(v2[s]),
                            "kl_k3_mean": float(v3[s]), "kl_k3_max": float(k3max[ci, k, j, s]),
                            "topk_kl_mean": float(topk[ci, k, j, s]),
                            "same_top_rate": float(same_top[ci, k, j, s]), "first_divergence": None,
                            "accept_length": float(accept[ci, k, j, s]) if scen == "speculative" else None})
        return rows


def load(store: Store, n_commits: int, configs: list[dict[str, Any]]) -> dict[str, Any]:
    gen = Generator(configs)
    insert_s = dict.fromkeys(TABLES, 0.0)
    t_start = time.perf_counter()
    gen_s = 0.0
    for first in range(0, n_commits, BATCH_COMMITS):
        t = time.perf_counter()
        rows = gen.batch(first, min(first + BATCH_COMMITS, n_commits))
        gen_s += time.perf_counter() - t
        with store.session() as s:
            for name, model in TABLES.items():  # parents first
                t = time.perf_counter()
                s.execute(insert(model.__table__), rows[name])
                insert_s[name] += time.perf_counter() - t
        done = min(first + BATCH_COMMITS, n_commits)
        if done % 200 == 0 or done == n_commits:
            print(f"  {done}/{n_commits} commits, {time.perf_counter() - t_start:.0f} s", flush=True)
    total = time.perf_counter() - t_start
    return {"seconds": round(total, 1), "generate_seconds": round(gen_s, 1),
            "insert_seconds": {k: round(v, 1) for k, v in insert_s.items()}}


def after_load(store: Store) -> dict[str, Any]:
    """PostgreSQL: what autovacuum does after a bulk load (statistics, visibility map) and the serial
    sequences moved past the explicit ids. SQLite: nothing (the store never runs ANALYZE)."""
    t = time.perf_counter()
    if store.engine.dialect.name == "postgresql":
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for name in ("commits", "builds", "runs"):
                conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                                  f"(SELECT max(id) FROM {name}))"))
            conn.execute(text("VACUUM ANALYZE"))
    return {"seconds": round(time.perf_counter() - t, 1)}


def counts_and_size(store: Store, sqlite_path: Path | None) -> dict[str, Any]:
    with store.session() as s:
        counts = {name: s.scalar(select(func.count()).select_from(model.__table__))
                  for name, model in TABLES.items()}
        if store.engine.dialect.name == "postgresql":
            size = s.scalar(text("SELECT pg_database_size(current_database())"))
        else:
            size = sum(p.stat().st_size for p in sqlite_path.parent.glob(sqlite_path.name + "*"))
    return {"rows": counts, "database_mb": round(size / 2**20)}


# ---------------------------------------------------------------- timing and plans

def timed(store: Store, fn, repeats: int) -> tuple[dict[str, float], Any]:
    for _ in range(2):  # warm-up
        with store.session() as s:
            result = fn(s)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        with store.session() as s:
            result = fn(s)
        times.append((time.perf_counter() - t) * 1000.0)
    times.sort()
    p95 = times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]
    return {"median_ms": round(statistics.median(times), 1), "p95_ms": round(p95, 1),
            "min_ms": round(times[0], 1), "max_ms": round(times[-1], 1)}, result


def plans(store: Store, fn) -> list[dict[str, Any]]:
    """Every statement fn sends, with its plan (PostgreSQL: EXPLAIN ANALYZE, actual rows and time)."""
    captured: list[tuple[str, Any]] = []

    def capture(conn, cursor, statement, parameters, context, executemany) -> None:
        captured.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", capture)
    try:
        with store.session() as s:
            fn(s)
    finally:
        event.remove(store.engine, "before_cursor_execute", capture)
    pg = store.engine.dialect.name == "postgresql"
    out = []
    with store.engine.connect() as conn:
        for statement, params in captured:
            prefix = "EXPLAIN (ANALYZE, BUFFERS) " if pg else "EXPLAIN QUERY PLAN "
            rows = conn.exec_driver_sql(prefix + statement, params).all()
            plan = [r[0] for r in rows] if pg else [f"{'  ' * _depth(rows, r)}{r[-1]}" for r in rows]
            out.append({"sql": " ".join(statement.split())[:300], "plan": plan})
    return out


def _depth(rows, row) -> int:
    parents = {r[0]: r[1] for r in rows}
    depth, p = 0, row[1]
    while p in parents:
        depth, p = depth + 1, parents[p]
    return depth


def check_compare(rows: list[ScenarioComparison], n_configs: int, session_factory) -> None:
    """compare's rows: every config x scenario, every one paired, intervals as paired_difference_ci."""
    assert len(rows) == n_configs * len(SCENARIOS), len(rows)
    assert all(r.paired_samples == SAMPLES_PER_SCENARIO for r in rows)
    with session_factory() as s:
        for r in rows:
            pairs = s.execute(select(SampleRow.run_id, SampleRow.sample_id, SampleRow.kl_k3_mean)
                              .where(SampleRow.run_id.in_([r.baseline_run, r.contender_run]),
                                     SampleRow.scenario == r.scenario)).all()
            b = {sid: v for rid, sid, v in pairs if rid == r.baseline_run}
            c = {sid: v for rid, sid, v in pairs if rid == r.contender_run}
            ids = sorted(set(b) & set(c))
            _, low, high = paired_difference_ci(np.array([b[i] for i in ids]), np.array([c[i] for i in ids]),
                                                n_boot=1000)
            assert np.allclose((low, high), (r.ci_low, r.ci_high), rtol=1e-12, atol=1e-15), (
                r, low, high)


def bench(url: str, n_commits: int, configs: list[dict[str, Any]], repeats: int,
          sqlite_path: Path | None = None) -> dict[str, Any]:
    t = time.perf_counter()
    store = Store(url)
    migrate_s = time.perf_counter() - t
    try:
        dialect = store.engine.dialect.name
        print(f"{dialect}: loading {n_commits} commits x {len(configs)} configs x {len(SCENARIOS)} "
              "scenarios", flush=True)
        loaded = load(store, n_commits, configs)
        post = after_load(store)
        sizes = counts_and_size(store, sqlite_path)
        print(f"  loaded in {loaded['seconds']} s (+{post['seconds']} s after-load), "
              f"{sizes['database_mb']} MB: {sizes['rows']}", flush=True)

        fingerprint = configs[len(configs) // 2]["fingerprint"]
        with store.session() as s:
            base_build, cont_build = s.scalars(select(Build.id).join(Commit)
                                               .order_by(Commit.committed_at.desc()).limit(2)).all()[::-1]

        def history(s):
            return metric_history(s, "kl_k3_mean", fingerprint=fingerprint, scenario=HISTORY_SCENARIO)

        def comp(s):
            return compare(s, base_build, cont_build)

        h_times, h_rows = timed(store, history, repeats)
        assert len(h_rows) == n_commits, len(h_rows)
        c_times, c_rows = timed(store, comp, repeats)
        check_compare(c_rows, len(configs), store.session)
        l_times, l_rows = timed(store, latest_per_config, max(5, repeats // 4))
        assert len(l_rows) == len(configs), len(l_rows)
        result = {"url": make_url(url).render_as_string(hide_password=True),
                  "migrate_seconds": round(migrate_s, 2), "load": loaded, "after_load": post, **sizes,
                  "history": {**h_times, "rows": len(h_rows), "fingerprint": fingerprint,
                              "scenario": HISTORY_SCENARIO, "plans": plans(store, history)},
                  "compare": {**c_times, "rows": len(c_rows), "baseline_build": base_build,
                              "contender_build": cont_build, "plans": plans(store, comp)},
                  "latest_per_config": {**l_times, "rows": len(l_rows), "target": "none (not in scope)",
                                        "plans": plans(store, latest_per_config)}}
        for q in ("history", "compare"):
            r = result[q]
            ok = "ok" if r["p95_ms"] < TARGET_MS else "OVER TARGET"
            print(f"  {q}: median {r['median_ms']} ms, p95 {r['p95_ms']} ms ({r['rows']} rows) [{ok}]")
            for p in r["plans"]:
                print(f"    {p['sql'][:110]}")
                for line in p["plan"]:
                    print(f"      {line}")
        r = result["latest_per_config"]
        print(f"  latest_per_config (no target): median {r['median_ms']} ms, p95 {r['p95_ms']} ms")
        return result
    finally:
        store.close()


def bench_postgres(admin_url: str, n_commits: int, configs, repeats: int) -> dict[str, Any]:
    """A fresh database on admin_url's server, dropped afterwards."""
    name = f"evalsvc_bench_{os.getpid()}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        return bench(url, n_commits, configs, repeats)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def parse_args(description: str, repeats: int, out: str) -> argparse.Namespace:
    """The options of the benchmarks over a synthetic store (this one and the dashboard's)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--commits", type=int, default=1000)
    ap.add_argument("--configs", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
                    help="a database on the server to create the benchmark's own database from")
    ap.add_argument("--skip-postgres", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / out)
    args = ap.parse_args()
    if args.commits < 2:
        ap.error("--commits must be at least 2 (comparing needs two builds)")
    return args


def main() -> None:
    args = parse_args(__doc__.split("\n")[0], repeats=20, out="store.json")

    configs = make_configs(args.configs)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "sqlalchemy": sqlalchemy.__version__, "sqlite": __import__("sqlite3").sqlite_version},
        "commits": args.commits, "configs": args.configs, "scenarios": list(SCENARIOS),
        "metric_names": list(METRIC_NAMES), "samples_per_scenario": SAMPLES_PER_SCENARIO,
        "repeats": args.repeats, "target_ms": TARGET_MS, "databases": {}}
    tmp = Path(tempfile.mkdtemp(prefix="evalsvc-store-bench-"))
    try:
        db = tmp / "store.db"
        report["databases"]["sqlite"] = bench(f"sqlite:///{db}", args.commits, configs, args.repeats, db)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not args.skip_postgres:
        report["databases"]["postgresql"] = bench_postgres(args.postgres_url, args.commits, configs,
                                                           args.repeats)
        with create_engine(args.postgres_url).connect() as conn:
            report["machine"]["postgresql"] = conn.scalar(text("SHOW server_version"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
