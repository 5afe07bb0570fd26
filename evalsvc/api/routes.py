"""REST routes under /api/v1: jobs, commits and results, history, comparisons, matrices, golden runs,
regressions and their triage, alerts, bisections."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from pydantic import BaseModel, Field

from evalsvc import model_catalog, verdicts
from evalsvc.bisect import BisectCreate
from evalsvc.builds import engine_envs
from evalsvc.jobs import JobCreate, JobError
from evalsvc.jobs.spec import job_spec, stored_spec
from evalsvc.matrix import MatrixError, expand, load_matrix, matrix_files, resolve_matrix_path
from evalsvc.store import audit, queries
from evalsvc.store.models import Bisection, Job, Regression
from evalsvc.store.reads import (
    AlertRead,
    BisectionRead,
    CommitSummary,
    GoldenRunRead,
    JudgedComparison,
    MetricPoint,
    RegressionRead,
    RunDetail,
)
from evalsvc.types import JobStatus
from evalsvc.verdicts import compare_builds
from evalsvc.web.deps import (
    ServicesDep,
    SessionDep,
    ShownDep,
    WriteUserDep,
    actor,
    require_read,
    require_write,
)
from evalsvc.web.params import JobId, RegressionId, RunId, StorableText, TriageUpdate
from evalsvc.web.redact import Shown, deep_shown, job_as_seen, run_as_seen

router = APIRouter(dependencies=[Depends(require_read)])


class JobPublic(BaseModel):
    id: str
    trigger: str
    status: str
    priority: int
    matrix: str
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    runs_errored: int = Field(0, description="its runs that ended with verdict error (no verdict "
                                             "reached); a job whose every run errored is failed")


class RunProgress(BaseModel):
    id: int
    config: str
    fingerprint: str
    build: str
    status: str
    verdict: str | None = None
    reason: str | None = None
    scenarios: dict[str, str] = Field(default_factory=dict)


class JobDetail(JobPublic):
    spec: dict[str, Any]
    runs: list[RunProgress]
    progress: dict[str, int]
    comparison: list[dict[str, Any]] | None = None


class BuildResults(BaseModel):
    """A build's runs (the commit's ref and the build's patch set)."""

    commit: str
    patch_set: str
    runs: list[RunDetail]


class Comparison(BaseModel):
    """Two builds compared per config and scenario on a metric (``verdicts.compare_builds``)."""

    baseline: str
    contender: str
    metric: str
    rows: list[JudgedComparison]


class GoldenCreate(BaseModel):
    run_id: int = Field(..., ge=1, le=2**31 - 1)
    label: Annotated[str | None, StorableText] = Field(None, max_length=200)


def _public(job: Job, runs_errored: int = 0, shown: Shown = lambda text: text) -> JobPublic:
    return JobPublic(id=job.id, trigger=job.trigger, status=job.status, priority=job.priority,
                     matrix=spec.matrix_name if (spec := job_spec(job)) else "",
                     created_at=job.created_at,
                     started_at=job.started_at, finished_at=job.finished_at,
                     error=shown(job.error), runs_errored=runs_errored)


@router.post("/jobs", status_code=201, response_model=JobPublic, tags=["jobs"])
def create_job(body: JobCreate, services: ServicesDep, user: WriteUserDep) -> JobPublic:
    """Submit a job (a matrix on one or two builds); refused with 422 naming the problem."""
    try:
        job_id = services.jobs.submit(body, trigger="api", actor=actor(user, "api"))
    except JobError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from None
    with services.store.session() as s:
        return _public(s.get(Job, job_id))


@router.get("/jobs", response_model=list[JobPublic], tags=["jobs"])
def read_jobs(session: SessionDep, shown: ShownDep,
              status: Annotated[str | None, Query(max_length=20)] = None,
              trigger: Annotated[str | None, Query(max_length=20)] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[JobPublic]:
    """Jobs, newest first, filtered by status and trigger."""
    jobs = queries.find_jobs(session, status=status, trigger=trigger, limit=limit)
    errored = queries.errored_runs(session, [j.id for j in jobs])
    return [_public(j, errored.get(j.id, 0), shown) for j in jobs]


@router.get("/jobs/{job_id}", response_model=JobDetail, tags=["jobs"])
def read_job(job_id: JobId, session: SessionDep, shown: ShownDep) -> JobDetail:
    """A job with the progress of each of its runs (and the comparison of its two builds). Server
    paths in its errors are redacted for readers without the write role."""
    job = queries.job_detail(session, job_id)
    if job is None:
        raise HTTPException(status_code=404, detail=f"no job {job_id}")
    job = job_as_seen(job, shown)
    runs = [run_as_seen(r, shown) for r in job.runs]
    builds = list(dict.fromkeys(r.build_id for r in runs))
    comparison = None
    if len(builds) == 2 and job.status == JobStatus.DONE:  # judged when it ended (jobs.comparison)
        comparison = session.get(Job, job_id).comparison
        if comparison is None:  # a job that ended before migration 0009: judged as it is read
            comparison = [r.model_dump() for r in compare_builds(session, builds[0], builds[1])]
    spec = stored_spec(job.spec)
    return JobDetail(**job.model_dump(exclude={"runs"}),
                     matrix=spec.matrix_name if spec is not None else "",
                     runs=[RunProgress.model_validate(r, from_attributes=True) for r in runs],
                     progress=dict(Counter(r.status for r in runs)), comparison=comparison)


@router.post("/jobs/{job_id}/cancel", tags=["jobs"])
def cancel_job(job_id: JobId, services: ServicesDep, user: WriteUserDep) -> dict[str, str]:
    """Cancel a job: queued ones never start, running ones stop their engines."""
    status = services.jobs.cancel(job_id, actor=actor(user, "api"))
    if status is None:
        raise HTTPException(status_code=404, detail=f"no job {job_id}")
    return {"id": job_id, "status": status}


@router.get("/commits", tags=["results"])
def read_commits(session: SessionDep, branch: Annotated[str | None, Query(max_length=255)] = None,
                 limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                 offset: Annotated[int, Query(ge=0, le=10**9)] = 0) -> list[CommitSummary]:
    """Commits, newest first, with the verdict counts of their configs' latest runs, per build
    (patch set) and in all."""
    return queries.commit_summaries(session, branch=branch, limit=limit, offset=offset)


@router.get("/commits/{ref:path}/results", tags=["results"])
def read_commit_results(ref: Annotated[str, Path(max_length=300)], session: SessionDep,
                        shown: ShownDep,
                        patch_set: Annotated[str, Query(max_length=500)] = "") -> BuildResults:
    """A commit's (build's) runs with their verdicts and scenario metrics."""
    build = queries.find_build(session, ref, patch_set)
    if build is None:
        raise HTTPException(status_code=404, detail=f"no build of {ref!r} with patch set "
                                                    f"{patch_set!r}")
    runs = queries.build_run_ids(session, build.id)
    return BuildResults(commit=ref, patch_set=patch_set,
                        runs=[run_as_seen(queries.run_detail(session, rid), shown)
                              for rid in runs])


@router.get("/runs/{run_id}", tags=["results"])
def read_run(run_id: RunId, session: SessionDep, shown: ShownDep) -> RunDetail:
    """One run: arguments asked for and resolved, reference, command, scenarios and metrics."""
    detail = queries.run_detail(session, run_id)
    if detail is None:
        raise HTTPException(status_code=404, detail=f"no run {run_id}")
    return run_as_seen(detail, shown)


@router.get("/history", tags=["results"])
def read_history(session: SessionDep,
                 fingerprint: Annotated[str | None, Query(max_length=64)] = None,
                 config: Annotated[str | None, Query(max_length=200)] = None,
                 metric: Annotated[str, Query(max_length=80)] = "kl_k3_mean",
                 scenario: Annotated[str | None, Query(max_length=40)] = None,
                 patch_set: Annotated[str | None, Query(max_length=500)] = "",
                 limit: Annotated[int, Query(ge=1, le=100000)] = 5000) -> list[MetricPoint]:
    """A metric's history for a fingerprint or a config name, oldest commit first."""
    if fingerprint is None and config is None:
        raise HTTPException(status_code=422, detail="give a fingerprint or a config")
    return queries.metric_history(session, metric, fingerprint=fingerprint, config=config,
                                  scenario=scenario, patch_set=patch_set, limit=limit)


@router.get("/compare", tags=["results"])
def read_compare(session: SessionDep,
                 baseline: Annotated[str, Query(max_length=300, description="commit ref")],
                 contender: Annotated[str, Query(max_length=300, description="commit ref")],
                 baseline_patches: Annotated[str, Query(max_length=500)] = "",
                 contender_patches: Annotated[str, Query(max_length=500)] = "",
                 metric: Annotated[str, Query(max_length=80)] = "kl_k3_mean") -> Comparison:
    """Baseline vs contender per config and scenario: values, delta, interval of the delta."""
    sides = {}
    for name, ref, patches in (("baseline", baseline, baseline_patches),
                               ("contender", contender, contender_patches)):
        build = queries.find_build(session, ref, patches)
        if build is None:
            raise HTTPException(status_code=404, detail=f"{name}: no build of {ref!r} with "
                                                        f"patch set {patches!r}")
        sides[name] = build.id
    rows = compare_builds(session, sides["baseline"], sides["contender"], metric=metric)
    return Comparison(baseline=baseline, contender=contender, metric=metric, rows=rows)


@router.get("/matrices", tags=["matrices"])
def read_matrices() -> list[dict[str, Any]]:
    """The matrices: EVALSVC_CONFIGS_DIR's and the shipped ones (the operator's first)."""
    out = []
    for path in matrix_files().values():
        try:
            m = load_matrix(path)
        except MatrixError:
            continue
        out.append({"name": m.name, "description": m.description, "engine": m.engine,
                    "models": list(m.models), "configs": len(expand(m))})
    return out


@router.get("/matrices/{name}", tags=["matrices"])
def read_matrix(name: Annotated[str, Path(max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")]
                ) -> dict[str, Any]:
    """A matrix and its configs (names, settings, server arguments, fingerprints)."""
    try:  # EVALSVC_CONFIGS_DIR's file, else the shipped one; never outside those directories
        path = resolve_matrix_path(name, allow_path=False)
    except MatrixError:
        raise HTTPException(status_code=404, detail=f"no matrix {name}") from None
    try:
        m = load_matrix(path)
    except MatrixError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from None
    return {"name": m.name, "description": m.description, "engine": m.engine,
            "scenarios": m.scenarios,
            "configs": [{"name": c.name, "model": c.model, "fingerprint": c.fingerprint,
                         "settings": c.settings, "args": c.args, "scenarios": list(c.scenarios)}
                        for c in expand(m)]}


@router.get("/engine-envs", tags=["matrices"])
def read_engine_envs(services: ServicesDep, shown: ShownDep) -> list[dict[str, Any]]:
    """The SGLang environments jobs may name (``engine_env``): each with its SGLang and torch
    releases, its kernel package, the CPU ops it serves with, and CPU or GPU; ``default`` marks
    the one of jobs that name none. Its interpreter's path is redacted for readers without the
    write role."""
    return deep_shown(engine_envs.listed(services.settings), shown)


@router.get("/models", tags=["matrices"])
def read_models(services: ServicesDep, shown: ShownDep) -> list[dict[str, Any]]:
    """The models jobs may name (``model``): the shipped ones and those of EVALSVC_MODELS_DIR,
    each with the engine that serves it and its architecture. Its directory is redacted for
    readers without the write role."""
    return deep_shown(model_catalog.listed(services.settings), shown)


@router.get("/golden", tags=["results"])
def read_golden(session: SessionDep) -> list[GoldenRunRead]:
    """The golden run of each fingerprint that has one."""
    return queries.golden_runs(session)


@router.post("/golden", status_code=201, tags=["results"], dependencies=[Depends(require_write)])
def create_golden(body: GoldenCreate, session: SessionDep) -> dict[str, Any]:
    """Make a run the golden run of its fingerprint."""
    try:
        g = queries.set_golden(session, body.run_id, body.label)
    except KeyError:
        raise HTTPException(status_code=404, detail=f"no run {body.run_id}") from None
    return {"fingerprint": g.fingerprint, "run_id": g.run_id, "label": g.label}


@router.get("/regressions", tags=["verdicts"])
def read_regressions(session: SessionDep,
                     state: Annotated[Literal["open", "resolved"] | None, Query()] = None
                     ) -> list[RegressionRead]:
    """Regressions (open first), each with the verdict and evidence of the run that opened it."""
    return queries.regressions(session, state)


@router.get("/regressions/{regression_id}", tags=["verdicts"])
def read_regression(regression_id: RegressionId, session: SessionDep) -> RegressionRead:
    r = session.get(Regression, regression_id)
    if r is None:
        raise HTTPException(status_code=404, detail=f"no regression {regression_id}")
    return queries.regression_read(session, r)


@router.patch("/regressions/{regression_id}", tags=["verdicts"])
def triage_regression(regression_id: RegressionId, body: TriageUpdate, session: SessionDep,
                      user: WriteUserDep) -> RegressionRead:
    """Triage a regression: acknowledged, expected (a known failure) or fixed, with a comment and
    a link (an http(s) URL)."""
    try:
        r = verdicts.triage_regression(session, regression_id, body.triage, body.comment,
                                      actor=actor(user, "api"), link=body.link)
    except KeyError:
        raise HTTPException(status_code=404, detail=f"no regression {regression_id}") from None
    return queries.regression_read(session, r)


@router.get("/alerts", tags=["verdicts"])
def read_alerts(session: SessionDep) -> list[AlertRead]:
    """The alerts made (newest first), delivered or not."""
    return queries.alerts(session)


@router.post("/bisections", status_code=201, tags=["bisections"])
def create_bisection(body: BisectCreate, services: ServicesDep, user: WriteUserDep
                     ) -> BisectionRead:
    """Find the first bad commit between a good and a bad one of a git source, running only the
    failing config on midpoints (give the fields, or a regression_id to take them from)."""
    try:
        bisect_id = services.bisector.submit(body, actor=actor(user, "api"))
    except JobError as exc:
        raise HTTPException(status_code=422, detail=str(exc)) from None
    with services.store.session() as s:
        return queries.bisection_read(s.get(Bisection, bisect_id))


@router.get("/bisections", tags=["bisections"])
def read_bisections(session: SessionDep) -> list[BisectionRead]:
    return queries.bisections(session)


@router.get("/bisections/{bisect_id}", tags=["bisections"])
def read_bisection(bisect_id: JobId, session: SessionDep) -> BisectionRead:
    b = session.get(Bisection, bisect_id)
    if b is None:
        raise HTTPException(status_code=404, detail=f"no bisection {bisect_id}")
    return queries.bisection_read(b)


@router.get("/audit", tags=["audit"])
def read_audit(session: SessionDep,
               target_type: Annotated[Literal["regression", "job", "bisection"] | None,
                                      Query()] = None,
               target_id: Annotated[str | None, Query(max_length=64)] = None,
               user: Annotated[str | None, Query(max_length=200)] = None,
               limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> list[dict[str, Any]]:
    """Who did what and when (triage, jobs submitted and cancelled, bisections), newest first."""
    return audit.events(session, target_type=target_type, target_id=target_id, user=user,
                        limit=limit)
