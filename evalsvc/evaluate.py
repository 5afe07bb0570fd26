"""A whole matrix on the local machine, one run at a time: what ``evalsvc run`` does.

Loads the matrix and the workload, runs every config as a job (``jobs.run.run_job``, the service's
own phases) on a local dispatcher through the harness with progress shown, and writes
``summary.json`` (a row per config and scenario) and ``samples.parquet`` (a row per sample, with
token-level logprobs) to the output directory.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from evalsvc.dispatch.base import RunTask
from evalsvc.dispatch.local import LocalDispatcher
from evalsvc.engines.base import EngineSpec, launch
from evalsvc.engines.client import EngineClient
from evalsvc.engines.launch import EngineProcess, EngineStartError, free_port
from evalsvc.harness import EnginePool, RunControl, run_config
from evalsvc.jobs import run as job_run
from evalsvc.jobs.builds import ReadyBuild
from evalsvc.jobs.plan import plan_runs
from evalsvc.jobs.record import PlannedRun, end_job
from evalsvc.jobs.run import JobOutcome, RunOptions
from evalsvc.jobs.spec import BuildSpec, JobSpec, mint_id
from evalsvc.matrix import Config, MatrixFile, make_config
from evalsvc.paths import inside
from evalsvc.store.db import Store
from evalsvc.types import JobStatus, RunResult, Verdict
from evalsvc.workloads import load_prompts, workload_version

# Exit status of the commands that evaluate (evalsvc run, evalsvc demo): 0 when every run
# reached its verdict and passed; EXIT_FAILED when a run failed its verdict (fail, or invalid: the
# engine did not run what was asked); else EXIT_ERRORED when a run reached no verdict (error: its
# engine did not start or died, or it could not be recorded). Every command exits 2 on what it
# refuses to start with (an unknown matrix, option or source; click's usage errors too) and
# evalsvc serve 3 when the service did not start.
EXIT_FAILED = 1
EXIT_ERRORED = 4

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


def evaluate(matrix: MatrixFile, configs: list[Config], prompts, spec: EngineSpec, out_dir: Path,
             console: Console | None = None, engines: EnginePool | None = None
             ) -> list[RunResult]:
    """Every config, one run at a time, nothing stored (``run_local``: each run judged on its fixed
    limits, ``jobs.run.run_job``); ``engines``: engines kept between runs (``EnginePool``)."""
    job = JobSpec(matrix_name=matrix.name, matrix=matrix, engine=spec.kind, builds=[BuildSpec()],
                  configs=[c.name for c in configs] or None)
    outcome = run_local(mint_id("local", digits=6), job, spec, configs, prompts, out_dir, console,
                        engines=engines)
    return outcome.results


def run_local(job_id: str, job: JobSpec, spec: EngineSpec, configs: list[Config], prompts,
              out_dir: Path, console: Console | None = None, *, engines: EnginePool | None = None,
              store: Store | None = None, results_dir: Path | None = None,
              build: ReadyBuild | None = None, trigger: str = "cli") -> JobOutcome:
    """A job on this machine (``jobs.run.run_job`` on a local dispatcher of one slot), its
    ``configs`` planned and its ``prompts`` loaded already on ``spec`` (its one build made:
    ``build``, what the store records), with progress shown on ``console``; a matrix's reference
    servers (``References``) started as its runs need them, ``engines`` kept between runs. With a
    ``store`` the job is recorded as it runs, and its end is written (``jobs.record.end_job``)
    however it stops: done, failed naming the runs that could not be recorded (or every run, when
    all errored), or cancelled when it stopped before its runs ended (Ctrl-C); the outcome's status
    is the one written. Without a store nothing is. Writes ``summary.json``, ``runs.json`` and
    ``samples.parquet`` to ``out_dir`` and the logs to ``out_dir/logs``. An exception (Ctrl-C)
    stops the run going on, then is raised."""
    console = console or Console()
    matrix = job.matrix
    log_dir = out_dir / "logs"
    by_name = {c.name: c for c in configs}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with References(matrix, spec, log_dir) as references, \
            Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task(f"matrix {matrix.name}", total=len(configs))
        bars: dict[str, TaskID] = {}

        def bar(cfg: Config) -> TaskID:
            if cfg.name not in bars:
                bars[cfg.name] = progress.add_task(f"  {cfg.name}", total=len(cfg.scenarios))
            return bars[cfg.name]

        def execute(task: RunTask, control: RunControl) -> RunResult:
            cfg = by_name[task.config.name]
            shown = bar(cfg)

            def on_scenario(_cfg, scen) -> None:
                progress.update(shown, advance=1,
                                description=f"  {_cfg.name}: {scen.scenario} {scen.verdict}")

            try:
                reference = references.client(cfg.model)
            except EngineStartError as exc:
                return cfg.unrun("error", f"reference server did not start: {exc}")
            result = run_config(cfg, matrix, spec, task.prompts, log_dir=Path(task.log_dir),
                                reference=reference, on_scenario=on_scenario, control=control,
                                run_timeout_s=task.run_timeout_s, engines=engines)
            result.reference = references.describe(cfg.model)
            return result

        left, failures = set(by_name), []  # what the job's end is written from

        def ended(planned: PlannedRun, result: RunResult, failure: str | None) -> None:
            cfg = planned.config
            left.discard(cfg.name)
            if failure is not None:
                failures.append(failure)
            progress.update(bar(cfg), completed=len(cfg.scenarios),
                            description=f"  {cfg.name}: {result.verdict}")
            progress.advance(overall)

        dispatcher = LocalDispatcher(1, execute=execute)
        try:
            outcome = job_run.run_job(job_id, job, dispatcher, store, RunOptions(
                engine=spec, log_dir=log_dir, results_dir=results_dir, per_build_logs=False,
                builds=[build or ReadyBuild(spec, None, None)], prompts=prompts,
                configs=configs, trigger=trigger, per_model_errors=True, on_result=ended))
        finally:
            dispatcher.shutdown()  # after a Ctrl-C: its run stopped (the job cancels it)
            if store is not None:
                status = (JobStatus.CANCELLED if left else JobStatus.FAILED if failures
                          else JobStatus.DONE)
                error = "; ".join(failures) or None
                written, _ = store.write(lambda s: end_job(s, job_id, status, error),
                                         f"job {job_id}: its end")
    if store is not None:
        outcome.status = written or status  # failed when every run errored
    write_outputs(outcome.results, out_dir)
    return outcome


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


VERDICT_STYLE = {"pass": "green", "expected": "blue", "fail": "red", "inconclusive": "yellow",
                 "measured": "white", "invalid": "magenta", "error": "red"}


def config_prefix(names: list[str]) -> str:
    """What every config name starts with, up to and including its last ``-`` (so that each name
    keeps a whole part of its own); "" for fewer than two names, or none shared."""
    if len(set(names)) < 2:
        return ""
    first, last = min(names), max(names)
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    prefix = first[:first.rfind("-", 0, n) + 1]
    return "" if prefix in names else prefix  # none that would leave a name empty


def results_table(results: list[RunResult], title: str) -> Group:
    """The results of ``evalsvc run``: a row per config and scenario, then the reasons of the rows
    that did not pass, each in full and numbered (the row names its number; rows with the same
    reason share it). It fits 100 columns: the config names' common prefix goes in the title
    (each cell holds the rest, so every name stays whole and unique), a too long name is folded
    onto more lines, never cut, and a reason wraps between words."""
    rows = summary_rows(results)
    prefix = config_prefix([row["config"] for row in rows])
    if prefix:
        title = f"{title}; configs {prefix}*"
    table = Table(title=title)
    table.add_column("config", overflow="fold")
    table.add_column("scenario", no_wrap=True)
    # the interval wraps under the mean where the width is short (it is one word, "[LOW,HIGH]");
    # narrower still, a number is folded onto the next line, never cut
    table.add_column("KL k3 mean\n[95% CI]", overflow="fold")
    for col in ("extend\nKL", "hit\ncov.", "accept\nlen", "verdict"):
        table.add_column(col, no_wrap=True)
    notes: dict[str, int] = {}
    for row in rows:
        kl, ci = row["kl_k3_mean"], row["kl_k3_ci"]
        kl_text = "" if kl is None else f"{kl:.2e}" + (f" [{ci[0]:.1e},{ci[1]:.1e}]" if ci else "")
        acc, cov, ext = row["accept_length"], row["hit_coverage"], row["extend_kl_k3_mean"]
        verdict = row["verdict"]
        cell = Text(verdict, style=VERDICT_STYLE.get(verdict, "white"))
        if verdict != Verdict.PASS and row["reason"]:
            number = notes.setdefault(row["reason"], len(notes) + 1)
            cell.append(f" [{number}]", style="dim")
        table.add_row(Text(row["config"][len(prefix):]), row["scenario"] or "-", Text(kl_text),
                      "" if ext is None else f"{ext:.2e}", "" if cov is None else f"{cov:.2f}",
                      "" if acc is None else f"{acc:.2f}", cell)
    if not notes:
        return Group(table)
    reasons = Table.grid(padding=(0, 1))
    reasons.add_column(no_wrap=True, style="dim")
    reasons.add_column(overflow="fold")  # words wrap whole; only a word wider than the line folds
    for reason, number in notes.items():
        reasons.add_row(Text(f"[{number}]"), Text(reason))
    return Group(table, reasons)
