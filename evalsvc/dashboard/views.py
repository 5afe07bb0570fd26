"""The dashboard's HTML pages: overview, commits, jobs, a job, compare, regressions (and one
regression), bisections, and a sample's tokens.

Pages render server-side from the store's queries; chart data goes into the page as JSON, drawn by
Plotly (served from the installed ``plotly`` package, nothing from the internet). Every page knows
who is reading it (``user``) and carries the session's CSRF token for its forms; the forms' routes
are in ``actions``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from datetime import datetime
from itertools import pairwise, zip_longest
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy.orm import Session

from evalsvc import model_catalog
from evalsvc.builds import engine_envs
from evalsvc.builds.embedded import EMBEDDED_REPOSITORY
from evalsvc.dashboard.samples import extend_tokens, read_sample, sample_tokens, top_candidates
from evalsvc.jobs.spec import stored_spec
from evalsvc.judging import LABELS, METRICS
from evalsvc.matrix import SCENARIOS, MatrixError, expand, load_matrix, matrix_names
from evalsvc.paths import package_dir
from evalsvc.settings import Settings
from evalsvc.store import audit, queries
from evalsvc.store.models import Bisection, Regression, Run
from evalsvc.store.reads import (
    BisectionBrief,
    BisectionRead,
    JobBuild,
    KnownFailureRef,
    MetricValue,
    RegressionRead,
    RunDetail,
    SampleStats,
    TrendWindow,
    VerdictRead,
)
from evalsvc.thresholds import load_thresholds
from evalsvc.types import FINISHED_JOB_STATUSES, MetricVerdict, Verdict
from evalsvc.verdicts import compare_builds, stored_limits
from evalsvc.web.auth import csrf_token
from evalsvc.web.deps import SessionDep, ShownDep, current_user, require_read
from evalsvc.web.params import JobId, RegressionId, RunId
from evalsvc.web.redact import build_as_seen, job_as_seen, run_as_seen

# the dashboard's templates and static files: package data of evalsvc.dashboard
DASHBOARDS_DIR = package_dir("dashboard")
templates = Jinja2Templates(directory=DASHBOARDS_DIR / "templates")
router = APIRouter(dependencies=[Depends(require_read)], include_in_schema=False,
                   default_response_class=HTMLResponse)

TREND_METRICS = ("kl_k3_mean", "extend_kl_k3_mean", "kl_k1_mean", "kl_k2_mean", "kl_k3_p99",
                 "kl_k3_max", "topk_kl_mean", "same_top_rate", "hit_coverage", "accept_length")
LOG_METRICS = {"kl_k3_mean", "extend_kl_k3_mean", "kl_k1_mean", "kl_k2_mean", "kl_k3_p99",
               "kl_k3_max", "topk_kl_mean"}
FINISHED = FINISHED_JOB_STATUSES
LOG_TAIL_BYTES = 8_000
PAGE_SIZE = 100
# compare verdicts, worst first: the order of the compare page
COMPARE_ORDER = ("regression", "fail", "inconclusive", "expected", "improvement", "pass")
REGRESSIONS_SHOWN = 200  # regression_read reads each one's opening verdict: one query each
TRIAGE = ("acknowledged", "expected", "fixed")

Text = Annotated[str | None, Query(max_length=300)]


def number(value: float | None, digits: int = 3) -> str:
    """A metric for reading: 3 significant digits, '-' for none."""
    if value is None:
        return "-"
    return f"{value:.{digits}g}"


def when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M UTC") if value else "-"


def short_ref(ref: str) -> str:
    """A commit's label: its sha's first 10 characters, or its version."""
    if "@" in ref:
        return ref.rsplit("@", 1)[1][:10]
    return ref.rsplit("==", 1)[-1]


def as_json(value: Any, indent: int | None = None) -> str:
    """JSON for reading (the templates escape it as text)."""
    return json.dumps(value, indent=indent, sort_keys=indent is not None, default=str)


def link_label(url: str) -> str:
    """A link for reading: a GitHub pull request or issue as "PR #N" or "issue #N", anything
    else as its host."""
    parts = urlsplit(url)
    path = parts.path.strip("/").split("/")
    if parts.hostname == "github.com" and len(path) >= 4 and path[2] in ("pull", "issues"):
        return f"{'PR' if path[2] == 'pull' else 'issue'} #{path[3]}"
    return parts.hostname or url


templates.env.filters.update(number=number, when=when, short_ref=short_ref, as_json=as_json,
                             exp=math.exp, zip_longest=zip_longest, link_label=link_label)


def runs_url(request: Request) -> str:
    """The run pages' URL without the id: many run and sample links without a url_for each
    (a url_for walks the routes)."""
    return request.url_for("read_run_page", run_id=1).path.removesuffix("1")


ERROR_TITLES = {401: "Sign-in needed", 403: "Not allowed", 404: "Not found"}


def page(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """A template rendered for this request: with who reads it (``user``, None: nobody signed in;
    ``can_write``), whether a sign-in is possible (``sign_in``) and the session's CSRF token
    (``csrf``) for its forms."""
    user = current_user(request)
    return templates.TemplateResponse(
        request, name, {"runs_url": runs_url(request), "user": user,
                        "can_write": user is not None and user.can_write,
                        "sign_in": request.app.state.accounts.guarded,
                        "csrf": csrf_token(request.session), **context},
        status_code=status_code)


def problem(request: Request, status_code: int, message: str) -> HTMLResponse:
    return page(request, "error.html", status_code,
                title=ERROR_TITLES.get(status_code, "Bad request"), message=message)


def _blank(value: str | None) -> str | None:
    """An empty form field means no filter."""
    return value or None


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def kl_threshold(session: Session, run_id: int) -> float | None:
    """The fixed KL limit (kl_k3_mean, nats) a run's cold scenario is judged against (the limits
    stored on it when it was planned, ``verdicts.stored_limits``: its config on its job's engine
    and matrix); None when none."""
    return stored_limits(session.get(Run, run_id), ["cold"], load_thresholds())["cold"].kl_k3_mean.max


# ---- overview ------------------------------------------------------------------------------

def trend_charts(window: TrendWindow, values: Iterable[tuple],
                 failures: dict[tuple[int, str], Verdict], metric: str,
                 threshold: Callable[[int], float | None]) -> dict[str, Any]:
    """Chart data: the window's commits (time, label) once, and per fingerprint its series per
    metric, scenario and patch set as commit indices, values and run ids, with the points whose
    scenario verdict is fail (the regression markers) and those whose verdict is expected (a
    known failure, marked apart), and for KL the fixed limit of the fingerprint
    (``threshold(run_id)`` of its first run). ``values``: (run_id, scenario, metric, value) rows
    of the window's runs; ``failures``: ``queries.commit_failures``."""
    index = {c.id: i for i, c in enumerate(window.commits)}
    runs = {r.id: r for r in window.runs}
    points: dict[tuple[str, str, str, str], list[tuple]] = {}
    for run_id, scenario, name, value in values:
        if value is None or not math.isfinite(value):
            continue
        run = runs[run_id]
        points.setdefault((run.fingerprint, name, scenario, run.patch_set), []).append(
            (index[run.commit_id], run_id, value, failures.get((run_id, scenario))))
    charts: dict[str, dict[str, Any]] = {}
    for (fingerprint, name, scenario, patch_set), series in sorted(points.items()):
        series.sort()
        if fingerprint not in charts:
            run = runs[series[0][1]]
            charts[fingerprint] = {
                "fingerprint": fingerprint, "config": run.config, "model": run.model,
                "threshold": threshold(run.id) if metric == "kl_k3_mean" else None,
                "series": []}
        chart = charts[fingerprint]
        chart["series"].append({
            "metric": name, "name": scenario + (f" [{patch_set}]" if patch_set else ""),
            "c": [p[0] for p in series], "run": [p[1] for p in series],
            "y": [float(f"{p[2]:.4g}") for p in series],
            "fail": [i for i, p in enumerate(series) if p[3] == Verdict.FAIL],
            "expected": [i for i, p in enumerate(series) if p[3] == Verdict.EXPECTED]})
    return {"commits": [[c.committed_at.isoformat(), short_ref(c.ref)] for c in window.commits],
            "charts": sorted(charts.values(), key=lambda c: (c["config"], c["fingerprint"])),
            "metric": metric, "log": metric in LOG_METRICS}


@router.get("/")
def read_overview_page(request: Request, session: SessionDep, matrix: Text = None,
                       model: Text = None, scenario: Text = None, branch: Text = None,
                       metric: Annotated[str, Query(max_length=80)] = "kl_k3_mean",
                       commits: Annotated[int, Query(ge=2, le=100)] = 100) -> HTMLResponse:
    """Latest verdict per config and build (patch set), and per-config trends over the newest
    commits."""
    matrix, model, scenario, branch = map(_blank, (matrix, model, scenario, branch))
    if metric not in TREND_METRICS:
        return problem(request, 422, f"metric {metric!r}: one of {', '.join(TREND_METRICS)}")
    if scenario is not None and scenario not in SCENARIOS:
        return problem(request, 422, f"scenario {scenario!r}: one of {', '.join(SCENARIOS)}")
    latest = queries.latest_per_config(session, matrix=matrix, branch=branch)
    if model is not None:
        models = queries.run_models(session, [r.run_id for r in latest])
        latest = [r for r in latest if models[r.run_id] == model]
    shown = [scenario] if scenario else [s for s in SCENARIOS
                                         if any(s in r.scenarios for r in latest)]
    window = queries.trend_window(session, branch=branch, commits=commits)
    commit_ids = [c.id for c in window.commits]
    values = queries.commit_metric_values(session, commit_ids,
                                          list(dict.fromkeys([metric, "accept_length"])),
                                          [scenario] if scenario else list(SCENARIOS),
                                          matrix=matrix, model=model)
    trends = {**trend_charts(window, values, queries.commit_failures(session, commit_ids), metric,
                             lambda run_id: kl_threshold(session, run_id)),
              "runs_url": runs_url(request)}
    filters = {"matrix": matrix, "model": model, "scenario": scenario, "branch": branch,
               "metric": metric, "commits": commits}
    choices = {"matrices": sorted({r.matrix for r in window.runs}),
               "models": sorted({r.model for r in window.runs}),
               "branches": queries.branches(session), "scenarios": SCENARIOS,
               "metrics": TREND_METRICS}
    known = queries.known_failures_of(session, [r.run_id for r in latest])
    return page(request, "overview.html", title="Overview", latest=latest, scenarios=shown,
                known=known, trends=trends, filters=filters, choices=choices,
                open_regressions=queries.open_regression_counts(session))


# ---- commits and jobs ----------------------------------------------------------------------

@router.get("/commits")
def read_commits_page(request: Request, session: SessionDep, branch: Text = None,
                      page_number: Annotated[int, Query(alias="page", ge=1, le=100_000)] = 1
                      ) -> HTMLResponse:
    """Commits, newest first, with the verdicts of each build."""
    branch = _blank(branch)
    commits = queries.commit_summaries(session, branch=branch, limit=PAGE_SIZE + 1,
                                       offset=(page_number - 1) * PAGE_SIZE)
    # each one's "compare with previous" (one past the page too)
    previous = {newer.ref: older.ref for newer, older in pairwise(commits)}
    more = len(commits) > PAGE_SIZE
    commits = commits[:PAGE_SIZE]
    return page(request, "commits.html", title="Commits", commits=commits, previous=previous,
                branch=branch, page_number=page_number, more=more,
                branches=queries.branches(session))


@router.get("/jobs")
def read_jobs_page(request: Request, session: SessionDep, shown: ShownDep,
                   status: Annotated[str | None, Query(max_length=20)] = None) -> HTMLResponse:
    """Jobs, newest first; running ones follow their progress live."""
    status = _blank(status)
    return page(request, "jobs.html", title="Jobs", status=status, finished=FINISHED,
                jobs=[job_as_seen(j, shown)
                      for j in queries.job_summaries(session, status=status, limit=PAGE_SIZE)])


# ---- posting a job (the form; it posts to actions.create_job_form) --------------------------

def manifest_source(manifest: dict[str, Any] | None) -> str | None:
    """The source a build's manifest says it was made from, as the API takes it: an SGLang
    build's (``builds.build``: ``path:DIR``, ``git:REPO@SHA`` at the commit its ref resolved to,
    ``sglang==VERSION``) or an embedded one's (``git:REPO@SHA``, ``path:DIR``); None when the
    manifest does not say (none, or an older one)."""
    m = manifest or {}
    kind, location = m.get("kind"), m.get("location")
    if kind == "path" and location:
        return f"path:{location}"
    if kind == "git" and location and m.get("commit"):
        return f"git:{location}@{m['commit']}"
    if kind == "pypi" and m.get("version"):
        return f"sglang=={m['version']}"
    source = m.get("source")
    if kind == "embedded" and isinstance(source, str):
        if source.startswith("git:") and m.get("commit"):
            return f"git:{source[4:].rpartition('@')[0]}@{m['commit']}"
        return source
    return None


def source_of(session: Session, ref: str | None, patch_set: str = "") -> str:
    """The build source that makes a stored build (a commit and patch set, or else any build of
    the commit) again, for the job form: the build's own source, as its manifest records it
    (``manifest_source``: a local tree's ``path:DIR``, never a version made up from the tree's
    hash); without one, written from the commit: ``git:REPO@SHA``, ``path:DIR`` for a tree,
    ``sglang==VERSION``; "" for the embedded engine as installed, or unknown."""
    commit = queries.find_commit(session, ref) if ref else None
    if commit is None or commit.repository == EMBEDDED_REPOSITORY:
        return ""
    build = queries.find_build(session, ref, patch_set)
    builds = [build] if build is not None else []
    builds += [b for b in commit.builds if b is not build]
    for b in builds:
        found = manifest_source(b.manifest)
        if found is not None:
            return found
    if commit.sha:
        return f"git:{commit.repository}@{commit.sha}"
    if commit.version and (commit.version.startswith("tree-") or "+tree-" in commit.version):
        return f"path:{commit.repository}"  # a tree's version is its code's hash
    return f"sglang=={commit.version}" if commit.version else ""


def job_form(matrix: str | None = None, configs: Iterable[str] = (),
             builds: list[tuple[str, str]] | None = None, settings: Settings | None = None,
             **values: Any) -> dict[str, Any]:
    """What the job form shows: the matrices under evalsvc/configs/, the chosen one's configs (those in
    ``configs`` ticked; none ticked: all), one or two builds as (source, patches), with
    ``settings`` the engine environments and models jobs may name (as the API lists them), and the
    other fields' values (``num_prompts``, ``track``, ``priority``, ``engine_env``, ``model``,
    ``error``)."""
    choices: dict[str, Any] = {"engine_envs": [], "models": []}
    if settings is not None:
        choices = {"engine_envs": engine_envs.listed(settings),
                   "models": model_catalog.listed(settings)}
    names = matrix_names()
    if matrix not in names:
        matrix = "smoke" if "smoke" in names else (names[0] if names else None)
    try:
        all_configs = [c.name for c in expand(load_matrix(matrix))] if matrix else []
    except MatrixError as exc:
        all_configs, values = [], {**values, "error": values.get("error") or str(exc)}
    builds = list(builds or [("", "")])
    return {"matrices": names, "matrix": matrix, "configs": all_configs,
            "checked": [c for c in configs if c in all_configs],
            "baseline": builds[0], "contender": builds[1] if len(builds) > 1 else builds[0],
            "second_build": len(builds) > 1, "num_prompts": "", "track": False, "priority": 0,
            "engine_env": "", "model": "", "error": None, **choices, **values}


Patches = Annotated[str, Query(max_length=500)]


@router.get("/jobs/new")
def read_new_job_page(request: Request, session: SessionDep, matrix: Text = None,
                      baseline: Text = None, baseline_source: Text = None,
                      baseline_patches: Patches = "", contender: Text = None,
                      contender_source: Text = None, contender_patches: Patches = "",
                      second_build: Text = None,
                      configs: Annotated[list[str] | None, Query(max_length=1000)] = None,
                      num_prompts: Annotated[str, Query(max_length=20)] = "",
                      track: Text = None, engine_env: Text = None,
                      model: Text = None) -> HTMLResponse:
    """The form that posts a job: a matrix (or some of its configs) on a commit, or on two builds
    (a commit with and without a fix); prefilled from a commit (``baseline``, ``contender``:
    stored commit refs) or from the form's own fields (``*_source``)."""
    first = (baseline_source if baseline_source is not None
             else source_of(session, baseline, baseline_patches))
    builds = [(first, baseline_patches)]
    if contender or contender_patches or second_build:
        second = (contender_source if contender_source is not None
                  else source_of(session, contender, contender_patches) if contender else first)
        builds.append((second, contender_patches))
    return page(request, "job_new.html", title="Post a job",
                form=job_form(matrix, configs or [], builds, request.app.state.settings,
                              num_prompts=num_prompts, track=bool(track),
                              engine_env=engine_env or "", model=model or ""))


def log_tail(path: str | None) -> str | None:
    """The last LOG_TAIL_BYTES of an engine log (from a line start), None if it is not here."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(size - LOG_TAIL_BYTES, 0))
            data = f.read()
    except OSError:
        return None
    text = data.decode("utf-8", errors="replace")
    if size > LOG_TAIL_BYTES and "\n" in text:
        text = text.split("\n", 1)[1]
    return text


# what a matrix cell shows of each metric that can decide a scenario's verdict: label and meaning
CELL_METRICS = {
    "kl_k3_mean": ("KL", "mean KL (k3) of the generated tokens, nats, with its bootstrap interval"),
    "extend_kl_k3_mean": ("extend KL", "mean KL (k3) of the extend (the prompt tokens prefilled on "
                                       "the cached prefix) against the cold reference, nats, with "
                                       "its bootstrap interval"),
    "hit_coverage": ("hit", "share of samples that hit the cache"),
    "accept_length": ("accept", "acceptance length"),
}
# what a scenario's reason says, for the metric it names (the reasons ``judging`` writes)
REASON_METRICS = {**{label: metric for metric, label in LABELS.items()},
                  "hit coverage": "hit_coverage", "speculative counters": "accept_length"}


def reason_metric(reason: str | None) -> str | None:
    """The metric a verdict's reason names first (``judging``'s wording); None if none."""
    found = [(reason.index(text), metric) for text, metric in REASON_METRICS.items()
             if reason and text in reason]
    return min(found)[1] if found else None


def deciding_verdict(verdict: str | None, reason: str | None, judged: list[VerdictRead]
                     ) -> tuple[str | None, VerdictRead | None]:
    """The metric that decided a scenario's verdict, and its stored verdict (``judged``: the
    scenario's metric verdicts, ``queries.metric_verdicts_of``'s) where there is one. A fail is decided by
    the first of its metrics, in the order ``judging`` takes them, that regressed (the generated
    tokens' KL, the extend's KL, acceptance), or else by the metric its reason names; a known
    failure (expected) by the metric it is known for; an inconclusive scenario by its hit
    coverage; a pass (or an error) by none."""
    if verdict == Verdict.FAIL:
        regressed = {v.metric: v for v in judged if v.verdict == MetricVerdict.REGRESSION}
        for metric in METRICS:
            if metric in regressed:
                return metric, regressed[metric]
        return reason_metric(reason), None
    if verdict == Verdict.EXPECTED:  # a known failure: the metric the known regression holds
        known = next((v for v in judged if v.verdict == MetricVerdict.EXPECTED), None)
        return (known.metric, known) if known is not None else (reason_metric(reason), None)
    if verdict == Verdict.INCONCLUSIVE:
        coverage = next((v for v in judged if v.method == "coverage"), None)
        metric = "hit_coverage" if coverage is not None else reason_metric(reason)
        return metric, coverage
    return None, None


NOT_MEASURED = MetricValue(value=None, ci_low=None, ci_high=None, count=None)


def cell_lines(metrics: dict[str, MetricValue], decided: str | None) -> list[dict[str, Any]]:
    """A matrix cell's figures: the deciding metric first (``decided``), then the generated
    tokens' KL, hit coverage and acceptance length where they were measured."""
    shown = [decided] if decided in CELL_METRICS else []
    shown += [m for m in ("kl_k3_mean", "hit_coverage", "accept_length")
              if m != decided and (m != "accept_length" or
                                   metrics.get(m, NOT_MEASURED).value is not None)]
    lines = []
    for name in shown:
        label, title = CELL_METRICS[name]
        value = metrics.get(name, NOT_MEASURED)
        lines.append({"metric": name, "label": label, "title": title,
                      "value": value.value, "ci_low": value.ci_low,
                      "ci_high": value.ci_high, "decided": name == decided})
    return lines


def known_failure(verdicts: list[VerdictRead], scenario: str) -> KnownFailureRef | None:
    """The known failure a scenario fails as: the evidence of its first ``expected`` verdict
    (regression id, link), None when it has none."""
    return next((KnownFailureRef.model_validate(v.evidence["known_failure"]) for v in verdicts
                 if v.scenario == scenario and v.verdict == MetricVerdict.EXPECTED
                 and "known_failure" in (v.evidence or {})), None)


class BuildView(JobBuild):
    """A job's build as its page shows it: with its label (``build_label``)."""

    label: str


class RunView(RunDetail):
    """A job's run as its page shows it: its arguments asked for beside those resolved
    (``args_table``), its engine log's tail and its samples."""

    args: list[dict[str, Any]]
    log: str | None
    samples: list[SampleStats]


def matrix_table(runs: list[RunView], builds: list[BuildView]) -> dict[str, Any]:
    """Configs (x builds) by scenarios: per cell the run, verdict (its reason on hover; the known
    failure an expected one is), the metric that decided it (``deciding_verdict``: the extend's
    KL where that failed), then the generated tokens' KL mean with its interval, hit coverage and
    acceptance length."""
    labels = {(b.commit, b.patch_set): b.label for b in builds}
    scenarios = [s for s in SCENARIOS if any(sc.scenario == s for r in runs
                                             for sc in r.scenarios)]
    rows = []
    for r in runs:
        cells = {}
        for sc in r.scenarios:
            judged = [v for v in r.verdicts if v.scenario == sc.scenario]
            decided, _ = deciding_verdict(sc.verdict, sc.reason, judged)
            cells[sc.scenario] = {"verdict": sc.verdict, "reason": sc.reason,
                                  "decided": decided, "lines": cell_lines(sc.metrics, decided),
                                  "known": known_failure(r.verdicts, sc.scenario)}
        rows.append({"run": r, "build": labels[(r.commit, r.patch_set)], "cells": cells})
    return {"scenarios": scenarios, "rows": rows}


def args_table(requested: dict[str, Any] | None, resolved: dict[str, Any] | None
               ) -> list[dict[str, Any]]:
    """Each argument asked for with the value the engine resolved it to; ``differs`` where they
    are not the same."""
    resolved = resolved or {}
    return [{"name": key, "requested": value, "resolved": resolved.get(key),
             "differs": key in resolved and resolved[key] != value}
            for key, value in (requested or {}).items()]


def build_label(build: JobBuild) -> str:
    return short_ref(build.commit) + (f" + {build.patch_set}" if build.patch_set else "")


@router.get("/jobs/{job_id}")
def read_job_page(job_id: JobId, request: Request, session: SessionDep,
                  shown: ShownDep) -> HTMLResponse:
    """A job: its matrix table, builds with their manifests, and each run's arguments and log.
    Server paths in its errors are redacted for readers without the write role."""
    job = queries.job_detail(session, job_id)
    if job is None:
        return problem(request, 404, f"no job {job_id}")
    job = job_as_seen(job, shown)
    builds = [build_as_seen(BuildView(**dict(b), label=build_label(b)), shown)
              for b in queries.job_builds(session, job_id)]
    runs = queries.job_runs(session, job_id)
    samples = queries.run_samples(session, [r.id for r in runs])
    # the log read from where it is, before its path is shown as the reader may see it
    runs = [run_as_seen(RunView(**dict(r), args=args_table(r.requested_args, r.resolved_args),
                                log=log_tail(r.log_path), samples=samples[r.id]), shown)
            for r in runs]
    progress: dict[str, int] = {}
    for r in runs:
        progress[r.status] = progress.get(r.status, 0) + 1
    compare_link = None
    if len(builds) == 2:
        compare_link = request.url_for("read_compare_page").include_query_params(
            baseline=builds[0].commit, contender=builds[1].commit,
            baseline_patches=builds[0].patch_set, contender_patches=builds[1].patch_set)
    return page(request, "job.html", title=f"Job {job_id}", job=job, spec=stored_spec(job.spec),
                builds=builds, runs=runs,
                table=matrix_table(runs, builds), progress=progress, finished=FINISHED,
                compare_link=compare_link, history=audit.history(session, [("job", job_id)]))


@router.get("/runs/{run_id}")
def read_run_page(run_id: RunId, request: Request, session: SessionDep) -> HTMLResponse:
    """A run: its place on its job's page."""
    job_id = queries.run_job_id(session, run_id)
    if job_id is None:
        return problem(request, 404, f"no run {run_id}")
    url = request.url_for("read_job_page", job_id=job_id)
    return RedirectResponse(f"{url.path}#run-{run_id}", status_code=303)


# ---- compare -------------------------------------------------------------------------------

def compare_verdict(baseline: str | None, contender: str | None) -> str:
    """A comparison's verdict from the two sides' scenario verdicts: regression (pass -> fail),
    improvement (fail -> pass), fail (failing on both), pass, expected (the contender fails as a
    known failure does, and the baseline did not pass), or inconclusive (either side was
    inconclusive, invalid, errored or missing). A known failure (expected) is a failure, known:
    pass -> expected is a regression, expected -> pass an improvement."""
    if baseline not in ("pass", "fail", "expected") or contender not in ("pass", "fail", "expected"):
        return "inconclusive"
    if baseline == "pass":
        return "pass" if contender == "pass" else "regression"
    if contender == "pass":
        return "improvement"
    return contender


def compare_decision(row: dict[str, Any], results: dict[tuple[int, str], tuple[str, str | None]],
                     judged: dict[tuple[int, str], list[VerdictRead]]) -> dict[str, Any]:
    """The test that decided a comparison row's verdict, with its figures. ``source``: ``paired``
    (the two builds' runs compared sample by sample, ``compare_builds``: a regression the runs' own
    verdicts do not show, or, for a pass, the test that found none), ``contender`` or ``baseline``
    (that run's own verdict of the scenario: a fail or an inconclusive decides), or ``both`` (a
    pass with no paired test of the metric). ``verdict``: the deciding metric verdict
    (a ``VerdictRead``; None where none was stored: then ``reason`` says why),
    ``metric`` and ``scenario_verdict``. ``results`` and ``judged``: the runs' scenario verdicts
    with their reasons and their metric verdicts, by (run id, scenario). ``row``: the page's row,
    a ``JudgedComparison``'s fields with both sides' scenario verdicts, its own verdict and the
    metric compared."""
    paired: VerdictRead | None = row["paired"]
    verdict = row["verdict"]
    own = compare_verdict(row["baseline_verdict"], row["contender_verdict"])
    tested = paired is not None and paired.method == "history"
    if (verdict == "regression" and own != "regression") or (verdict == "pass" and tested):
        return {"source": "paired", "metric": paired.metric, "verdict": paired,
                "reason": paired.reason, "scenario_verdict": None}
    if verdict == "pass":  # no paired test: of a metric without one, or too few samples
        why = paired and ((paired.evidence or {}).get("history") or paired.reason)
        return {"source": "both", "metric": None, "verdict": None, "scenario_verdict": "pass",
                "reason": f"no paired test of {row['metric']}" + (f": {why}" if why else "")}
    side = "baseline" if verdict == "improvement" or (
        verdict == "inconclusive" and row["contender_verdict"] in ("pass", "fail")) else "contender"
    run = row[f"{side}_run"]
    scenario_verdict, reason = results.get((run, row["scenario"]), (None, None))
    metric, decided = deciding_verdict(scenario_verdict, reason,
                                       judged.get((run, row["scenario"]), []))
    if scenario_verdict is None:
        reason = f"the {side} run has no verdict of {row['scenario']}"
    return {"source": side, "metric": metric, "verdict": decided,
            "reason": reason or (decided.reason if decided is not None else None),
            "scenario_verdict": scenario_verdict}


@router.get("/compare")
def read_compare_page(request: Request, session: SessionDep, baseline: Text = None,
                      contender: Text = None,
                      baseline_patches: Annotated[str, Query(max_length=500)] = "",
                      contender_patches: Annotated[str, Query(max_length=500)] = "",
                      metric: Annotated[str, Query(max_length=80)] = "kl_k3_mean") -> HTMLResponse:
    """Baseline vs contender per config and scenario, regressions first: each row's verdict with
    the test that decided it (``compare_decision``), and the chosen metric's values, delta and
    bootstrap interval labelled as figures for reading."""
    form = {"baseline": baseline or "", "contender": contender or "",
            "baseline_patches": baseline_patches, "contender_patches": contender_patches,
            "metric": metric}
    recent = [c.ref for c in queries.commit_summaries(session, limit=50)]
    if not baseline or not contender:
        return page(request, "compare.html", title="Compare", form=form, recent=recent, rows=None)
    builds = {}
    for name, ref, patches in (("baseline", baseline, baseline_patches),
                               ("contender", contender, contender_patches)):
        build = queries.find_build(session, ref, patches)
        if build is None:
            return problem(request, 404, f"{name}: no build of {ref!r} with patch set {patches!r}")
        builds[name] = build.id
    compared = compare_builds(session, builds["baseline"], builds["contender"], metric=metric)
    run_ids = [c.baseline_run for c in compared] + [c.contender_run for c in compared]
    results = queries.scenario_results_of(session, run_ids)
    judged = queries.metric_verdicts_of(session, run_ids)
    rows = []  # the page's rows: each comparison's fields, both sides' verdicts, its own
    for c in compared:
        r = {**dict(c),
             "baseline_verdict": results.get((c.baseline_run, c.scenario), (None,))[0],
             "contender_verdict": results.get((c.contender_run, c.scenario), (None,))[0]}
        r["verdict"] = compare_verdict(r["baseline_verdict"], r["contender_verdict"])
        if c.paired_verdict == "regression" and r["verdict"] in ("pass", "improvement"):
            r["verdict"] = "regression"  # both pass their limits, yet the same prompts got worse
        r["decision"] = compare_decision({**r, "metric": metric}, results, judged)
        rows.append(r)
    rows.sort(key=lambda r: (COMPARE_ORDER.index(r["verdict"]), -(r["delta"] or 0.0),
                             r["config"], r["scenario"]))
    counts = {v: sum(r["verdict"] == v for r in rows) for v in COMPARE_ORDER}
    new_job = None
    user = current_user(request)
    if user is not None and user.can_write:  # the same comparison again, or on fewer configs
        matrices = queries.run_matrices(session, [r["contender_run"] for r in rows])
        new_job = job_form(matrices[0] if matrices else None,
                           dict.fromkeys(r["config"] for r in rows),
                           [(source_of(session, baseline, baseline_patches), baseline_patches),
                            (source_of(session, contender, contender_patches),
                             contender_patches)])
    return page(request, "compare.html", title="Compare", form=form, recent=recent, rows=rows,
                counts={v: n for v, n in counts.items() if n}, permalink=str(request.url),
                new_job=new_job)


# ---- regressions and bisections ------------------------------------------------------------

class RegressionView(RegressionRead):
    """A regression as the dashboard shows it: with its bisections and who triaged it last."""

    bisections: list[BisectionBrief]
    triaged_by: str | None = None


def regression_rows(session: Session, limit: int = REGRESSIONS_SHOWN) -> list[RegressionView]:
    """``queries.regressions``, open first, with the runs they point at (and their builds and
    commits) loaded up front instead of one by one, and each one's bisections."""
    rows = [queries.regression_read(session, r)
            for r in queries.regressions_with_runs(session, limit)]
    bisections = queries.regression_bisections(session, [r.id for r in rows])
    triaged_by = audit.last_triage_by(session, [r.id for r in rows])
    return [RegressionView(**dict(r), bisections=bisections[r.id], triaged_by=triaged_by.get(r.id))
            for r in rows]


def regression_api(request: Request) -> str:
    """The triage endpoint's URL without the id, at the service's public address when it has one
    (that is what a curl from elsewhere needs)."""
    url = request.url_for("read_regression", regression_id=1)
    public = request.app.state.settings.public_url
    base = public.rstrip("/") + url.path if public else str(url)
    return base.removesuffix("1")


@router.get("/regressions")
def read_regressions_page(request: Request, session: SessionDep) -> HTMLResponse:
    """Regressions, open ones first: their triage, commits, and the evidence of the verdict that
    opened them; each one's page triages and bisects it."""
    rows = regression_rows(session)
    return page(request, "regressions.html", title="Regressions",
                open=[r for r in rows if r.state == "open"],
                resolved=[r for r in rows if r.state != "open"], shown=REGRESSIONS_SHOWN,
                full=len(rows) == REGRESSIONS_SHOWN, triage_api=regression_api(request),
                triage_values=TRIAGE,
                write_token=bool(request.app.state.settings.api_token))


def regression_page(request: Request, session: Session, regression_id: int,
                    status_code: int = 200, **context: Any) -> HTMLResponse:
    """A regression's page (``context``: an error and the values of a form that was refused)."""
    r = session.get(Regression, regression_id)
    if r is None:
        return problem(request, 404, f"no regression {regression_id}")
    row = RegressionView(**dict(queries.regression_read(session, r)),
                         bisections=queries.regression_bisections(session, [r.id])[r.id])
    targets = [("regression", r.id), *(("bisection", b.id) for b in row.bisections)]
    return page(request, "regression.html", status_code, title=f"Regression #{r.id}", r=row,
                triage_values=TRIAGE, history=audit.history(session, targets),
                triage_api=regression_api(request),
                write_token=bool(request.app.state.settings.api_token), **context)


@router.get("/regressions/{regression_id}")
def read_regression_page(regression_id: RegressionId, request: Request, session: SessionDep
                         ) -> HTMLResponse:
    """A regression: its series, commits and evidence, its bisections, who triaged it and how
    (the forms triage and bisect it)."""
    return regression_page(request, session, regression_id)


class BisectionView(BisectionRead):
    """A bisection as the dashboard shows it (``bisection_view``)."""

    search: int | None
    ran_bad: bool
    bound: int | None
    reused: int
    candidate_states: list[dict[str, str | None]]


def bisection_view(b: BisectionRead) -> BisectionView:
    """``queries.bisection_read`` with the most runs it may take (``bound``: ceil(log2(n)) for n
    candidates, ``search``, plus one when the bad end had to be run rather than reused,
    ``ran_bad``; None without candidates), and each candidate's state: first_bad, bad, good, or
    None (not evaluated). Its steps are the stored JSON: dicts."""
    steps = b.steps or []
    n = len(b.candidates or [])
    search = math.ceil(math.log2(n)) if n else None
    ran_bad = any(s["sha"] == b.bad and not s.get("reused") for s in steps)
    tested = {s["sha"]: "bad" if s["bad"] else "good" for s in steps}
    candidates = [{"sha": sha, "state": "first_bad" if sha == b.first_bad
                   else tested.get(sha)} for sha in b.candidates or []]
    return BisectionView(**dict(b), search=search, ran_bad=ran_bad,
                         bound=None if search is None else search + ran_bad,
                         reused=sum(bool(s.get("reused")) for s in steps),
                         candidate_states=candidates)


@router.get("/bisections")
def read_bisections_page(request: Request, session: SessionDep) -> HTMLResponse:
    """Bisections, newest first."""
    return page(request, "bisections.html", title="Bisections",
                bisections=[bisection_view(b) for b in queries.bisections(session)])


@router.get("/bisections/{bisect_id}")
def read_bisection_page(bisect_id: JobId, request: Request, session: SessionDep) -> HTMLResponse:
    """A bisection: its range, each step and why, and the first bad commit (or why it stopped)."""
    b = session.get(Bisection, bisect_id)
    if b is None:
        return problem(request, 404, f"no bisection {bisect_id}")
    return page(request, "bisection.html", title=f"Bisection {bisect_id}",
                b=bisection_view(queries.bisection_read(b)),
                history=audit.history(session, [("bisection", bisect_id)]))


# ---- a sample's tokens ---------------------------------------------------------------------

@router.get("/runs/{run_id}/samples/{sample_id}")
def read_sample_page(run_id: RunId, request: Request, session: SessionDep, shown: ShownDep,
                     sample_id: Annotated[str, PathParam(max_length=100)],
                     scenario: Annotated[str | None, Query(max_length=40)] = None,
                     position: Annotated[int | None, Query(ge=0, le=1_000_000)] = None
                     ) -> HTMLResponse:
    """One sample: its generated tokens coloured by per-token KL, the first divergent token
    marked, the per-token KL of its extend beside that of its generated tokens, both sides'
    logprobs at a chosen position, and its extend's tokens."""
    run = queries.run_detail(session, run_id)
    if run is None:
        return problem(request, 404, f"no run {run_id}")
    found = queries.find_samples(session, run_id, sample_id, scenario)
    if not found:
        return problem(request, 404, f"run {run_id} has no sample {sample_id!r}"
                       + (f" in scenario {scenario}" if scenario else ""))
    if len(found) > 1:
        return problem(request, 422, f"sample {sample_id!r} is in several scenarios of run "
                                     f"{run_id}: name one with ?scenario=")
    sample = found[0]
    path = run.samples_path
    row = read_sample(path, sample.scenario, sample_id) if path and Path(path).is_file() else None
    if row is None:
        return problem(request, 404, f"run {run_id}: the token-level record of sample "
                                     f"{sample_id!r} is not here "
                                     f"({shown(path) or 'no samples file'})")
    model_path = (run.requested_args or {}).get("model_path")
    try:
        tokens = sample_tokens(row, model_path)
        extend = extend_tokens(row, model_path)
    except ValueError as exc:
        return problem(request, 422, f"sample {sample_id!r}: its logprobs are not usable ({exc})")
    first = sample.first_divergence
    if position is None:
        position = first if first is not None else 0
    if tokens and position >= len(tokens):
        return problem(request, 422, f"position {position}: the sample has {len(tokens)} tokens")
    chart = {"k3": [finite(t["k3"]) for t in tokens], "first": first, "position": position,
             "extend_k3": [finite(t["k3"]) for t in extend]}
    top = top_candidates(row, position, model_path)
    return page(request, "sample.html", title=f"Sample {sample_id}", run=run, sample=sample,
                tokens=tokens, first=first, position=position,
                at=tokens[position] if tokens else None, chart=chart, top=top,
                decoded=any(t["text"] is not None for t in tokens), extend=extend)
