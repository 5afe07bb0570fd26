"""Verdicts, the store side: what ``evalsvc.judging.judge_run`` judges a run with, read from the
store (the baseline its earlier runs make, its series' known failures: ``run_history``; the limits
stored on it: ``stored_limits``), and regressions opened and closed from its verdicts (``track``).
The judging itself is ``evalsvc.judging``'s; a run is judged once, where it is recorded
(``jobs.record.record_result``).

Regressions are tracked per series (fingerprint, patch set, scenario, metric) for jobs that ask
for it (nightly): the first flagged run opens one, later flagged runs extend it, and the next run
that passes closes it. Only the newest run of a series moves it, so bisection steps on older
commits never do.

A regression triaged ``expected`` is a known failure while it is open: later runs of its series
that fail no worse than its level are judged ``expected`` (``judging.hold_known``) and extend it,
opening nothing; a run worse than that, or a failure of another series of the config, opens a
regression of its own as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict
from datetime import UTC, datetime

import numpy as np
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from evalsvc.judging import (
    HIT_SCENARIOS,
    METRICS,
    POOLED,
    History,
    Judgement,
    KnownFailure,
    Series,
    judge_comparison,
    scenario_limits,
)
from evalsvc.matrix import Config
from evalsvc.store import audit
from evalsvc.store.audit import Actor
from evalsvc.store.models import (
    Build,
    Commit,
    Metric,
    Regression,
    Run,
    SampleRow,
    VerdictRow,
    utcnow,
)
from evalsvc.store.reads import JudgedComparison, ScenarioComparison, VerdictRead
from evalsvc.thresholds import Limits, ThresholdsFile, load_thresholds
from evalsvc.types import MetricVerdict, RunStatus

log = logging.getLogger("evalsvc.verdicts")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# ---- the store side --------------------------------------------------------------------------

def order_key(run: Run) -> tuple:
    return (run.build.commit.committed_at or EPOCH, run.finished_at or run.created_at, run.id)


def _series_query(run: Run):
    return (select(Run).join(Build, Run.build_id == Build.id)
            .join(Commit, Build.commit_id == Commit.id)
            .where(Run.fingerprint == run.fingerprint, Build.patch_set == run.build.patch_set,
                   Run.status == RunStatus.DONE, Run.id != run.id))


def _before(run: Run):
    """Runs before this one in commit order, then finish time, then id."""
    committed = run.build.commit.committed_at
    finished = run.finished_at or run.created_at
    return or_(Commit.committed_at < committed,
               and_(Commit.committed_at == committed,
                    or_(Run.finished_at < finished,
                        and_(Run.finished_at == finished, Run.id < run.id))))


def earlier_runs(session: Session, run: Run, limit: int) -> list[Run]:
    """Done runs of the run's fingerprint and patch set before it, newest first."""
    q = (_series_query(run).where(_before(run))
         .order_by(Commit.committed_at.desc(), Run.finished_at.desc(), Run.id.desc())
         .limit(limit))
    return list(session.scalars(q))


def newest_in_series(session: Session, run: Run) -> bool:
    return session.scalars(_series_query(run).where(~_before(run)).limit(1)).first() is None


def kept_runs(session: Session, run: Run, candidates: list[Run], scenario: str,
              metric: str) -> list[Run]:
    """The earlier runs (newest first) that may form a series' baseline, oldest first: runs
    flagged for this scenario and metric are left out, unless a regression triaged as expected
    made them the new normal (then nothing before that regression counts, and of the runs
    flagged since, only those recorded before the triage: a run flagged after it was worse than
    the known level)."""
    expected = session.scalars(
        select(Regression).where(Regression.fingerprint == run.fingerprint,
                                 Regression.patch_set == run.build.patch_set,
                                 Regression.scenario == scenario, Regression.metric == metric,
                                 Regression.triage == "expected")
        .order_by(Regression.opened_at.desc()).limit(1)).first()
    start = order_key(expected.first_run) if expected is not None else None
    triaged = expected.triaged_at if expected is not None else None
    ids = [r.id for r in candidates]
    flagged = set(session.scalars(select(VerdictRow.run_id).where(
        VerdictRow.run_id.in_(ids), VerdictRow.scenario == scenario, VerdictRow.metric == metric,
        VerdictRow.verdict == MetricVerdict.REGRESSION)))

    def kept(r: Run) -> bool:
        if r.id not in flagged:
            return start is None or order_key(r) >= start
        return (start is not None and order_key(r) >= start
                and (triaged is None or (r.finished_at or r.created_at) <= triaged))

    keep = [r for r in candidates if kept(r)]
    keep.reverse()  # oldest first
    return keep


def is_known_failure(reg: Regression) -> bool:
    """An open regression triaged expected, with the level it was triaged at."""
    return reg.state == "open" and reg.triage == "expected" and reg.expected_level is not None


def known_failures(session: Session, run: Run) -> dict[tuple[str, str], KnownFailure]:
    """The known failures of a run's series, by (scenario, metric): the newest regression of
    each that ``is_known_failure``."""
    out: dict[tuple[str, str], KnownFailure] = {}
    for reg in session.scalars(
            select(Regression).where(Regression.fingerprint == run.fingerprint,
                                     Regression.patch_set == run.build.patch_set,
                                     Regression.state == "open", Regression.triage == "expected")
            .order_by(Regression.opened_at, Regression.id)):
        if is_known_failure(reg):
            out[(reg.scenario, reg.metric)] = KnownFailure(reg.id, reg.expected_level, reg.link)
    return out


def failure_level(session: Session, reg: Regression) -> float | None:
    """The worst value of a regression's metric over the run that opened it and the latest it
    has seen: the level it holds to once triaged expected. None without verdicts."""
    values = [v for v in session.scalars(select(VerdictRow.value).where(
        VerdictRow.run_id.in_({reg.first_run_id, reg.last_run_id}), VerdictRow.scenario == reg.scenario,
        VerdictRow.metric == reg.metric)) if v is not None]
    if not values:
        return None
    return max(values) if METRICS.get(reg.metric, 1) > 0 else min(values)


def triage_regression(session: Session, regression_id: int, triage: str | None,
                      comment: str | None, actor: Actor | None = None,
                      link: str | None = None) -> Regression:
    """Set a regression's triage, comment and link; ``actor``: who did it (an audit event, in the
    same transaction). Triaged expected (from another triage), it takes the level it holds to as
    a known failure (``failure_level``)."""
    r = session.get(Regression, regression_id)
    if r is None:
        raise KeyError(f"no regression {regression_id}")
    previous = r.triage
    r.triage, r.comment, r.link, r.triaged_at = triage, comment, link, utcnow()
    if triage != "expected":
        r.expected_level = None
    elif previous != "expected" or r.expected_level is None:
        r.expected_level = failure_level(session, r)
    if actor is not None:
        audit.record(session, actor, "triage", "regression", r.id, comment=comment,
                     details={"triage": triage, "previous": previous, "link": link})
    session.flush()
    return r


def baseline_series(session: Session, run: Run, candidates: list[Run], scenario: str,
                    metric: str) -> Series:
    """The baseline of one series from the earlier runs (newest first): ``kept_runs`` with their
    values and per-sample values."""
    keep = kept_runs(session, run, candidates, scenario, metric)
    values = dict(session.execute(select(Metric.run_id, Metric.value).where(
        Metric.run_id.in_([r.id for r in keep]), Metric.scenario == scenario,
        Metric.name == metric)).all())
    per_run: dict[int, dict[str, float]] = {}
    for run_id, sample_id, v in session.execute(
            select(SampleRow.run_id, SampleRow.sample_id, getattr(SampleRow, metric)).where(
                SampleRow.run_id.in_([r.id for r in keep]), SampleRow.scenario == scenario)):
        if v is not None:
            per_run.setdefault(run_id, {})[sample_id] = v
    series = Series()
    for r in keep:
        if values.get(r.id) is not None and per_run.get(r.id):
            series.run_ids.append(r.id)
            series.values.append(values[r.id])
            series.samples.append(per_run[r.id])
    return series


def pooled_series(session: Session, run: Run, candidates: list[Run], scenarios: list[str],
                  metric: str) -> Series:
    """The baseline of a run's pooled series: the kept earlier runs' per-sample values of these
    scenarios, keyed ``scenario/sample id``; each run's value is their mean."""
    keep = kept_runs(session, run, candidates, POOLED, metric)
    per_run: dict[int, dict[str, float]] = {}
    for run_id, scenario, sample_id, v in session.execute(
            select(SampleRow.run_id, SampleRow.scenario, SampleRow.sample_id, getattr(SampleRow, metric))
            .where(SampleRow.run_id.in_([r.id for r in keep]), SampleRow.scenario.in_(scenarios))):
        if v is not None:
            per_run.setdefault(run_id, {})[f"{scenario}/{sample_id}"] = v
    series = Series()
    for r in keep:
        if per_run.get(r.id):
            series.run_ids.append(r.id)
            series.values.append(float(np.mean(list(per_run[r.id].values()))))
            series.samples.append(per_run[r.id])
    return series


def run_engine(run: Run) -> str | None:
    """The engine of a run's job (``jobs.spec.JobSpec.engine``); None when its spec is none."""
    from evalsvc.jobs.spec import job_spec  # the jobs package records runs with this module

    spec = job_spec(run.job)
    return spec.engine if spec is not None else None


def stored_limits(run: Run, scenarios: Iterable[str],
                  thresholds: ThresholdsFile | None = None) -> dict[str, Limits]:
    """The limits a run is judged against, by scenario: those stored on it when it was planned
    (``runs.limits``: ``judging.config_limits`` of its config, matrix and engine). A run without
    them (recorded before migration 0009, or recorded without being planned) or without a
    scenario's falls back to the rules of ``evalsvc/configs/thresholds.yaml`` for its matrix's
    name, config, model and settings on its job's engine (``judging.scenario_limits`` with no
    matrix file): the matrix file's own thresholds and accept floor, which only the stored limits
    carry, are left out."""
    stored = run.limits or {}
    out: dict[str, Limits] = {}
    for scenario in dict.fromkeys(scenarios):
        if isinstance(stored.get(scenario), dict):
            out[scenario] = Limits.model_validate(stored[scenario])
            continue
        config = Config(name=run.config, matrix=run.matrix, model=run.model,
                        settings=run.settings or {}, args=run.requested_args or {},
                        fingerprint=run.fingerprint, scenarios=())
        out[scenario] = scenario_limits(config, None, scenario,
                                        engine=run_engine(run),
                                        thresholds=thresholds)
    return out


def run_history(session: Session, run: Run, scenarios: Iterable[str],
                thresholds: ThresholdsFile | None = None) -> History:
    """The history of a run's series, for ``judging.judge_run``: the baseline of each of
    ``scenarios``' metrics (``baseline_series``), of each metric pooled over the scenarios that
    may be pooled (``pooled_series``), the series' known failures, and the thresholds' history
    settings. ``run``: its place in its series (build, finish time) set."""
    thresholds = thresholds or load_thresholds()
    hs = thresholds.history
    candidates = earlier_runs(session, run, limit=3 * max(hs.window, hs.change_point_window))
    names = list(dict.fromkeys(scenarios))
    history = History(known=known_failures(session, run), settings=hs)
    for scenario in names:
        for metric in METRICS:
            history.series[(scenario, metric)] = baseline_series(session, run, candidates,
                                                                 scenario, metric)
    for metric in METRICS:
        pooled = [sc for sc in names if metric == "accept_length" or sc in HIT_SCENARIOS]
        if len(pooled) >= 2:
            history.pooled[metric] = pooled_series(session, run, candidates, pooled, metric)
    return history


def track(session: Session, run: Run, verdicts: list[VerdictRow]) -> None:
    """Open, extend or close the regressions of the run's series (only from the series' newest
    run: evaluations of older commits, such as bisection steps, never move them). A regression
    verdict extends the series' open regression that is not a known failure (triaged expected),
    or opens one; an expected verdict extends its known failure; any other conclusive verdict
    closes the series' open regressions, but for the known failure an expected one holds to."""
    if not newest_in_series(session, run):
        return
    for v in verdicts:
        if v.verdict == MetricVerdict.INCONCLUSIVE:
            continue
        series = session.scalars(select(Regression).where(
            Regression.fingerprint == run.fingerprint, Regression.patch_set == run.build.patch_set,
            Regression.scenario == v.scenario, Regression.metric == v.metric,
            Regression.state == "open").order_by(Regression.id)).all()
        holding = (v.evidence or {}).get("known_failure", {}).get("regression_id") \
            if v.verdict == MetricVerdict.EXPECTED else None
        if v.verdict != MetricVerdict.REGRESSION:
            for reg in series:
                if reg.id == holding:
                    if reg.last_run_id != run.id:
                        reg.last_run_id, reg.runs_seen = run.id, reg.runs_seen + 1
                elif reg.first_run_id != run.id:
                    reg.state, reg.resolved_run_id, reg.resolved_at = "resolved", run.id, utcnow()
                    log.info("regression %d resolved by run %d", reg.id, run.id)
        else:
            reg = next((r for r in series if not is_known_failure(r)), None)
            if reg is None:
                reg = Regression(fingerprint=run.fingerprint, patch_set=run.build.patch_set,
                                 scenario=v.scenario, metric=v.metric, config=run.config,
                                 matrix=run.matrix, state="open", first_run_id=run.id,
                                 last_run_id=run.id, runs_seen=1,
                                 last_good_run_id=last_good_run(session, run, v.scenario,
                                                                v.metric))
                session.add(reg)
                log.warning("regression opened: %s %s %s (run %d)", run.config, v.scenario,
                            v.metric, run.id)
            elif reg.last_run_id != run.id:
                reg.last_run_id, reg.runs_seen = run.id, reg.runs_seen + 1
    session.flush()



def last_good_run(session: Session, run: Run, scenario: str, metric: str) -> int | None:
    """The newest earlier run of the series whose verdict for this scenario and metric was a
    pass (or an improvement): where a bisection starts."""
    for r in earlier_runs(session, run, limit=100):
        v = session.scalars(select(VerdictRow.verdict).where(
            VerdictRow.run_id == r.id, VerdictRow.scenario == scenario, VerdictRow.metric == metric)).first()
        if v in (MetricVerdict.PASS, MetricVerdict.IMPROVEMENT):
            return r.id
    return None


def compare_builds(session: Session, baseline_build: int, contender_build: int,
                   metric: str = "kl_k3_mean", thresholds: ThresholdsFile | None = None
                   ) -> list[JudgedComparison]:
    """``queries.compare``'s rows (per config and scenario), each judged as one step of a series
    whose only earlier run is the baseline build's: both builds ran the same prompts and seeds, so
    the history test's paired per-sample tests apply (location, and tail where the thresholds ask
    for it). The fixed limits are left to each run's own verdicts. Adds ``paired_verdict``
    (regression / improvement / pass / inconclusive; None for a metric without verdicts),
    ``paired_reason``, ``paired_test`` and ``paired``: the whole judgement (the keys of a stored
    verdict: method, value, baseline, the interval of the difference, effect floor, p-value and
    evidence, whose ``location_interval`` on its ``scale`` is the interval the test decides on),
    None where ``paired_verdict`` is."""
    from evalsvc.store import queries

    thresholds = thresholds or load_thresholds()
    rows = []
    for row in queries.compare(session, baseline_build, contender_build, metric=metric):
        j = None
        if metric in METRICS and row.contender is not None and row.baseline is not None:
            j = judge_paired(session, row, metric, thresholds)
        rows.append(JudgedComparison(**dict(row)) if j is None else JudgedComparison(
            **dict(row), paired_verdict=j.verdict, paired_reason=j.reason or None,
            paired_test=j.evidence.get("test"),
            paired=VerdictRead(**{**asdict(j), "reason": j.reason or None})))
    return rows


def judge_paired(session: Session, row: ScenarioComparison, metric: str,
                 thresholds: ThresholdsFile) -> Judgement | None:
    """``compare_builds``' judgement of one row: the contender's value and samples against the
    baseline run's as its series' only earlier run (None where the test has nothing to say)."""
    base, cont = session.get(Run, row.baseline_run), session.get(Run, row.contender_run)
    scenario = row.scenario
    per_run: dict[int, dict[str, float]] = {base.id: {}, cont.id: {}}
    for run_id, sample_id, value in session.execute(
            select(SampleRow.run_id, SampleRow.sample_id, getattr(SampleRow, metric))
            .where(SampleRow.run_id.in_([base.id, cont.id]), SampleRow.scenario == scenario)):
        if value is not None:
            per_run[run_id][sample_id] = value
    coverage = [v for v in session.scalars(select(Metric.value).where(
        Metric.run_id.in_([base.id, cont.id]), Metric.scenario == scenario,
        Metric.name == "hit_coverage")) if v is not None]
    limits = stored_limits(cont, [scenario], thresholds)[scenario]
    return judge_comparison(scenario, metric, row.contender, per_run[cont.id], base.id,
                            row.baseline, per_run[base.id], limits, thresholds.history,
                            coverage=min(coverage) if coverage else None)
