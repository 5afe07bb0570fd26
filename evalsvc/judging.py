"""Judging: each metric of each scenario of a run against its limits and its history, with the
evidence, each scenario's verdict and the run's. One judge (``judge_run``), pure: it takes the run
as the harness measured it (``RunResult``, its scenarios ``measured``), the limits per scenario
(``config_limits``, stored on the run when it is planned) and the history (``History``: what the
store knows of the run's series, which ``evalsvc.verdicts.run_history`` reads; none for a run
outside the store). It runs once, where a run is recorded (``jobs.record.record_result``), or
with no history where nothing is stored (``evaluate.evaluate``). The store side (the history
read, the verdicts written, regressions tracked) is ``evalsvc.verdicts``.

A metric is judged in this order, and the first rule that decides wins:

1. coverage: a scenario that did not hit the cache as much as its limit asks is ``inconclusive``,
   never a pass;
2. fixed limits (``evalsvc/configs/thresholds.yaml``): bit-exactness under deterministic inference, the KL
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
   direction, with the contender after it, is a regression too;
5. known failures: in a series with an open regression triaged ``expected`` (a known failure,
   with its link), a regression no worse than the level it was triaged at by more than the effect
   floor, or a pass within the floor of that level, is ``expected``; worse than that, it stays a
   regression.

KL (higher is worse) and acceptance length (lower is worse) are judged on their own: an unchanged
KL says nothing about an MTP config's acceptance. Each metric is also judged over the run's
conclusive scenarios together (``pooled``: the hit scenarios for KL, all with acceptance for it;
history only), as one defect acts in several and their samples pooled make the test sharper.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evalsvc.matrix import SCENARIOS, Config, MatrixFile
from evalsvc.metrics.kl import PositionKL, kl_by_position, token_kl_by_sample
from evalsvc.metrics.stats import change_point, paired_shift
from evalsvc.thresholds import HistorySettings, Limits, ThresholdsFile, limits_for
from evalsvc.types import MetricVerdict, RunResult, ScenarioResult, Verdict, worst

# metric -> +1 when higher is worse, -1 when lower is worse
METRICS = {"kl_k3_mean": 1, "extend_kl_k3_mean": 1, "accept_length": -1}
LABELS = {"kl_k3_mean": "mean KL (k3)", "extend_kl_k3_mean": "extend KL (k3)",
          "accept_length": "accept length"}
LOG_SCALE = {"kl_k3_mean", "extend_kl_k3_mean"}  # positive, heavy-tailed, multiplied by a bug
# the verdicts of a run's scenarios judged together ("scenario" of those verdicts and regressions)
POOLED = "pooled"
HIT_SCENARIOS = ("prefill_hit", "decode_hit", "branching", "host_tier", "mixed_hit",
                 "chunked_hit")
# a scenario's failure that no metric's verdict says (``judge_scenario``)
NO_SPEC_COUNTERS = "no speculative counters in the responses"
# a failing extend's reason names at most this many positions that carry half of its k3, when
# their level is at least STANDOUT times the rest's
NAMED_POSITIONS = 3
STANDOUT = 10.0


@dataclass
class Judgement:
    scenario: str
    metric: str
    verdict: MetricVerdict
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


@dataclass
class KnownFailure:
    """An open regression of a series triaged expected: the level its metric failed at when it
    was triaged, and where to read about it."""

    regression_id: int
    level: float
    link: str | None = None


@dataclass
class History:
    """What the store knows of a run's series, for ``judge_run``: the baseline of each scenario's
    metric (``series``, by (scenario, metric)); of each metric pooled over the scenarios
    (``pooled``, by metric: the earlier runs' per-sample values of every scenario that may be
    pooled, keyed ``scenario/sample id``, ``judge_run`` keeps those of the scenarios it pools);
    the series' known failures (``known``, by (scenario, metric), ``POOLED`` for the pooled
    series); and the history settings of the thresholds. Empty: a run without history."""

    series: dict[tuple[str, str], Series] = field(default_factory=dict)
    pooled: dict[str, Series] = field(default_factory=dict)
    known: dict[tuple[str, str], KnownFailure] = field(default_factory=dict)
    settings: HistorySettings = field(default_factory=HistorySettings)


def hold_known(j: Judgement | None, known: KnownFailure | None, limits: Limits) -> None:
    """A verdict of a series with a known failure, against the known level and the metric's
    effect floor there (``Limits.effect_floor``): a regression no worse than the level by more
    than the floor, or a pass within the floor of it (the new baseline's level: the failure is
    still there), is ``expected``, for a reason that names the regression and its link. A
    regression worse than that stays one, its reason saying so; a pass further below the level
    (a fix), an improvement and an inconclusive verdict stay as they are."""
    if (j is None or known is None or j.value is None
            or j.verdict not in (MetricVerdict.REGRESSION, MetricVerdict.PASS)):
        return
    floor = limits.effect_floor(j.metric, known.level)
    worse = METRICS[j.metric] * (j.value - known.level)
    label = LABELS[j.metric]
    about = f"regression #{known.regression_id}{', ' + known.link if known.link else ''}"
    facts = {"regression_id": known.regression_id, "link": known.link, "level": known.level,
             "floor": floor}
    if j.verdict == MetricVerdict.REGRESSION and worse > floor:
        j.evidence["known_failure"] = {**facts, "exceeded": True}
        j.reason = (f"{j.reason}; worse than the known failure ({about}: {label} "
                    f"{known.level:.3g}) by more than the effect floor {floor:.3g}")
    elif j.verdict == MetricVerdict.REGRESSION or abs(worse) <= floor:
        j.evidence["known_failure"] = {**facts, "exceeded": False}
        j.reason = f"known failure ({about}): " + (
            j.reason if j.verdict == MetricVerdict.REGRESSION else
            f"{label} {j.value:.4g} at its level {known.level:.3g} (within the effect floor "
            f"{floor:.3g})")
        j.verdict = MetricVerdict.EXPECTED


def coverage_shortfall(coverage: float | None, need: float) -> str | None:
    """Why a scenario that hit the cache for a ``coverage`` fraction of its samples says nothing
    about the cache path, when ``need`` asks for more (or for any and it had none); None when
    it covers enough, or coverage was not measured."""
    if coverage is not None and (coverage < need or (need > 0 and coverage == 0)):
        return f"hit coverage {coverage:.2f} below {need:.2f}: the cache path was not exercised"
    return None


def extend_location(profile: PositionKL | None) -> str | None:
    """Where along the extend its k3 sits, for a failing extend verdict's reason, as "k3 130, 41,
    9.5 at extend positions 0, 1, 2 of 96; positions 3+ at 0.0001" (positions counted from the
    first token after the cached prefix), or "spread along the extend of 96, no position standing
    out".

    The positions named are the fewest whose k3, summed over the samples, is at least half of all
    the extend's, each next one that stands out from what is left added (STANDOUT times its
    level); at most NAMED_POSITIONS, and they must stand out from the rest together. A position's
    level is its mean k3 over the samples whose extend reaches it; the rest's, the mean over all
    of its tokens, with its highest position where that stands out from it ("...; other
    positions at 0.00075, up to 0.047 (position 3)"). Extends differ in length: "of 40-96" gives
    the shortest and the longest. None without extends of two tokens or more (one position says
    nothing about where), or without k3 to place (zero, or infinite)."""
    if profile is None or profile.sums.size < 2:
        return None
    sums, counts = profile.sums, profile.counts
    total = float(sums.sum())
    if not np.isfinite(total) or total <= 0:
        return None
    lengths = profile.lengths[profile.lengths > 0]
    low, high = int(lengths.min()), int(lengths.max())
    span = f"{high}" if low == high else f"{low}-{high}"
    order = np.argsort(-sums, kind="stable")

    def level(positions: np.ndarray) -> float:
        return float(sums[positions].sum() / counts[positions].sum()) if positions.size else 0.0

    k = int(np.searchsorted(np.cumsum(sums[order]), 0.5 * total)) + 1
    while k < min(NAMED_POSITIONS, sums.size - 1) and (
            0 < level(order[k:k + 1]) >= STANDOUT * level(order[k + 1:])):
        k += 1
    named, rest = np.sort(order[:k]), level(order[k:])
    if k > NAMED_POSITIONS or k >= sums.size or level(named) < STANDOUT * rest:
        return f"spread along the extend of {span}, no position standing out"
    levels = sums / counts
    at = ", ".join(f"{levels[p]:.3g}" for p in named)
    where = ", ".join(str(p) for p in named)
    others = f"positions {k}+" if named[-1] == k - 1 else "other positions"
    levels[named] = -np.inf
    top = int(np.argmax(levels))
    peak = (f", up to {levels[top]:.3g} (position {top})"
            if levels[top] >= STANDOUT * rest > 0 else "")
    return (f"k3 {at} at extend position{'s' if k > 1 else ''} {where} of {span}; {others} at "
            f"{rest:.3g}{peak}")


Profile = PositionKL | Callable[[], PositionKL | None] | None


def locate_extend(j: Judgement | None, profile: Profile) -> None:
    """A failing extend verdict's reason, with where along the extend its k3 sits
    (``extend_location``) added. ``profile``: the extend k3 by position, or what makes it (called
    only for a failing extend)."""
    if j is None or j.metric != "extend_kl_k3_mean" or j.verdict != MetricVerdict.REGRESSION:
        return
    where = extend_location(profile() if callable(profile) else profile)
    if where is not None:
        j.reason = f"{j.reason} ({where})"


def scenario_limits(config: Config, matrix: MatrixFile | None, scenario: str, *,
                    engine: str | None = None, thresholds: ThresholdsFile | None = None) -> Limits:
    """The limits in force for a config and a scenario: the rules of ``evalsvc/configs/thresholds.yaml``
    for it (on ``engine``, default the matrix's), then the matrix's own thresholds and the
    config's accept floor. ``matrix``: None when the run's matrix is not known (no thresholds of
    its own)."""
    return limits_for(matrix=config.matrix, engine=engine or (matrix.engine if matrix else "embedded"),
                      config=config.name, model=config.model, settings=config.settings,
                      scenario=scenario, thresholds=thresholds,
                      matrix_thresholds=matrix.thresholds if matrix is not None else None,
                      accept_floor=config.accept_floor)


def config_limits(config: Config, matrix: MatrixFile | None, *, engine: str | None = None,
                  thresholds: ThresholdsFile | None = None) -> dict[str, Limits]:
    """The limits of each of a config's scenarios, and of its pooled verdicts (``POOLED``), on
    ``engine`` (``scenario_limits``): what a run is judged against, stored on it when it is
    planned (``runs.limits``)."""
    return {name: scenario_limits(config, matrix, name, engine=engine, thresholds=thresholds)
            for name in (*config.scenarios, POOLED)}


def extend_profile(samples: list[dict[str, Any]]) -> PositionKL | None:
    """The samples' extend k3 by position (as ``harness.score`` finds it), from their extend
    logprobs and the reference's; None without extends, or when they are not usable."""
    served = [row.get("extend_logprobs") or [] for row in samples]
    if not any(len(e) for e in served):
        return None
    reference = [row.get("extend_reference_logprobs") or [] for row in samples]
    try:
        ext = token_kl_by_sample(served, reference)
    except (ValueError, TypeError):
        return None
    return kl_by_position(ext.k3, ext.lengths)


def judge_scenario(scenario: str, metrics: dict[str, Any], limits: Limits, *,
                   uses_mtp: bool = False, extend: Profile = None) -> tuple[str, str]:
    """pass / fail / inconclusive for one scenario's metrics (as ``harness.score`` makes them)
    against its fixed limits: ``judge_metric`` without history (``judge_run`` adds the history).
    ``extend``: the samples' extend k3 by position (or what makes it), which a failing extend's
    reason places (``locate_extend``)."""
    short = coverage_shortfall(metrics.get("hit_coverage"), limits.min_hit_coverage)
    if short is not None:
        return Verdict.INCONCLUSIVE, short
    if (scenario == "speculative" and uses_mtp and limits.accept_length.min is not None
            and metrics.get("accept_length") is None):
        return Verdict.FAIL, NO_SPEC_COUNTERS
    for metric in METRICS:
        j = judge_metric(scenario, metric, metrics.get(metric), {}, limits, Series(),
                         HistorySettings(), exact_fraction=metrics.get("bit_exact_fraction"))
        locate_extend(j, extend)
        if j is not None and j.verdict == MetricVerdict.REGRESSION:
            return Verdict.FAIL, j.reason
    return Verdict.PASS, ""


def after_history(verdict: str, reason: str | None, judgements: list[Judgement]
                  ) -> tuple[str, str | None]:
    """A scenario's verdict (its fixed limits') once its metrics are judged with their history
    and known failures: a pass with a regression among them is a fail, for the first
    regression's reason (so is a fail whose first failure was a known one); a pass or a fail
    whose metrics fail only as known failures (``expected`` verdicts, no regression) is expected,
    for the first one's reason, unless it failed for what no metric's verdict says (no
    speculative counters). A scenario judged expected before is judged again from its metrics."""
    if verdict == Verdict.EXPECTED:
        verdict, reason = Verdict.PASS, None
    regressions = [j for j in judgements if j.verdict == MetricVerdict.REGRESSION]
    known = [j for j in judgements if j.verdict == MetricVerdict.EXPECTED]
    # the metrics' verdicts say why: a pass, or a fail among known failures
    metrics_say = verdict == Verdict.PASS or (verdict == Verdict.FAIL and bool(known)
                                        and reason != NO_SPEC_COUNTERS)
    if regressions:
        return (Verdict.FAIL, regressions[0].reason) if metrics_say else (verdict, reason)
    if known and metrics_say:
        return Verdict.EXPECTED, known[0].reason
    return verdict, reason


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
    j = Judgement(scenario, metric, MetricVerdict.PASS, "threshold", value=value)
    short = coverage_shortfall(coverage, limits.min_hit_coverage)
    if short is not None:
        j.verdict, j.method, j.threshold = MetricVerdict.INCONCLUSIVE, "coverage", limits.min_hit_coverage
        j.evidence = {"hit_coverage": coverage}
        j.reason = short
        return j
    lim = getattr(limits, metric)
    if sign > 0 and limits.bit_exact:
        exact = 1.0 if exact_fraction is None or metric != "kl_k3_mean" else exact_fraction
        j.method, j.threshold, j.evidence = "bit_exact", 0.0, {"bit_exact_fraction": exact}
        if value > 0 or exact < 1.0:
            j.verdict = MetricVerdict.REGRESSION
            j.reason = (f"not bit-exact under deterministic inference: {label} {value:.3g}, "
                        f"{exact:.1%} of tokens exact")
            return j
    elif sign > 0 and lim.max is not None and value > lim.max:
        j.verdict, j.threshold = MetricVerdict.REGRESSION, lim.max
        j.reason = f"{label} {value:.3g} above the limit {lim.max:.3g}"
        return j
    elif sign < 0 and lim.min is not None and value < lim.min:
        j.verdict, j.threshold = MetricVerdict.REGRESSION, lim.min
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
        j.verdict = MetricVerdict.REGRESSION
        j.reason = (f"{label} {j.value:.4g} against {j.baseline:.4g} over {len(base_runs)} "
                    f"earlier runs: difference [{shift.low:.3g}, {shift.high:.3g}] at "
                    f"{settings.confidence:.1%}, a change beyond the effect floor {floor:.3g}")
        return j
    if shift.tail_p is not None:
        # an order of magnitude, say, above the baseline's median, or above the engine's clean
        # noise where the baseline repeats the reference exactly (its chunk grids coincided)
        least = (lim.tail_factor or 0.0) * max(float(np.median(base)), lim.noise or 0.0)
        far = [o for o in shift.outliers if sign * (o[1] - o[2]) > floor and o[1] >= least]
        j.evidence["tail"] = {"p_value": shift.tail_p, "z_bound": shift.tail_z,
                              "outliers": [list(o) for o in far[:10]]}
        if far and shift.tail_p <= 1.0 - settings.confidence:
            sid, c, b, z = max(far, key=lambda o: o[3])
            j.verdict, j.p_value = MetricVerdict.REGRESSION, shift.tail_p
            j.evidence["test"] = "tail"
            j.reason = (f"{label}: {len(far)} of {shift.n} samples far beyond their baseline "
                        f"(the farthest, {sid}: {c:.3g} against {b:.3g}, z = {z:.3g} past "
                        f"{shift.tail_z:.3g}; p = {shift.tail_p:.2g}), each beyond the effect "
                        f"floor {floor:.3g}")
            return j
    if better_high < 0 and -worse > floor:
        j.verdict = MetricVerdict.IMPROVEMENT
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
                j.verdict, j.method, j.p_value, j.threshold = (MetricVerdict.REGRESSION, "change_point",
                                                               cp["p_value"], floor_cp)
                j.reason = (f"{label} shifted from {cp['before']:.4g} to {cp['after']:.4g} "
                            f"{len(series) - cp['index']} runs ago (p = {cp['p_value']:.2g})")
    return j


# the verdicts of a scenario its metrics decide: the harness's ``measured``, and a verdict judged
# before (judged again from the metrics)
JUDGED = (Verdict.MEASURED, Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE, Verdict.EXPECTED)
# a run's verdicts that are no judgement of its metrics: they stay as they are
NOT_JUDGED = (Verdict.INVALID, Verdict.ERROR, Verdict.CANCELLED)


def finite(value: Any) -> float | None:
    """A metric's value as the store keeps it: a finite number, else None (not judged)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def judge_run(result: RunResult, limits: Mapping[str, Limits], history: History | None = None
              ) -> list[Judgement]:
    """The one judge of a run: each scenario it measured (``JUDGED``) and each of its metrics,
    against the scenario's limits (``limits``: by scenario, ``config_limits``) and ``history``
    (None or empty: fixed limits only, as where nothing is stored); returns the metric judgements
    (what the store keeps as verdicts), and sets on ``result`` each scenario's verdict and reason
    and the run's.

    A scenario's verdict is its fixed limits' (``judge_scenario``: pass, fail or inconclusive);
    then, unless the run was cancelled, each metric is judged with its history and its series'
    known failure (``judge_metric``, ``hold_known``): a history regression fails the scenario, a
    scenario that fails only as its known failures do is expected (``after_history``). What the
    measurement noted (the reason of a ``measured`` scenario: planted defects that acted) follows
    the verdict's reason. Each metric is judged over the run's conclusive scenarios pooled too
    (``POOLED``, history only), a pooled regression failing the run. The run's verdict is the
    worst of its scenarios' and the pooled ones (``worst``), unless it is invalid, an error or
    cancelled (``NOT_JUDGED``): those stay, with their reasons. Judging a judged result again
    judges it from its metrics again. No store here."""
    history = history or History()
    with_history = result.verdict != Verdict.CANCELLED
    uses_mtp = bool((result.settings or {}).get("mtp"))
    out: list[Judgement] = []
    samples: dict[tuple[str, str], dict[str, float]] = {}
    for scen in result.scenarios:
        if scen.verdict not in JUDGED:
            continue
        notes = scen.reason if scen.verdict == Verdict.MEASURED else ""
        lim = limits[scen.scenario]
        profile = functools.cache(lambda scen=scen: extend_profile(scen.samples))
        verdict, reason = judge_scenario(scen.scenario, scen.metrics, lim, uses_mtp=uses_mtp,
                                         extend=profile)
        if with_history:
            judged = []
            for metric in METRICS:
                values = {row["sample_id"]: row[metric] for row in scen.samples
                          if row.get(metric) is not None}
                if values:
                    samples[(scen.scenario, metric)] = values
                j = judge_metric(scen.scenario, metric, finite(scen.metrics.get(metric)), values,
                                 lim, history.series.get((scen.scenario, metric), Series()),
                                 history.settings,
                                 coverage=finite(scen.metrics.get("hit_coverage")),
                                 exact_fraction=finite(scen.metrics.get("bit_exact_fraction")))
                locate_extend(j, profile)
                hold_known(j, history.known.get((scen.scenario, metric)), lim)
                if j is not None:
                    out.append(j)
                    judged.append(j)
            verdict, reason = after_history(verdict, reason, judged)
        scen.verdict, scen.reason = verdict, "; ".join(r for r in (reason, notes) if r)
    reasons = [(s.scenario, s.verdict, s.reason) for s in result.scenarios]
    if with_history and POOLED in limits:
        for metric in METRICS:
            j = judge_pooled(result, metric, samples, limits[POOLED], history)
            if j is None:
                continue
            out.append(j)
            if j.verdict in (MetricVerdict.REGRESSION, MetricVerdict.EXPECTED):
                fails = Verdict.FAIL if j.verdict == MetricVerdict.REGRESSION else Verdict.EXPECTED
                reasons.append((POOLED, fails,
                                f"{', '.join(j.evidence['scenarios'])} together: {j.reason}"))
    if reasons and result.verdict not in NOT_JUDGED:  # none: nothing here to judge
        result.verdict, reason = worst(reasons)
        result.reason = reason or ""
    return out


def pooled_baseline(series: Series | None, scenarios: list[str]) -> Series:
    """A pooled series' baseline (``History.pooled``) over ``scenarios`` only: each earlier run's
    per-sample values of those scenarios, its value their mean (runs without any left out)."""
    out = Series()
    for run_id, per_sample in zip(*((series.run_ids, series.samples) if series else ((), ())),
                                  strict=True):
        kept = {k: v for k, v in per_sample.items() if k.split("/", 1)[0] in scenarios}
        if kept:
            out.run_ids.append(run_id)
            out.values.append(float(np.mean(list(kept.values()))))
            out.samples.append(kept)
    return out


def judge_pooled(result: RunResult, metric: str, samples: dict[tuple[str, str], dict[str, float]],
                 limits: Limits, history: History) -> Judgement | None:
    """One metric over the run's conclusive scenarios together (the hit scenarios for KL, every
    scenario with acceptance for it), when there are two or more: one defect acts in several, and
    their samples pooled make the location test sharper. History only: fixed limits and the tail
    test belong to each scenario's own verdict. ``samples``: the run's values per sample, by
    (scenario, metric); ``limits``: the pooled verdicts' (``POOLED``)."""
    conclusive = (Verdict.PASS, Verdict.FAIL, Verdict.EXPECTED)
    scenarios = [sc for sc in SCENARIOS if any(
        r.scenario == sc and r.verdict in conclusive for r in result.scenarios)
        and (sc, metric) in samples and (metric == "accept_length" or sc in HIT_SCENARIOS)]
    if len(scenarios) < 2:
        return None
    pooled = {f"{sc}/{sid}": v for sc in scenarios for sid, v in samples[(sc, metric)].items()}
    lim = getattr(limits, metric).model_copy(update={"max": None, "min": None, "tail": False})
    limits = limits.model_copy(update={metric: lim, "bit_exact": False, "min_hit_coverage": 0.0})
    j = judge_metric(POOLED, metric, float(np.mean(list(pooled.values()))), pooled, limits,
                     pooled_baseline(history.pooled.get(metric), scenarios), history.settings)
    if j is not None:
        j.evidence["scenarios"] = scenarios
        hold_known(j, history.known.get((POOLED, metric)), limits)
    return j


def judge_comparison(scenario: str, metric: str, contender: float,
                     contender_samples: dict[str, float], baseline_run: int, baseline: float,
                     baseline_samples: dict[str, float], limits: Limits,
                     settings: HistorySettings, coverage: float | None = None
                     ) -> Judgement | None:
    """One metric of one scenario of a contender run judged as one step of a series whose only
    earlier run is the baseline run (``judge_run`` on that scenario alone, with a history of that
    one run): both ran the same prompts and seeds, so the history test's paired per-sample tests
    apply (location, and tail where the limits ask for it). The fixed limits (maximum, floor,
    bit-exactness) are left out: they are each run's own verdicts'. ``coverage``: the lower hit
    coverage of the two runs (an inconclusive verdict below the limit's). None for a metric
    without judgements."""
    lim = getattr(limits, metric).model_copy(update={"max": None, "min": None})
    limits = limits.model_copy(update={metric: lim, "bit_exact": False})
    metrics: dict[str, Any] = {metric: contender}
    if coverage is not None:
        metrics["hit_coverage"] = coverage
    result = RunResult(config="", fingerprint="", model="", settings={}, requested_args={},
                       verdict=Verdict.MEASURED, scenarios=[ScenarioResult(
                           scenario, Verdict.MEASURED, metrics=metrics,
                           samples=[{"sample_id": sid, metric: v}  # type: ignore[misc]
                                    for sid, v in contender_samples.items()])])
    history = History(series={(scenario, metric): Series([baseline_run], [baseline],
                                                         [baseline_samples])},
                      settings=settings.model_copy(update={"min_runs": 1}))
    return next((j for j in judge_run(result, {scenario: limits}, history)
                 if j.metric == metric), None)
