"""Acceptance metrics on hand-computed counters, under every convention."""

from __future__ import annotations

import pytest

from evalsvc.metrics import (
    per_position_acceptance,
    sglang_accept_length,
    sglang_accept_rate,
    summarize_acceptance,
    vllm_acceptance_rate,
    vllm_mean_acceptance_length,
)
from evalsvc.types import SpecCounters

# Three requests, chain drafting with draft_tokens = 4 (3 draft positions per verify step).
# Each request: completion_tokens = 1 (prefill) + verify_ct (bonus) + correct_drafts.
# histogram[j] = verify steps accepting exactly j drafts; sum(j * h[j]) = correct_drafts.


def _reqs() -> list[SpecCounters]:
    return [
        # 4 steps accepting 0, 2, 2, 2 drafts: correct 6, completion 1 + 4 + 6 = 11
        SpecCounters(
            verify_ct=4,
            completion_tokens=11,
            correct_drafts=6,
            proposed_drafts=12,
            histogram=[1, 0, 3, 0],
            draft_tokens=4,
        ),
        # 2 steps accepting 3, 3: correct 6, completion 1 + 2 + 6 = 9
        SpecCounters(
            verify_ct=2,
            completion_tokens=9,
            correct_drafts=6,
            proposed_drafts=6,
            histogram=[0, 0, 0, 2],
            draft_tokens=4,
        ),
        # 4 steps accepting 0, 1, 1, 0: correct 2, completion 1 + 4 + 2 = 7
        SpecCounters(
            verify_ct=4,
            completion_tokens=7,
            correct_drafts=2,
            proposed_drafts=12,
            histogram=[2, 2],
            draft_tokens=4,
        ),
    ]


def test_sglang_conventions() -> None:
    reqs = _reqs()
    # totals: verify 10, completion 27, correct 14, proposed 30
    assert sglang_accept_length(reqs) == pytest.approx(27 / 10)
    assert sglang_accept_rate(reqs) == pytest.approx(14 / 30)


def test_vllm_conventions() -> None:
    reqs = _reqs()
    assert vllm_mean_acceptance_length(reqs) == pytest.approx(1 + 14 / 10)
    assert vllm_acceptance_rate(reqs) == pytest.approx(14 / 30)
    # SGLang's length also counts one prefill-sampled token per request: 3 requests / 10 steps more
    assert sglang_accept_length(reqs) - vllm_mean_acceptance_length(reqs) == pytest.approx(3 / 10)


def test_ratio_of_sums_not_mean_of_ratios() -> None:
    reqs = _reqs()
    per_request = [c.completion_tokens / c.verify_ct for c in reqs]
    assert sglang_accept_length(reqs) != pytest.approx(sum(per_request) / len(per_request))


def test_per_position_acceptance_from_histograms() -> None:
    reqs = _reqs()
    # summed histogram: [3, 2, 3, 2] over 10 steps; >=1: 7, >=2: 5, >=3: 2
    assert per_position_acceptance(reqs, 3) == pytest.approx([0.7, 0.5, 0.2])
    # more positions than the histogram covers: zeros; fewer: truncated
    assert per_position_acceptance(reqs, 5) == pytest.approx([0.7, 0.5, 0.2, 0.0, 0.0])
    assert per_position_acceptance(reqs, 1) == pytest.approx([0.7])
    assert per_position_acceptance(reqs, 0) == []
    # the histogram's mean accepted drafts equals the sum of per-position rates
    assert sum(per_position_acceptance(reqs, 3)) == pytest.approx(14 / 10)
    with pytest.raises(ValueError, match="num_draft_positions"):
        per_position_acceptance(reqs, -1)


def test_per_position_acceptance_without_histograms() -> None:
    reqs = _reqs()
    reqs[1].histogram = None
    assert per_position_acceptance(reqs, 3) is None
    assert per_position_acceptance([], 3) is None
    no_steps = SpecCounters(verify_ct=0, completion_tokens=1, histogram=[0, 0])
    assert per_position_acceptance([no_steps], 1) is None


def test_proposed_derived_from_draft_tokens() -> None:
    reqs = _reqs()
    for c in reqs:
        c.proposed_drafts = None  # verify_ct * (4 - 1) = 12, 6, 12 -> 30
    assert sglang_accept_rate(reqs) == pytest.approx(14 / 30)
    assert summarize_acceptance(reqs)["proposed_drafts"] == 30
    reqs[0].draft_tokens = None  # neither known for one request: no rate
    assert sglang_accept_rate(reqs) is None
    assert vllm_acceptance_rate(reqs) is None


def test_missing_correct_drafts() -> None:
    reqs = _reqs()
    reqs[2].correct_drafts = None
    assert sglang_accept_rate(reqs) is None
    assert vllm_mean_acceptance_length(reqs) is None
    assert sglang_accept_length(reqs) == pytest.approx(27 / 10)  # needs only the always-present counts


def test_empty_and_zero_verify() -> None:
    for reqs in ([], [SpecCounters(verify_ct=0, completion_tokens=1, correct_drafts=0, proposed_drafts=0)]):
        assert sglang_accept_length(reqs) is None
        assert sglang_accept_rate(reqs) is None
        assert vllm_mean_acceptance_length(reqs) is None
        assert vllm_acceptance_rate(reqs) is None
        out = summarize_acceptance(reqs)
        for key in (
            "sglang_accept_length",
            "sglang_accept_rate",
            "vllm_mean_acceptance_length",
            "vllm_acceptance_rate",
            "per_position_acceptance",
            "server_avg_accept_length",
        ):
            assert out[key] is None, key
    empty = summarize_acceptance([])
    assert empty["n_requests"] == 0
    assert empty["verify_ct"] is None and empty["completion_tokens"] is None


def test_negative_counter_rejected() -> None:
    with pytest.raises(ValueError, match="verify_ct is negative"):
        sglang_accept_length([SpecCounters(verify_ct=-1, completion_tokens=1)])
    with pytest.raises(ValueError, match="histogram"):
        per_position_acceptance([SpecCounters(verify_ct=1, completion_tokens=2, histogram=[2, -1])], 1)


def test_summarize_acceptance() -> None:
    out = summarize_acceptance(_reqs(), server_avg_accept_length=2.7)
    assert out == {
        "n_requests": 3,
        "verify_ct": 10,
        "correct_drafts": 14,
        "proposed_drafts": 30,
        "completion_tokens": 27,
        "sglang_accept_length": pytest.approx(2.7),
        "sglang_accept_rate": pytest.approx(14 / 30),
        "vllm_mean_acceptance_length": pytest.approx(2.4),
        "vllm_acceptance_rate": pytest.approx(14 / 30),
        "num_draft_positions": 3,
        "per_position_acceptance": pytest.approx([0.7, 0.5, 0.2]),
        "server_avg_accept_length": 2.7,
    }


def test_summarize_acceptance_positions_from_histogram_when_draft_tokens_unknown() -> None:
    reqs = _reqs()
    for c in reqs:
        c.draft_tokens = None
    out = summarize_acceptance(reqs)
    assert out["num_draft_positions"] == 3  # summed histogram has entries for 0..3 accepted
    assert out["per_position_acceptance"] == pytest.approx([0.7, 0.5, 0.2])
    for c in reqs:
        c.histogram = None
    out = summarize_acceptance(reqs)
    assert out["num_draft_positions"] is None and out["per_position_acceptance"] is None
    assert out["sglang_accept_rate"] == pytest.approx(14 / 30)  # proposed_drafts still given
