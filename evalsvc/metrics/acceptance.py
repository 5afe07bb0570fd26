"""Speculative-decoding acceptance metrics from per-request counters (``evalsvc.types.SpecCounters``).

Every function takes the counters of a set of requests (one ``SpecCounters`` per request), sums
the raw counts first and divides once (a token-weighted ratio, not a mean of per-request ratios),
and returns None instead of dividing by zero or when a needed counter is missing.

Conventions (they differ between servers; none is "the" acceptance length):

* SGLang accept length (``avg_spec_accept_length``): ``completion_tokens / verify_ct`` - tokens
  per verify forward, counting the bonus token each verify step yields *and* the token sampled by
  prefill (which had no verify step), so it is slightly above 1 + accepted / verify_ct.
* SGLang accept rate: ``correct_drafts / proposed_drafts`` with
  ``proposed_drafts = verify_ct * (draft_tokens - 1)`` in chain drafting - the bonus token is
  excluded from both numerator and denominator. Range 0..1.
* vLLM mean acceptance length: ``1 + accepted / drafts`` where drafts = verify steps
  (``1 + correct_drafts / verify_ct``): the bonus token counts, the prefill token does not.
* vLLM acceptance rate: ``accepted / proposed draft tokens`` - the same ratio as SGLang's rate.
* Per-position acceptance (vLLM's per-position rate): for draft position i = 1..k, the fraction of
  verify steps that accepted at least i drafts, from ``histogram[j]`` = steps accepting exactly j.

Units: lengths are tokens per verify step; rates are fractions in 0..1.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from evalsvc.types import SpecCounters


def _check(counters: Sequence[SpecCounters]) -> None:
    for i, c in enumerate(counters):
        for name in ("verify_ct", "completion_tokens", "correct_drafts", "proposed_drafts"):
            v = getattr(c, name)
            if v is not None and v < 0:
                raise ValueError(f"counters[{i}].{name} is negative: {v}")
        if c.histogram is not None and any(h < 0 for h in c.histogram):
            raise ValueError(f"counters[{i}].histogram has a negative count")


def _proposed(c: SpecCounters) -> int | None:
    if c.proposed_drafts is not None:
        return c.proposed_drafts
    if c.draft_tokens is not None:
        return c.verify_ct * max(c.draft_tokens - 1, 0)
    return None


def total_verify_ct(counters: Sequence[SpecCounters]) -> int:
    """Sum of ``verify_ct`` (target verify forwards)."""
    return sum(c.verify_ct for c in counters)


def total_correct_drafts(counters: Sequence[SpecCounters]) -> int | None:
    """Sum of accepted draft tokens; None if any request lacks ``correct_drafts`` (or none given)."""
    if not counters or any(c.correct_drafts is None for c in counters):
        return None
    return sum(c.correct_drafts for c in counters)  # type: ignore[misc]


def total_proposed_drafts(counters: Sequence[SpecCounters]) -> int | None:
    """Sum of proposed draft tokens, using ``verify_ct * (draft_tokens - 1)`` for a request without
    ``proposed_drafts``; None if any request has neither (or none given)."""
    vals = [_proposed(c) for c in counters]
    if not vals or any(v is None for v in vals):
        return None
    return sum(vals)  # type: ignore[arg-type]


def sglang_accept_length(counters: Sequence[SpecCounters]) -> float | None:
    """SGLang's accept length: ``sum(completion_tokens) / sum(verify_ct)`` (tokens per verify step,
    bonus and prefill-sampled tokens included). None when there are no verify steps."""
    _check(counters)
    v = total_verify_ct(counters)
    return sum(c.completion_tokens for c in counters) / v if v > 0 else None


def sglang_accept_rate(counters: Sequence[SpecCounters]) -> float | None:
    """SGLang's accept rate: ``sum(correct_drafts) / sum(proposed_drafts)`` (bonus excluded), 0..1.
    None when a request lacks the counters or nothing was proposed."""
    _check(counters)
    correct = total_correct_drafts(counters)
    proposed = total_proposed_drafts(counters)
    if correct is None or proposed is None or proposed == 0:
        return None
    return correct / proposed


def vllm_mean_acceptance_length(counters: Sequence[SpecCounters]) -> float | None:
    """vLLM's mean acceptance length: ``1 + sum(correct_drafts) / sum(verify_ct)`` (drafts = verify
    steps; the bonus token counts, the prefill token does not). None without verify steps or
    ``correct_drafts``."""
    _check(counters)
    v = total_verify_ct(counters)
    correct = total_correct_drafts(counters)
    if v == 0 or correct is None:
        return None
    return 1.0 + correct / v


def vllm_acceptance_rate(counters: Sequence[SpecCounters]) -> float | None:
    """vLLM's draft acceptance rate: ``sum(accepted) / sum(proposed draft tokens)``, 0..1 -
    numerically the same as ``sglang_accept_rate``."""
    return sglang_accept_rate(counters)


def _summed_histogram(counters: Sequence[SpecCounters]) -> np.ndarray | None:
    if not counters or any(c.histogram is None for c in counters):
        return None
    length = max(len(c.histogram) for c in counters)  # type: ignore[arg-type]
    total = np.zeros(length, dtype=np.int64)
    for c in counters:
        total[: len(c.histogram)] += np.asarray(c.histogram, dtype=np.int64)  # type: ignore[arg-type]
    return total


def per_position_acceptance(counters: Sequence[SpecCounters], num_draft_positions: int) -> list[float] | None:
    """Per draft position i = 1..``num_draft_positions``, the fraction of verify steps that
    accepted at least i drafts (0..1, non-increasing in i).

    Uses the histograms summed over requests (``histogram[j]``: steps that accepted exactly j
    drafts; missing trailing entries count as 0, entries beyond k still count as ">= i"); the
    denominator is the histogram's total step count. Returns None when no request was given, any
    request lacks a histogram, or the histograms hold no steps; ``[]`` for 0 positions.
    """
    if num_draft_positions < 0:
        raise ValueError(f"num_draft_positions must be >= 0, got {num_draft_positions}")
    _check(counters)
    hist = _summed_histogram(counters)
    if hist is None or hist.sum() == 0:
        return None
    # at_least[j] = steps accepting >= j drafts
    at_least = np.cumsum(hist[::-1])[::-1]
    padded = np.zeros(num_draft_positions + 1, dtype=np.int64)
    m = min(at_least.size, padded.size)
    padded[:m] = at_least[:m]
    return [float(x) for x in padded[1:] / hist.sum()]


def _num_draft_positions(counters: Sequence[SpecCounters]) -> int | None:
    dts = {c.draft_tokens for c in counters}
    if len(dts) == 1 and None not in dts:
        return max(dts.pop() - 1, 0)  # type: ignore[operator]
    hist = _summed_histogram(counters)
    return hist.size - 1 if hist is not None and hist.size else None


def summarize_acceptance(
    counters: Sequence[SpecCounters], server_avg_accept_length: float | None = None
) -> dict[str, float | int | list[float] | None]:
    """All acceptance metrics of a set of requests in one dict.

    Keys: ``n_requests``; totals ``verify_ct``, ``correct_drafts``, ``proposed_drafts``,
    ``completion_tokens``; ``sglang_accept_length``, ``sglang_accept_rate``,
    ``vllm_mean_acceptance_length``, ``vllm_acceptance_rate``; ``num_draft_positions`` (from
    ``draft_tokens - 1`` when all requests agree on it, else the summed histogram's length - 1) and
    ``per_position_acceptance``; ``server_avg_accept_length`` (as given, the server's own figure,
    for comparison). Anything that cannot be computed (empty input, zero verify steps, missing
    counters) is None.
    """
    _check(counters)
    k = _num_draft_positions(counters) if counters else None
    return {
        "n_requests": len(counters),
        "verify_ct": total_verify_ct(counters) if counters else None,
        "correct_drafts": total_correct_drafts(counters),
        "proposed_drafts": total_proposed_drafts(counters),
        "completion_tokens": sum(c.completion_tokens for c in counters) if counters else None,
        "sglang_accept_length": sglang_accept_length(counters),
        "sglang_accept_rate": sglang_accept_rate(counters),
        "vllm_mean_acceptance_length": vllm_mean_acceptance_length(counters),
        "vllm_acceptance_rate": vllm_acceptance_rate(counters),
        "num_draft_positions": k,
        "per_position_acceptance": per_position_acceptance(counters, k) if k is not None else None,
        "server_avg_accept_length": server_avg_accept_length,
    }
