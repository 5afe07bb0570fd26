"""Bootstrap intervals (incl. a coverage simulation), percentiles, KL summaries, paired differences."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from evalsvc.metrics import bootstrap_mean_ci, paired_difference_ci, percentiles, summarize_kl
from evalsvc.metrics.stats import PERCENTILES, paired_shift


def test_bootstrap_basic_properties() -> None:
    x = np.random.default_rng(0).normal(2.0, 1.0, size=50)
    mean, low, high = bootstrap_mean_ci(x)
    assert mean == pytest.approx(x.mean(), rel=1e-15)
    assert low < mean < high
    # roughly mean +- 1.96 * s / sqrt(n)
    half = 1.96 * x.std(ddof=1) / math.sqrt(x.size)
    assert high - low == pytest.approx(2 * half, rel=0.2)
    # deterministic for a seed, different for another
    assert bootstrap_mean_ci(x, seed=0) == (mean, low, high)
    assert bootstrap_mean_ci(x, seed=1) != (mean, low, high)
    # wider at higher confidence
    _, low99, high99 = bootstrap_mean_ci(x, confidence=0.99)
    assert low99 < low and high99 > high


def test_bootstrap_edge_cases() -> None:
    assert bootstrap_mean_ci([3.5]) == (3.5, 3.5, 3.5)
    assert bootstrap_mean_ci(np.full(10, 2.0)) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="empty"):
        bootstrap_mean_ci([])
    with pytest.raises(ValueError, match="NaN or inf"):
        bootstrap_mean_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_mean_ci([1.0, 2.0], confidence=1.0)
    with pytest.raises(ValueError, match="n_boot"):
        bootstrap_mean_ci([1.0, 2.0], n_boot=0)
    with pytest.raises(ValueError, match="1-D"):
        bootstrap_mean_ci([[1.0, 2.0]])


def test_bootstrap_chunking_is_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    import evalsvc.metrics.stats as stats_mod

    x = np.random.default_rng(2).exponential(size=100)
    whole = bootstrap_mean_ci(x, n_boot=500, seed=3)
    monkeypatch.setattr(stats_mod, "_MAX_RESAMPLE_ELEMENTS", 1000)  # 10 rows per chunk
    chunked = bootstrap_mean_ci(x, n_boot=500, seed=3)
    assert chunked == bootstrap_mean_ci(x, n_boot=500, seed=3)
    assert chunked[0] == whole[0]
    assert chunked[1] == pytest.approx(whole[1], rel=0.05)
    assert chunked[2] == pytest.approx(whole[2], rel=0.05)


def test_bootstrap_coverage_on_skewed_data() -> None:
    """300 datasets of n=40 lognormal(0, 0.5) values (skewness ~1.75); true mean exp(0.125).

    The 95% interval should cover the true mean in about 95% of datasets. Bounds 0.90..0.99:
    over 300 independent datasets the observed rate has binomial sd sqrt(.95 * .05 / 300) ~ 0.013.
    The percentile bootstrap under-covers a little at this n and skew (~0.93, measured over 3000
    datasets), so the lower bound is ~2 sd below that and ~4 sd below nominal 0.95; the upper
    bound 0.99 is ~3 sd above nominal and catches intervals that are systematically too wide.
    A broken interval (e.g. token-level width, or a quantile mix-up) lands far outside.
    """
    rng = np.random.default_rng(2024)
    n_datasets, n = 300, 40
    sigma = 0.5
    true_mean = math.exp(sigma**2 / 2)
    data = rng.lognormal(0.0, sigma, size=(n_datasets, n))
    start = time.perf_counter()
    cis = np.array([bootstrap_mean_ci(row, n_boot=1000, seed=i)[1:] for i, row in enumerate(data)])
    elapsed = time.perf_counter() - start
    covered = (cis[:, 0] <= true_mean) & (true_mean <= cis[:, 1])
    rate = covered.mean()
    assert 0.90 <= rate <= 0.99, rate
    # misses fall on both sides (no systematic shift of the interval)
    assert (cis[:, 0] > true_mean).any() and (cis[:, 1] < true_mean).any()
    assert elapsed < 10.0


def test_percentiles_match_numpy() -> None:
    x = np.random.default_rng(1).lognormal(size=5000)
    got = percentiles(x)
    assert set(got) == {"max", "p999", "p99", "p95", "p90", "p50", "p10", "p5", "p1", "p01", "min"}
    for key, q in PERCENTILES.items():
        assert got[key] == pytest.approx(float(np.percentile(x, q)), rel=1e-12), key
    assert got["max"] == x.max() and got["min"] == x.min()
    assert got["p50"] == pytest.approx(float(np.median(x)))
    assert all(isinstance(v, float) for v in got.values())
    # 2-D input is flattened
    assert percentiles(x.reshape(50, 100)) == got
    assert percentiles([7.0]) == dict.fromkeys(got, 7.0)
    with pytest.raises(ValueError, match="empty"):
        percentiles([])


def test_summarize_kl_hand_data() -> None:
    samples = [np.array([0.0, 0.2]), np.array([0.4]), np.array([0.1, 0.1, 0.1, 0.5]), np.array([])]
    out = summarize_kl(samples, seed=0)
    # per-sample means 0.1, 0.4, 0.2 -> mean 0.7/3
    assert out["mean"] == pytest.approx(0.7 / 3)
    assert out["token_mean"] == pytest.approx(1.4 / 7)
    assert out["n_samples"] == 3
    assert out["n_empty_samples"] == 1
    assert out["n_tokens"] == 7
    assert 0.1 - 1e-12 <= out["ci_low"] <= out["mean"] <= out["ci_high"] <= 0.4 + 1e-12
    assert (out["mean"], out["ci_low"], out["ci_high"]) == bootstrap_mean_ci([0.1, 0.4, 0.2], seed=0)
    pooled = [0.0, 0.2, 0.4, 0.1, 0.1, 0.1, 0.5]
    assert out["max"] == 0.5 and out["min"] == 0.0
    assert out["p50"] == pytest.approx(0.1)
    assert out["p90"] == pytest.approx(float(np.percentile(pooled, 90)))
    assert summarize_kl(samples, seed=0) == out  # deterministic
    with pytest.raises(ValueError, match="at least one"):
        summarize_kl([])
    with pytest.raises(ValueError, match="at least one"):
        summarize_kl([np.array([])])
    with pytest.raises(ValueError, match="NaN or inf"):
        summarize_kl([[0.1, float("inf")]])


def test_summarize_kl_single_sample() -> None:
    out = summarize_kl([[0.1, 0.3]])
    assert out["mean"] == out["ci_low"] == out["ci_high"] == pytest.approx(0.2)


def test_paired_difference_ci() -> None:
    rng = np.random.default_rng(11)
    n = 60
    difficulty = rng.lognormal(0.0, 1.0, size=n)  # large per-prompt variation shared by both sides
    a = difficulty + rng.normal(0.0, 0.01, size=n)
    b_small = difficulty + 0.002 + rng.normal(0.0, 0.01, size=n)
    mean, low, high = paired_difference_ci(a, b_small)
    assert mean == pytest.approx(float(np.mean(b_small - a)))
    assert low <= 0.002 <= high  # contains the true shift
    b_large = difficulty + 0.05 + rng.normal(0.0, 0.01, size=n)
    mean, low, high = paired_difference_ci(a, b_large)
    assert low > 0  # excludes 0
    assert low <= 0.05 <= high
    # unpaired intervals on the same data would not resolve the shift: pairing matters
    high_a = bootstrap_mean_ci(a)[2]
    low_b = bootstrap_mean_ci(b_large)[1]
    assert low_b < high_a
    # sign: mean(b - a)
    assert paired_difference_ci(b_large, a)[0] == pytest.approx(-mean)
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference_ci(a, b_large[:-1])


def test_batched_paired_intervals_equal_one_call_each():
    import evalsvc.metrics.stats as stats_mod

    rng = np.random.default_rng(3)
    pairs = [(rng.normal(size=n), rng.normal(size=n) + shift)
             for n, shift in [(2, 0.0), (8, 0.5), (8, -1.0), (50, 0.1), (1, 0.3), (8, 0.0)]]
    batched = stats_mod.paired_difference_cis(pairs, confidence=0.9, n_boot=500)
    single = [stats_mod.paired_difference_ci(a, b, confidence=0.9, n_boot=500) for a, b in pairs]
    for got, want in zip(batched, single, strict=True):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


# ---- paired_shift: location and tail ---------------------------------------------------------

def _runs(rng, level, n_runs, noise):
    """Per-prompt KL levels (log-normal across prompts) with multiplicative run-to-run noise."""
    return [{f"p{i}": float(v) for i, v in enumerate(level * np.exp(rng.normal(0, noise, level.size)))}
            for _ in range(n_runs)]


def test_paired_shift_location_on_the_log_scale_sees_a_multiplied_kl():
    rng = np.random.default_rng(0)
    level = np.exp(rng.normal(np.log(3e-5), 1.0, 48))  # prompts differ tenfold and more
    base = _runs(rng, level, 5, 0.3)
    same = paired_shift(_runs(rng, level, 1, 0.3)[0], base, log_floor=3e-5)
    assert same.test == "paired" and same.n == 48 and same.scale == "log"
    assert same.location_low < 0 < same.location_high and same.p > 0.001
    double = paired_shift({k: 2 * v for k, v in _runs(rng, level, 1, 0.3)[0].items()}, base,
                          log_floor=3e-5)
    assert double.location_low > 0.2 and double.p < 1e-6 and double.diff > 0


def test_paired_shift_tail_flags_a_few_samples_a_mean_does_not_move():
    rng = np.random.default_rng(1)
    level = np.exp(rng.normal(np.log(1e-5), 0.8, 48))
    base = _runs(rng, level, 4, 0.2)
    contender = _runs(rng, level, 1, 0.2)[0]
    clean = paired_shift(contender, base, log_floor=1e-5, tail=1, tail_floor=1e-7)
    assert clean.outliers == () and clean.tail_p > 0.001
    # a floor near the median squeezes the small samples' differences: the spread looks narrow
    assert paired_shift(contender, base, log_floor=1e-5, tail=1).outliers != ()
    struck = dict(contender, p3=contender["p3"] * 300, p17=contender["p17"] * 80)
    hit = paired_shift(struck, base, log_floor=1e-5, tail=1, tail_floor=1e-7)
    assert hit.location_low < 0  # two samples of 48: the location test cannot tell
    assert {o[0] for o in hit.outliers} == {"p3", "p17"} and hit.tail_p < 1e-6
    assert all(o[3] > hit.tail_z for o in hit.outliers)
    # the other direction is not a tail of this side
    assert paired_shift(struck, base, log_floor=1e-5, tail=-1, tail_floor=1e-7).outliers == ()


def test_paired_shift_without_noise_any_repeatable_change_is_an_outlier():
    """Bit-identical runs (a deterministic engine, the same seeds) have no spread: one sample
    that moved is far out (the verdict's effect floor then says whether it matters)."""
    base = [{f"p{i}": 2.0 + i / 100 for i in range(10)} for _ in range(3)]
    assert paired_shift(base[0], base, tail=-1).outliers == ()
    moved = dict(base[0], p4=1.8)
    out = paired_shift(moved, base, tail=-1)
    assert [o[0] for o in out.outliers] == ["p4"] and out.scale == "linear"


def test_paired_shift_falls_back_to_welch_without_shared_samples():
    out = paired_shift({"a": 1.0, "b": 1.2}, [{"c": 1.0, "d": 1.1}], tail=1)
    assert (out.test, out.n, out.tail_p) == ("welch", 0, None)
