"""Verdicts: coverage, fixed limits, the history test and change points; the thresholds file."""

from __future__ import annotations

import numpy as np
import pytest

from evalsvc.judging import Series, judge_metric
from evalsvc.metrics.stats import change_point, welch_difference
from evalsvc.thresholds import HistorySettings, Limits, MetricLimits, ThresholdError, limits_for
from evalsvc.thresholds import load_thresholds as load
from tests.oracles.change_point import loop_change_point

HS = HistorySettings()
KL = Limits(kl_k3_mean=MetricLimits(max=1e-8, min_effect=1e-9),
            accept_length=MetricLimits(min=1.96, min_effect=0.02, relative_effect=0.03),
            min_hit_coverage=0.5)
# a hit scenario's acceptance: the floor's rules name the speculative scenario, the history judges
NO_FLOOR = KL.model_copy(update={"accept_length": MetricLimits(min_effect=0.02,
                                                               relative_effect=0.03)})


def history(rng, n_runs=5, n=8, mean=1e-13, sd=2e-14) -> Series:
    s = Series()
    for i in range(n_runs):
        x = np.abs(rng.normal(mean, sd, n))
        s.run_ids.append(i + 1)
        s.values.append(float(x.mean()))
        s.samples.append(by_id(x))
    return s


def by_id(values) -> dict[str, float]:
    """Per-sample values keyed by sample id, as the store keeps them (same prompts every run)."""
    return {f"s{i:03d}": float(v) for i, v in enumerate(values)}


def judge(samples, hist=None, metric="kl_k3_mean", limits=KL, scenario="prefill_hit", **kw):
    samples = np.asarray(samples, dtype=float)
    return judge_metric(scenario, metric, float(samples.mean()), by_id(samples), limits,
                        hist if hist is not None else Series(), HS, **kw)


# ---- fixed limits ----------------------------------------------------------------------------

def test_too_few_hits_is_inconclusive_whatever_the_kl():
    j = judge([5.0] * 8, coverage=0.25)
    assert (j.verdict, j.method) == ("inconclusive", "coverage")
    assert "hit coverage 0.25 below 0.50" in j.reason
    assert judge([1e-13] * 8, coverage=0.0).verdict == "inconclusive"


def test_kl_above_the_limit_is_a_regression_with_the_limit_as_evidence():
    j = judge([2e-8] * 8, coverage=1.0)
    assert (j.verdict, j.method, j.threshold) == ("regression", "threshold", 1e-8)
    assert "above the limit" in j.reason


def test_bit_exact_configs_fail_on_any_nonzero_kl():
    exact = Limits(kl_k3_mean=MetricLimits(max=0.0), bit_exact=True)
    assert judge([0.0] * 4, limits=exact, exact_fraction=1.0).verdict == "pass"
    j = judge([0.0, 0.0, 0.0, 1e-15], limits=exact, exact_fraction=0.99)
    assert (j.verdict, j.method) == ("regression", "bit_exact")


def test_acceptance_floor_applies_to_the_speculative_scenario():
    j = judge([1.5] * 8, metric="accept_length", scenario="speculative")
    assert (j.verdict, j.threshold) == ("regression", 1.96)
    assert judge([2.05] * 8, metric="accept_length", scenario="speculative").verdict == "pass"


# ---- history ---------------------------------------------------------------------------------

def test_without_enough_history_only_fixed_limits_decide():
    rng = np.random.default_rng(0)
    j = judge([5e-9] * 8, hist=history(rng, n_runs=2))
    assert (j.verdict, j.method) == ("pass", "threshold")
    assert "2 earlier run(s), 3 needed" in j.evidence["history"]


def test_a_rise_below_the_limit_but_beyond_the_effect_floor_is_a_history_regression():
    rng = np.random.default_rng(1)
    j = judge(np.abs(rng.normal(5e-9, 1e-9, 8)), hist=history(rng))
    assert (j.verdict, j.method) == ("regression", "history")
    assert j.diff_low > 0 and j.value - j.baseline > j.threshold == pytest.approx(1e-9)
    assert j.evidence["baseline_runs"] == [1, 2, 3, 4, 5]
    assert j.evidence["n"] == 8 and j.evidence["n_baseline"] == 40


def test_a_significant_rise_smaller_than_the_effect_floor_passes():
    rng = np.random.default_rng(2)
    j = judge(np.abs(rng.normal(4e-13, 1e-14, 8)), hist=history(rng))
    assert j.diff_low > 0  # statistically clear, but float rounding is not a bug
    assert (j.verdict, j.method) == ("pass", "history")


def test_acceptance_drop_is_judged_on_its_own_with_kl_unchanged():
    rng = np.random.default_rng(3)
    hist = Series()
    for i in range(5):
        x = rng.normal(2.05, 0.15, 16)
        hist.run_ids.append(i)
        hist.values.append(float(x.mean()))
        hist.samples.append(by_id(x))
    j = judge(rng.normal(1.80, 0.15, 16), hist=hist, metric="accept_length", limits=NO_FLOOR)
    assert (j.verdict, j.method) == ("regression", "history"), j
    assert judge([1.80] * 16, metric="accept_length", scenario="speculative").reason == \
        "accept length 1.800 below the floor 1.960"
    better = judge(rng.normal(2.30, 0.15, 16), hist=hist, metric="accept_length",
                   limits=NO_FLOOR)
    assert better.verdict == "improvement"


def test_welch_interval_covers_and_rejects():
    rng = np.random.default_rng(4)
    misses = 0
    for _ in range(2000):
        _, low, high, _ = welch_difference(rng.normal(0, 1, 8), rng.normal(0, 2, 30), 0.95)
        misses += not low <= 0 <= high
    assert 0.03 < misses / 2000 < 0.07  # a 95 % interval misses about 5 % of the time
    diff, low, high, p = welch_difference([1.0] * 4, [1.0] * 4)
    assert (diff, low, high, p) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="needs >= 2 samples"):
        welch_difference([1.0], [1.0, 2.0])


def test_no_false_alarms_on_noise_and_power_on_a_real_shift():
    """1,000 contenders drawn like their baseline (gamma-shaped KL around 1e-3, a GPU's level)
    raise no alarm; a threefold rise (four times the effect floor) is caught nearly always."""
    rng = np.random.default_rng(5)
    gpu = Limits(kl_k3_mean=MetricLimits(max=5e-3, min_effect=5e-4, relative_effect=0.5))

    def draw(scale, n=16):
        return rng.gamma(4.0, scale / 4.0, n)

    false = caught = 0
    for _ in range(1000):
        hist = Series()
        for i in range(10):
            x = draw(1e-3)
            hist.run_ids.append(i)
            hist.values.append(float(x.mean()))
            hist.samples.append(by_id(x))
        false += judge(draw(1e-3), hist=hist, limits=gpu).verdict == "regression"
        caught += judge(draw(3e-3), hist=hist, limits=gpu).verdict == "regression"
    assert false == 0
    assert caught >= 900


def test_change_point_finds_a_lasting_shift_and_ignores_noise():
    rng = np.random.default_rng(6)
    series = np.concatenate([rng.normal(1.0, 0.05, 14), rng.normal(1.2, 0.05, 6)])
    cp = change_point(series)
    assert cp["index"] == 14 and cp["p_value"] <= 0.001
    noise = [change_point(rng.normal(1.0, 0.05, 20), permutations=499)["p_value"]
             for _ in range(50)]
    assert sum(p <= 0.01 for p in noise) <= 2
    assert change_point([1.0] * 10) is None


@pytest.mark.parametrize("n", [4, 11, 24])
def test_change_point_shuffles_as_one_permutation_per_draw(n):
    """The shuffles drawn in one call are the ones drawn one ``rng.permutation`` at a time (how
    the p-values of recorded verdicts were computed): the same statistic and p-value."""
    x = np.random.default_rng(n).normal(1.0, 0.1, n)
    x[n // 2:] += 0.05
    cp = change_point(x, permutations=499, seed=3)
    assert (cp["statistic"], cp["p_value"]) == loop_change_point(x, permutations=499, seed=3)


def test_change_point_flags_a_shift_that_single_runs_do_not_show():
    rng = np.random.default_rng(7)
    limits = Limits(accept_length=MetricLimits(min_effect=0.02, relative_effect=0.0))
    hist = Series()
    for i in range(24):
        x = rng.normal(2.05 if i < 20 else 1.99, 0.3, 8)
        hist.run_ids.append(100 + i)
        hist.values.append(2.05 if i < 20 else 1.99)  # per-run means exactly on their levels
        hist.samples.append(by_id(x))
    j = judge(rng.normal(1.99, 0.3, 8) * 0 + 1.99, hist=hist, metric="accept_length",
              limits=limits)
    assert (j.verdict, j.method) == ("regression", "change_point"), j
    assert j.evidence["change_point"]["first_run_id"] == 120


# ---- thresholds file -------------------------------------------------------------------------

def test_thresholds_file_rules_per_config_and_scenario():
    t = load()
    embedded = limits_for(matrix="smoke", engine="embedded", config="mamba2-eb-ov-c64",
                          model="mamba2", settings={"mtp": False}, scenario="prefill_hit",
                          thresholds=t)
    assert embedded.kl_k3_mean.max == 1e-8 and embedded.min_hit_coverage == 0.5
    cold = limits_for(matrix="smoke", engine="embedded", config="x", model="mamba2",
                      settings={}, scenario="cold", thresholds=t)
    assert cold.min_hit_coverage == 0.0
    mtp = limits_for(matrix="smoke", engine="embedded", config="x", model="gdn",
                     settings={"mtp": True}, scenario="speculative", thresholds=t)
    assert mtp.accept_length.min == 1.96
    gpu = limits_for(matrix="mamba-full", engine="sglang", config="x", model="qwen3-next",
                     settings={"deterministic": True}, scenario="cold", thresholds=t)
    assert gpu.bit_exact and gpu.kl_k3_mean.max == 0.0


def test_a_bad_thresholds_file_names_the_key(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("rules:\n  - match: {colour: red}\n    min_hit_coverage: 0.5\n")
    with pytest.raises(ThresholdError, match=r"t.yaml: rules.0.match.*unknown match key 'colour'"):
        load(path)
    path.write_text("defaults:\n  kl_k3_mean: {max: 1.0, typo: 2}\n")
    with pytest.raises(ThresholdError, match=r"defaults.kl_k3_mean.typo"):
        load(path)


def test_pairing_by_prompt_sees_a_drop_that_prompt_to_prompt_spread_hides():
    """Acceptance differs a lot from prompt to prompt and little from run to run for one prompt:
    the paired test catches a drop of 0.1 on every prompt; Welch's, between the groups, cannot."""
    rng = np.random.default_rng(11)
    level = rng.uniform(1.2, 3.0, 16)  # per prompt
    hist = Series()
    for i in range(4):
        x = level + rng.normal(0, 0.02, 16)
        hist.run_ids.append(i)
        hist.values.append(float(x.mean()))
        hist.samples.append(by_id(x))
    contender = level - 0.1 + rng.normal(0, 0.02, 16)
    j = judge(contender, hist=hist, metric="accept_length", limits=NO_FLOOR)
    assert (j.verdict, j.method, j.evidence["test"], j.evidence["pairs"]) == (
        "regression", "history", "paired_t", 16)
    unpaired = judge_metric("prefill_hit", "accept_length", float(contender.mean()),
                            {f"other-{i}": float(v) for i, v in enumerate(contender)},
                            NO_FLOOR, hist, HS)
    assert (unpaired.verdict, unpaired.evidence["test"]) == ("pass", "welch")


# ---- the tail test (extend KL, greedy acceptance) --------------------------------------------

EXTEND = Limits(extend_kl_k3_mean=MetricLimits(max=1e-2, min_effect=1e-6, relative_effect=0.5,
                                               tail=True))


def extend_history(rng, level, n_runs=4):
    s = Series()
    for i in range(n_runs):
        x = level * np.exp(rng.normal(0, 0.2, level.size))
        s.run_ids.append(i + 1)
        s.values.append(float(x.mean()))
        s.samples.append(by_id(x))
    return s


def test_a_few_requests_struck_hard_are_a_tail_regression_the_mean_test_misses():
    """Two of 48 requests whose extend KL is 200 times their usual: the location test does not
    see it (on the log scale two samples of 48 move the mean little), the tail test flags both."""
    rng = np.random.default_rng(20)
    level = np.exp(rng.normal(np.log(2e-5), 0.7, 48))
    hist = extend_history(rng, level)
    clean = level * np.exp(rng.normal(0, 0.2, 48))
    j = judge(clean, hist=hist, metric="extend_kl_k3_mean", limits=EXTEND)
    assert (j.verdict, j.method) == ("pass", "history") and j.evidence["tail"]["outliers"] == []
    struck = clean.copy()
    struck[[5, 30]] *= 200
    j = judge(struck, hist=hist, metric="extend_kl_k3_mean", limits=EXTEND)
    assert (j.verdict, j.method, j.evidence["test"]) == ("regression", "history", "tail"), j
    assert {o[0] for o in j.evidence["tail"]["outliers"]} == {"s005", "s030"}
    assert "2 of 48 samples far beyond their baseline" in j.reason
    # without the tail test, the mean alone does not say so
    plain = Limits(extend_kl_k3_mean=EXTEND.extend_kl_k3_mean.model_copy(update={"tail": False}))
    assert judge(struck, hist=hist, metric="extend_kl_k3_mean", limits=plain).verdict == "pass"


def test_tail_samples_below_the_effect_floor_do_not_count():
    """A deterministic engine repeats itself exactly: a sample that moved is far out, but a move
    smaller than the effect floor is rounding, not a bug."""
    hist = Series()
    level = np.linspace(1e-13, 5e-13, 16)
    for i in range(3):
        hist.run_ids.append(i + 1)
        hist.values.append(float(level.mean()))
        hist.samples.append(by_id(level))
    limits = Limits(extend_kl_k3_mean=MetricLimits(max=1e-8, min_effect=1e-9, tail=True))
    moved = level.copy()
    moved[3] = 8e-13
    j = judge(moved, hist=hist, metric="extend_kl_k3_mean", limits=limits)
    assert j.verdict == "pass" and j.evidence["tail"]["outliers"] == []
    moved[3] = 5e-9
    j = judge(moved, hist=hist, metric="extend_kl_k3_mean", limits=limits)
    assert (j.verdict, j.evidence["test"]) == ("regression", "tail")


def test_a_baseline_that_repeats_the_reference_exactly_takes_the_engines_noise_for_its_median():
    """bf16, chunk grids that coincide: every baseline run repeats the reference exactly (extend KL
    0), so ten times the baseline's median is 0. One batch composed otherwise moves three of five
    samples to the engine's clean scale (8e-5): with the engine's `noise` that is no tail, and a
    state bug's hundredfold still is."""
    hist = Series()
    for i in range(5):
        hist.run_ids.append(i + 1)
        hist.values.append(0.0)
        hist.samples.append(by_id([0.0] * 5))
    bare = MetricLimits(max=3e-2, min_effect=5e-6, relative_effect=0.5, tail=True, tail_factor=10)
    batched = [8.1e-5, 0.0, 7.5e-5, 0.0, 6.9e-5]
    j = judge(batched, hist=hist, metric="extend_kl_k3_mean",
              limits=Limits(extend_kl_k3_mean=bare))
    assert (j.verdict, j.evidence["test"]) == ("regression", "tail")  # without it: a false alarm
    noisy = Limits(extend_kl_k3_mean=bare.model_copy(update={"noise": 7e-5}))
    j = judge(batched, hist=hist, metric="extend_kl_k3_mean", limits=noisy)
    assert j.verdict == "pass" and j.evidence["tail"]["outliers"] == []
    j = judge([8.1e-5, 0.0, 7e-3, 0.0, 0.0], hist=hist, metric="extend_kl_k3_mean", limits=noisy)
    assert (j.verdict, j.evidence["test"]) == ("regression", "tail")
    assert [o[0] for o in j.evidence["tail"]["outliers"]] == ["s002"]


def test_greedy_acceptance_that_drops_for_some_prompts_is_a_tail_regression():
    rng = np.random.default_rng(21)
    level = rng.uniform(1.5, 2.8, 48)
    hist = Series()
    for i in range(3):  # greedy, one request at a time: every run repeats the last exactly
        hist.run_ids.append(i + 1)
        hist.values.append(float(level.mean()))
        hist.samples.append(by_id(level))
    limits = Limits(accept_length=MetricLimits(min_effect=0.02, relative_effect=0.03, tail=True))
    dropped = level.copy()
    dropped[[2, 9, 11, 40]] -= 0.3
    j = judge(dropped, hist=hist, metric="accept_length", scenario="speculative", limits=limits)
    assert (j.verdict, j.evidence["test"]) == ("regression", "tail"), j
    assert len(j.evidence["tail"]["outliers"]) == 4
