"""Bisection: the first bad commit of a git source between a good and a bad one, or the first
bad release of SGLang on PyPI (``repository: pypi:sglang``, ``good`` and ``bad`` versions).

The candidates are the first-parent commits after ``good`` up to ``bad`` (the releases after
``good`` up to ``bad``, in the index's order). Each step evaluates one
config, only, on one commit (a job with trigger ``bisect``, run like any other), or reuses a
finished run of that config on that commit if the store has one; the commit is bad when the
scenario failed (a fixed limit or a history regression) or, with ``metric``, when that metric's
verdict is a regression. A run that fails as a known failure does (``expected``) is bad when the
bisection searches that failure (its regression is triaged expected, or it names no regression),
and good when it searches another regression of the series (one worse than the known failure).
The search (``first_bad``, pure) needs at most ceil(log2(n)) runs for n
candidates, plus one if the bad end has not been evaluated yet; a step waits for its job by being
woken when the job service ends a job (``JobService.wait_end``). A step whose run cannot decide
(engine error, too few cache hits) stops the bisection with that reason.

Bisections live in the store: the steps are written as they finish, and a service restarted in
the middle resumes them (finished steps are reused, not run again).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from evalsvc.builds.build import BuildError, git, git_mirror
from evalsvc.engines.base import EngineSpec
from evalsvc.jobs import BuildSpec, JobCreate, JobError, JobService, UnknownConfigs, mint_id, plan_runs
from evalsvc.jobs.builds import SGLANG_REPOSITORY
from evalsvc.jobs.spec import JobSpec, job_spec
from evalsvc.judging import METRICS, POOLED
from evalsvc.logs import log_context
from evalsvc.matrix import SCENARIOS, MatrixError, load_matrix
from evalsvc.nightly import NightlyError, releases
from evalsvc.store import audit
from evalsvc.store.audit import Actor
from evalsvc.store.db import Store
from evalsvc.store.models import Bisection, Build, Commit, Job, Regression, Run, VerdictRow, utcnow
from evalsvc.types import FINISHED_JOB_STATUSES, JobStatus, MetricVerdict, RunStatus, Verdict

log = logging.getLogger("evalsvc.bisect")
T = TypeVar("T")
RELEASES = "pypi:sglang"  # the repository of a bisection over SGLang's releases
SETTLE = 30.0  # seconds: a step's job is looked at this often even when no end was signalled
# the verdicts of a run (and its scenarios) that decide a step: good or bad, not unmeasured
DECIDING = (Verdict.PASS, Verdict.FAIL, Verdict.EXPECTED)
# a pooled metric's verdicts that decide a step (an inconclusive one does not)
POOLED_DECIDING = (MetricVerdict.PASS, MetricVerdict.REGRESSION, MetricVerdict.IMPROVEMENT,
                   MetricVerdict.EXPECTED)


class BisectCreate(BaseModel):
    """A bisection: a repository, a good and a bad commit, the config and scenario that fail."""

    model_config = ConfigDict(extra="forbid")

    repository: str | None = Field(None, max_length=500,
                                     description="git repository (path or URL), or pypi:sglang "
                                                 "for SGLang's releases")
    good: str | None = Field(None, max_length=200, description="a commit (or release) where the "
                                                               "config passes")
    bad: str | None = Field(None, max_length=200, description="a later one where it fails")
    matrix: str = Field("smoke", max_length=100, description="matrix name (EVALSVC_CONFIGS_DIR or "
                                                                 "evalsvc/configs)")
    config: str | None = Field(None, max_length=200, description="the failing config of the matrix")
    scenario: str | None = Field(None, max_length=40, description="the failing scenario")
    metric: str | None = Field(None, max_length=80,
                               description="kl_k3_mean or accept_length; none: any failure of "
                                           "the scenario")
    patches: list[str] = Field(default_factory=list, max_length=20)
    workload: dict[str, Any] | None = Field(None, description="overrides of the matrix workload")
    engine_env: str | None = Field(None, min_length=1, max_length=64,
                                   description="engine sglang: the SGLang environment of the "
                                               "steps, by name (GET /api/v1/engine-envs)")
    regression_id: int | None = Field(None, ge=1, le=2**31 - 1,
                                      description="bisect this regression: the fields above "
                                                  "default to its series and commits")


class BisectSpec(BaseModel):
    """A bisection as checked and stored with it (``Bisection.spec``): what each step evaluates,
    and the commits to search."""

    model_config = ConfigDict(extra="forbid")

    repository: str
    good: str
    bad: str
    matrix: str
    config: str
    scenario: str
    metric: str | None = None
    patches: list[str] = Field(default_factory=list)
    workload: dict[str, Any] | None = None
    engine_env: str | None = None
    regression_id: int | None = None
    candidates: list[str]


class Bisector:
    """Runs bisections in threads of their own, each step a job of the job service. ``poll``: how
    often (seconds) a step waiting for its job looks at the bisector's stop."""

    def __init__(self, store: Store, jobs: JobService, poll: float = 1.0) -> None:
        self.store, self.jobs, self.poll = store, jobs, poll
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- submission ------------------------------------------------------------------------
    def submit(self, body: BisectCreate, start: bool = True, trusted: bool = False,
               actor: Actor | None = None) -> str:
        """Validate and store a bisection, and start it. ``trusted``: from the operator (the CLI),
        whose repositories need not be on the allowed list. ``actor``: the person starting it (an
        audit event, stored with the bisection)."""
        spec = self.normalize(body, trusted=trusted)
        bisect_id = mint_id("bisect")
        with self.store.session() as s:
            s.add(Bisection(id=bisect_id, repository=spec.repository, good=spec.good,
                            bad=spec.bad, matrix=spec.matrix, config=spec.config,
                            scenario=spec.scenario, metric=spec.metric, spec=spec.model_dump(),
                            status="queued", candidates=spec.candidates, steps=[],
                            regression_id=body.regression_id))
            if actor is not None:
                audit.record(s, actor, "bisect", "bisection", bisect_id, details={
                    "regression_id": body.regression_id, "good": spec.good, "bad": spec.bad,
                    "config": spec.config, "scenario": spec.scenario,
                    "candidates": len(spec.candidates)})
        log.info("bisection %s queued: %d candidates between %s and %s", bisect_id,
                 len(spec.candidates), spec.good[:10], spec.bad[:10])
        if start:
            self.start(bisect_id)
        return bisect_id

    def normalize(self, body: BisectCreate, trusted: bool = False) -> BisectSpec:
        """Fill in from the regression, check everything, list the candidates; JobError if not."""
        fields = body.model_dump()
        # a stored regression's repository is one the service evaluated already: the operator's
        trusted = trusted or (body.regression_id is not None and body.repository is None)
        if body.regression_id is not None:
            fields = {**self._from_regression(body.regression_id),
                      **{k: v for k, v in fields.items() if v is not None and k != "patches"},
                      "patches": body.patches or self._from_regression(body.regression_id)
                      ["patches"]}
        for key in ("repository", "good", "bad", "config", "scenario"):
            if not fields.get(key):
                raise JobError(f"{key}: required (or give a regression_id)")
        if fields["scenario"] not in (*SCENARIOS, POOLED):
            raise JobError(f"scenario: unknown {fields['scenario']!r} (known: "
                           f"{', '.join((*SCENARIOS, POOLED))})")
        if fields["scenario"] == POOLED and fields["metric"] is None:
            raise JobError(f"metric: required with scenario {POOLED!r} (its verdicts are per metric)")
        if fields["metric"] is not None and fields["metric"] not in METRICS:
            raise JobError(f"metric: unknown {fields['metric']!r} (known: {', '.join(METRICS)})")
        try:
            matrix = load_matrix(fields["matrix"])
        except MatrixError as exc:
            raise JobError(f"matrix: {exc}") from None
        try:
            [cfg] = plan_runs(matrix, EngineSpec(kind=matrix.engine), configs=[fields["config"]])
        except UnknownConfigs:
            raise JobError(f"config: {fields['config']!r} not in matrix {matrix.name}") from None
        if fields["scenario"] not in (*cfg.scenarios, POOLED):
            raise JobError(f"scenario: config {cfg.name} does not run {fields['scenario']!r} "
                           f"(it runs {', '.join(cfg.scenarios)})")
        repo = fields["repository"]
        # the steps' job body, checked first (allowed sources before anything is cloned)
        stored = self.jobs.normalize(_step_body(
            fields["matrix"], fields["config"], fields["patches"], fields.get("workload"),
            _source(repo, fields["bad"]), fields.get("engine_env")), trusted=trusted)
        fields["engine_env"] = stored.get("engine_env")  # the steps run where the first did
        if repo == RELEASES:
            return BisectSpec.model_validate({**fields, "candidates": _releases_between(
                fields["good"], fields["bad"])})
        try:
            mirror = git_mirror(repo, self.jobs.settings.resolved_builds_dir())
            good = _resolve(mirror, fields["good"], "good")
            bad = _resolve(mirror, fields["bad"], "bad")
        except BuildError as exc:
            raise JobError(f"repository: {exc}") from None
        if git(["merge-base", "--is-ancestor", good, bad], mirror, check=False).returncode != 0:
            raise JobError(f"good: {good[:12]} is not an ancestor of bad {bad[:12]}")
        candidates = git(["rev-list", "--first-parent", "--reverse", f"{good}..{bad}"],
                         mirror).stdout.split()
        if not candidates:
            raise JobError("bad: the same commit as good")
        return BisectSpec.model_validate({**fields, "good": good, "bad": bad,
                                          "candidates": candidates})

    def _from_regression(self, regression_id: int) -> dict[str, Any]:
        with self.store.session() as s:
            reg = s.get(Regression, regression_id)
            if reg is None:
                raise JobError(f"regression_id: no regression {regression_id}")
            bad_commit = reg.first_run.build.commit
            good_run = reg.last_good_run
            spec = job_spec(reg.first_run.job)
            good_commit = good_run.build.commit if good_run is not None else None
            releases = (bad_commit.repository == SGLANG_REPOSITORY and not bad_commit.sha
                        and bad_commit.version and good_commit is not None
                        and not good_commit.sha and good_commit.version)
            if not releases and (not bad_commit.sha or good_commit is None
                                 or not good_commit.sha):
                raise JobError(f"regression_id: regression {regression_id} has no good and bad "
                               "git commits (or SGLang releases) to bisect between")
            return {"repository": RELEASES if releases else bad_commit.repository,
                    "good": good_commit.version if releases else good_commit.sha,
                    "bad": bad_commit.version if releases else bad_commit.sha,
                    "matrix": reg.matrix, "config": reg.config,
                    "scenario": reg.scenario, "metric": reg.metric,
                    "patches": [p for p in reg.patch_set.split(",") if p],
                    "workload": _workload_overrides(spec),
                    "engine_env": spec.engine_env if spec is not None else None}

    # ---- running ---------------------------------------------------------------------------
    def start(self, bisect_id: str) -> None:
        t = threading.Thread(target=self.run, args=(bisect_id,), name=f"bisect-{bisect_id[-8:]}",
                             daemon=True)
        self._threads.append(t)
        t.start()

    def resume(self) -> None:
        """After a restart: continue the bisections that had not finished."""
        with self.store.session() as s:
            ids = list(s.scalars(select(Bisection.id).where(Bisection.status.in_(("queued",
                                                                                   "running")))))
        for bisect_id in ids:
            self.start(bisect_id)

    def stop(self) -> None:
        self._stop.set()

    def run(self, bisect_id: str, on_step=None) -> str | None:
        """Run a bisection to its end; returns the first bad commit (None if it failed)."""
        with log_context(job=bisect_id):
            with self.store.session() as s:
                b = s.get(Bisection, bisect_id)
                b.status = "running"
                spec, candidates = BisectSpec.model_validate(b.spec), list(b.candidates)
            try:
                first_bad = self._search(bisect_id, spec, candidates, on_step)
            except BisectError as exc:
                self._finish(bisect_id, "failed", error=str(exc))
                log.warning("bisection %s failed: %s", bisect_id, exc)
                return None
            except _Stopped:
                return None
            except Exception as exc:
                self._finish(bisect_id, "failed", error=f"{type(exc).__name__}: {exc}")
                log.exception("bisection %s failed", bisect_id)
                return None
            self._finish(bisect_id, "done", first_bad=first_bad)
            log.info("bisection %s: first bad commit %s", bisect_id, first_bad)
            return first_bad

    def _search(self, bisect_id: str, spec: BisectSpec, candidates: list[str],
                on_step) -> str:
        found = first_bad(candidates, lambda sha: self._step(bisect_id, spec, sha, on_step))
        if found is None:
            raise BisectError(f"the bad commit {candidates[-1][:12]} passes {spec.config} / "
                              f"{spec.scenario}: nothing to bisect")
        return found

    def _step(self, bisect_id: str, spec: BisectSpec, sha: str, on_step) -> bool:
        """Evaluate one commit (or reuse its stored run): True when it is bad."""
        # a step submitted before a restart and still queued or running is waited for; asked
        # before the stored runs, so one that ends between the two questions is found stored
        job_id = self._unfinished_step(bisect_id, sha)
        run_id = None if job_id else self._stored_run(spec, sha)
        reused = run_id is not None
        if run_id is None:
            job_id = job_id or self._submit_step(bisect_id, spec, sha)
            run_id = self._wait(job_id, sha)
        bad, verdict, reason = self._judge(spec, run_id, sha)
        step = {"sha": sha, "run_id": run_id, "job_id": job_id, "reused": reused,
                "bad": bad, "verdict": verdict, "reason": reason}
        with self.store.session() as s:
            b = s.get(Bisection, bisect_id)
            b.steps = [*b.steps, step]
        log.info("bisection %s: %s is %s%s", bisect_id, sha[:10], "bad" if bad else "good",
                 " (stored run)" if reused else "")
        if on_step is not None:
            on_step(step)
        return bad

    def _submit_step(self, bisect_id: str, spec: BisectSpec | dict[str, Any], sha: str) -> str:
        spec = BisectSpec.model_validate(spec) if isinstance(spec, dict) else spec  # as stored
        body = _step_body(spec.matrix, spec.config, spec.patches, spec.workload,
                          _source(spec.repository, sha), spec.engine_env)
        job_id = self.jobs.submit(body, trigger="bisect", trusted=True,
                                  extra={"bisection": bisect_id, "bisection_sha": sha})
        with self.store.session() as s:  # counted when it starts, whatever its outcome
            s.get(Bisection, bisect_id).runs_used += 1
        return job_id

    def _unfinished_step(self, bisect_id: str, sha: str) -> str | None:
        with self.store.session() as s:
            jobs = s.scalars(select(Job).where(Job.trigger == "bisect",
                                               Job.status.not_in(FINISHED_JOB_STATUSES)).order_by(Job.created_at))
            return next((j.id for j in jobs if (spec := job_spec(j)) is not None
                         and spec.bisection == bisect_id and spec.bisection_sha == sha), None)

    def _stored_run(self, spec: BisectSpec, sha: str) -> int | None:
        patch_set = ",".join(sorted(set(spec.patches)))
        commit = ((Commit.version == sha) & Commit.sha.is_(None)
                  & (Commit.repository == SGLANG_REPOSITORY) if spec.repository == RELEASES
                  else (Commit.sha == sha) & (Commit.repository == spec.repository))
        with self.store.session() as s:
            return s.scalars(
                select(Run.id).join(Build, Run.build_id == Build.id)
                .join(Commit, Build.commit_id == Commit.id)
                .where(commit, Build.patch_set == patch_set, Run.matrix == spec.matrix,
                       Run.config == spec.config, Run.status == RunStatus.DONE,
                       Run.verdict.in_(DECIDING))
                .order_by(Run.finished_at.desc()).limit(1)).first()

    def _wait(self, job_id: str, sha: str) -> int:
        """The run of a step's job, once the job finished. The store is read when the job service
        ended a job (``JobService.wait_end``), and every SETTLE seconds besides (an end written
        elsewhere); the bisector's stop is looked at every ``poll`` seconds."""
        looked_at, looked = None, -math.inf
        while True:
            if self._stop.is_set():
                raise _Stopped
            ends = self.jobs.ends()  # before the read: an end after it wakes the wait below
            if ends != looked_at or time.monotonic() - looked >= SETTLE:
                looked_at, looked = ends, time.monotonic()
                with self.store.session() as s:
                    job = s.get(Job, job_id)
                    if job.status in FINISHED_JOB_STATUSES:
                        run = s.scalars(select(Run).where(Run.job_id == job_id)).first()
                        if (job.status != JobStatus.DONE or run is None
                                or run.status != RunStatus.DONE):
                            raise BisectError(f"commit {sha[:12]}: job {job_id} {job.status}"
                                              + (f": {job.error}" if job.error else ""))
                        return run.id
            self.jobs.wait_end(ends, timeout=self.poll)

    def _judge(self, spec: BisectSpec, run_id: int, sha: str) -> tuple[bool, str, str]:
        with self.store.session() as s:
            searched = s.get(Regression, spec.regression_id) if spec.regression_id else None
            known = searched is None or searched.triage == "expected"
            bad = ("fail", "regression", "expected") if known else ("fail", "regression")
            run = s.get(Run, run_id)
            scen = next((x for x in run.scenarios if x.scenario == spec.scenario), None)
            if spec.scenario == POOLED:  # no scenario row: the pooled verdict decides
                v = s.scalars(select(VerdictRow).where(VerdictRow.run_id == run_id,
                                                    VerdictRow.scenario == POOLED,
                                                    VerdictRow.metric == spec.metric)).first()
                if v is None or v.verdict not in POOLED_DECIDING:
                    raise BisectError(f"commit {sha[:12]}: run {run_id} cannot decide (no pooled "
                                      f"{spec.metric} verdict: {run.verdict}: {run.reason})")
                return v.verdict in bad, v.verdict, v.reason or ""
            if scen is None or scen.verdict not in DECIDING:
                why = (f"{scen.verdict}: {scen.reason}" if scen is not None
                       else f"{run.verdict}: {run.reason}")
                raise BisectError(f"commit {sha[:12]}: run {run_id} cannot decide ({why})")
            if spec.metric:
                v = s.scalars(select(VerdictRow).where(VerdictRow.run_id == run_id,
                                                    VerdictRow.scenario == spec.scenario,
                                                    VerdictRow.metric == spec.metric)).first()
                if v is None:
                    raise BisectError(f"commit {sha[:12]}: run {run_id} has no "
                                      f"{spec.metric} verdict for {spec.scenario}")
                return v.verdict in bad, v.verdict, v.reason or ""
            return scen.verdict in bad, scen.verdict, scen.reason or ""

    def _finish(self, bisect_id: str, status: str, first_bad: str | None = None,
                error: str | None = None) -> None:
        with self.store.session() as s:
            b = s.get(Bisection, bisect_id)
            b.status, b.first_bad, b.error, b.finished_at = status, first_bad, error, utcnow()


class BisectError(RuntimeError):
    """A bisection that cannot go on; the message names the commit and why."""


class _Stopped(Exception):
    pass


def first_bad(candidates: Sequence[T], is_bad: Callable[[T], bool]) -> T | None:
    """The first bad candidate, by binary search (as asv's ``find`` bisects): ``candidates`` in
    order, the one before the first known good, and every one after a bad one bad too. The last
    is asked first: None when it is good (nothing to bisect). Asks at most ceil(log2(n)) + 1
    times for n candidates, never about one twice."""
    if not candidates:
        return None
    lo, hi = -1, len(candidates) - 1  # candidates[lo] good (-1: the one before), [hi] bad
    if not is_bad(candidates[hi]):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if is_bad(candidates[mid]):
            hi = mid
        else:
            lo = mid
    return candidates[hi]


def _step_body(matrix: str, config: str, patches: list[str], workload: dict[str, Any] | None,
               source: str, engine_env: str | None = None) -> JobCreate:
    """A step's job: the one config on the one commit, ahead of other jobs."""
    return JobCreate(matrix=matrix, configs=[config],
                     builds=[BuildSpec(source=source, patches=patches)], workload=workload,
                     engine_env=engine_env, priority=100)


def _source(repository: str, ref: str) -> str:
    """The build source of one candidate: a release of SGLang, or a commit of a repository."""
    return f"sglang=={ref}" if repository == RELEASES else f"git:{repository}@{ref}"


def _releases_between(good: str, bad: str) -> list[str]:
    """SGLang's releases after ``good`` up to ``bad``, oldest first."""
    try:
        listed = list(reversed(releases("sglang")))
    except NightlyError as exc:
        raise JobError(f"repository: {exc}") from None
    for what, version in (("good", good), ("bad", bad)):
        if version not in listed:
            raise JobError(f"{what}: no release {version!r} of sglang on the index")
    if listed.index(good) >= listed.index(bad):
        raise JobError(f"good: release {good} is not older than bad {bad}")
    return listed[listed.index(good) + 1:listed.index(bad) + 1]


def _resolve(mirror, ref: str, what: str) -> str:
    proc = git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], mirror, check=False)
    if proc.returncode != 0:
        raise BuildError(f"{what}: no commit {ref!r}")
    return proc.stdout.strip()


def _workload_overrides(spec: JobSpec | None) -> dict[str, Any] | None:
    """The workload a job ran, as overrides of its matrix's, so that the steps measure the same."""
    return spec.matrix.workload.model_dump(mode="json") if spec is not None else None
