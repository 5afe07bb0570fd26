"""Verdicts on the embedded engine: false alarms on a clean engine, and the weakest defect caught.

    .venv/bin/python benchmarks/detection.py false-alarms [--seeds 20] [--num-prompts 8]
                                                          [--configs NAME,...]
    .venv/bin/python benchmarks/detection.py strength [--sizes 4,8,16]
                                                      [--strengths 1,0.5,0.25,0.1,0.05,0.02]

Both record real runs of the smoke matrix's configs (engine processes, the harness, the store) in
a SQLite store of their own and judge them with ``evalsvc.verdicts`` exactly as the service does:
fixed limits from ``configs/thresholds.yaml``, the history test against the earlier runs of the
same fingerprint, change points along the series.

false-alarms: the defect-free engine evaluated ``--seeds`` times, each time with another sampling
seed (same prompts, so the same fingerprints), as consecutive commits of one tracked series:
every evaluation is judged against the ones before it and its regressions tracked. Reports the
regression verdicts and regressions opened (the target is none), and the verdicts by method.

strength: per sample count (``--sizes``: prompts per scenario), three clean evaluations form the
baseline; then each defect, at every strength (the fraction of requests it acts on), is run on
the configs where it acts and judged against that baseline alone (the run is removed after).
Reports, per defect, config and scenario, the weakest strength caught, the stronger ones missed
(a defect's effect need not grow with its strength), the verdict, value and baseline at each
strength, for the metric that shows the defect (KL for the state bugs, acceptance for the MTP
one).

Results go to ``benchmarks/results/detection-*.json``; BENCHMARKS.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from sqlalchemy import delete, func, select

from evalsvc.engines.base import EngineSpec
from evalsvc.evaluate import evaluate, prepare
from evalsvc.matrix import MatrixFile, load_matrix
from evalsvc.store.db import Store
from evalsvc.store.models import Regression, Run, Verdict
from evalsvc.store.record import BuildRef, record_results
from evalsvc.verdicts import judge_recorded

RESULTS = Path(__file__).parent / "results"
START = datetime(2026, 1, 1, tzinfo=UTC)
# where each defect acts in the smoke matrix (tests/test_detection.py's "must" pairs), and the
# metric that shows it
ACTS = {
    "snapshot-race": ("kl_k3_mean", [("mamba2-eb-ov-c64", "prefill_hit"),
                                     ("gdn-eb-ov-c64", "prefill_hit")]),
    "deferred-ops-dropped": ("kl_k3_mean", [("mamba2-nb-sync-c64", "prefill_hit"),
                                            ("gdn-nb-sync-c64-hicache", "prefill_hit")]),
    "stale-spec-metadata": ("accept_length", [("gdn-nb-sync-nochunk-mtp", "speculative")]),
    "host-load-race": ("kl_k3_mean", [("mamba2-eb-sync-nochunk-hicache", "host_tier"),
                                      ("gdn-nb-sync-c64-hicache", "host_tier")]),
}


def evaluate_recorded(store: Store, matrix: MatrixFile, configs: list[str] | None, *, seed: int,
                      num_prompts: int, label: str, day: int, work: Path,
                      defects: str | None = None, track: bool = False) -> list[int]:
    """Evaluate configs of a matrix once on the embedded engine, record the runs as one more
    commit (``label``, ``day`` days after START) of the series and judge them."""
    matrix = matrix.model_copy(deep=True)
    matrix.workload.num_prompts = num_prompts
    matrix.workload.sampling_seed = seed
    spec = EngineSpec(kind="embedded", env={"EVALSVC_ENGINE_DEFECTS": defects} if defects else {})
    cfgs, prompts = prepare(matrix, spec)
    if configs:
        cfgs = [c for c in cfgs if c.name in configs]
    results = evaluate(matrix, cfgs, prompts, spec, work / label, Console(quiet=True))
    job_id = f"{label}-{seed}"
    run_ids = record_results(
        store, job_id=job_id, trigger="cli",
        spec={"matrix_name": matrix.name, "matrix": matrix.model_dump(mode="json"),
              "engine": "embedded", "track": track},
        build=BuildRef("bench/embedded", version=label,
                       committed_at=START + timedelta(days=day)),
        matrix=matrix.name, results=results, results_dir=work / "results")
    judge_recorded(store, run_ids, track_regressions=track)
    return run_ids


def false_alarms(store: Store, work: Path, seeds: int, num_prompts: int,
                 configs: list[str] | None, progress=print) -> dict[str, Any]:
    matrix = load_matrix("smoke")
    t0 = time.monotonic()
    for i in range(seeds):
        evaluate_recorded(store, matrix, configs, seed=1000 + i, num_prompts=num_prompts,
                          label=f"clean-{i:02d}", day=i, work=work, track=True)
        progress(f"evaluation {i + 1}/{seeds}: {time.monotonic() - t0:.0f} s")
    with store.session() as s:
        by = s.execute(select(Verdict.verdict, Verdict.method, func.count())
                       .group_by(Verdict.verdict, Verdict.method)).all()
        flagged = s.execute(select(Run.config, Verdict.scenario, Verdict.metric, Verdict.reason)
                            .join(Run, Run.id == Verdict.run_id)
                            .where(Verdict.verdict == "regression")).all()
        opened = s.scalar(select(func.count()).select_from(Regression))
        runs = s.scalar(select(func.count()).select_from(Run))
        inconclusive = s.execute(select(Run.config, Verdict.scenario, func.count())
                                 .join(Run, Run.id == Verdict.run_id)
                                 .where(Verdict.verdict == "inconclusive")
                                 .group_by(Run.config, Verdict.scenario)).all()
    return {"seeds": seeds, "num_prompts": num_prompts, "runs": runs,
            "verdicts": {f"{v}/{m}": n for v, m, n in by},
            "regression_verdicts": [list(r) for r in flagged], "regressions_opened": opened,
            "inconclusive": [list(r) for r in inconclusive],
            "seconds": round(time.monotonic() - t0, 1)}


def strength(store: Store, work: Path, sizes: list[int], strengths: list[float],
             progress=print) -> list[dict[str, Any]]:
    matrix = load_matrix("smoke")
    configs = sorted({c for _, pairs in ACTS.values() for c, _ in pairs})
    rows = []
    for size in sizes:
        for i in range(3):
            evaluate_recorded(store, matrix, configs, seed=i, num_prompts=size,
                              label=f"base-{size}-{i}", day=i, work=work)
        progress(f"{size} prompts: baseline recorded")
        for defect, (metric, pairs) in ACTS.items():
            seen: dict[tuple[str, str], list[dict[str, Any]]] = {p: [] for p in pairs}
            for st in strengths:  # every strength: detection need not fall monotonically
                run_ids = evaluate_recorded(
                    store, matrix, sorted({c for c, _ in pairs}), seed=100, num_prompts=size,
                    label=f"{defect}@{st}-{size}", day=10, work=work, defects=f"{defect}@{st}")
                with store.session() as s:
                    got = {(r.config, r.scenario): r for r in s.execute(
                        select(Run.config, Verdict.scenario, Verdict.verdict, Verdict.method,
                               Verdict.value, Verdict.baseline, Verdict.reason)
                        .join(Run, Run.id == Verdict.run_id)
                        .where(Verdict.run_id.in_(run_ids), Verdict.metric == metric))}
                    s.execute(delete(Run).where(Run.id.in_(run_ids)))  # judged alone
                for pair in pairs:
                    r = got.get(pair)
                    seen[pair].append({"strength": st, "verdict": r.verdict if r else "missing",
                                       "method": r.method if r else None,
                                       "value": r.value if r else None,
                                       "baseline": r.baseline if r else None})
                progress(f"{size} prompts: {defect}@{st}: " + ", ".join(
                    f"{c}/{sc}={seen[(c, sc)][-1]['verdict']}" for c, sc in pairs))
            for pair, tries in seen.items():
                caught = [t for t in tries if t["verdict"] == "regression"]
                weakest = min(caught, key=lambda t: t["strength"]) if caught else None
                rows.append({"defect": defect, "config": pair[0], "scenario": pair[1],
                             "metric": metric, "num_prompts": size,
                             "weakest_strength": weakest["strength"] if weakest else None,
                             "method": weakest["method"] if weakest else None,
                             "missed_above": [t["strength"] for t in tries if weakest
                                              and t["strength"] > weakest["strength"]
                                              and t["verdict"] != "regression"],
                             "tries": tries})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    fa = sub.add_parser("false-alarms")
    fa.add_argument("--seeds", type=int, default=20)
    fa.add_argument("--num-prompts", type=int, default=8)
    fa.add_argument("--configs", default="", help="comma-separated (default: the whole matrix)")
    st = sub.add_parser("strength")
    st.add_argument("--sizes", default="4,8,16")
    st.add_argument("--strengths", default="1,0.5,0.25,0.1,0.05,0.02")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="evalsvc-detection-") as tmp:
        work = Path(tmp)
        store = Store(f"sqlite:///{work / 'store.db'}")
        try:
            if args.what == "false-alarms":
                out = false_alarms(store, work, args.seeds, args.num_prompts,
                                   [c for c in args.configs.split(",") if c] or None)
            else:
                out = strength(store, work, [int(x) for x in args.sizes.split(",")],
                               [float(x) for x in args.strengths.split(",")])
        finally:
            store.close()
    path = RESULTS / f"detection-{args.what}.json"
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps(out, indent=2, default=str))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
