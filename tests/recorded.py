"""A job recorded from run results made by hand (``JobRecord``), for the tests that hold the
store's planning, recording, judging and job end to account without running an engine. It is
made of the production pieces ``evalsvc run`` goes through (``jobs.record.plan_build_runs``,
``record_result`` and ``end_job``, the steps of ``jobs.run.run_job`` and ``evaluate.run_local``),
called in the order they call them."""

from __future__ import annotations

from pathlib import Path

from evalsvc import judging
from evalsvc.jobs.record import end_job, plan_build_runs, record_result
from evalsvc.jobs.spec import JobSpec
from evalsvc.matrix import Config, MatrixFile
from evalsvc.store.db import Store
from evalsvc.store.record import BuildRef, ensure_job
from evalsvc.thresholds import Limits
from evalsvc.types import RunResult


class JobRecord:
    """A job that runs outside the service (``evalsvc run``), in the store as it runs: the job and
    its runs planned when it starts, each run judged and recorded as it ends (``record_result``,
    which hands the judged verdicts back on the result: what ``evalsvc run`` prints and exits
    with), and the job's end when it stops: done, failed naming the runs that could not be
    recorded (or every run, when all errored), or cancelled when it stopped before its runs ended
    (Ctrl-C). A run that could not be recorded is judged without history, against its planned
    limits."""

    def __init__(self, store: Store, results_dir: Path, job_id: str, runs: dict[str, int],
                 limits: dict[str, dict[str, Limits]] | None = None) -> None:
        self.store, self.results_dir, self.job_id = store, results_dir, job_id
        self.run_ids = list(runs.values())  # in the order of the configs
        self.runs = runs  # fingerprint -> run id, of the runs not recorded yet
        self.limits = limits or {}  # fingerprint -> its limits, by scenario
        self.failures: list[str] = []
        self.unrecorded: set[str] = set()  # names of the configs whose run could not be recorded

    @classmethod
    def start(cls, store: Store, results_dir: Path, job_id: str, trigger: str, ref: BuildRef,
              matrix: MatrixFile | str, configs: list[Config], spec: JobSpec | dict
              ) -> JobRecord:
        """The job (``spec``: its ``JobSpec``, or as ``JobSpec.stored()`` stores it) and its runs
        planned, judged on the spec's ``engine`` against ``matrix`` (its name alone: the
        thresholds' rules without the matrix file's own thresholds)."""
        stored = spec.stored() if isinstance(spec, JobSpec) else spec
        store.write(lambda s: ensure_job(s, job_id, trigger, stored), f"job {job_id}: its start")
        engine = stored.get("engine")
        planned = plan_build_runs(store, job_id, ref, matrix, configs, engine=engine)
        file = None if isinstance(matrix, str) else matrix
        return cls(store, results_dir, job_id, {p.config.fingerprint: p.run_id for p in planned},
                   {c.fingerprint: judging.config_limits(c, file, engine=engine)
                    for c in configs})

    def record(self, config: Config, result: RunResult) -> None:
        run_id = self.runs.pop(config.fingerprint)
        failure = record_result(self.store, self.results_dir, self.job_id, run_id, result)
        if failure is not None:
            self.failures.append(failure)
            self.unrecorded.add(config.name)
            limits = self.limits.get(config.fingerprint)
            if limits is not None:
                judging.judge_run(result, limits)

    def finish(self) -> str:
        """Write the job's end; returns its status (``end_job``: failed when every run errored)."""
        status = "cancelled" if self.runs else "failed" if self.failures else "done"
        error = "; ".join(self.failures) or None
        written, _ = self.store.write(lambda s: end_job(s, self.job_id, status, error),
                                      f"job {self.job_id}: its end")
        return written or status
