"""Verdicts: each metric of each scenario of a run, judged, with its evidence; regressions opened
and closed from them.

A metric is judged in this order, and the first rule that decides wins:

1. coverage: a scenario that did not hit the cache as much as its limit asks is ``inconclusive``,
   never a pass;
2. fixed limits (``configs/thresholds.yaml``): bit-exactness under deterministic inference, the KL
   maximum, the acceptance floor;
3. history: the contender's per-sample values against those of the fingerprint's earlier runs
   (same patch set, before it in commit order, not themselves flagged), which share its prompts
   and seeds (``metrics.stats.paired_shift``):

   * location: per sample (the same prompt), the contender's value minus the baseline runs' mean
     for it, and Student's interval on the mean difference, for KL on the log scale (Welch's
     between the groups when samples cannot be paired); a regression needs the interval to
     exclude no change (statistically clear) and the mean difference to exceed the effect floor
     (large enough to matter); an improvement the same the other way;
   * tail, for metrics whose thresholds ask for it (teacher-forced extend KL, greedy
     acceptance): samples far out in the bad direction (a robust z past a Bonferroni bound,
     against the baseline's distribution of every sample for KL, against the pairs for
     acceptance), each by more than the effect floor (and ``tail_factor`` times the baseline's
     median sample), are a regression too: a bug that strikes a few requests hard moves no mean;
4. change point: the series of per-run values, the contender last, searched for one lasting shift
   in the mean (a permutation test); a significant shift of at least the effect floor in the bad
   direction, with the contender after it, is a regression too.

KL (higher is worse) and acceptance length (lower is worse) are judged on their own: an unchanged
KL says nothing about an MTP config's acceptance. Each metric is also judged over the run's
conclusive scenarios together (``pooled``: the hit scenarios for KL, all with acceptance for it;
history only), as one defect acts in several and their samples pooled make the test sharper.

Regressions are tracked per series (fingerprint, patch set, scenario, metric) for jobs that ask
for it (nightly): the first flagged run opens one, later flagged runs extend it, and the next run
that passes closes it. Only the newest run of a series moves it, so bisection steps on older
commits never do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from sqlalchemy import and_, delete, or_, select
from sqlalchemy.orm import Session

from evalsvc.matrix import SCENARIOS
from evalsvc.metrics.stats import change_point, paired_shift
from evalsvc.store.models import (
    Build,
    Commit,
    Metric,
    Regression,
    Run,
    Sample,
    Verdict,
    utcnow,
)
from evalsvc.thresholds import HistorySettings, Limits, ThresholdsFile, limits_for, load_thresholds
from evalsvc.types import worst

log = logging.getLogger("evalsvc.verdicts")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

# metric -> +1 when higher is worse, -1 when lower is worse
METRICS = {"kl_k3_mean": 1, "extend_kl_k3_mean": 1, "accept_length": -1}
LABELS = {"kl_k3_mean": "mean KL (k3)", "extend_kl_k3_mean": "extend KL (k3)",
          "accept_length": "accept length"}
LOG_SCALE = {"kl_k3_mean", "extend_kl_k3_mean"}  # positive, heavy-tailed, multiplied by a bug
# the verdicts of a run's scenarios judged together ("scenario" of those verdicts and regressions)
POOLED = "pooled"
HIT_SCENARIOS = ("prefill_hit", "decode_hit", "branching", "host_tier")


@dataclass
class Judgement:
    scenario: str
    metric: str
    verdict: str  # pass | regression | improvement | inconclusive
    method: str  # coverage | threshold | bit_exact | history | change_point
    value: float | None = None
    baseline: float | None = None
    diff_low: float | None = None
    diff_high: float | None = None
    threshold: float | None = None
    p_value: float | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


@dataclass
class Series:
    """A series' earlier runs that form the baseline, oldest first."""

    run_ids: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)  # the scenario's metric per run
    samples: list[dict[str, float]] = field(default_factory=list)  # sample id -> value, per run


def judge_metric(scenario: str, metric: str, value: float | None, samples: dict[str, float],
                 limits: Limits, history: Series, settings: HistorySettings, *,
                 coverage: float | None = None, exact_fraction: float | None = None
                 ) -> Judgement | None:
    """One metric of one scenario (``samples``: the contender's value per sample id); None when
    the scenario has no such metric."""
    if value is None:
        return None
    sign = METRICS[metric]
    label = LABELS[metric]
    j = Judgement(scenario, metric, "pass", "threshold", value=value)
    need = limits.min_hit_coverage
    if coverage is not None and (coverage < need or (need > 0 and coverage == 0)):
        j.verdict, j.method, j.threshold = "inconclusive", "coverage", need
        j.evidence = {"hit_coverage": coverage}
        j.reason = f"hit coverage {coverage:.2f} below {need:.2f}: the cache path was not exercised"
        return j
    lim = getattr(limits, metric)
    if sign > 0 and limits.bit_exact:
        exact = 1.0 if exact_fraction is None or metric != "kl_k3_mean" else exact_fraction
        j.method, j.threshold, j.evidence = "bit_exact", 0.0, {"bit_exact_fraction": exact}
        if value > 0 or exact < 1.0:
            j.verdict = "regression"
            j.reason = (f"not bit-exact under deterministic inference: {label} {value:.3g}, "
                        f"{exact:.1%} of tokens exact")
            return j
    elif sign > 0 and lim.max is not None and value > lim.max:
        j.verdict, j.threshold = "regression", lim.max
        j.reason = f"{label} {value:.3g} above the limit {lim.max:.3g}"
        return j
    elif sign < 0 and lim.min is not None and scenario == "speculative" and value < lim.min:
        j.verdict, j.threshold = "regression", lim.min
        j.reason = f"{label} {value:.3f} below the floor {lim.min:.3f}"
        return j
    if j.method == "threshold":
        j.threshold = lim.max if sign > 0 else lim.min
    return _judge_history(j, samples, limits, history, settings)


def _judge_history(j: Judgement, samples: dict[str, float], limits: Limits, history: Series,
                   settings: HistorySettings) -> Judgement:
    sign, label = METRICS[j.metric], LABELS[j.metric]
    base_runs = history.run_ids[-settings.window:]
    j.evidence["history_runs"] = len(history.run_ids)
    if len(base_runs) < settings.min_runs:
        j.evidence["history"] = f"{len(base_runs)} earlier run(s), {settings.min_runs} needed"
        return j
    window = history.samples[-settings.window:]
    base = np.array([v for run in window for v in run.values()])
    if len(samples) < 2 or base.size < 2:
        j.evidence["history"] = f"too few samples ({len(samples)} against {base.size})"
        return j
    lim = getattr(limits, j.metric)
    log_floor = tail_floor = None
    if j.metric in LOG_SCALE:  # values far below the smallest change that matters are alike
        least = max(lim.min_effect or 0.0, 1e-30)
        log_floor = max(float(np.median(base)), least)
        tail_floor = max(float(np.quantile(base, 0.1)), least)
    # a KL averaged over an extend varies little from prompt to prompt and more from run to run
    # (its chunk grid follows the batch): its tail is judged against the baseline's distribution;
    # greedy acceptance repeats per prompt: against the pairs
    shift = paired_shift(samples, window, confidence=settings.confidence, log_floor=log_floor,
                         tail=sign if lim.tail else 0, tail_floor=tail_floor,
                         tail_against="distribution" if j.metric in LOG_SCALE else "pairs")
    floor = limits.effect_floor(j.metric, float(base.mean()))
    j.method, j.baseline = "history", float(np.mean(history.values[-settings.window:]))
    j.diff_low, j.diff_high, j.threshold, j.p_value = shift.low, shift.high, floor, shift.p
    j.evidence.update({"baseline_runs": base_runs, "n": len(samples), "pairs": shift.n,
                       "n_baseline": int(base.size), "confidence": settings.confidence,
                       "test": "paired_t" if shift.test == "paired" else shift.test,
                       "scale": shift.scale, "diff": shift.diff,
                       "location_interval": [shift.location_low, shift.location_high]})
    worse_low = shift.location_low if sign > 0 else -shift.location_high
    better_high = shift.location_high if sign > 0 else -shift.location_low
    worse = sign * shift.diff
    if worse_low > 0 and worse > floor:
        j.verdict = "regression"
        j.reason = (f"{label} {j.value:.4g} against {j.baseline:.4g} over {len(base_runs)} "
                    f"earlier runs: difference [{shift.low:.3g}, {shift.high:.3g}] at "
                    f"{settings.confidence:.1%}, a change beyond the effect floor {floor:.3g}")
        return j
    if shift.tail_p is not None:
        least = (lim.tail_factor or 0.0) * float(np.median(base))  # an order of magnitude, say
        far = [o for o in shift.outliers if sign * (o[1] - o[2]) > floor and o[1] >= least]
        j.evidence["tail"] = {"p_value": shift.tail_p, "z_bound": shift.tail_z,
                              "outliers": [list(o) for o in far[:10]]}
        if far and shift.tail_p <= 1.0 - settings.confidence:
            sid, c, b, z = max(far, key=lambda o: o[3])
            j.verdict, j.p_value = "regression", shift.tail_p
            j.evidence["test"] = "tail"
            j.reason = (f"{label}: {len(far)} of {shift.n} samples far beyond their baseline "
                        f"(the farthest, {sid}: {c:.3g} against {b:.3g}, z = {z:.1f} past "
                        f"{shift.tail_z:.1f}; p = {shift.tail_p:.2g}), each beyond the effect "
                        f"floor {floor:.3g}")
            return j
    if better_high < 0 and -worse > floor:
        j.verdict = "improvement"
        j.reason = (f"{label} {j.value:.4g} against {j.baseline:.4g}: difference "
                    f"[{shift.low:.3g}, {shift.high:.3g}]")
        return j
    series = [*history.values[-(settings.change_point_window - 1):], j.value]
    if len(series) >= settings.change_point_min_runs:
        cp = change_point(series, permutations=settings.permutations)
        if cp is not None:
            shift = cp["after"] - cp["before"]
            floor_cp = limits.effect_floor(j.metric, cp["before"])
            offset = len(history.values) - (len(series) - 1)  # series[0] is values[offset]
            first = (history.run_ids[offset + cp["index"]] if cp["index"] < len(series) - 1
                     else None)  # None: the contender itself
            j.evidence["change_point"] = {**cp, "first_run_id": first}
            if cp["p_value"] <= settings.change_point_alpha and sign * shift > floor_cp:
                j.verdict, j.method, j.p_value, j.threshold = ("regression", "change_point",
                                                               cp["p_value"], floor_cp)
                j.reason = (f"{label} shifted from {cp['before']:.4g} to {cp['after']:.4g} "
                            f"{len(series) - cp['index']} runs ago (p = {cp['p_value']:.2g})")
    return j


# ---- the store side --------------------------------------------------------------------------

def order_key(run: Run) -> tuple:
    return (run.build.commit.committed_at or EPOCH, run.finished_at or run.created_at, run.id)


def _series_query(run: Run):
    return (select(Run).join(Build, Run.build_id == Build.id)
            .join(Commit, Build.commit_id == Commit.id)
            .where(Run.fingerprint == run.fingerprint, Build.patch_set == run.build.patch_set,
                   Run.status == "done", Run.id != run.id))


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
    made them the new normal (then nothing before that regression counts)."""
    expected = session.scalars(
        select(Regression).where(Regression.fingerprint == run.fingerprint,
                                 Regression.patch_set == run.build.patch_set,
                                 Regression.scenario == scenario, Regression.metric == metric,
                                 Regression.triage == "expected")
        .order_by(Regression.opened_at.desc()).limit(1)).first()
    start = order_key(expected.first_run) if expected is not None else None
    ids = [r.id for r in candidates]
    flagged = set(session.scalars(select(Verdict.run_id).where(
        Verdict.run_id.in_(ids), Verdict.scenario == scenario, Verdict.metric == metric,
        Verdict.verdict == "regression")))
    keep = [r for r in candidates if (start is not None and order_key(r) >= start)
            or (start is None and r.id not in flagged)]
    keep.reverse()  # oldest first
    return keep


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
            select(Sample.run_id, Sample.sample_id, getattr(Sample, metric)).where(
                Sample.run_id.in_([r.id for r in keep]), Sample.scenario == scenario)):
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
            select(Sample.run_id, Sample.scenario, Sample.sample_id, getattr(Sample, metric))
            .where(Sample.run_id.in_([r.id for r in keep]), Sample.scenario.in_(scenarios))):
        if v is not None:
            per_run.setdefault(run_id, {})[f"{scenario}/{sample_id}"] = v
    series = Series()
    for r in keep:
        if per_run.get(r.id):
            series.run_ids.append(r.id)
            series.values.append(float(np.mean(list(per_run[r.id].values()))))
            series.samples.append(per_run[r.id])
    return series


def judge_pooled(session: Session, run: Run, candidates: list[Run], metric: str,
                 samples: dict[tuple[str, str], dict[str, float]],
                 thresholds: ThresholdsFile) -> Judgement | None:
    """One metric over the run's conclusive scenarios together (the hit scenarios for KL, every
    scenario with acceptance for it), when there are two or more: one defect acts in several, and
    their samples pooled make the location test sharper. History only: fixed limits and the tail
    test belong to each scenario's own verdict."""
    scenarios = [sc for sc in SCENARIOS if any(
        r.scenario == sc and r.verdict in ("pass", "fail") for r in run.scenarios)
        and (sc, metric) in samples and (metric == "accept_length" or sc in HIT_SCENARIOS)]
    if len(scenarios) < 2:
        return None
    pooled = {f"{sc}/{sid}": v for sc in scenarios for sid, v in samples[(sc, metric)].items()}
    limits = run_limits(run, POOLED, thresholds)
    lim = getattr(limits, metric).model_copy(update={"max": None, "min": None, "tail": False})
    limits = limits.model_copy(update={metric: lim, "bit_exact": False, "min_hit_coverage": 0.0})
    j = judge_metric(POOLED, metric, float(np.mean(list(pooled.values()))), pooled, limits,
                     pooled_series(session, run, candidates, scenarios, metric),
                     thresholds.history)
    if j is not None:
        j.evidence["scenarios"] = scenarios
    return j


def run_limits(run: Run, scenario: str, thresholds: ThresholdsFile) -> Limits:
    """The limits in force for a run's config and a scenario, from the job's matrix."""
    spec = run.job.spec or {}
    matrix = spec.get("matrix") if isinstance(spec.get("matrix"), dict) else {}
    model = (matrix.get("models") or {}).get(run.model) or {}
    floor = None
    if (run.settings or {}).get("mtp"):
        steps = (matrix.get("mtp") or {}).get("num_steps", 3)
        floors = model.get("accept_floor") or {}
        floor = floors.get(steps, floors.get(str(steps)))
    return limits_for(matrix=run.matrix, engine=spec.get("engine") or matrix.get("engine")
                      or "embedded", config=run.config, model=run.model,
                      settings=run.settings or {}, scenario=scenario, thresholds=thresholds,
                      matrix_thresholds={k: v for k, v in (matrix.get("thresholds") or {}).items()
                                         if v is not None},
                      accept_floor=floor)


def judge_run(session: Session, run_id: int, thresholds: ThresholdsFile | None = None
              ) -> list[Verdict]:
    """Judge every metric of every scenario of a recorded run and store the verdicts (replacing
    any it had). A history regression turns its scenario's verdict to fail."""
    thresholds = thresholds or load_thresholds()
    hs = thresholds.history
    run = session.get(Run, run_id)
    session.execute(delete(Verdict).where(Verdict.run_id == run_id))
    if run.status != "done":
        return []
    metrics: dict[str, dict[str, float | None]] = {}
    for scen, name, value in session.execute(select(Metric.scenario, Metric.name, Metric.value)
                                             .where(Metric.run_id == run_id)):
        metrics.setdefault(scen, {})[name] = value
    samples: dict[tuple[str, str], dict[str, float]] = {}
    for row in session.execute(select(Sample.scenario, Sample.sample_id,
                                      *(getattr(Sample, m) for m in METRICS))
                               .where(Sample.run_id == run_id)):
        for metric in METRICS:
            v = getattr(row, metric)
            if v is not None:
                samples.setdefault((row.scenario, metric), {})[row.sample_id] = v
    candidates = earlier_runs(session, run, limit=3 * max(hs.window, hs.change_point_window))
    out: list[Verdict] = []

    def add(j: Judgement) -> None:
        v = Verdict(run_id=run_id, scenario=j.scenario, metric=j.metric, verdict=j.verdict,
                    method=j.method, value=j.value, baseline=j.baseline, diff_low=j.diff_low,
                    diff_high=j.diff_high, threshold=j.threshold, p_value=j.p_value,
                    evidence=j.evidence, reason=j.reason or None)
        session.add(v)
        out.append(v)

    for scen_row in run.scenarios:
        m = metrics.get(scen_row.scenario)
        if not m or scen_row.verdict == "error":
            continue
        limits = run_limits(run, scen_row.scenario, thresholds)
        for metric in METRICS:
            series = baseline_series(session, run, candidates, scen_row.scenario, metric)
            j = judge_metric(scen_row.scenario, metric, m.get(metric),
                             samples.get((scen_row.scenario, metric), {}),
                             limits, series, hs, coverage=m.get("hit_coverage"),
                             exact_fraction=m.get("bit_exact_fraction"))
            if j is None:
                continue
            add(j)
            if j.verdict == "regression" and scen_row.verdict == "pass":
                scen_row.verdict, scen_row.reason = "fail", j.reason
    reasons = [(s.scenario, s.verdict, s.reason) for s in run.scenarios]
    pooled = None
    for metric in METRICS:
        j = judge_pooled(session, run, candidates, metric, samples, thresholds)
        if j is not None:
            add(j)
            if j.verdict == "regression" and pooled is None:
                pooled = (POOLED, "fail", f"{', '.join(j.evidence['scenarios'])} together: "
                                          f"{j.reason}")
    if pooled is not None:
        reasons.append(pooled)
    if reasons and run.verdict not in ("invalid", "cancelled"):
        run.verdict, reason = worst(reasons)
        if reason is not None:
            run.reason = reason
    session.flush()
    return out


def track(session: Session, run: Run, verdicts: list[Verdict]) -> None:
    """Open, extend or close the regressions of the run's series (only from the series' newest
    run: evaluations of older commits, such as bisection steps, never move them)."""
    if not newest_in_series(session, run):
        return
    for v in verdicts:
        if v.verdict == "inconclusive":
            continue
        reg = session.scalars(select(Regression).where(
            Regression.fingerprint == run.fingerprint, Regression.patch_set == run.build.patch_set,
            Regression.scenario == v.scenario, Regression.metric == v.metric,
            Regression.state == "open")).first()
        if v.verdict == "regression":
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
        elif reg is not None and reg.first_run_id != run.id:
            reg.state, reg.resolved_run_id, reg.resolved_at = "resolved", run.id, utcnow()
            log.info("regression %d resolved by run %d", reg.id, run.id)
    session.flush()



def last_good_run(session: Session, run: Run, scenario: str, metric: str) -> int | None:
    """The newest earlier run of the series whose verdict for this scenario and metric was a
    pass (or an improvement): where a bisection starts."""
    for r in earlier_runs(session, run, limit=100):
        v = session.scalars(select(Verdict.verdict).where(
            Verdict.run_id == r.id, Verdict.scenario == scenario, Verdict.metric == metric)).first()
        if v in ("pass", "improvement"):
            return r.id
    return None


def judge_recorded(store, run_ids: list[int], track_regressions: bool = False) -> list[Verdict]:
    """Judge runs recorded outside the job service (``evalsvc run --store``), each in a
    transaction of its own, oldest first; optionally tracking their regressions."""
    out = []
    for run_id in run_ids:
        with store.session() as s:
            verdicts = judge_run(s, run_id)
            if track_regressions:
                track(s, s.get(Run, run_id), verdicts)
            out.extend(verdicts)
    return out


def compare_builds(session: Session, baseline_build: int, contender_build: int,
                   metric: str = "kl_k3_mean", thresholds: ThresholdsFile | None = None
                   ) -> list[dict[str, Any]]:
    """``queries.compare``'s rows (per config and scenario), each judged as one step of a series
    whose only earlier run is the baseline build's: both builds ran the same prompts and seeds, so
    the history test's paired per-sample tests apply (location, and tail where the thresholds ask
    for it). The fixed limits are left to each run's own verdicts. Adds ``paired_verdict``
    (regression / improvement / pass / inconclusive; None for a metric without verdicts),
    ``paired_reason`` and ``paired_test``."""
    from evalsvc.store import queries

    thresholds = thresholds or load_thresholds()
    rows = queries.compare(session, baseline_build, contender_build, metric=metric)
    settings = thresholds.history.model_copy(update={"min_runs": 1})
    for row in rows:
        row.update(paired_verdict=None, paired_reason=None, paired_test=None)
        if metric not in METRICS or row["contender"] is None or row["baseline"] is None:
            continue
        base, cont = session.get(Run, row["baseline_run"]), session.get(Run, row["contender_run"])
        scenario = row["scenario"]
        per_run: dict[int, dict[str, float]] = {base.id: {}, cont.id: {}}
        for run_id, sample_id, value in session.execute(
                select(Sample.run_id, Sample.sample_id, getattr(Sample, metric))
                .where(Sample.run_id.in_([base.id, cont.id]), Sample.scenario == scenario)):
            if value is not None:
                per_run[run_id][sample_id] = value
        coverage = [v for v in session.scalars(select(Metric.value).where(
            Metric.run_id.in_([base.id, cont.id]), Metric.scenario == scenario,
            Metric.name == "hit_coverage")) if v is not None]
        limits = run_limits(cont, scenario, thresholds)
        lim = getattr(limits, metric).model_copy(update={"max": None, "min": None})
        limits = limits.model_copy(update={metric: lim, "bit_exact": False})
        j = judge_metric(scenario, metric, row["contender"], per_run[cont.id], limits,
                         Series([base.id], [row["baseline"]], [per_run[base.id]]), settings,
                         coverage=min(coverage) if coverage else None)
        if j is not None:
            row.update(paired_verdict=j.verdict, paired_reason=j.reason or None,
                       paired_test=j.evidence.get("test"))
    return rows
