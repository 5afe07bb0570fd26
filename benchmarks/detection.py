"""Verdicts on the embedded engine: false alarms on a clean engine, and the weakest defect caught,
by evalsvc's verdicts and by SGLang's own method.

    .venv/bin/python benchmarks/detection.py false-alarms [--matrix smoke-bf16] [--seeds 20]
        [--num-prompts 48] [--configs NAME,...] [--same-seed] [--store PATH]
        [--engine-python PY [--model DIR]]                   # an SGLang matrix (sglang-cpu)
    .venv/bin/python benchmarks/detection.py strength [--matrix smoke-bf16] [--sizes 48]
        [--strengths 1,0.25,0.1,0.05,0.02,0.01] [--store PATH]
    .venv/bin/python benchmarks/detection.py rejudge --store PATH    # judge recorded runs again

Both record real runs of the matrix's configs (engine processes, the harness, the store) in a
SQLite store of their own and judge them with ``evalsvc.verdicts`` exactly as the service does:
fixed limits from ``evalsvc/configs/thresholds.yaml``, the history test against the earlier runs of the
same fingerprint (location and tail), change points along the series.

false-alarms: the defect-free engine evaluated ``--seeds`` times as consecutive commits of one
tracked series: every evaluation is judged against the ones before it and its regressions
tracked. With ``--same-seed`` every evaluation uses the matrix's own sampling seed, as a nightly
series does (the runs then differ by the engine's own batching noise); without it each takes
another seed (1000, 1001, ...). One engine per config serves all the evaluations
(``harness.EnginePool``: every scenario starts from a flushed cache). Reports the regression
verdicts and regressions opened (the target is none), the verdicts by method, and the clean floor
the same runs measure: per config and scenario, the scenario means of the KL (k3) of the generated
tokens and of the extend over the evaluations. An SGLang matrix (``sglang-cpu``) runs on real
SGLang: ``--engine-python`` names the environment's python (``make sglang-cpu``), ``--model`` a
checkpoint other than the matrix's.

strength: per sample count (``--sizes``: prompts per scenario), three clean evaluations form the
baseline (the matrix's seed, as a series would have them); then a clean contender (strength 0: the
false-alarm control) and each defect at every strength (the fraction of requests it acts on) run
on the configs where it acts, each judged against that baseline alone (removed after). Per defect
and strength: which of its paths evalsvc flags (regression verdicts of any metric where the defect
acts, ``WHERE``) and by which test, regressions anywhere else (false alarms), and SGLang's method on
the same runs: its KL tests' fixed threshold on the mean k3 of the sampled tokens
(``SGLANG_KL_THRESHOLD``) per scenario, and for acceptance the fixed floor its MTP tests assert.

``--store PATH`` keeps the store (default: a temporary one); ``rejudge`` judges a kept store's runs
again in commit order with the current thresholds, for calibrating without running engines again.
Results go to ``benchmarks/results/detection-*.json``; BENCHMARKS.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from sqlalchemy import delete, func, select

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.children import exit_on_sigterm  # noqa: E402
from evalsvc.engines.base import EngineSpec  # noqa: E402
from evalsvc.evaluate import evaluate, prepare  # noqa: E402
from evalsvc.harness import EnginePool  # noqa: E402
from evalsvc.jobs.record import JobRecord  # noqa: E402
from evalsvc.judging import POOLED  # noqa: E402
from evalsvc.matrix import MatrixFile, load_matrix  # noqa: E402
from evalsvc.store.db import Store  # noqa: E402
from evalsvc.store.models import Build, Commit, Metric, Regression, Run, Verdict  # noqa: E402
from evalsvc.store.record import BuildRef  # noqa: E402
from evalsvc.verdicts import judge_and_track  # noqa: E402

RESULTS = Path(__file__).parent / "results"
START = datetime(2026, 1, 1, tzinfo=UTC)
# SGLang's KL tests compare the mean k3 of the sampled tokens with a fixed threshold: 0.002 is the
# tightest in its suite (kl_test_utils.py users; 0.0025 to 0.012 elsewhere)
SGLANG_KL_THRESHOLD = 0.002
# (config, scenario) pairs where each defect acts in the smoke matrices ("must": it is always
# there; "may": the same path taken by some requests). tests/test_detection.py holds verdicts to
# these; anything flagged elsewhere is a false alarm.
WHERE: dict[str, dict[str, set[tuple[str, str]]]] = {
    "snapshot-race": {
        "must": {("mamba2-eb-ov-c64", "prefill_hit"), ("gdn-eb-ov-c64", "prefill_hit")},
        # chunked_hit's seeded prefixes are prefilled in chunks too, their snapshots as racy
        "may": {(c, s) for c in ("mamba2-eb-ov-c64", "gdn-eb-ov-c64")
                for s in ("branching", "chunked_hit")},
    },
    "deferred-ops-dropped": {
        "must": {(c, s) for c in ("mamba2-nb-sync-c64", "gdn-nb-sync-c64-hicache")
                 for s in ("prefill_hit", "chunked_hit")},
        # chunked no_buffer requests that hit a prefix: seeds of later turns, branches, host hits,
        # and "cold" requests that happen to share a chunk-sized prefix
        "may": {(c, s) for c in ("mamba2-nb-sync-c64", "gdn-nb-sync-c64-hicache")
                for s in ("cold", "decode_hit", "branching", "host_tier")},
    },
    "stale-spec-metadata": {
        # acts when the extend that first runs a request also ends its prefill: unchunked prompts
        "must": {("gdn-nb-sync-nochunk-mtp", "speculative")},
        # the other scenarios of that config decode with MTP too (sampled, batched)
        "may": {("gdn-nb-sync-nochunk-mtp", s) for s in ("cold", "prefill_hit", "decode_hit",
                                                          "branching")},
    },
    "host-load-race": {
        "must": {("mamba2-eb-sync-nochunk-hicache", "host_tier"),
                 ("gdn-nb-sync-c64-hicache", "host_tier")},
        # the small device pools also overflow into the host tier in the other scenarios
        "may": {(c, s) for c in ("mamba2-eb-sync-nochunk-hicache", "gdn-nb-sync-c64-hicache")
                for s in ("prefill_hit", "decode_hit", "branching")},
    },
    "mixed-chunk-tracking-dropped": {
        # only mixed_hit prefills beside decode steps with no request asking for logprobs
        "must": {("mamba2-eb-sync-c128-mixed-p16", "mixed_hit")},
        "may": set(),
    },
}


def acting_configs(defect: str) -> list[str]:
    return sorted({c for c, _ in WHERE[defect]["must"] | WHERE[defect]["may"]})


def evaluate_recorded(store: Store, matrix: MatrixFile, configs: list[str] | None, *,
                      seed: int | None, num_prompts: int, label: str, day: int, work: Path,
                      defects: str | None = None, track: bool = False,
                      engines: EnginePool | None = None, engine_python: str | None = None,
                      model: str | None = None) -> list[int]:
    """Evaluate configs of a matrix once, record the runs as one more commit (``label``, ``day``
    days after START) of the series and judge them. ``seed``: the sampling seed (None: the
    matrix's own); ``engines``: engines kept from the evaluations before. The embedded engine, or
    for an SGLang matrix real SGLang from ``engine_python`` (``model``: another checkpoint)."""
    matrix = matrix.model_copy(deep=True)
    matrix.workload.num_prompts = num_prompts
    matrix.workload.sampling_seed = seed
    if matrix.engine == "sglang":
        if not engine_python:
            raise SystemExit(f"matrix {matrix.name} runs on SGLang: pass --engine-python")
        spec = EngineSpec(kind="sglang", python=engine_python, startup_timeout=300)
    else:
        spec = EngineSpec(kind="embedded",
                          env={"EVALSVC_ENGINE_DEFECTS": defects} if defects else {})
    cfgs, prompts = prepare(matrix, spec, model_override=model)
    if configs:
        cfgs = [c for c in cfgs if c.name in configs]
    record = JobRecord.start(
        store, work / "results", f"{label}-{seed}", "cli",
        BuildRef(f"bench/{spec.kind}", version=label, committed_at=START + timedelta(days=day)),
        matrix.name, cfgs, spec={"matrix_name": matrix.name,
                                 "matrix": matrix.model_dump(mode="json"),
                                 "engine": spec.kind, "track": track})
    try:
        evaluate(matrix, cfgs, prompts, spec, work / label, Console(quiet=True), engines=engines,
                 on_result=record.record)
    finally:
        record.finish()
    return record.run_ids


def verdict_counts(store: Store) -> dict[str, Any]:
    with store.session() as s:
        by = s.execute(select(Verdict.verdict, Verdict.method, Verdict.metric, func.count())
                       .group_by(Verdict.verdict, Verdict.method, Verdict.metric)).all()
        flagged = s.execute(select(Run.config, Verdict.scenario, Verdict.metric, Verdict.reason)
                            .join(Run, Run.id == Verdict.run_id)
                            .where(Verdict.verdict == "regression")).all()
        opened = s.scalar(select(func.count()).select_from(Regression))
        runs = s.scalar(select(func.count()).select_from(Run))
        inconclusive = s.execute(select(Run.config, Verdict.scenario, func.count())
                                 .join(Run, Run.id == Verdict.run_id)
                                 .where(Verdict.verdict == "inconclusive")
                                 .group_by(Run.config, Verdict.scenario)).all()
    verdicts: dict[str, int] = {}
    for v, m, _, n in by:
        verdicts[f"{v}/{m}"] = verdicts.get(f"{v}/{m}", 0) + n
    return {"runs": runs, "verdicts": verdicts,
            "verdicts_by_metric": {f"{v}/{m}/{metric}": n for v, m, metric, n in by},
            "regression_verdicts": [list(r) for r in flagged], "regressions_opened": opened,
            "inconclusive": [list(r) for r in inconclusive]}


def scenario_floor(store: Store) -> list[dict[str, Any]]:
    """Per config and scenario, the scenario means of the runs recorded: the KL (k3) of the
    generated tokens and of the extend, their mean and range over the evaluations."""
    with store.session() as s:
        rows = s.execute(select(Run.config, Metric.scenario, Metric.name, Metric.value)
                         .join(Run, Run.id == Metric.run_id)
                         .where(Metric.name.in_(("kl_k3_mean", "extend_kl_k3_mean")),
                                Metric.value.is_not(None))).all()
    values: dict[tuple[str, str], dict[str, list[float]]] = {}
    for config, scenario, name, value in rows:
        values.setdefault((config, scenario), {}).setdefault(name, []).append(value)
    out = []
    for (config, scenario), metrics in sorted(values.items()):
        row: dict[str, Any] = {"config": config, "scenario": scenario}
        for name, v in sorted(metrics.items()):
            # fmean rounds once, and the clamp keeps n equal values' mean equal to them
            mean = min(max(statistics.fmean(v), min(v)), max(v))
            row[name] = {"n": len(v), "mean": mean, "min": min(v), "max": max(v)}
        out.append(row)
    return out


def false_alarms(store: Store, work: Path, seeds: int, num_prompts: int,
                 configs: list[str] | None, progress=print, matrix: str = "smoke",
                 same_seed: bool = False, engine_python: str | None = None,
                 model: str | None = None) -> dict[str, Any]:
    m = load_matrix(matrix)
    t0 = time.monotonic()
    # one engine per config serves every evaluation (each scenario starts from a flushed cache)
    with EnginePool() as engines:
        for i in range(seeds):
            evaluate_recorded(store, m, configs, seed=None if same_seed else 1000 + i,
                              num_prompts=num_prompts, label=f"clean-{i:02d}", day=i, work=work,
                              track=True, engines=engines, engine_python=engine_python,
                              model=model)
            progress(f"evaluation {i + 1}/{seeds}: {time.monotonic() - t0:.0f} s")
    return {"matrix": matrix, "seeds": seeds, "same_seed": same_seed, "num_prompts": num_prompts,
            **verdict_counts(store), "floor": scenario_floor(store),
            "seconds": round(time.monotonic() - t0, 1)}


def judged(store: Store, run_ids: list[int]) -> list[dict[str, Any]]:
    """The regression verdicts of these runs, and each scenario's mean KL and acceptance."""
    with store.session() as s:
        verdicts = s.execute(select(Run.config, Verdict.scenario, Verdict.metric, Verdict.verdict,
                                    Verdict.method, Verdict.evidence, Verdict.value,
                                    Verdict.baseline, Verdict.reason)
                             .join(Run, Run.id == Verdict.run_id)
                             .where(Verdict.run_id.in_(run_ids))).all()
    return [{"config": c, "scenario": sc, "metric": m, "verdict": v, "method": meth,
             "test": (ev or {}).get("test"), "value": val, "baseline": base, "reason": why}
            for c, sc, m, v, meth, ev, val, base, why in verdicts]


def sglang_method(store: Store, run_ids: list[int], pairs: set[tuple[str, str]]
                  ) -> dict[str, Any]:
    """SGLang's tests on the same runs: mean k3 of the sampled tokens above the fixed threshold
    (every scenario where the defect acts), acceptance length below the fixed floor (the
    speculative scenario)."""
    with store.session() as s:
        rows = s.execute(select(Run.config, Metric.scenario, Metric.name, Metric.value)
                         .join(Run, Run.id == Metric.run_id)
                         .where(Metric.run_id.in_(run_ids),
                                Metric.name.in_(["kl_k3_mean", "accept_length"]))).all()
        floors = dict(s.execute(select(Verdict.scenario, Verdict.threshold)
                                .where(Verdict.run_id.in_(run_ids),
                                       Verdict.metric == "accept_length",
                                       Verdict.scenario == "speculative")).all())
    kl = {(c, sc): v for c, sc, name, v in rows if name == "kl_k3_mean" and (c, sc) in pairs}
    acc = {(c, sc): v for c, sc, name, v in rows if name == "accept_length"
           and sc == "speculative" and (c, sc) in pairs}
    flagged = sorted(f"{c}/{sc}" for (c, sc), v in kl.items() if v is not None
                     and v > SGLANG_KL_THRESHOLD)
    floor = floors.get("speculative")
    flagged += sorted(f"{c}/{sc} accept" for (c, sc), v in acc.items()
                      if v is not None and floor is not None and v < floor)
    return {"flagged": flagged, "max_kl": max((v for v in kl.values() if v is not None),
                                              default=None),
            "accept": {f"{c}/{sc}": v for (c, sc), v in acc.items()}, "accept_floor": floor}


def contender(store: Store, matrix: MatrixFile, defect: str | None, st: float,
              configs: list[str], size: int, work: Path) -> list[int]:
    label = f"{defect or 'clean'}@{st}-{size}"
    return evaluate_recorded(store, matrix, configs, seed=None, num_prompts=size, label=label,
                             day=10, work=work, defects=f"{defect}@{st}" if defect else None)


def classify(verdicts: list[dict[str, Any]], defect: str | None) -> dict[str, Any]:
    where = WHERE[defect]["must"] | WHERE[defect]["may"] if defect else set()
    where |= {(c, POOLED) for c, _ in where}  # a config's scenarios judged together
    hits = [v for v in verdicts if v["verdict"] == "regression"]
    return {"flagged": sorted({f"{v['config']}/{v['scenario']}/{v['metric']} ({v['test'] or v['method']})"
                               for v in hits if (v["config"], v["scenario"]) in where}),
            "must_flagged": sorted({f"{v['config']}/{v['scenario']}" for v in hits
                                    if (v["config"], v["scenario"]) in
                                    (WHERE[defect]["must"] if defect else set())}),
            "elsewhere": sorted({f"{v['config']}/{v['scenario']}/{v['metric']}" for v in hits
                                 if (v["config"], v["scenario"]) not in where}),
            "reasons": sorted(f"{v['config']}/{v['scenario']}/{v['metric']}: {v['reason']}"
                              for v in hits)}


def strength(store: Store, work: Path, sizes: list[int], strengths: list[float],
             progress=print, matrix: str = "smoke", baseline_runs: int = 3) -> dict[str, Any]:
    m = load_matrix(matrix)
    configs = sorted({c for d in WHERE for c in acting_configs(d)})
    rows, t0 = [], time.monotonic()
    for size in sizes:
        for i in range(baseline_runs):
            evaluate_recorded(store, m, configs, seed=None, num_prompts=size,
                              label=f"base-{size}-{i}", day=i, work=work)
        progress(f"{size} prompts: baseline recorded ({time.monotonic() - t0:.0f} s)")
        control = contender(store, m, None, 0.0, configs, size, work)
        verdicts = judged(store, control)
        rows.append({"defect": None, "strength": 0.0, "num_prompts": size,
                     **classify(verdicts, None)})
        _drop(store, control)
        progress(f"{size} prompts: clean control: {len(rows[-1]['elsewhere'])} regressions")
        for defect in WHERE:
            pairs = WHERE[defect]["must"] | WHERE[defect]["may"]
            for st in strengths:  # every strength: detection need not fall monotonically
                t1 = time.monotonic()
                run_ids = contender(store, m, defect, st, acting_configs(defect), size, work)
                row = {"defect": defect, "strength": st, "num_prompts": size,
                       **classify(judged(store, run_ids), defect),
                       "sglang": sglang_method(store, run_ids, pairs),
                       "seconds": round(time.monotonic() - t1, 1)}
                _drop(store, run_ids)
                rows.append(row)
                progress(f"{size} prompts: {defect}@{st}: evalsvc {len(row['flagged'])} "
                         f"(must {row['must_flagged']}), SGLang {row['sglang']['flagged']}, "
                         f"elsewhere {row['elsewhere']}")
    return {"matrix": matrix, "sizes": sizes, "strengths": strengths,
            "sglang_kl_threshold": SGLANG_KL_THRESHOLD, "rows": rows,
            "weakest": weakest(rows), "seconds": round(time.monotonic() - t0, 1)}


def weakest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per defect and sample count: the weakest strength each method flags, and stronger ones it
    missed."""
    out = []
    for defect in WHERE:
        for size in sorted({r["num_prompts"] for r in rows}):
            mine = [r for r in rows if r["defect"] == defect and r["num_prompts"] == size]
            entry = {"defect": defect, "num_prompts": size}
            for name, caught in (("evalsvc", lambda r: bool(r["flagged"])),
                                 ("sglang", lambda r: bool(r["sglang"]["flagged"]))):
                hit = [r["strength"] for r in mine if caught(r)]
                low = min(hit) if hit else None
                entry[name] = low
                entry[f"{name}_missed_above"] = [r["strength"] for r in mine if low is not None
                                                 and r["strength"] > low and not caught(r)]
            out.append(entry)
    return out


def _drop(store: Store, run_ids: list[int]) -> None:
    with store.session() as s:
        s.execute(delete(Run).where(Run.id.in_(run_ids)))


def rejudge(store: Store) -> dict[str, Any]:
    """Judge every recorded run again, oldest commit first, and track regressions afresh (the
    jobs that tracked them before)."""
    with store.session() as s:
        s.execute(delete(Regression))
        runs = s.scalars(select(Run.id).join(Build, Run.build_id == Build.id)
                         .join(Commit, Build.commit_id == Commit.id)
                         .order_by(Commit.committed_at, Run.finished_at, Run.id)).all()
    for run_id in runs:
        store.write(lambda s, run_id=run_id: judge_and_track(s, run_id))
    return verdict_counts(store)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    fa = sub.add_parser("false-alarms")
    fa.add_argument("--matrix", default="smoke-bf16")
    fa.add_argument("--seeds", type=int, default=20)
    fa.add_argument("--num-prompts", type=int, default=48)
    fa.add_argument("--configs", default="", help="comma-separated (default: the whole matrix)")
    fa.add_argument("--same-seed", action="store_true")
    fa.add_argument("--engine-python", default=None, help="an SGLang matrix: its python")
    fa.add_argument("--model", default=None, help="an SGLang matrix: another checkpoint")
    st = sub.add_parser("strength")
    st.add_argument("--matrix", default="smoke-bf16")
    st.add_argument("--sizes", default="48")
    st.add_argument("--strengths", default="1,0.25,0.1,0.05,0.02,0.01")
    rj = sub.add_parser("rejudge")
    for p in (fa, st, rj):
        p.add_argument("--store", type=Path, default=None, required=p is rj,
                       help="a SQLite file to keep the store in")
    args = parser.parse_args()
    exit_on_sigterm()  # engines stopped on SIGTERM as on Ctrl-C
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="evalsvc-detection-") as tmp:
        work = Path(tmp)
        db = args.store or work / "store.db"
        store = Store(f"sqlite:///{db}")
        try:
            if args.what == "false-alarms":
                out = false_alarms(store, work, args.seeds, args.num_prompts,
                                   [c for c in args.configs.split(",") if c] or None,
                                   matrix=args.matrix, same_seed=args.same_seed,
                                   engine_python=args.engine_python, model=args.model)
                name = f"false-alarms-{args.matrix}" + ("-same-seed" if args.same_seed else "")
            elif args.what == "strength":
                out = strength(store, work, [int(x) for x in args.sizes.split(",")],
                               [float(x) for x in args.strengths.split(",")], matrix=args.matrix)
                name = f"strength-{args.matrix}"
            else:
                out = rejudge(store)
                name = f"rejudge-{args.store.stem}"
        finally:
            store.close()
    path = RESULTS / f"detection-{name}.json"
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps(out.get("weakest", out), indent=2, default=str))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
