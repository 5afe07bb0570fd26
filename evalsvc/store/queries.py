"""The reads the API and the dashboard need, as the read models of ``store.reads``."""

from __future__ import annotations

from typing import Any

import numpy as np
from sqlalchemy import Row, case, func, select
from sqlalchemy.orm import Session, selectinload

from evalsvc.metrics import paired_difference_cis
from evalsvc.store.models import (
    Alert,
    Bisection,
    Build,
    Commit,
    GoldenRun,
    Job,
    Metric,
    Regression,
    Run,
    SampleRow,
    ScenarioRow,
    VerdictRow,
)
from evalsvc.store.reads import (
    AlertRead,
    BisectionBrief,
    BisectionRead,
    CommitSummary,
    GoldenRunRead,
    JobBuild,
    JobRead,
    JobRunRead,
    JobSummary,
    KnownFailureRef,
    LatestRun,
    MetricPoint,
    MetricValue,
    RegressionCounts,
    RegressionRead,
    RunBrief,
    RunDetail,
    SampleStats,
    ScenarioComparison,
    ScenarioDetail,
    TrendCommit,
    TrendRun,
    TrendWindow,
    VerdictRead,
)
from evalsvc.types import MetricVerdict, Verdict

SAMPLE_METRICS = {"kl_k3_mean", "kl_k1_mean", "kl_k2_mean", "topk_kl_mean", "accept_length",
                  "extend_kl_k3_mean"}


def metric_history(session: Session, metric: str = "kl_k3_mean", *, fingerprint: str | None = None,
                   config: str | None = None, scenario: str | None = None,
                   patch_set: str | None = "", limit: int | None = None) -> list[MetricPoint]:
    """A metric's values for one fingerprint (or config name), oldest commit first.

    ``patch_set``: only builds with this patch set ("" = unpatched, None = any).
    """
    if fingerprint is None and config is None:
        raise ValueError("metric_history needs a fingerprint or a config name")
    q = (select(Commit.ref, Commit.sha, Commit.version, Commit.committed_at, Build.patch_set,
                Run.id, Run.fingerprint, Run.config, Metric.scenario, Metric.value, Metric.ci_low,
                Metric.ci_high, Metric.count)
         .join(Build, Build.commit_id == Commit.id)
         .join(Run, Run.build_id == Build.id)
         .join(Metric, Metric.run_id == Run.id)
         .where(Metric.name == metric))
    q = q.where(Run.fingerprint == fingerprint) if fingerprint else q.where(Run.config == config)
    if scenario is not None:
        q = q.where(Metric.scenario == scenario)
    if patch_set is not None:
        q = q.where(Build.patch_set == patch_set)
    q = q.order_by(Commit.committed_at, Run.id, Metric.scenario)
    if limit is not None:
        q = q.limit(limit)
    keys = tuple(MetricPoint.model_fields)
    return [MetricPoint(**dict(zip(keys, row, strict=True))) for row in session.execute(q)]


def latest_per_config(session: Session, matrix: str | None = None,
                      branch: str | None = None) -> list[LatestRun]:
    """The newest run of every fingerprint and patch set (by commit time, then recording), with
    its verdicts: a build with a patch set (a fix, or a defect put back) is a series of its own,
    never mixed with the unpatched build of the same commit."""
    ranked = (select(Run.id.label("run_id"),
                     func.row_number().over(partition_by=(Run.fingerprint, Build.patch_set),
                                            order_by=(Commit.committed_at.desc(),
                                                      Run.id.desc())).label("rank"))
              .join(Build, Run.build_id == Build.id).join(Commit, Build.commit_id == Commit.id))
    if matrix is not None:
        ranked = ranked.where(Run.matrix == matrix)
    if branch is not None:
        ranked = ranked.where(Commit.branch == branch)
    ranked = ranked.subquery()
    runs = session.scalars(select(Run).join(ranked, ranked.c.run_id == Run.id)
                           .where(ranked.c.rank == 1)
                           .options(selectinload(Run.scenarios),
                                    selectinload(Run.build).selectinload(Build.commit))).all()
    runs = sorted(runs, key=lambda r: (r.config, r.fingerprint, r.build.patch_set))
    return [LatestRun(run_id=r.id, config=r.config, fingerprint=r.fingerprint,
                      commit=r.build.commit.ref, patch_set=r.build.patch_set, verdict=r.verdict,
                      scenarios={s.scenario: s.verdict for s in r.scenarios}) for r in runs]


def _build_runs(session: Session, build_id: int, job_id: str | None) -> dict[str, Row]:
    """A build's runs as (id, fingerprint, config) rows by fingerprint; the newest run wins."""
    q = select(Run.id, Run.fingerprint, Run.config).where(Run.build_id == build_id).order_by(Run.id)
    if job_id is not None:
        q = q.where(Run.job_id == job_id)
    return {r.fingerprint: r for r in session.execute(q)}


def compare(session: Session, baseline_build: int, contender_build: int, *,
            metric: str = "kl_k3_mean", confidence: float = 0.95) -> list[ScenarioComparison]:
    """Per config and scenario: both values, the delta (contender - baseline) and, where both
    sides have per-sample values for the same samples, a paired bootstrap interval of it."""
    base = _build_runs(session, baseline_build, None)
    cont = _build_runs(session, contender_build, None)
    common = sorted(set(base) & set(cont), key=lambda f: base[f].config)
    run_ids = [base[f].id for f in common] + [cont[f].id for f in common]
    # plain Core rows from here (the ORM's per-row work was a third of the time); _build_runs'
    # session.execute has already autoflushed pending changes
    conn = session.connection()
    values: dict[tuple[int, str], float | None] = {}
    scenarios_of: dict[int, set[str]] = {}
    if run_ids:
        for run_id, scen, value in conn.execute(
                select(Metric.run_id, Metric.scenario, Metric.value)
                .where(Metric.run_id.in_(run_ids), Metric.name == metric)).all():
            values[(run_id, scen)] = value
            scenarios_of.setdefault(run_id, set()).add(scen)
    per_sample: dict[tuple[int, str], dict[str, float]] = {}
    if metric in SAMPLE_METRICS and run_ids:
        column = getattr(SampleRow, metric)
        for run_id, scen, sid, val in conn.execute(
                select(SampleRow.run_id, SampleRow.scenario, SampleRow.sample_id, column)
                .where(SampleRow.run_id.in_(run_ids))).all():
            if val is not None:
                per_sample.setdefault((run_id, scen), {})[sid] = val
    # the rows' keys and their paired samples first: the intervals of all of them in one call
    staged: list[tuple[Row, Row, str, str, int]] = []  # baseline, contender, fp, scenario, pairs
    pairs = []
    for fp in common:
        b, c = base[fp], cont[fp]
        scenarios = sorted(scenarios_of.get(b.id, set()) | scenarios_of.get(c.id, set()))
        for scen in scenarios:
            bs, cs = per_sample.get((b.id, scen), {}), per_sample.get((c.id, scen), {})
            ids = sorted(set(bs) & set(cs))
            if len(ids) >= 2:
                pairs.append((np.array([bs[i] for i in ids]), np.array([cs[i] for i in ids])))
            staged.append((b, c, fp, scen, len(ids) if len(ids) >= 2 else 0))
    intervals = iter(paired_difference_cis(pairs, confidence, 1000))
    rows = []
    for b, c, fp, scen, paired in staged:
        bv, cv = values.get((b.id, scen)), values.get((c.id, scen))
        _, low, high = next(intervals) if paired else (None, None, None)
        rows.append(ScenarioComparison(
            config=b.config, fingerprint=fp, scenario=scen, baseline=bv, contender=cv,
            delta=None if bv is None or cv is None else cv - bv, ci_low=low, ci_high=high,
            paired_samples=paired, baseline_run=b.id, contender_run=c.id))
    return rows


def find_build(session: Session, ref: str, patch_set: str = "") -> Build | None:
    return session.scalar(select(Build).join(Commit).where(Commit.ref == ref,
                                                           Build.patch_set == patch_set))


def find_commit(session: Session, ref: str) -> Commit | None:
    return session.scalar(select(Commit).where(Commit.ref == ref))


def build_run_ids(session: Session, build_id: int) -> list[int]:
    """The ids of a build's runs, in run order."""
    return list(session.scalars(select(Run.id).where(Run.build_id == build_id).order_by(Run.id)))


def run_job_id(session: Session, run_id: int) -> str | None:
    """The job a run belongs to; None: no such run."""
    return session.scalar(select(Run.job_id).where(Run.id == run_id))


def run_matrices(session: Session, run_ids: list[int]) -> list[str]:
    """The matrix of each of these runs (in no particular order)."""
    return list(session.scalars(select(Run.matrix).where(Run.id.in_(run_ids))))


def find_jobs(session: Session, *, status: str | None = None, trigger: str | None = None,
              limit: int = 100) -> list[Job]:
    """Jobs, newest first, filtered by status and trigger."""
    q = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    if status is not None:
        q = q.where(Job.status == status)
    if trigger is not None:
        q = q.where(Job.trigger == trigger)
    return list(session.scalars(q))


def errored_runs(session: Session, job_ids: list[str]) -> dict[str, int]:
    """Per job, how many of its runs ended ``error`` (no verdict reached: the engine did not
    start, died or could not be recorded); jobs without any are left out."""
    if not job_ids:
        return {}
    return dict(session.execute(select(Run.job_id, func.count()).where(
        Run.job_id.in_(job_ids), Run.verdict == Verdict.ERROR).group_by(Run.job_id)).all())


def job_detail(session: Session, job_id: str) -> JobRead | None:
    job = session.get(Job, job_id)
    if job is None:
        return None
    runs = session.scalars(select(Run).where(Run.job_id == job_id).order_by(Run.id)
                           .options(selectinload(Run.scenarios),
                                    selectinload(Run.build).selectinload(Build.commit))).all()
    return JobRead(
        id=job.id, trigger=job.trigger, status=job.status, priority=job.priority, spec=job.spec,
        created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
        error=job.error, cancel_requested_at=job.cancel_requested_at,
        runs_errored=sum(r.verdict == Verdict.ERROR for r in runs),
        runs=[JobRunRead(id=r.id, config=r.config, fingerprint=r.fingerprint,
                         build_id=r.build_id, build=r.build.commit.ref
                         + (f"+{r.build.patch_set}" if r.build.patch_set else ""),
                         status=r.status, verdict=r.verdict, reason=r.reason,
                         scenarios={s.scenario: s.verdict for s in r.scenarios}) for r in runs])


def run_detail(session: Session, run_id: int,
               verdicts: list[VerdictRead] | None = None) -> RunDetail | None:
    """One run with its scenarios, metrics and verdicts (``verdicts``: read already)."""
    run = session.get(Run, run_id, options=[selectinload(Run.scenarios),
                                            selectinload(Run.metrics),
                                            selectinload(Run.build).selectinload(Build.commit)])
    if run is None:
        return None
    metrics: dict[str, dict[str, MetricValue]] = {}
    for m in run.metrics:
        metrics.setdefault(m.scenario, {})[m.name] = MetricValue(
            value=m.value, ci_low=m.ci_low, ci_high=m.ci_high, count=m.count)
    return RunDetail(
        id=run.id, job_id=run.job_id, config=run.config, matrix=run.matrix, model=run.model,
        fingerprint=run.fingerprint, settings=run.settings, requested_args=run.requested_args,
        resolved_args=run.resolved_args, reference=run.reference, command=run.command,
        status=run.status, verdict=run.verdict, reason=run.reason, seconds=run.seconds,
        startup_seconds=run.startup_seconds, log_path=run.log_path,
        samples_path=run.samples_path, commit=run.build.commit.ref,
        patch_set=run.build.patch_set,
        scenarios=[ScenarioDetail(scenario=s.scenario, verdict=s.verdict, reason=s.reason,
                                  seconds=s.seconds, metrics=metrics.get(s.scenario, {}))
                   for s in run.scenarios],
        verdicts=run_verdicts(session, run_id) if verdicts is None else verdicts)


def verdict_read(v: VerdictRow) -> VerdictRead:
    """A stored verdict as read."""
    return VerdictRead(scenario=v.scenario, metric=v.metric, verdict=v.verdict, method=v.method,
                       value=v.value, baseline=v.baseline, diff_low=v.diff_low,
                       diff_high=v.diff_high, threshold=v.threshold, p_value=v.p_value,
                       evidence=v.evidence, reason=v.reason)


def run_verdicts(session: Session, run_id: int) -> list[VerdictRead]:
    """A run's verdicts per scenario and metric, with their evidence."""
    return [verdict_read(v) for v in session.scalars(
        select(VerdictRow).where(VerdictRow.run_id == run_id).order_by(VerdictRow.id))]


def _run_brief(run: Run | None) -> RunBrief | None:
    if run is None:
        return None
    commit = run.build.commit
    return RunBrief(id=run.id, job_id=run.job_id, commit=commit.ref, sha=commit.sha,
                    committed_at=commit.committed_at)


def regression_read(session: Session, r: Regression) -> RegressionRead:
    v = session.scalars(select(VerdictRow).where(VerdictRow.run_id == r.first_run_id,
                                              VerdictRow.scenario == r.scenario,
                                              VerdictRow.metric == r.metric)).first()
    return RegressionRead(
        id=r.id, state=r.state, config=r.config, matrix=r.matrix, fingerprint=r.fingerprint,
        patch_set=r.patch_set, scenario=r.scenario, metric=r.metric, runs_seen=r.runs_seen,
        opened_at=r.opened_at, resolved_at=r.resolved_at, triage=r.triage, comment=r.comment,
        link=r.link, expected_level=r.expected_level, triaged_at=r.triaged_at,
        first_run=_run_brief(r.first_run), last_run=_run_brief(r.last_run),
        last_good_run=_run_brief(r.last_good_run), resolved_run=_run_brief(r.resolved_run),
        evidence=verdict_read(v) if v is not None else None)


def regressions(session: Session, state: str | None = None, limit: int = 200
                ) -> list[RegressionRead]:
    """Regressions, open first, newest first."""
    q = select(Regression)
    if state:
        q = q.where(Regression.state == state)
    q = q.order_by((Regression.state == "open").desc(), Regression.opened_at.desc(),
                   Regression.id.desc()).limit(limit)
    return [regression_read(session, r) for r in session.scalars(q)]


def open_regression_counts(session: Session) -> RegressionCounts:
    """How many regressions are open, and how many of them nobody has triaged yet."""
    total, untriaged = session.execute(
        select(func.count(Regression.id),
               func.coalesce(func.sum(case((Regression.triage.is_(None), 1), else_=0)), 0))
        .where(Regression.state == "open")).one()
    return RegressionCounts(open=total, untriaged=untriaged)


def regressions_with_runs(session: Session, limit: int = 200) -> list[Regression]:
    """Regressions, open first, newest first, with the runs they point at (and their builds and
    commits) loaded up front instead of one by one."""
    runs = [selectinload(rel).selectinload(Run.build).selectinload(Build.commit)
            for rel in (Regression.first_run, Regression.last_run, Regression.last_good_run,
                        Regression.resolved_run)]
    return list(session.scalars(
        select(Regression).options(*runs)
        .order_by((Regression.state == "open").desc(), Regression.opened_at.desc(),
                  Regression.id.desc()).limit(limit)))


def regression_bisections(session: Session, regression_ids: list[int]
                          ) -> dict[int, list[BisectionBrief]]:
    """Per regression, its bisections in the order they were made: id, status and first bad
    commit."""
    out: dict[int, list[BisectionBrief]] = {rid: [] for rid in regression_ids}
    if out:
        for b in session.execute(select(Bisection.id, Bisection.regression_id, Bisection.status,
                                        Bisection.first_bad)
                                 .where(Bisection.regression_id.in_(list(out)))
                                 .order_by(Bisection.created_at)):
            out[b.regression_id].append(BisectionBrief(id=b.id, status=b.status,
                                                       first_bad=b.first_bad))
    return out


def bisection_read(b: Bisection) -> BisectionRead:
    """A bisection as read."""
    return BisectionRead(id=b.id, status=b.status, repository=b.repository, good=b.good,
                         bad=b.bad, matrix=b.matrix, config=b.config, scenario=b.scenario,
                         metric=b.metric, candidates=b.candidates, steps=b.steps,
                         first_bad=b.first_bad, runs_used=b.runs_used, error=b.error,
                         regression_id=b.regression_id, created_at=b.created_at,
                         finished_at=b.finished_at)


def bisections(session: Session, limit: int = 100) -> list[BisectionRead]:
    return [bisection_read(b) for b in session.scalars(
        select(Bisection).order_by(Bisection.created_at.desc()).limit(limit))]


def alerts(session: Session, limit: int = 100) -> list[AlertRead]:
    return [AlertRead(id=a.id, job_id=a.job_id, kind=a.kind, regression_ids=a.regression_ids,
                      text=a.payload.get("text"), created_at=a.created_at,
                      delivered_at=a.delivered_at, attempts=a.attempts, error=a.error)
            for a in session.scalars(select(Alert).order_by(Alert.id.desc()).limit(limit))]


def set_golden(session: Session, run_id: int, label: str | None = None) -> GoldenRun:
    """Make a run the golden run of its fingerprint (replacing an earlier one)."""
    run = session.get(Run, run_id)
    if run is None:
        raise KeyError(f"no run {run_id}")
    golden = session.scalar(select(GoldenRun).where(GoldenRun.fingerprint == run.fingerprint))
    if golden is None:
        golden = GoldenRun(fingerprint=run.fingerprint, run_id=run_id, label=label)
        session.add(golden)
    else:
        golden.run_id, golden.label = run_id, label
    session.flush()
    return golden


def golden_runs(session: Session) -> list[GoldenRunRead]:
    rows = session.execute(select(GoldenRun.fingerprint, GoldenRun.run_id, GoldenRun.label,
                                  Run.config).join(Run, Run.id == GoldenRun.run_id)
                           .order_by(Run.config))
    return [GoldenRunRead(fingerprint=f, run_id=r, label=lab, config=c)
            for f, r, lab, c in rows]


def scenario_verdicts(session: Session, run_id: int) -> dict[str, str]:
    return {s.scenario: s.verdict for s in session.scalars(
        select(ScenarioRow).where(ScenarioRow.run_id == run_id))}


# ---- the dashboard's reads ---------------------------------------------------------------------

def trend_window(session: Session, *, branch: str | None = None,
                 commits: int = 100) -> TrendWindow:
    """The newest ``commits`` commits (of ``branch``), oldest first, and the runs of all their
    builds, in run order."""
    window = (select(Commit.id, Commit.ref, Commit.committed_at)
              .order_by(Commit.committed_at.desc(), Commit.id.desc()).limit(commits))
    if branch is not None:
        window = window.where(Commit.branch == branch)
    found = [TrendCommit(id=i, ref=ref, committed_at=at)
             for i, ref, at in session.execute(window).all()[::-1]]
    runs = session.execute(select(Run.id, Build.commit_id, Build.patch_set, Run.fingerprint,
                                  Run.config, Run.matrix, Run.model)
                           .join(Build, Run.build_id == Build.id)
                           .where(Build.commit_id.in_([c.id for c in found]))
                           .order_by(Run.id))
    keys = tuple(TrendRun.model_fields)
    return TrendWindow(commits=found,
                       runs=[TrendRun(**dict(zip(keys, r, strict=True))) for r in runs])


def commit_metric_values(session: Session, commit_ids: list[int], metrics: list[str],
                         scenarios: list[str], *, matrix: str | None = None,
                         model: str | None = None) -> list[Row]:
    """(run_id, scenario, name, value) rows of ``metrics`` in ``scenarios`` of every run of these
    commits' builds (only of ``matrix`` and ``model`` when given)."""
    # naming the scenarios lets the (run_id, scenario, name) index find each row directly
    q = (select(Metric.run_id, Metric.scenario, Metric.name, Metric.value)
         .join(Run, Metric.run_id == Run.id).join(Build, Run.build_id == Build.id)
         .where(Build.commit_id.in_(commit_ids), Metric.scenario.in_(scenarios),
                Metric.name.in_(metrics)))
    if matrix is not None:
        q = q.where(Run.matrix == matrix)
    if model is not None:
        q = q.where(Run.model == model)
    return session.execute(q).all()


def commit_failures(session: Session, commit_ids: list[int]) -> dict[tuple[int, str], Verdict]:
    """The verdict by (run id, scenario) of the scenarios that failed in runs of these commits:
    fail, or expected (failing as a known failure does)."""
    rows = session.execute(select(ScenarioRow.run_id, ScenarioRow.scenario, ScenarioRow.verdict)
                           .join(Run, ScenarioRow.run_id == Run.id)
                           .join(Build, Run.build_id == Build.id)
                           .where(Build.commit_id.in_(commit_ids),
                                  ScenarioRow.verdict.in_([Verdict.FAIL, Verdict.EXPECTED])))
    return {(run_id, scenario): Verdict(verdict) for run_id, scenario, verdict in rows}


def run_models(session: Session, run_ids: list[int]) -> dict[int, str]:
    """The model of each run, by run id."""
    if not run_ids:
        return {}
    return dict(session.execute(select(Run.id, Run.model).where(Run.id.in_(run_ids))).all())


def branches(session: Session) -> list[str]:
    """The branches the store has commits of, sorted."""
    return sorted(b for b in session.scalars(select(Commit.branch).distinct()) if b is not None)


def job_summaries(session: Session, *, status: str | None = None,
                  limit: int = 100) -> list[JobSummary]:
    """Jobs, newest first, with their runs counted by status and by verdict."""
    q = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    if status is not None:
        q = q.where(Job.status == status)
    jobs = session.scalars(q).all()
    progress: dict[str, dict[str, int]] = {j.id: {} for j in jobs}
    verdicts: dict[str, dict[str, int]] = {j.id: {} for j in jobs}
    if jobs:
        for job_id, run_status, verdict, n in session.execute(
                select(Run.job_id, Run.status, Run.verdict, func.count())
                .where(Run.job_id.in_(list(progress)))
                .group_by(Run.job_id, Run.status, Run.verdict)):
            progress[job_id][run_status] = progress[job_id].get(run_status, 0) + n
            if verdict is not None:
                verdicts[job_id][verdict] = verdicts[job_id].get(verdict, 0) + n
    return [JobSummary(id=j.id, trigger=j.trigger, status=j.status, priority=j.priority,
                       matrix=_matrix_name(j.spec), created_at=j.created_at,
                       started_at=j.started_at, finished_at=j.finished_at, error=j.error,
                       progress=progress[j.id], verdicts=verdicts[j.id],
                       runs_errored=verdicts[j.id].get(Verdict.ERROR, 0))
            for j in jobs]


def _matrix_name(spec: dict[str, Any] | None) -> str | None:
    """The matrix a stored job spec names (``matrix_name``; a spec older than migration 0010
    names it as ``matrix``), read without the jobs layer's ``JobSpec``; None where it names
    none."""
    spec = spec or {}
    name = spec.get("matrix_name") or spec.get("matrix")
    return name if isinstance(name, str) else None


def job_builds(session: Session, job_id: str) -> list[JobBuild]:
    """The engine builds a job's runs used, in the order of their first run: commit, patch set,
    probe answers, base environment and manifest."""
    first_run = (select(Run.build_id, func.min(Run.id).label("first")).where(Run.job_id == job_id)
                 .group_by(Run.build_id).subquery())
    builds = session.execute(select(Build, Commit).join(Commit, Build.commit_id == Commit.id)
                             .join(first_run, first_run.c.build_id == Build.id)
                             .order_by(first_run.c.first)).all()
    return [JobBuild(id=b.id, commit=c.ref, repository=c.repository, sha=c.sha,
                     version=c.version, branch=c.branch, committed_at=c.committed_at,
                     patch_set=b.patch_set, probes=b.probes, base_env=b.base_env,
                     manifest=b.manifest) for b, c in builds]


def job_runs(session: Session, job_id: str) -> list[RunDetail]:
    """``run_detail`` of each of a job's runs, in run order."""
    # loaded with everything run_detail reads in four queries; run_detail then finds them in the
    # session instead of querying run by run (``runs`` keeps them there)
    runs = session.scalars(select(Run).where(Run.job_id == job_id).order_by(Run.id)
                           .options(selectinload(Run.scenarios), selectinload(Run.metrics),
                                    selectinload(Run.build).selectinload(Build.commit))).all()
    verdicts: dict[int, list[VerdictRead]] = {r.id: [] for r in runs}
    for v in session.scalars(select(VerdictRow).where(VerdictRow.run_id.in_(list(verdicts)))
                             .order_by(VerdictRow.id)):
        verdicts[v.run_id].append(verdict_read(v))
    return [run_detail(session, r.id, verdicts[r.id]) for r in runs]


def find_samples(session: Session, run_id: int, sample_id: str,
                 scenario: str | None = None) -> list[SampleRow]:
    """A run's samples of this id (in any scenario, or in ``scenario``)."""
    q = select(SampleRow).where(SampleRow.run_id == run_id, SampleRow.sample_id == sample_id)
    if scenario:
        q = q.where(SampleRow.scenario == scenario)
    return list(session.scalars(q))


def run_samples(session: Session, run_ids: list[int]) -> dict[int, list[SampleStats]]:
    """Per run, its samples' statistics, by scenario and sample id."""
    out: dict[int, list[SampleStats]] = {rid: [] for rid in run_ids}
    if not run_ids:
        return out
    rows = session.execute(select(SampleRow.run_id, SampleRow.scenario, SampleRow.sample_id,
                                  SampleRow.prompt_id, SampleRow.hit, SampleRow.cached_tokens,
                                  SampleRow.kl_k3_mean, SampleRow.first_divergence)
                           .where(SampleRow.run_id.in_(run_ids))
                           .order_by(SampleRow.run_id, SampleRow.scenario, SampleRow.id))
    for r in rows:
        out[r.run_id].append(SampleStats(scenario=r.scenario, sample_id=r.sample_id,
                                         prompt_id=r.prompt_id, hit=r.hit,
                                         cached_tokens=r.cached_tokens, kl_k3_mean=r.kl_k3_mean,
                                         first_divergence=r.first_divergence))
    return out


def commit_summaries(session: Session, *, branch: str | None = None, limit: int = 100,
                     offset: int = 0) -> list[CommitSummary]:
    """Commits, newest first, each with its builds (patch sets) and the verdict counts of their
    configs' latest runs."""
    q = (select(Commit).order_by(Commit.committed_at.desc(), Commit.id.desc())
         .limit(limit).offset(offset))
    if branch is not None:
        q = q.where(Commit.branch == branch)
    commits = session.scalars(q).all()
    builds: dict[int, dict[str, dict[str, int]]] = {c.id: {} for c in commits}
    if commits:
        # the latest run of each config (fingerprint) of each build: a config evaluated again
        # counts once, with its newest verdict
        latest = (select(Run.id, Run.build_id, Run.verdict, Run.status,
                         func.row_number().over(partition_by=(Run.build_id, Run.fingerprint),
                                                order_by=Run.id.desc()).label("rank"))
                  .join(Build, Run.build_id == Build.id)
                  .where(Build.commit_id.in_(list(builds))).subquery())
        for commit_id, patch_set, verdict, run_status, n in session.execute(
                select(Build.commit_id, Build.patch_set, latest.c.verdict, latest.c.status,
                       func.count())
                .join(latest, latest.c.build_id == Build.id).where(latest.c.rank == 1)
                .group_by(Build.commit_id, Build.patch_set, latest.c.verdict, latest.c.status)):
            counts = builds[commit_id].setdefault(patch_set, {})
            key = verdict or run_status  # a run without a verdict yet counts by its status
            counts[key] = counts.get(key, 0) + n
    return [CommitSummary(ref=c.ref, repository=c.repository, sha=c.sha, version=c.version,
                          branch=c.branch, committed_at=c.committed_at,
                          builds=dict(sorted(builds[c.id].items()))) for c in commits]


def known_failures_of(session: Session, run_ids: list[int]
                      ) -> dict[tuple[int, str], KnownFailureRef]:
    """The known failures these runs' scenarios fail as (``expected`` verdicts), by (run id,
    scenario): the first one's regression id and link."""
    out: dict[tuple[int, str], KnownFailureRef] = {}
    if run_ids:
        for run_id, scenario, evidence in session.execute(
                select(VerdictRow.run_id, VerdictRow.scenario, VerdictRow.evidence)
                .where(VerdictRow.run_id.in_(run_ids), VerdictRow.verdict == MetricVerdict.EXPECTED)
                .order_by(VerdictRow.id)):
            known = (evidence or {}).get("known_failure")
            if known and (run_id, scenario) not in out:
                out[(run_id, scenario)] = KnownFailureRef.model_validate(known)
    return out


def scenario_verdicts_of(session: Session, run_ids: list[int]) -> dict[tuple[int, str], str]:
    """Scenario verdicts of many runs, by (run id, scenario)."""
    return {key: verdict for key, (verdict, _) in scenario_results_of(session, run_ids).items()}


def scenario_results_of(session: Session, run_ids: list[int]
                        ) -> dict[tuple[int, str], tuple[str, str | None]]:
    """Scenario verdicts of many runs with their reasons, by (run id, scenario)."""
    if not run_ids:
        return {}
    return {(r, s): (v, why) for r, s, v, why in session.execute(
        select(ScenarioRow.run_id, ScenarioRow.scenario, ScenarioRow.verdict, ScenarioRow.reason)
        .where(ScenarioRow.run_id.in_(run_ids)))}


def metric_verdicts_of(session: Session, run_ids: list[int]
                       ) -> dict[tuple[int, str], list[VerdictRead]]:
    """The metric verdicts (``verdict_read``) of many runs, by (run id, scenario), in the order
    they were judged."""
    out: dict[tuple[int, str], list[VerdictRead]] = {}
    if run_ids:
        for v in session.scalars(select(VerdictRow).where(VerdictRow.run_id.in_(run_ids))
                                 .order_by(VerdictRow.id)):
            out.setdefault((v.run_id, v.scenario), []).append(verdict_read(v))
    return out
