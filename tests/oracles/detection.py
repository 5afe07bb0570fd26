"""The embedded engine's defects and where each acts (``WHERE``), and the recorded evaluations
that judge a matrix's runs as the service does (``evaluate_recorded``, ``false_alarms``): what
``tests/test_detection.py``, ``tests/test_false_alarms.py``, ``tests/test_known_failures.py`` and
``tests/store/test_regressions.py`` hold verdicts to, and what ``benchmarks/detection.py`` runs
over whole matrices."""

from __future__ import annotations

import statistics
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from sqlalchemy import func, select

from evalsvc.engines.base import EngineSpec
from evalsvc.evaluate import prepare, run_local
from evalsvc.harness import EnginePool
from evalsvc.jobs.builds import ReadyBuild
from evalsvc.jobs.spec import BuildSpec, JobSpec
from evalsvc.matrix import MatrixFile, load_matrix
from evalsvc.store.db import Store
from evalsvc.store.models import Metric, Regression, Run, VerdictRow
from evalsvc.store.record import BuildRef

START = datetime(2026, 1, 1, tzinfo=UTC)
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
    # recorded as ``evalsvc run`` records a job: its runs planned, each judged with its history as
    # it ends, the job's end written
    ref = BuildRef(f"bench/{spec.kind}", version=label, committed_at=START + timedelta(days=day))
    job = JobSpec(matrix_name=matrix.name, matrix=matrix, engine=spec.kind, builds=[BuildSpec()],
                  track=track)
    outcome = run_local(f"{label}-{seed}", job, spec, cfgs, prompts, work / label,
                        Console(quiet=True), engines=engines, store=store,
                        results_dir=work / "results", build=ReadyBuild(spec, ref, None))
    return [p.run_id for p in outcome.planned]


def verdict_counts(store: Store) -> dict[str, Any]:
    with store.session() as s:
        by = s.execute(select(VerdictRow.verdict, VerdictRow.method, VerdictRow.metric, func.count())
                       .group_by(VerdictRow.verdict, VerdictRow.method, VerdictRow.metric)).all()
        flagged = s.execute(select(Run.config, VerdictRow.scenario, VerdictRow.metric, VerdictRow.reason)
                            .join(Run, Run.id == VerdictRow.run_id)
                            .where(VerdictRow.verdict == "regression")).all()
        opened = s.scalar(select(func.count()).select_from(Regression))
        runs = s.scalar(select(func.count()).select_from(Run))
        inconclusive = s.execute(select(Run.config, VerdictRow.scenario, func.count())
                                 .join(Run, Run.id == VerdictRow.run_id)
                                 .where(VerdictRow.verdict == "inconclusive")
                                 .group_by(Run.config, VerdictRow.scenario)).all()
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

