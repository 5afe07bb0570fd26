"""The clean floor: what a defect-free engine's KL is, per model and scenario, over many seeds.

    .venv/bin/python benchmarks/floor.py [--matrix smoke-bf16] [--seeds 20] [--num-prompts 8]
    .venv/bin/python benchmarks/floor.py --matrix sglang-cpu --configs A,B \
        --engine-python .venv-sglang-cpu/bin/python --model DIR      # real SGLang on this CPU

Evaluates every config of the matrix (``--configs``: some of them; no defect) once per sampling seed
(0 .. seeds-1, the same prompts) and reports, per model and scenario, the scenario's mean KL (k3) of
its runs over all seeds and configs: mean, p99 and max; and the same of the per-sample means (one
value per prompt), which is what per-prompt tests see. Acceptance lengths of the speculative
scenario come with them. These are the figures the thresholds of ``evalsvc/configs/thresholds.yaml`` for
the matrix are calibrated on (BENCHMARKS.md quotes them).

Results go to ``benchmarks/results/floor-MATRIX.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.children import exit_on_sigterm  # noqa: E402
from evalsvc.engines.base import EngineSpec  # noqa: E402
from evalsvc.evaluate import evaluate, prepare  # noqa: E402
from evalsvc.matrix import load_matrix  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def collect(matrix_name: str, seeds: int, num_prompts: int, work: Path,
            configs_wanted: list[str] | None = None, engine_python: str | None = None,
            model: str | None = None) -> list[dict[str, Any]]:
    """One row per seed, config and scenario: the scenario's metrics and its per-sample KL.
    An SGLang matrix runs on ``engine_python``'s SGLang, with ``model`` for every model."""
    matrix = load_matrix(matrix_name)
    matrix.workload.num_prompts = num_prompts
    spec = (EngineSpec(kind="sglang", python=engine_python, startup_timeout=300)
            if matrix.engine == "sglang" else EngineSpec(kind="embedded"))
    rows = []
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task(f"{matrix_name}: {seeds} seeds", total=seeds)
        for seed in range(seeds):
            matrix.workload.sampling_seed = seed
            configs, prompts = prepare(matrix, spec, model_override=model)
            if configs_wanted:
                configs = [c for c in configs if c.name in configs_wanted]
            for run in evaluate(matrix, configs, prompts, spec, work / f"seed-{seed}",
                                Console(quiet=True)):
                for scen in run.scenarios:
                    rows.append({"seed": seed, "config": run.config, "model": run.model,
                                 "scenario": scen.scenario, "verdict": scen.verdict,
                                 "kl_k3_mean": scen.metrics.get("kl_k3_mean"),
                                 "extend_kl_k3_mean": scen.metrics.get("extend_kl_k3_mean"),
                                 "accept_length": scen.metrics.get("accept_length"),
                                 "hit_coverage": scen.metrics.get("hit_coverage"),
                                 "samples": [r["kl_k3_mean"] for r in scen.samples],
                                 "extend_samples": [r["extend_kl_k3_mean"] for r in scen.samples
                                                    if r["extend_kl_k3_mean"] is not None]})
            progress.advance(task)
    return rows


def stats(values: list[float]) -> dict[str, float]:
    v = np.asarray(values, dtype=float)
    return {"n": int(v.size), "mean": float(v.mean()), "p99": float(np.quantile(v, 0.99)),
            "min": float(v.min()), "max": float(v.max())}


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for model, scenario in sorted({(r["model"], r["scenario"]) for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["scenario"] == scenario
                and r["kl_k3_mean"] is not None]
        acc = [r["accept_length"] for r in mine if r["accept_length"] is not None]
        ext = [r["extend_kl_k3_mean"] for r in mine if r["extend_kl_k3_mean"] is not None]
        out.append({"model": model, "scenario": scenario,
                    "configs": sorted({r["config"] for r in mine}),
                    "scenario_kl": stats([r["kl_k3_mean"] for r in mine]),
                    "sample_kl": stats([v for r in mine for v in r["samples"]]),
                    "scenario_extend_kl": stats(ext) if ext else None,
                    "sample_extend_kl": stats([v for r in mine for v in r["extend_samples"]])
                    if ext else None,
                    "accept_length": stats(acc) if acc else None})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--matrix", default="smoke-bf16")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--configs", default="", help="comma-separated (default: the whole matrix)")
    parser.add_argument("--engine-python", default=None, help="an SGLang matrix: its python")
    parser.add_argument("--model", default=None, help="an SGLang matrix: the model for every config")
    parser.add_argument("--name", default=None, help="results file suffix (default: the matrix)")
    args = parser.parse_args()
    exit_on_sigterm()  # engines stopped on SIGTERM as on Ctrl-C
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="evalsvc-floor-") as tmp:
        rows = collect(args.matrix, args.seeds, args.num_prompts, Path(tmp),
                       [c for c in args.configs.split(",") if c] or None, args.engine_python,
                       args.model)
    out = {"matrix": args.matrix, "seeds": args.seeds, "num_prompts": args.num_prompts,
           "model": args.model, "seconds": round(time.monotonic() - t0, 1),
           "summary": summarize(rows), "runs": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"floor-{args.name or args.matrix}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for s in out["summary"]:
        sk, pk = s["scenario_kl"], s["sample_kl"]
        acc, ek = s["accept_length"], s["scenario_extend_kl"]
        print(f"{s['model']:7} {s['scenario']:12} KL: scenario mean {sk['mean']:.2e} p99 "
              f"{sk['p99']:.2e} max {sk['max']:.2e}, per sample p99 {pk['p99']:.2e} max "
              f"{pk['max']:.2e}"
              + (f" | extend KL: mean {ek['mean']:.2e} max {ek['max']:.2e}" if ek else "")
              + (f" | accept length {acc['mean']:.3f} (min {acc['min']:.3f})" if acc else ""))
    print(f"written to {path} ({out['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
