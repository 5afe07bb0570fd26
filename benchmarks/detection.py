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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc import judging  # noqa: E402
from evalsvc.children import exit_on_sigterm  # noqa: E402
from evalsvc.jobs.spec import job_spec  # noqa: E402
from evalsvc.judging import POOLED  # noqa: E402
from evalsvc.matrix import MatrixFile, load_matrix  # noqa: E402
from evalsvc.store.db import Store  # noqa: E402
from evalsvc.store.models import (  # noqa: E402
    Build,
    Commit,
    Metric,
    Regression,
    Run,
    SampleRow,
    VerdictRow,
)
from evalsvc.store.record import write_verdicts  # noqa: E402
from evalsvc.types import SAMPLE_FIELDS, RunResult, ScenarioResult  # noqa: E402
from evalsvc.verdicts import run_history, stored_limits, track  # noqa: E402
from tests.oracles.detection import (  # noqa: E402
    WHERE,
    acting_configs,
    evaluate_recorded,
    false_alarms,
    verdict_counts,
)

RESULTS = Path(__file__).parent / "results"
# SGLang's KL tests compare the mean k3 of the sampled tokens with a fixed threshold: 0.002 is the
# tightest in its suite (kl_test_utils.py users; 0.0025 to 0.012 elsewhere)
SGLANG_KL_THRESHOLD = 0.002


def judged(store: Store, run_ids: list[int]) -> list[dict[str, Any]]:
    """The regression verdicts of these runs, and each scenario's mean KL and acceptance."""
    with store.session() as s:
        verdicts = s.execute(select(Run.config, VerdictRow.scenario, VerdictRow.metric, VerdictRow.verdict,
                                    VerdictRow.method, VerdictRow.evidence, VerdictRow.value,
                                    VerdictRow.baseline, VerdictRow.reason)
                             .join(Run, Run.id == VerdictRow.run_id)
                             .where(VerdictRow.run_id.in_(run_ids))).all()
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
        floors = dict(s.execute(select(VerdictRow.scenario, VerdictRow.threshold)
                                .where(VerdictRow.run_id.in_(run_ids),
                                       VerdictRow.metric == "accept_length",
                                       VerdictRow.scenario == "speculative")).all())
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
        store.write(lambda s, run_id=run_id: judge_again(s, run_id))
    return verdict_counts(store)


def stored_result(s, run: Run) -> RunResult:
    """A recorded run as the harness measured it, read back: its scenarios (those it judged
    ``measured`` again), their metrics, and their samples' scalars with their extends' logprobs
    from the run's Parquet file when it is there."""
    import pandas as pd

    extends: dict[tuple[str, str], dict[str, Any]] = {}
    if run.samples_path and Path(run.samples_path).is_file():
        columns = ["scenario", "sample_id", "extend_logprobs", "extend_reference_logprobs"]
        for row in pd.read_parquet(run.samples_path, columns=columns).to_dict("records"):
            extends[(row["scenario"], row["sample_id"])] = {
                k: list(row[k]) if row[k] is not None else None for k in columns[2:]}
    metrics: dict[str, dict[str, Any]] = {}
    for scen, name, value in s.execute(select(Metric.scenario, Metric.name, Metric.value)
                                       .where(Metric.run_id == run.id)):
        metrics.setdefault(scen, {})[name] = value
    samples: dict[str, list[dict[str, Any]]] = {}
    for row in s.scalars(select(SampleRow).where(SampleRow.run_id == run.id).order_by(SampleRow.id)):
        samples.setdefault(row.scenario, []).append(
            {"sample_id": row.sample_id, **{k: getattr(row, k, None) for k in SAMPLE_FIELDS},
             **extends.get((row.scenario, row.sample_id), {})})
    judged = judging.JUDGED
    return RunResult(run.config, run.fingerprint, run.model, run.settings or {},
                     run.requested_args or {}, verdict=run.verdict or "error",
                     reason=run.reason or "",
                     scenarios=[ScenarioResult(r.scenario,
                                               "measured" if r.verdict in judged else r.verdict,
                                               "" if r.verdict in judged else r.reason or "",
                                               metrics.get(r.scenario, {}),
                                               samples.get(r.scenario, []))
                                for r in run.scenarios])


def judge_again(s, run_id: int) -> None:
    """A recorded run judged again (``judging.judge_run``, with its history as the store has it
    now), its verdicts replaced, and its regressions tracked when its job asks."""
    run = s.get(Run, run_id)
    result = stored_result(s, run)
    names = [sc.scenario for sc in result.scenarios if sc.verdict == "measured"]
    history = run_history(s, run, names) if result.verdict != "cancelled" else None
    judgements = judging.judge_run(result, stored_limits(run, [*names, POOLED]), history)
    for row, scen in zip(run.scenarios, result.scenarios, strict=True):
        row.verdict, row.reason = scen.verdict, scen.reason or None
    run.verdict, run.reason = result.verdict, result.reason or None
    rows = write_verdicts(s, run, judgements)
    spec = job_spec(run.job)
    if spec is not None and spec.track:
        track(s, run, rows)


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
