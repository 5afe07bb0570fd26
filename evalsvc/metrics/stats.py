"""Summary statistics for per-sample metrics: bootstrap intervals and percentile reports.

The unit of independence is a *sample* (one prompt / request), not a token: tokens within one
completion are strongly correlated, so intervals are computed over per-sample aggregates (e.g. each
sample's mean per-token KL), never over pooled tokens. Pooled-token percentiles describe the
distribution only and carry no interval. Units are those of the input (nats for KL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

# Reported percentiles, llama.cpp's ``--kl-divergence`` set: name -> percentile (0..100).
PERCENTILES: dict[str, float] = {
    "max": 100.0,
    "p999": 99.9,
    "p99": 99.0,
    "p95": 95.0,
    "p90": 90.0,
    "p50": 50.0,
    "p10": 10.0,
    "p5": 5.0,
    "p1": 1.0,
    "p01": 0.1,
    "min": 0.0,
}

# Bootstrap resample rows are drawn in chunks of at most this many indices (memory bound).
_MAX_RESAMPLE_ELEMENTS = 4_000_000
# ... and their resampled values gathered in pieces of about this many (5 MB), for the cache
_GATHER_ELEMENTS = 640_000


def _as_finite_vector(x: np.ndarray | Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf")
    return arr


def bootstrap_mean_ci(
    per_sample: np.ndarray | Sequence[float],
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Percentile-bootstrap confidence interval of the mean: ``(mean, low, high)``.

    ``per_sample``: shape ``(n,)``, one value per independent sample (callers aggregate tokens per
    sample first). ``mean`` is the plain sample mean; ``low``/``high`` are the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of ``n_boot`` resampled means,
    all in the input's units. Resampling is one ``(n_boot, n)`` index matrix (chunked for very
    large inputs) from ``numpy.random.default_rng(seed)``: the same input and seed always give the
    same interval. n = 1 gives ``(x, x, x)``.

    The percentile bootstrap under-covers somewhat for small, skewed samples (about 0.93 instead
    of 0.95 for n = 40 lognormal(0, 0.5) data). Raises ValueError for empty input, NaN/inf,
    ``confidence`` outside (0, 1) or ``n_boot < 1``.
    """
    x = _as_finite_vector(per_sample, "per_sample")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot!r}")
    mean = float(x.mean())
    if x.size == 1:
        return mean, mean, mean
    low, high = _bootstrap_quantiles(x[None, :], confidence, n_boot, seed)
    return mean, float(low[0]), float(high[0])


def _bootstrap_quantiles(x: np.ndarray, confidence: float, n_boot: int,
                         seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Percentile-bootstrap bounds of the mean of each row of ``x`` (shape ``(k, n)``), all rows
    resampled with the same index matrix, drawn in chunks (memory bound) from ``default_rng(seed)``."""
    k, n = x.shape
    rng = np.random.default_rng(seed)
    rows = max(1, _MAX_RESAMPLE_ELEMENTS // n)
    means = np.empty((k, n_boot), dtype=np.float64)
    block = max(1, _MAX_RESAMPLE_ELEMENTS // (n_boot * n))
    if k > 1 and block > 1:  # small rows, several at once: one (block, n_boot, n) gather each
        draws = np.concatenate([rng.integers(0, n, size=(min(rows, n_boot - start), n))
                                for start in range(0, n_boot, rows)])  # (n_boot, n)
        for start in range(0, k, block):
            means[start: start + block] = x[start: start + block, draws].mean(axis=2)
    else:
        # each row alone: the resampled means of each chunk of draws as it is drawn (the same
        # draws, and the same sums, as gathering the whole (n_boot, n) matrix at once)
        step = max(1, _GATHER_ELEMENTS // n)  # resampled rows gathered at once (in cache)
        for start in range(0, n_boot, rows):
            draws = rng.integers(0, n, size=(min(rows, n_boot - start), n))
            for i in range(k):
                for sub in range(0, len(draws), step):
                    part = draws[sub: sub + step]
                    means[i, start + sub: start + sub + len(part)] = x[i, part].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0], axis=1)
    return low, high


def percentiles(values: np.ndarray | Sequence[float]) -> dict[str, float]:
    """Distribution summary of ``values`` (any shape, flattened): keys max, p999, p99, p95, p90,
    p50, p10, p5, p1, p01, min (``pXY`` = XY-th percentile, ``p999`` = 99.9, ``p01`` = 0.1),
    computed like ``numpy.percentile`` (linear interpolation), in the input's units.

    Raises ValueError for empty input or NaN/inf.
    """
    x = _as_finite_vector(np.asarray(values, dtype=np.float64).ravel(), "values")
    q = np.percentile(x, list(PERCENTILES.values()))
    return {name: float(v) for name, v in zip(PERCENTILES, q, strict=True)}


def summarize_kl(
    per_sample_token_kl: Sequence[np.ndarray | Sequence[float]],
    confidence: float = 0.95,
    seed: int = 0,
    n_boot: int = 2000,
) -> dict[str, float | int]:
    """Summarise per-token KL values (nats) grouped by sample.

    ``per_sample_token_kl[s]``: shape ``(n_tokens_s,)``, sample s's per-token estimator (k3 or any
    other). Returns:

    * ``mean``: mean over samples of each sample's mean per-token value (every sample weighs the
      same, however long), with ``ci_low`` / ``ci_high`` from ``bootstrap_mean_ci`` over those
      per-sample means;
    * ``token_mean``: mean over all tokens pooled (long samples weigh more; no interval);
    * ``n_samples`` (samples with >= 1 token), ``n_empty_samples`` (skipped: no tokens), ``n_tokens``;
    * the ``percentiles`` keys over all tokens pooled (distribution only, no interval).

    Raises ValueError when no sample has any token, or values are NaN/inf.
    """
    arrays = [np.asarray(a, dtype=np.float64).ravel() for a in per_sample_token_kl]
    nonempty = [a for a in arrays if a.size]
    if not nonempty:
        raise ValueError("summarize_kl needs at least one sample with at least one token")
    pooled = np.concatenate(nonempty)
    return summarize_pooled_kl(pooled, np.array([a.mean() for a in nonempty]),
                               len(arrays) - len(nonempty), confidence, seed, n_boot)


def summarize_pooled_kl(
    pooled: np.ndarray,
    sample_means: np.ndarray,
    n_empty_samples: int = 0,
    confidence: float = 0.95,
    seed: int = 0,
    n_boot: int = 2000,
) -> dict[str, float | int]:
    """``summarize_kl`` from what it computes first: ``pooled``, shape ``(n_tokens,)``, every
    nonempty sample's per-token values concatenated in sample order (nats), and
    ``sample_means``, shape ``(n_samples,)``, each such sample's ``mean()``; ``n_empty_samples``
    samples had no token. The same result as ``summarize_kl`` of those samples. Reorders
    ``pooled`` in place (the percentiles partition it).
    """
    if not pooled.size:
        raise ValueError("summarize_kl needs at least one sample with at least one token")
    # a sum is NaN or inf exactly when some value is NaN or inf (the values are >= 0 or mixed,
    # either way non-finite propagates): one pass instead of an isfinite array
    if not np.isfinite(pooled.sum()) and not np.isfinite(pooled).all():
        raise ValueError("per_sample_token_kl contains NaN or inf")
    mean, low, high = bootstrap_mean_ci(sample_means, confidence=confidence, n_boot=n_boot,
                                        seed=seed)
    out: dict[str, float | int] = {
        "mean": mean,
        "ci_low": low,
        "ci_high": high,
        "confidence": confidence,
        "token_mean": float(pooled.mean()),
        "n_samples": int(sample_means.size),
        "n_empty_samples": n_empty_samples,
        "n_tokens": int(pooled.size),
    }
    q = np.percentile(pooled, list(PERCENTILES.values()), overwrite_input=True)
    out.update({name: float(v) for name, v in zip(PERCENTILES, q, strict=True)})
    return out


def paired_difference_ci(
    a_per_sample: np.ndarray | Sequence[float],
    b_per_sample: np.ndarray | Sequence[float],
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Bootstrap CI of mean(b - a) for paired samples: ``(mean_diff, low, high)``, input units.

    ``a_per_sample[s]`` and ``b_per_sample[s]`` must be the same sample (prompt) measured two ways,
    shape ``(n,)`` each; pairs are resampled together, so shared per-prompt difficulty cancels.
    Raises ValueError for different lengths, plus ``bootstrap_mean_ci``'s errors.
    """
    return paired_difference_cis([(a_per_sample, b_per_sample)], confidence, n_boot, seed)[0]


def paired_difference_cis(
    pairs: Sequence[tuple[np.ndarray | Sequence[float], np.ndarray | Sequence[float]]],
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> list[tuple[float, float, float]]:
    """``paired_difference_ci`` of many pairs at once: pairs of one length share their resampling
    indices, so their bootstrap means are one array operation (the bounds equal one call each up
    to float rounding: numpy sums a row of a bigger array in another order)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot!r}")
    diffs = []
    for a_in, b_in in pairs:
        a = _as_finite_vector(a_in, "a_per_sample")
        b = _as_finite_vector(b_in, "b_per_sample")
        if a.size != b.size:
            raise ValueError(f"a_per_sample and b_per_sample differ in length: {a.size} != {b.size}")
        diffs.append(b - a)
    out: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * len(diffs)
    by_length: dict[int, list[int]] = {}
    for i, d in enumerate(diffs):
        by_length.setdefault(d.size, []).append(i)
    for n, indices in by_length.items():
        stacked = np.stack([diffs[i] for i in indices])
        means = stacked.mean(axis=1)
        if n == 1:
            low = high = means
        else:
            low, high = _bootstrap_quantiles(stacked, confidence, n_boot, seed)
        for j, i in enumerate(indices):
            out[i] = (float(means[j]), float(low[j]), float(high[j]))
    return out


def welch_difference(contender: np.ndarray | Sequence[float], baseline: np.ndarray | Sequence[float],
                     confidence: float = 0.999) -> tuple[float, float, float, float]:
    """Welch's interval on mean(contender) - mean(baseline) for independent samples:
    ``(diff, low, high, p_value)`` (two-sided ``confidence``; p of "no difference"), input units.

    Each input holds one value per independent sample (a prompt's mean per-token KL, say), n >= 2
    each. Welch's t does not assume equal variances and is honest for small n, where the
    percentile bootstrap under-covers. Zero variance on both sides gives a zero-width interval.
    """
    a = _as_finite_vector(contender, "contender")
    b = _as_finite_vector(baseline, "baseline")
    if a.size < 2 or b.size < 2:
        raise ValueError(f"welch_difference needs >= 2 samples a side, got {a.size} and {b.size}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    from scipy import stats as sps

    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    diff = float(a.mean() - b.mean())
    se = float(np.sqrt(va + vb))
    if se == 0.0:
        return diff, diff, diff, 0.0 if diff != 0.0 else 1.0
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    half = float(sps.t.ppf(0.5 + confidence / 2.0, df)) * se
    p = float(2.0 * sps.t.sf(abs(diff) / se, df))
    return diff, diff - half, diff + half, p


def change_point(series: np.ndarray | Sequence[float], permutations: int = 1999, seed: int = 0,
                 min_segment: int = 2) -> dict[str, float | int] | None:
    """The most likely single shift in the mean of a series, with a permutation p-value.

    For each split k (both segments at least ``min_segment`` long) the statistic is
    ``|mean(x[k:]) - mean(x[:k])| * sqrt(k (n - k) / n)``; its maximum over k is compared with the
    maxima of ``permutations`` shuffles of the series (``default_rng(seed)``), so the p-value needs
    no distributional assumption beyond exchangeable values under no change. Returns ``{"index": k
    (first value after the shift), "before", "after" (segment means), "statistic", "p_value"}``, or
    None for a series too short to split or with no variation at all.
    """
    x = _as_finite_vector(series, "series")
    n = x.size
    if n < 2 * min_segment or float(np.ptp(x)) == 0.0:
        return None
    # the shuffles in one call: each row shuffled in turn from the same stream, so the same
    # permutations as one ``rng.permutation(x)`` per shuffle; the whole test is 2 to 8 times
    # faster for 60 to 8 runs (benchmarks/change_point.py)
    shuffled = np.random.default_rng(seed).permuted(np.broadcast_to(x, (permutations, n)), axis=1)
    perms = np.vstack([x[None, :], shuffled])
    stats = _split_statistics(perms, min_segment)
    best = int(np.argmax(stats[0]))
    observed = stats[0, best]
    exceed = int(np.sum(stats[1:].max(axis=1) >= observed - 1e-12 * abs(observed)))
    k = best + min_segment
    return {"index": k, "before": float(x[:k].mean()), "after": float(x[k:].mean()),
            "statistic": float(observed), "p_value": (1 + exceed) / (1 + permutations)}


def _split_statistics(x: np.ndarray, min_segment: int) -> np.ndarray:
    """Per row of ``x`` (shape ``(m, n)``), the split statistic of ``change_point`` for
    k = min_segment .. n - min_segment: shape ``(m, n - 2 min_segment + 1)``."""
    n = x.shape[1]
    k = np.arange(min_segment, n - min_segment + 1)
    csum = np.cumsum(x, axis=1)
    left = csum[:, k - 1] / k
    right = (csum[:, -1:] - csum[:, k - 1]) / (n - k)
    return np.abs(right - left) * np.sqrt(k * (n - k) / n)


def paired_t_interval(differences: np.ndarray | Sequence[float], confidence: float = 0.999
                      ) -> tuple[float, float, float, float]:
    """Student's interval on the mean of paired differences (one per sample, the same prompt on
    both sides): ``(mean, low, high, p_value)``. The per-prompt level cancels, so this is far
    sharper than comparing two groups when prompts differ a lot (acceptance lengths do). n >= 2;
    differences that are all equal give a zero-width interval."""
    d = _as_finite_vector(differences, "differences")
    if d.size < 2:
        raise ValueError(f"paired_t_interval needs >= 2 differences, got {d.size}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    from scipy import stats as sps

    mean = float(d.mean())
    se = float(d.std(ddof=1) / np.sqrt(d.size))
    if se == 0.0:
        return mean, mean, mean, 0.0 if mean != 0.0 else 1.0
    half = float(sps.t.ppf(0.5 + confidence / 2.0, d.size - 1)) * se
    p = float(2.0 * sps.t.sf(abs(mean) / se, d.size - 1))
    return mean, mean - half, mean + half, p


@dataclass(frozen=True)
class Shift:
    """How a contender's per-sample values moved against the same samples' baseline values
    (``paired_shift``). Differences are contender minus baseline."""

    test: str  # "paired" (one value per shared sample) or "welch" (two groups)
    n: int  # samples paired (0 for welch)
    diff: float  # mean difference, in the values' units
    low: float  # Student's (Welch's) interval on ``diff`` at the confidence, values' units
    high: float
    p: float  # two-sided p-value of the location test, on ``scale``
    scale: str  # "log" (the location test on log(value + floor)) or "linear"
    location_low: float  # the location test's interval on ``scale``: what decides clarity
    location_high: float
    # the tail test: samples far out on one side, (sample id, contender, baseline mean, z)
    outliers: tuple[tuple[str, float, float, float], ...] = ()
    tail_p: float | None = None  # Bonferroni p-value of the largest z (None: not tested)
    tail_z: float | None = None  # the z a sample must pass to be flagged


def paired_shift(contender: Mapping[str, float], baseline: Sequence[Mapping[str, float]], *,
                 confidence: float = 0.999, log_floor: float | None = None,
                 tail: int = 0, tail_floor: float | None = None,
                 tail_against: str = "pairs", min_tail_samples: int = 5) -> Shift:
    """Compare a contender's per-sample values (sample id -> value) with those of baseline runs.

    Runs of one fingerprint, and both builds of a comparison, share their prompts and seeds, so
    the same sample id names the same prompt on both sides. Per shared sample: the contender's
    value minus the mean of the baseline runs' values for it.

    * Location (a shift of the whole): Student's interval on the mean paired difference. With
      ``log_floor`` it runs on ``log(value + log_floor)``: KL values are positive and heavy-tailed
      (one sampled token of low probability can make a sample's KL hundreds of times its usual
      size), and a bug multiplies them; on the log scale a few wild samples do not swamp it, and
      values far below the floor count as equal. ``diff``/``low``/``high`` are reported in the
      values' own units either way.
    * Tail (a few samples far out, as a bug that strikes some requests makes them), when ``tail``
      is +1 (high is worse) or -1, on ``log(value + tail_floor)`` for log values (a floor below
      most values: the small ones squeezed under a floor would make the spread look narrower
      than it is), in units of a robust spread (1.4826 x the median absolute deviation), against
      ``tail_against``:

      - ``"pairs"``: each paired difference against their median; the spread is the larger of the
        contender's differences' and that of the moves among the baseline runs' own leave-one-out
        differences. For values a prompt repeats from run to run (greedy acceptance);
      - ``"distribution"``: each value against the baseline's values of every sample and run
        together. For values that vary little from prompt to prompt but move from run to run
        by more than that (a KL averaged over a long extend, whose chunk grid follows the batch).

      Samples beyond the one-sided Bonferroni bound for ``1 - confidence`` over the samples are
      ``outliers``. Only for values whose clean spread has no sampling in it (teacher-forced
      logprobs, greedy acceptance): sampled ones have heavy tails of their own.

    Without two shared samples: Welch's interval between the two groups of values (no tail test).
    """
    pooled: dict[str, list[float]] = {}
    for run in baseline:
        for sample_id, value in run.items():
            pooled.setdefault(sample_id, []).append(value)
    shared = [k for k in contender if k in pooled]
    if len(shared) < 2:
        diff, low, high, p = welch_difference(list(contender.values()),
                                              [v for vs in pooled.values() for v in vs], confidence)
        return Shift("welch", 0, diff, low, high, p, "linear", low, high)

    def scaled(x: np.ndarray) -> np.ndarray:
        return np.log(x + log_floor) if log_floor is not None else x

    c = np.array([contender[k] for k in shared], dtype=np.float64)
    base = [np.asarray(pooled[k], dtype=np.float64) for k in shared]
    b_mean = np.array([b.mean() for b in base])
    d = scaled(c) - np.array([scaled(b).mean() for b in base])
    diff, low, high, _ = paired_t_interval(c - b_mean, confidence)
    _, loc_low, loc_high, p = paired_t_interval(d, confidence)
    shift = Shift("paired", len(shared), diff, low, high, p,
                  "log" if log_floor is not None else "linear", loc_low, loc_high)
    if tail == 0 or len(shared) < min_tail_samples:
        return shift
    if log_floor is not None and tail_floor is not None:
        def scaled(x: np.ndarray) -> np.ndarray:
            return np.log(x + tail_floor)

        d = scaled(c) - np.array([scaled(b).mean() for b in base])
    if tail_against == "distribution":
        ref = tail * scaled(np.concatenate(base))
        z = (tail * scaled(c) - np.median(ref)) / max(_robust_spread(ref), 1e-12)
        return _tail(shift, z, shared, c, b_mean, confidence)
    w = tail * d
    spread = _robust_spread(w)
    loo = np.array([tail * (scaled(b[j: j + 1])[0] - np.delete(scaled(b), j).mean())
                    for b in base if b.size >= 2 for j in range(b.size)])
    # Runs of one engine with the same seeds repeat most samples exactly and move a few by the
    # engine's own noise (batching, a flipped token): the null spread is that of those moves, in
    # the baseline runs against each other. None at all: the engine repeats itself, and any move
    # of the contender is out of the ordinary (the verdict's effect floor says whether it matters).
    moved = loo[loo != 0]
    if moved.size >= min_tail_samples:
        spread = max(spread, _robust_spread(moved))
    elif moved.size:
        spread = max(spread, float(np.abs(moved).max()))
    return _tail(shift, (w - np.median(w)) / max(spread, 1e-12), shared, c, b_mean, confidence)


def _tail(shift: Shift, z: np.ndarray, shared: list[str], c: np.ndarray, b_mean: np.ndarray,
          confidence: float) -> Shift:
    """The samples whose z passes the one-sided Bonferroni bound, and the p-value of the
    largest."""
    from scipy import stats as sps

    bound = float(sps.norm.isf((1.0 - confidence) / len(shared)))
    outliers = tuple((shared[i], float(c[i]), float(b_mean[i]), float(z[i]))
                     for i in np.flatnonzero(z > bound))
    tail_p = min(1.0, len(shared) * float(sps.norm.sf(z.max())))
    return replace(shift, outliers=outliers, tail_p=tail_p, tail_z=bound)


def _robust_spread(x: np.ndarray) -> float:
    """1.4826 x the median absolute deviation: the standard deviation for normal data, unmoved
    by a few wild values."""
    return float(1.4826 * np.median(np.abs(x - np.median(x))))
