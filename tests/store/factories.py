"""Hand-built harness output (RunResult / ScenarioResult) with the keys ``harness.score`` and
``harness.sample_row`` produce, and small helpers to record and count it."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import func, select

from evalsvc.jobs.builds import made_build_ref
from evalsvc.jobs.record import end_job, plan_build_runs, record_result
from evalsvc.matrix import Config
from evalsvc.metrics import summarize_kl
from evalsvc.store.db import Store
from evalsvc.store.models import (
    Build,
    Commit,
    GoldenRun,
    Job,
    Metric,
    Run,
    SampleRow,
    ScenarioRow,
)
from evalsvc.store.record import BuildRef, ensure_job, record_results
from evalsvc.thresholds import ThresholdsFile
from evalsvc.types import SAMPLE_FIELDS, TOKEN_FIELDS, RunResult, SampleFields, ScenarioResult

TABLES = {"commits": Commit, "builds": Build, "jobs": Job, "runs": Run, "scenarios": ScenarioRow,
          "metrics": Metric, "samples": SampleRow, "golden_runs": GoldenRun}
THRESHOLD = 1e-2
TOKENS = 4
BASE_TIME = datetime(2026, 3, 1, tzinfo=UTC)


def job_spec(matrix: str | dict[str, Any] = "smoke", **fields: Any) -> dict[str, Any]:
    """A job's spec as the store holds it (``JobSpec.stored()``): the matrix by its name or as
    data, one build as installed, the engine the matrix's unless given, and ``fields``."""
    from evalsvc.jobs.spec import BuildSpec, JobSpec
    from evalsvc.matrix import MatrixFile, load_matrix

    m = load_matrix(matrix) if isinstance(matrix, str) else MatrixFile.model_validate(matrix)
    return JobSpec(matrix_name=m.name, matrix=m, engine=fields.pop("engine", m.engine),
                   builds=[BuildSpec()], **fields).stored()


def fingerprint_of(config: str) -> str:
    return hashlib.sha256(config.encode()).hexdigest()[:16]


def sample_row(scenario: str, index: int, kl: float, rng: np.random.Generator,
               sample_id: str | None = None) -> SampleFields:
    """One sample as ``harness.sample_row`` writes it (plus the top-k columns of ``score``); no
    extend and no top-k lists (None)."""
    dec = rng.normal(-1.5, 0.5, TOKENS)
    ref = dec + (np.sqrt(2 * kl) if kl else 0.0)
    hit = scenario != "cold"
    diverged = kl > 1e-3
    return {
        **dict.fromkeys(SAMPLE_FIELDS + TOKEN_FIELDS),
        "sample_id": sample_id or f"s{index:03d}", "prompt_id": f"demo-{index}",
        "prompt_tokens": 40 + index, "cached_tokens": 32 if hit else 0, "host_cached_tokens": 0,
        "hit": hit, "completion_tokens": TOKENS,
        "kl_k1_mean": kl * 0.98, "kl_k2_mean": kl * 1.01, "kl_k3_mean": kl, "kl_k3_max": kl * 2.5,
        "first_divergence": 0 if diverged else None,
        "output_ids": [int(x) for x in rng.integers(0, 512, TOKENS)],
        "decode_logprobs": [float(x) for x in dec],
        "reference_logprobs": [float(x) for x in ref],
        "accept_length": None,
        "topk_kl_mean": kl * 0.9, "same_top_rate": 1.0 if not diverged else 0.75,
    }


def scenario_result(scenario: str, kls: list[float], *, seed: int = 0,
                    sample_ids: list[str] | None = None, with_samples: bool = True) -> ScenarioResult:
    """A scored scenario: the metrics dict of ``harness.score`` over per-sample k3 means ``kls``."""
    rng = np.random.default_rng(seed)
    rows = [sample_row(scenario, i, kl, rng, sample_ids[i] if sample_ids else None)
            for i, kl in enumerate(kls)]
    m: dict[str, Any] = {f"kl_k3_{k}": v for k, v in
                         summarize_kl([np.full(TOKENS, kl) for kl in kls], seed=0, n_boot=500).items()}
    m["kl_k1_mean"] = float(np.mean([r["kl_k1_mean"] for r in rows]))
    m["kl_k2_mean"] = float(np.mean([r["kl_k2_mean"] for r in rows]))
    m["topk_kl_mean"] = float(np.mean([r["topk_kl_mean"] for r in rows]))
    m["same_top_rate"] = float(np.mean([r["same_top_rate"] for r in rows]))
    m["bit_exact_fraction"] = float(np.mean([r["first_divergence"] is None for r in rows]))
    divergences = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    m["first_divergence_min"] = min(divergences) if divergences else None
    m["samples_diverged"] = len(divergences)
    m["hit_coverage"] = float(np.mean([r["hit"] for r in rows]))
    m["cached_tokens_mean"] = float(np.mean([r["cached_tokens"] for r in rows]))
    m["accept_per_position_acceptance"] = [0.9, 0.7]  # not a scalar: not stored
    fail = m["kl_k3_mean"] > THRESHOLD
    return ScenarioResult(scenario=scenario, verdict="fail" if fail else "pass",
                          reason=f"mean KL (k3) {m['kl_k3_mean']:.3g} above {THRESHOLD:.3g}" if fail else "",
                          metrics=m, samples=rows if with_samples else [], seconds=1.25)


def run_result(config: str, scenarios: dict[str, list[float]], *, seed: int = 0,
               fingerprint: str | None = None, with_samples: bool = True,
               sample_ids: list[str] | None = None) -> RunResult:
    """A run of ``config`` with per-scenario per-sample k3 means."""
    scens = [scenario_result(name, kls, seed=seed + i, sample_ids=sample_ids, with_samples=with_samples)
             for i, (name, kls) in enumerate(scenarios.items())]
    verdict = "fail" if any(s.verdict == "fail" for s in scens) else "pass"
    settings = {"strategy": "extra_buffer", "overlap": True, "chunked_prefill": 64, "mtp": False}
    args = {"mamba_radix_cache_strategy": "extra_buffer", "chunked_prefill_size": 64,
            "random_seed": 0}
    return RunResult(config=config, fingerprint=fingerprint or fingerprint_of(config),
                     model="hybrid-mamba2-tiny", settings=settings, requested_args=args,
                     verdict=verdict, reason="; ".join(s.reason for s in scens if s.reason),
                     resolved_args={**args, "disable_overlap_schedule": False},
                     command=["python", "-m", "evalsvc.cli", "engine", "--port", "30000"],
                     scenarios=scens, startup_seconds=2.5, seconds=12.0,
                     log_path=f"/tmp/logs/{config}.log")


def build_ref(sha: str, *, hours: float = 0, patches: list[str] | None = None,
              branch: str | None = "main", repository: str = "sgl-project/sglang",
              committed_at: datetime | None = None) -> BuildRef:
    when = committed_at or BASE_TIME + timedelta(hours=hours)
    return BuildRef(repository=repository, sha=sha, committed_at=when, branch=branch,
                    patches=list(patches or []), probes={"sglang": "0.5.14"},
                    base_env={"python": "3.11"}, manifest={"files": 3})


def sglang_build_ref(kind: str, location: str, ref: str | None = None, hours: float = 0) -> BuildRef:
    """An SGLang build made from a source, as ``jobs.builds.made_build_ref`` records it."""
    label = {"path": f"path:{location}", "git": f"git:{location}@{ref}",
             "pypi": f"sglang=={ref}"}[kind]
    manifest = {"kind": kind, "location": location, "source": label,
                "commit" if kind == "git" else "version": ref, "patches": [],
                "probes_after": [], "package_hash": hashlib.sha256(label.encode()).hexdigest()}
    return made_build_ref(manifest, BASE_TIME + timedelta(hours=hours))


def record(store: Store, results_dir: Path, job_id: str, build: BuildRef, results: list[RunResult],
           matrix: str = "smoke") -> list[int]:
    return record_results(store, job_id=job_id, trigger="cli", spec={"matrix": matrix},
                          build=build, matrix=matrix, results=results, results_dir=results_dir)


def record_judged(store: Store, results_dir: Path, *, job_id: str, trigger: str,
                  spec: dict[str, Any], build: BuildRef, matrix: str, result: RunResult,
                  thresholds: ThresholdsFile | None = None) -> int:
    """A job of one run, as the service records it (``jobs.record``): the run planned with its
    limits (on the spec's engine; ``matrix`` a name: the thresholds' rules, ``thresholds``'
    when given), then judged with its history and recorded (``record_result``: regressions
    tracked when the spec asks), and the job's end. Returns the run's id."""
    store.write(lambda s: ensure_job(s, job_id, trigger, spec), f"job {job_id}: its start")
    config = Config(name=result.config, matrix=matrix, model=result.model,
                    settings=dict(result.settings), args=dict(result.requested_args),
                    fingerprint=result.fingerprint,
                    scenarios=tuple(s.scenario for s in result.scenarios))
    [planned] = plan_build_runs(store, job_id, build, matrix, [config],
                                engine=spec.get("engine"), thresholds=thresholds)
    failure = record_result(store, results_dir, job_id, planned.run_id, result, thresholds)
    assert failure is None, failure
    store.write(lambda s: end_job(s, job_id, "done", None), f"job {job_id}: its end")
    return planned.run_id


def counts(store: Store) -> dict[str, int]:
    with store.session() as s:
        return {name: s.scalar(select(func.count()).select_from(model))
                for name, model in TABLES.items()}


def as_utc(dt: datetime | None) -> datetime | None:
    """SQLite hands timestamps back naive (UTC), PostgreSQL aware: compare them as aware UTC."""
    if dt is None:
        return None
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)
