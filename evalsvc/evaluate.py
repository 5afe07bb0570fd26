"""A whole matrix on the local machine, one run at a time: what ``evalsvc run`` does.

Loads the matrix and the workload, runs every config through the harness with progress shown,
and writes ``summary.json`` (a row per config and scenario) and ``samples.parquet`` (a row per
sample, with token-level logprobs) to the output directory.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from evalsvc.engines.base import EngineSpec, engine_command, launch
from evalsvc.engines.client import EngineClient
from evalsvc.engines.launch import EngineProcess, EngineStartError, free_port
from evalsvc.harness import EnginePool, run_config
from evalsvc.jobs.plan import plan_runs
from evalsvc.matrix import Config, MatrixFile, make_config
from evalsvc.paths import inside
from evalsvc.tokenization import tokenized
from evalsvc.types import RunResult
from evalsvc.workloads import load_prompts, workload_version

log = logging.getLogger("evalsvc.evaluate")


def prepare(matrix: MatrixFile, spec: EngineSpec, model_override: str | None = None,
            configs: list[str] | None = None):
    """(configs, prompts per model key as (id, token ids)) for a matrix and an engine; only the
    ``configs`` named, when given (``jobs.plan.plan_runs``: UnknownConfigs if one is not in it)."""
    if model_override:
        for entry in matrix.models.values():
            entry.path = model_override
    prompts = load_prompts(matrix.workload)
    version = workload_version(matrix.workload, prompts)
    return plan_runs(matrix, spec, version, configs), prompts


def dry_run_commands(configs: list[Config], spec: EngineSpec) -> list[list[str]]:
    """Each config's command line, behind ``env VAR=VALUE ...`` where its engine gets variables
    (the matrix's ``engine_env``, the radix-tree core)."""
    commands = []
    for c in configs:
        env = [f"{k}={v}" for k, v in sorted(c.env.items())]
        commands.append([*(["env", *env] if env else []),
                         *engine_command(spec, c.args, port=30000)])
    return commands


def evaluate(matrix: MatrixFile, configs: list[Config], prompts, spec: EngineSpec, out_dir: Path,
             console: Console | None = None, engines: EnginePool | None = None,
             on_result: Callable[[Config, RunResult], None] | None = None) -> list[RunResult]:
    """Every config, one run at a time; ``engines``: engines kept between runs (``EnginePool``);
    ``on_result(config, result)`` as each run ends (``jobs.record.JobRecord.record``)."""
    console = console or Console()
    bad_models: dict[str, str] = {}
    by_model = tokenized(matrix, spec, prompts, errors=bad_models)
    log_dir = out_dir / "logs"
    results: list[RunResult] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with References(matrix, spec, log_dir) as references, \
            Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task(f"matrix {matrix.name}", total=len(configs))
        for cfg in configs:
            task = progress.add_task(f"  {cfg.name}", total=len(cfg.scenarios))

            def on_scenario(_cfg, scen, task=task):
                progress.update(task, advance=1,
                                description=f"  {_cfg.name}: {scen.scenario} {scen.verdict}")

            if cfg.model in bad_models:  # this config fails; the other models' configs still run
                result = cfg.unrun("error", bad_models[cfg.model])
            else:
                try:
                    reference = references.client(cfg.model)
                except EngineStartError as exc:
                    result = cfg.unrun("error", f"reference server did not start: {exc}")
                else:
                    result = run_config(cfg, matrix, spec, by_model[cfg.model], log_dir=log_dir,
                                        reference=reference, on_scenario=on_scenario,
                                        engines=engines)
                    result.reference = references.describe(cfg.model)
            progress.update(task, completed=len(cfg.scenarios),
                            description=f"  {cfg.name}: {result.verdict}")
            progress.advance(overall)
            results.append(result)
            if on_result is not None:
                on_result(cfg, result)
    write_outputs(results, out_dir)
    return results


class References:
    """Reference servers (``reference: {kind: config}``): one per model, started on first use and
    shared by that model's configs; ``None`` means SGLang's same-server method."""

    def __init__(self, matrix: MatrixFile, spec: EngineSpec, log_dir: Path) -> None:
        self.matrix, self.spec, self.log_dir = matrix, spec, log_dir
        self.servers: dict[str, tuple[EngineProcess, EngineClient]] = {}
        self.described: dict[str, dict[str, Any]] = {}

    def client(self, model: str) -> EngineClient | None:
        ref = self.matrix.reference
        if ref.kind != "config":
            return None
        if model not in self.servers:
            cfg = make_config(self.matrix, {**(ref.config or {}), "model": model})
            proc = launch(self.spec.with_env(cfg.env), cfg.args, free_port(),
                          inside(self.log_dir, f"reference-{model}.log"))
            self.servers[model] = (proc, EngineClient(
                proc.base_url, concurrency=self.matrix.workload.concurrency))
            self.described[model] = {"kind": "config", "config": cfg.name, "command": proc.argv}
            log.info("reference server for %s: %s", model, cfg.name)
        return self.servers[model][1]

    def describe(self, model: str) -> dict[str, Any]:
        return self.described.get(model, {"kind": "same_server"})

    def __enter__(self) -> References:
        return self

    def __exit__(self, *exc) -> None:
        for proc, client in self.servers.values():
            client.close()
            proc.stop()


def summary_rows(results: list[RunResult]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        if not r.scenarios:  # invalid or failed before any scenario
            rows.append({"config": r.config, "fingerprint": r.fingerprint, "scenario": None,
                         "kl_k3_mean": None, "kl_k3_ci": None, "extend_kl_k3_mean": None,
                         "hit_coverage": None,
                         "accept_length": None, "verdict": r.verdict, "reason": r.reason,
                         "resolved_args": r.resolved_args})
            continue
        for s in r.scenarios:
            m = s.metrics
            ci = ([m["kl_k3_ci_low"], m["kl_k3_ci_high"]] if "kl_k3_ci_low" in m else None)
            rows.append({
                "config": r.config, "fingerprint": r.fingerprint, "scenario": s.scenario,
                "kl_k3_mean": m.get("kl_k3_mean"), "kl_k3_ci": ci,
                "extend_kl_k3_mean": m.get("extend_kl_k3_mean"),
                "hit_coverage": m.get("hit_coverage"), "accept_length": m.get("accept_length"),
                "verdict": s.verdict, "reason": s.reason, "metrics": m,
                "resolved_args": r.resolved_args})
    return rows


def write_outputs(results: list[RunResult], out_dir: Path) -> None:
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary_rows(results), indent=2,
                                                     default=_json_default) + "\n")
    (out_dir / "runs.json").write_text(json.dumps(
        [{k: v for k, v in asdict(r).items() if k != "scenarios"} | {
            "scenarios": [{"scenario": s.scenario, "verdict": s.verdict, "reason": s.reason}
                          for s in r.scenarios]} for r in results],
        indent=2, default=_json_default) + "\n")
    rows = [{"config": r.config, "fingerprint": r.fingerprint, "scenario": s.scenario, **row}
            for r in results for s in r.scenarios for row in s.samples]
    if rows:
        pd.DataFrame(rows).to_parquet(out_dir / "samples.parquet", index=False)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def results_table(results: list[RunResult], title: str) -> Table:
    table = Table(title=title)
    for col in ("config", "scenario", "KL k3 mean [95% CI]", "extend KL", "hit cov.",
                "accept len", "verdict"):
        table.add_column(col, no_wrap=col != "config")
    style = {"pass": "green", "expected": "blue", "fail": "red", "inconclusive": "yellow",
             "invalid": "magenta", "error": "red"}
    for row in summary_rows(results):
        kl = row["kl_k3_mean"]
        ci = row["kl_k3_ci"]
        kl_text = "" if kl is None else f"{kl:.2e}" + (f" [{ci[0]:.1e}, {ci[1]:.1e}]" if ci else "")
        acc = row["accept_length"]
        cov = row["hit_coverage"]
        verdict = row["verdict"]
        ext = row["extend_kl_k3_mean"]
        table.add_row(row["config"], row["scenario"] or "-", kl_text,
                      "" if ext is None else f"{ext:.2e}", "" if cov is None else f"{cov:.2f}",
                      "" if acc is None else f"{acc:.2f}",
                      f"[{style.get(verdict, 'white')}]{verdict}[/]"
                      + (f" ({row['reason'][:60]})" if verdict != "pass" and row["reason"] else ""))
    return table
