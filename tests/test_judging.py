"""Where a failing extend's KL sits along the extend (``judging.extend_location``), and the
reasons that name it: a scenario judged against its fixed limits, and a metric judged alone."""

from __future__ import annotations

import numpy as np
import pytest

from evalsvc.judging import Series, extend_location, judge_metric, judge_scenario, locate_extend
from evalsvc.metrics import PositionKL, kl_by_position
from evalsvc.thresholds import HistorySettings, Limits, MetricLimits

LENGTHS = [96, 96, 80, 40]


def profile(head: list[float], lengths: list[int] = LENGTHS, rest: float = 1e-4,
            seed: int = 0) -> PositionKL:
    """Samples whose extend k3 is about ``rest`` at every position but the first ones, ``head``."""
    rng = np.random.default_rng(seed)
    k3 = []
    for n in lengths:
        x = rest * rng.uniform(0.8, 1.2, n)
        x[: len(head)] = head[:n]
        k3.append(x)
    return kl_by_position(np.concatenate(k3) if k3 else np.zeros(0), np.array(lengths))


def test_a_first_position_that_dominates_is_named_with_the_level_of_the_rest():
    where = extend_location(profile([130.0]))
    assert where is not None
    assert where.startswith("k3 130 at extend position 0 of 40-96; positions 1+ at ")
    rest = float(where.rsplit(" at ", 1)[1])
    assert 0.9e-4 < rest < 1.1e-4


def test_the_first_width_minus_one_positions_of_a_conv_state_bug_are_named_together():
    # a kernel that ignores the conv state for the first 3 positions of each extend
    where = extend_location(profile([130.0, 20.0, 5.0], lengths=[96] * 4))
    assert where is not None
    assert where.startswith("k3 130, 20, 5 at extend positions 0, 1, 2 of 96; positions 3+ at ")


def test_a_position_in_the_middle_is_named_against_the_other_positions():
    k3 = np.full(64, 1e-4)
    k3[32] = 50.0
    where = extend_location(kl_by_position(k3, np.array([64])))
    assert where == "k3 50 at extend position 32 of 64; other positions at 0.0001"


def test_a_flat_extend_singles_out_no_position():
    where = extend_location(profile([]))
    assert where == "spread along the extend of 40-96, no position standing out"
    # a short extend where two positions carry half: they do not stand out from the others
    assert "spread" in extend_location(kl_by_position(np.full(4, 0.3), np.array([4])))
    # four high positions: more than the few named
    assert "spread" in extend_location(profile([1.0] * 8, lengths=[96] * 4))


@pytest.mark.parametrize("case", ["none", "empty", "no tokens", "one token", "all zero", "inf"])
def test_nothing_to_place_says_nothing(case):
    p = {"none": None,
         "empty": kl_by_position(np.zeros(0), np.array([], dtype=np.int64)),
         "no tokens": kl_by_position(np.zeros(0), np.array([0, 0])),
         "one token": kl_by_position(np.array([5.0, 1e-4, 3.0]), np.array([1, 1, 1])),
         "all zero": kl_by_position(np.zeros(10), np.array([5, 5])),
         "inf": kl_by_position(np.array([np.inf, 1e-4, 1e-4]), np.array([3]))}[case]
    assert extend_location(p) is None


def limits() -> Limits:
    return Limits(kl_k3_mean=MetricLimits(max=1e-2), extend_kl_k3_mean=MetricLimits(max=1e-2))


def test_a_failing_extend_verdict_names_the_positions_and_a_passing_one_does_not():
    p = profile([130.0])
    j = judge_metric("prefill_hit", "extend_kl_k3_mean", 1.4, {}, limits(), Series(),
                     HistorySettings())
    locate_extend(j, p)
    assert j.verdict == "regression"
    assert j.reason.startswith("extend KL (k3) 1.4 above the limit 0.01 (k3 130 at extend "
                               "position 0 of 40-96; positions 1+ at ")
    ok = judge_metric("prefill_hit", "extend_kl_k3_mean", 1e-4, {}, limits(), Series(),
                      HistorySettings())
    locate_extend(ok, p)
    assert (ok.verdict, ok.reason) == ("pass", "")
    kl = judge_metric("prefill_hit", "kl_k3_mean", 1.4, {}, limits(), Series(), HistorySettings())
    locate_extend(kl, p)  # the generated tokens' KL has no extend positions
    assert kl.reason == "mean KL (k3) 1.4 above the limit 0.01"
    locate_extend(None, p)


def test_a_scenario_failing_on_its_extend_says_where():
    metrics = {"hit_coverage": 1.0, "kl_k3_mean": 1e-4, "extend_kl_k3_mean": 1.4}
    verdict, reason = judge_scenario("prefill_hit", metrics, limits(), extend=profile([130.0]))
    assert verdict == "fail" and "at extend position 0 of 40-96" in reason
    assert judge_scenario("prefill_hit", metrics, limits()) == (
        "fail", "extend KL (k3) 1.4 above the limit 0.01")


def test_a_high_position_left_in_the_rest_is_named_with_its_level():
    # four positions well above the rest: three named, the fourth's level given with the rest's
    k3 = np.full(100, 1e-4)
    k3[[2, 7, 11, 30]] = [5.0, 0.5, 0.4, 0.3]
    where = extend_location(kl_by_position(k3, np.array([100])))
    assert where == ("k3 5, 0.5, 0.4 at extend positions 2, 7, 11 of 100; other positions at "
                     "0.00319, up to 0.3 (position 30)")
