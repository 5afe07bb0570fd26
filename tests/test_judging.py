"""Where a failing extend's KL sits along the extend (``judging.extend_location``), and the
reasons that name it: a scenario judged against its fixed limits, and a metric judged alone; and a
known failure's level held (``judging.hold_known``, ``after_history``)."""

from __future__ import annotations

import numpy as np
import pytest

from evalsvc.judging import (
    NO_SPEC_COUNTERS,
    Judgement,
    KnownFailure,
    Series,
    after_history,
    extend_location,
    hold_known,
    judge_metric,
    judge_scenario,
    locate_extend,
)
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


PR = "https://github.com/sgl-project/sglang/pull/29068"


def known_limits() -> Limits:
    """A fixed limit of 0.01 and an effect floor of half the level (at least 1e-3)."""
    lim = MetricLimits(max=0.01, min_effect=1e-3, relative_effect=0.5)
    return Limits(kl_k3_mean=lim, extend_kl_k3_mean=lim)


@pytest.mark.parametrize(("value", "verdict"), [
    (0.9, "expected"), (0.5, "expected"), (1.3, "expected"),  # past the limit, not past the level
    (1.4, "regression"),  # past the level by more than its floor (0.45)
    (0.005, "pass"),  # under the limit: the fix landed
])
def test_a_known_failure_holds_its_level_and_not_more(value, verdict):
    j = judge_metric("prefill_hit", "extend_kl_k3_mean", value, {}, known_limits(), Series(),
                     HistorySettings())
    hold_known(j, KnownFailure(7, 0.9, PR), known_limits())
    assert j.verdict == verdict, j.reason
    if verdict == "expected":
        assert j.reason == (f"known failure (regression #7, {PR}): extend KL (k3) {value:.3g} "
                            "above the limit 0.01")
        assert j.evidence["known_failure"] == {"regression_id": 7, "link": PR, "level": 0.9,
                                               "floor": 0.45, "exceeded": False}
    if verdict == "regression":
        assert j.reason.endswith(f"; worse than the known failure (regression #7, {PR}: extend "
                                 "KL (k3) 0.9) by more than the effect floor 0.45")


def test_a_pass_at_a_known_level_is_expected_and_acceptance_is_worse_when_lower():
    """Under the fixed limit (a history-level known failure: its level is the new baseline), a
    pass within the floor of the level is still the known failure; for acceptance length, lower
    is worse."""
    j = Judgement("pooled", "kl_k3_mean", "pass", "history", value=0.006)
    hold_known(j, KnownFailure(3, 0.005, None), known_limits())
    assert (j.verdict, j.reason) == ("expected", "known failure (regression #3): mean KL (k3) "
                                     "0.006 at its level 0.005 (within the effect floor 0.0025)")
    limits = Limits(accept_length=MetricLimits(min_effect=0.02, relative_effect=0.03))
    for value, verdict in ((2.0, "expected"), (2.1, "expected"), (1.9, "regression")):
        j = Judgement("speculative", "accept_length", "regression", "history", value=value)
        hold_known(j, KnownFailure(4, 2.0, PR), limits)  # floor 0.06
        assert j.verdict == verdict, value


def test_a_scenario_failing_only_as_known_failures_is_expected():
    known = Judgement("prefill_hit", "extend_kl_k3_mean", "expected", "threshold",
                      reason="known failure (regression #7): extend KL (k3) 0.9 above the limit")
    new = Judgement("prefill_hit", "kl_k3_mean", "regression", "threshold",
                    reason="mean KL (k3) 0.2 above the limit 0.01")
    ok = Judgement("prefill_hit", "kl_k3_mean", "pass", "threshold")
    assert after_history("fail", "extend KL (k3) 0.9 above the limit", [known, ok]) == (
        "expected", known.reason)
    assert after_history("pass", None, [known, ok]) == ("expected", known.reason)
    assert after_history("fail", "extend KL (k3) 0.9 above the limit", [known, new]) == (
        "fail", new.reason)
    assert after_history("fail", NO_SPEC_COUNTERS, [known, ok]) == ("fail", NO_SPEC_COUNTERS)
    assert after_history("inconclusive", "too few hits", [known]) == ("inconclusive", "too few hits")
    assert after_history("expected", known.reason, [ok]) == ("pass", None)  # judged again
    assert after_history("fail", "why", [ok]) == ("fail", "why")


def test_an_acceptance_floor_holds_in_the_scenarios_its_rule_matches():
    """The shipped floors name the speculative scenario; the exact draft's (inkling-tiny on real
    SGLang) holds in every scenario, where PR #37165's bug shows wherever it strikes; a matrix's
    own floor (``thresholds`` or a model's ``accept_floor``) is its speculative scenario's."""
    from evalsvc.matrix import Thresholds
    from evalsvc.thresholds import limits_for

    def floor(model, scenario, **kw):
        return limits_for(matrix="m", engine="sglang", config="c", model=model,
                          settings={"mtp": True}, scenario=scenario, **kw).accept_length.min

    assert (floor("qwen3-next-tiny", "speculative"), floor("qwen3-next-tiny", "branching")) == \
        (1.3, None)
    assert floor("inkling-tiny", "speculative") == floor("inkling-tiny", "branching") == 1.98
    own = Thresholds.model_validate({"accept_length": {"min": 1.5, "min_effect": 0.1}})
    assert (floor("x", "speculative", matrix_thresholds=own),
            floor("x", "cold", matrix_thresholds=own)) == (1.5, None)
    assert (floor("x", "speculative", accept_floor=2.0), floor("x", "cold", accept_floor=2.0)) == \
        (2.0, None)
    limits = limits_for(matrix="m", engine="sglang", config="c", model="inkling-tiny",
                        settings={"mtp": True}, scenario="branching")
    verdict, reason = judge_scenario("branching", {"accept_length": 1.9}, limits, uses_mtp=True)
    assert (verdict, reason) == ("fail", "accept length 1.900 below the floor 1.980")
