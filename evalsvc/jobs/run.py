"""A job's phases, one way for the job service and ``evalsvc run``: ``run_job``.

The workload is loaded, its prompts tokenized, each build of the job made ready, its configs
planned into runs (pending runs in the store, when there is one), the runs handed to a dispatcher,
and each finished run recorded in a transaction of its own (``jobs.record.record_result``) as it
ends. The dispatcher tells the job of its runs by values on the job's queue (``RunEvent``: a run
started, its engine's pid; ``run_job`` writes them), never by a call into the job. What differs
between the service and the command line is told by ``RunOptions``: the service's cancel and
shutdown, the command line's builds made before its job starts, its reference servers and
progress (its own dispatcher, ``evaluate.run_local``), ``--no-store`` (no store: the results are
only returned) and ``--dry-run`` (the command lines, nothing launched). Who runs the job writes
its end (``jobs.record.end_job``): the service's runner, or ``evalsvc run``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalsvc import judging
from evalsvc.counters import Counters
from evalsvc.dispatch.base import RunTask
from evalsvc.engines.base import EngineSpec, engine_command
from evalsvc.jobs.builds import ReadyBuild, ready_build
from evalsvc.jobs.plan import plan_runs
from evalsvc.jobs.record import (
    JobCancelled,
    PlannedRun,
    describe,
    fail_run,
    plan_build_runs,
    record_progress,
    record_result,
)
from evalsvc.jobs.spec import JobSpec
from evalsvc.matrix import Config
from evalsvc.paths import inside
from evalsvc.store.db import Store
from evalsvc.store.models import Run
from evalsvc.store.record import ensure_job
from evalsvc.tokenization import tokenized
from evalsvc.types import RunEvent, RunResult, RunStatus, Verdict

log = logging.getLogger("evalsvc.jobs")


@dataclass
class RunOptions:
    """How a job runs where ``run_job`` is called from (the service's runner, ``evalsvc run``)."""

    engine: EngineSpec  # the job's engine, its builds made over it (its SGLang python)
    log_dir: Path | None = None  # the runs' logs (none for a dry run)
    results_dir: Path | None = None  # the runs' samples files (with a store)
    # each build's runs log in log_dir/build-BUILD (the service's); else in log_dir itself
    per_build_logs: bool = True
    run_timeout_s: float | None = None  # the default deadline of a run (the matrix's wins)
    # where a build of the job is made ready (``jobs.builds.ready_build``: an embedded build's
    # mirrors; an SGLang build is made by the dispatcher, where the runs go)
    builds_dir: Path | None = None
    builds: list[ReadyBuild] | None = None  # made ready already, one per build of the job
    prompts: Any = None  # the workload loaded already (``workloads.load_prompts``)
    configs: list[Config] | None = None  # planned already (each build runs them)
    trigger: str | None = None  # the job written to the store when it starts, running
    # a model whose tokenizer cannot be loaded errors its runs only (else the job fails)
    per_model_errors: bool = False
    dry_run: bool = False  # plan only: the engine command lines, nothing launched or stored
    # set once the job's cancel is asked: it stops at once (the service clears it again where the
    # cancel could not be written)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # set when the service is shutting down: the job resumes after its restart
    stopping: threading.Event = field(default_factory=threading.Event)
    counters: Counters | None = None  # each recorded run's wall time (the service's /metrics)
    # as each run ended and was recorded: the run, its result, why it could not be recorded
    on_result: Callable[[PlannedRun, RunResult, str | None], None] | None = None


@dataclass
class JobOutcome:
    """What ``run_job`` ends with: the job's status (done, failed, cancelled, or interrupted: the
    service shut down and the job resumes after its restart) and error; the results of the runs
    that ended, in order; the runs that could not be recorded (``failures``, and the names of
    their configs); the command lines of a dry run."""

    status: str
    error: str | None = None
    results: list[RunResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    unrecorded: set[str] = field(default_factory=set)
    planned: list[PlannedRun] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)


def dry_run_commands(configs: list[Config], spec: EngineSpec) -> list[list[str]]:
    """Each config's command line, behind ``env VAR=VALUE ...`` where its engine gets variables
    (the matrix's ``engine_env``, the radix-tree core)."""
    commands = []
    for c in configs:
        env = [f"{k}={v}" for k, v in sorted(c.env.items())]
        commands.append([*(["env", *env] if env else []),
                         *engine_command(spec, c.args, port=30000)])
    return commands


def run_job(job_id: str, spec: JobSpec, dispatcher, store: Store | None,
            options: RunOptions) -> JobOutcome:
    """Run a job's phases (workload, tokens, builds, plan, runs, record); ``options.cancelled``
    is looked at between them and in their loops (JobCancelled before its runs were handed over;
    after, the job ends cancelled). ``store`` None: nothing is recorded (``evalsvc run
    --no-store``). An exception (Ctrl-C too) stops every run of the job it handed over."""
    from evalsvc.workloads import load_prompts, workload_version

    matrix = spec.matrix

    def check() -> None:
        if options.cancelled.is_set():
            raise JobCancelled(job_id)

    check()
    prompts = options.prompts if options.prompts is not None else load_prompts(matrix.workload)
    version = workload_version(matrix.workload, prompts)
    base = options.engine
    if options.dry_run:
        configs = (options.configs if options.configs is not None
                   else plan_runs(matrix, base, version, spec.configs))
        return JobOutcome("done", commands=dry_run_commands(configs, base))
    if store is not None and options.trigger is not None:
        stored = spec.stored()
        for attempt in store.attempts(f"job {job_id}: its start"):
            with attempt as s:
                ensure_job(s, job_id, options.trigger, stored)
    check()
    bad_models: dict[str, str] | None = {} if options.per_model_errors else None
    by_model = tokenized(matrix, base, prompts, errors=bad_models)
    items: list[tuple[PlannedRun, RunTask | None, RunResult | None]] = []
    planned_all: list[PlannedRun] = []
    for i, b in enumerate(spec.builds):
        check()
        if options.builds is not None:
            engine, ref, request = options.builds[i]
        else:
            engine, ref, request = ready_build(base, b, dispatcher.prepare_build,
                                              options.builds_dir)
        check()
        # validated when submitted: a config its build's release excludes is left out
        configs = (options.configs if options.configs is not None
                   else plan_runs(matrix, engine, version, spec.configs, strict=False))
        if store is not None:
            planned = plan_build_runs(store, job_id, ref, matrix, configs, options.cancelled,
                                      engine=spec.engine)
        else:  # nothing stored: the runs are numbered in the job
            planned = [PlannedRun(len(planned_all) + n, 0, "pending", c)
                       for n, c in enumerate(configs)]
        planned_all += planned
        for p in planned:
            if p.status != RunStatus.PENDING:  # recorded already (a job resumed after a restart)
                continue
            if bad_models and p.config.model in bad_models:  # its other models' runs still go
                items.append((p, None, p.config.unrun("error", bad_models[p.config.model])))
                continue
            log_dir = (inside(options.log_dir, f"build-{p.build_id}") if options.per_build_logs
                       else options.log_dir)
            items.append((p, RunTask.make(
                job_id, p.run_id, matrix, p.config, engine, by_model[p.config.model], log_dir,
                build=request, run_timeout_s=options.run_timeout_s),
                None))
    outcome = JobOutcome("done", planned=planned_all)
    # what the dispatcher and the runs' futures tell of the runs, in the order it happens
    events: queue.Queue[RunEvent] = queue.Queue()
    handed: dict[int, tuple[PlannedRun, RunTask | None, Future]] = {}  # in the order handed over
    ended: dict[int, tuple[RunResult, str | None] | None] = {}
    try:
        for p, task, unrun in items:
            if options.cancelled.is_set():
                break
            if task is None:
                fut: Future = Future()
                fut.set_result(unrun)
            else:
                fut = dispatcher.submit(task, events)
            handed[p.run_id] = (p, task, fut)
            fut.add_done_callback(lambda _, rid=p.run_id: events.put(RunEvent(rid, "ended")))
        if options.cancelled.is_set():  # a cancel that came while its runs were handed over
            dispatcher.cancel_job(job_id)
        while len(ended) < len(handed):
            event = events.get()
            if event.kind == "ended":
                ended[event.run_id] = _collect(job_id, spec, *handed[event.run_id], store,
                                               options, outcome)
            elif store is not None:
                record_progress(store, event)
    except BaseException:
        dispatcher.cancel_job(job_id)  # no run of it goes on without the job
        raise
    for run_id in handed:  # the results in the order of the job's runs, as each was recorded
        if (result := ended[run_id]) is not None:
            outcome.results.append(result[0])
            if result[1] is not None:
                outcome.failures.append(result[1])
    if options.stopping.is_set() and not options.cancelled.is_set():
        outcome.status = "interrupted"  # left running: it resumes after the restart
    elif options.cancelled.is_set():
        outcome.status = "cancelled"
    elif outcome.failures:
        outcome.status, outcome.error = "failed", "; ".join(outcome.failures)
    return outcome


def _collect(job_id: str, spec: JobSpec, p: PlannedRun, task: RunTask | None, fut: Future,
             store: Store | None, options: RunOptions, outcome: JobOutcome
             ) -> tuple[RunResult, str | None] | None:
    """One run that ended, recorded (``record_result``), or its failure: its result and why it
    could not be recorded; None for a run that never started or runs again after a restart."""
    try:
        result = fut.result()
    except CancelledError:  # never started: the service is shutting down
        return None
    except Exception as exc:  # e.g. the dispatcher could not place it
        log.exception("run %d failed", p.run_id)
        reason = describe(exc)
        failure = (fail_run(store, p.run_id, reason) if store is not None
                   else f"run {p.run_id}: {reason}")
        outcome.unrecorded.add(p.config.name)
        result = task.outcome("error", reason) if task is not None else p.config.unrun(
            "error", reason)
        if options.on_result is not None:
            options.on_result(p, result, failure)
        return result, failure
    if options.stopping.is_set() and result.verdict == Verdict.CANCELLED:
        if store is not None:
            with store.session() as s:  # shutting down: run again after the restart
                s.get(Run, p.run_id).status = RunStatus.PENDING
        return None
    failure = None
    if store is not None:  # judged there, with its history, and the verdicts handed back
        failure = record_result(store, options.results_dir, job_id, p.run_id, result)
        if failure is not None:
            outcome.unrecorded.add(p.config.name)
    if store is None or failure is not None:  # nothing stored: judged on its fixed limits
        judging.judge_run(result, judging.config_limits(p.config, spec.matrix, engine=spec.engine))
    if failure is None and options.counters is not None:
        options.counters.run_finished(result.seconds)
    if options.on_result is not None:
        options.on_result(p, result, failure)
    return result, failure
