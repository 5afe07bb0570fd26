"""KL-divergence estimators between a decode run and a reference run.

All logprobs are natural logs, so every divergence returned here is in **nats**. Two settings:

* Only the sampled token's logprob is known on each side (``token_kl``): per-token Monte-Carlo
  estimators of KL(decode || reference), the k1/k2/k3 family SGLang's own tests use. Tokens are
  sampled from the decode distribution, so averaging an unbiased estimator over tokens estimates
  the KL; a single token's value is noisy and can be negative (k1).
* Both sides returned their top-k (``topk_kl``): an exact KL between coarse-grained distributions,
  which is a lower bound of the true KL.

Plus exact-match diagnostics: ``same_top_token``, ``first_divergence``, ``bit_exact_fraction``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Logprobs above this are rejected as "positive"; values in (0, LOGPROB_TOL] are float noise
#: around log(1) = 0 and are kept unchanged.
LOGPROB_TOL = 1e-4

#: Floor applied to every bucket of the coarse distributions in ``topk_kl`` (before they are
#: renormalised) so that a bucket one side gives ~0 mass never yields log(0) or a division by 0.
#: A bucket with mass m on P and ~0 on Q therefore contributes about m * ln(m / TOPK_EPS) nats
#: (<= ~23 m) instead of infinity; with both sides at ~0 it contributes ~0.
TOPK_EPS = 1e-10

# Upper bound on the (positions x k_p x k_q) intermediate of ``topk_kl``; larger inputs are chunked.
_MAX_PAIR_ELEMENTS = 4_000_000

TopK = Sequence[Sequence[tuple[int, float]]]


def _check_logprob_values(x: np.ndarray, name: str, allow_neg_inf: bool = False) -> None:
    if np.isnan(x).any():
        raise ValueError(f"{name} contains NaN")
    bad_inf = np.isposinf(x) if allow_neg_inf else ~np.isfinite(x)
    if bad_inf.any():
        raise ValueError(f"{name} contains {'+inf' if allow_neg_inf else 'inf'}")
    if (x > LOGPROB_TOL).any():
        raise ValueError(f"{name} contains positive logprobs (max {float(x.max())!r} > {LOGPROB_TOL})")


def _as_logprob_vector(x: np.ndarray | Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    _check_logprob_values(arr, name)
    return arr


def token_kl(
    decode_logprobs: np.ndarray | Sequence[float],
    reference_logprobs: np.ndarray | Sequence[float],
) -> dict[str, np.ndarray]:
    """Per-token estimators of KL(decode || reference), in nats.

    ``decode_logprobs[i]`` and ``reference_logprobs[i]`` are the natural-log probabilities that the
    decode run and the reference run assign to the *same* token, the one the decode run sampled at
    position i. Shapes: both ``(n,)``; every returned array is ``(n,)`` float64.

    With ``logr = reference - decode`` (= log q(x) - log p(x), x ~ p):

    * ``k1 = -logr``: unbiased, high variance, can be negative per token.
    * ``k2 = logr**2 / 2``: biased (exact only to second order for close distributions), >= 0.
    * ``k3 = exp(logr) - 1 - logr``: unbiased (E_p[q/p] = 1), always >= 0, zero iff the two
      logprobs are equal; the usual choice. It is +inf when ``logr`` exceeds ~709 nats.

    Also returns ``logr`` itself. Raises ValueError for non-1-D or different-length inputs, NaN or
    inf values, or logprobs above ``LOGPROB_TOL``.
    """
    dec = _as_logprob_vector(decode_logprobs, "decode_logprobs")
    ref = _as_logprob_vector(reference_logprobs, "reference_logprobs")
    if dec.shape != ref.shape:
        raise ValueError(
            f"decode_logprobs and reference_logprobs differ in length: {dec.shape[0]} != {ref.shape[0]}"
        )
    logr = ref - dec
    with np.errstate(over="ignore"):  # logr > ~709 (a near-impossible sampled token): k3 = inf
        k3 = np.expm1(logr) - logr
    # expm1 keeps k3 accurate for small logr; clip the last-ulp negatives rounding can leave.
    np.maximum(k3, 0.0, out=k3)
    return {"logr": logr, "k1": -logr, "k2": 0.5 * logr**2, "k3": k3}


def _pad_topk(top: TopK, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pad per-position top-k lists into (ids, logprobs, valid) arrays of shape (n, k_max)."""
    n = len(top)
    k_max = max((len(pos) for pos in top), default=0)
    ids = np.zeros((n, k_max), dtype=np.int64)
    lps = np.full((n, k_max), -np.inf, dtype=np.float64)
    valid = np.zeros((n, k_max), dtype=bool)
    for i, pos in enumerate(top):
        k = len(pos)
        if k:
            arr = np.asarray(pos, dtype=np.float64).reshape(k, 2)
            ids[i, :k] = arr[:, 0].astype(np.int64)
            lps[i, :k] = arr[:, 1]
            valid[i, :k] = True
    _check_logprob_values(lps[valid], name, allow_neg_inf=True)
    if k_max > 1:
        # Duplicate ids within one position would be double-counted: reject them.
        sentinel = np.iinfo(np.int64).min + np.arange(k_max)  # distinct, never a real id
        s = np.sort(np.where(valid, ids, sentinel), axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if dup.any():
            raise ValueError(f"{name} repeats a token id at position {int(np.flatnonzero(dup)[0])}")
    return ids, lps, valid


def _topk_kl_chunk(
    ids_p: np.ndarray,
    lp_p: np.ndarray,
    ok_p: np.ndarray,
    ids_q: np.ndarray,
    lp_q: np.ndarray,
    ok_q: np.ndarray,
) -> np.ndarray:
    # match[n, i, j]: P's i-th listed token is Q's j-th listed token.
    match = (ids_p[:, :, None] == ids_q[:, None, :]) & ok_p[:, :, None] & ok_q[:, None, :]
    in_p = match.any(axis=2)  # (n, kp): P's entry is in the intersection
    p = np.where(in_p, np.exp(lp_p), 0.0)  # (n, kp) intersection probs, in P's order
    # Q's prob of the same token, aligned to P's order (ids are unique, so at most one match).
    q = np.where(match, np.exp(lp_q)[:, None, :], 0.0).sum(axis=2)  # (n, kp)
    rest_p = np.clip(1.0 - p.sum(axis=1), 0.0, None)
    rest_q = np.clip(1.0 - q.sum(axis=1), 0.0, None)
    pf = np.where(in_p, np.maximum(p, TOPK_EPS), 0.0)
    qf = np.where(in_p, np.maximum(q, TOPK_EPS), 0.0)
    rpf = np.maximum(rest_p, TOPK_EPS)
    rqf = np.maximum(rest_q, TOPK_EPS)
    zp = pf.sum(axis=1) + rpf
    zq = qf.sum(axis=1) + rqf
    pf /= zp[:, None]
    qf /= zq[:, None]
    rpf /= zp
    rqf /= zq
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(in_p, pf * (np.log(pf) - np.log(qf)), 0.0)
    kl = terms.sum(axis=1) + rpf * (np.log(rpf) - np.log(rqf))
    return np.maximum(kl, 0.0)


def topk_kl(p_top: TopK, q_top: TopK) -> np.ndarray:
    """Per position, a lower bound of KL(P || Q) in nats from the two sides' top-k lists.

    ``p_top[t]`` / ``q_top[t]`` are position t's ``(token_id, logprob)`` pairs (as in
    ``evalsvc.types.TopLogprobs.positions``); k may differ by side and by position; order within a
    list does not matter; ids must be unique within a list. Returns shape ``(n_positions,)``.

    Both distributions are coarse-grained onto one partition of the vocabulary: each token id in
    *both* lists is its own bucket, and one "rest" bucket holds everything else, with mass
    ``1 - sum(listed intersection probs)`` on each side (clipped at >= 0). The KL of these coarse
    distributions is returned. Coarse-graining is a deterministic map applied to both sides, so by
    the data-processing inequality the result is <= the true KL(P || Q) (up to the floor below),
    and with full lists (k = vocabulary size) it equals the true KL. Larger k refines the partition
    and can only raise the bound.

    Tiny masses: every bucket is floored at ``TOPK_EPS`` (1e-10) and each coarse distribution is
    renormalised, so a zero rest bucket (full lists, or listed mass rounding to > 1) is finite.

    Edge cases: an empty intersection (including an empty list on either side) leaves only the
    rest bucket, mass 1 on both sides, so the result is 0 - the bound carries no information there;
    check ``same_top_token`` alongside. Raises ValueError when the sides have different numbers of
    positions, a list repeats an id, or a logprob is NaN, +inf or above ``LOGPROB_TOL``
    (-inf, i.e. probability 0, is allowed).

    Memory is O(n * k_p * k_q) per chunk of positions; meant for top-k of tens, not whole vocabularies.
    """
    if len(p_top) != len(q_top):
        raise ValueError(f"p_top and q_top differ in number of positions: {len(p_top)} != {len(q_top)}")
    ids_p, lp_p, ok_p = _pad_topk(p_top, "p_top")
    ids_q, lp_q, ok_q = _pad_topk(q_top, "q_top")
    n = len(p_top)
    out = np.zeros(n, dtype=np.float64)
    if n == 0 or ids_p.shape[1] == 0 or ids_q.shape[1] == 0:
        return out
    step = max(1, _MAX_PAIR_ELEMENTS // (ids_p.shape[1] * ids_q.shape[1]))
    for s in range(0, n, step):
        sl = slice(s, s + step)
        out[sl] = _topk_kl_chunk(ids_p[sl], lp_p[sl], ok_p[sl], ids_q[sl], lp_q[sl], ok_q[sl])
    return out


def _top_ids(top: TopK, name: str) -> tuple[np.ndarray, np.ndarray]:
    ids, lps, valid = _pad_topk(top, name)
    nonempty = valid.any(axis=1)
    if ids.shape[1] == 0:
        return np.zeros(len(top), dtype=np.int64), nonempty
    # np.argmax takes the first maximum: ties resolve to the earliest listed entry.
    best = np.argmax(np.where(valid, lps, -np.inf), axis=1)
    return ids[np.arange(len(top)), best], nonempty


def same_top_token(p_top: TopK, q_top: TopK) -> np.ndarray:
    """Per position, whether both sides' highest-logprob token ids are equal. Shape ``(n,)`` bool.

    Ties within a list resolve to the earliest listed entry. A position where either list is empty
    is False. Raises ValueError when the sides differ in number of positions.
    """
    if len(p_top) != len(q_top):
        raise ValueError(f"p_top and q_top differ in number of positions: {len(p_top)} != {len(q_top)}")
    top_p, ok_p = _top_ids(p_top, "p_top")
    top_q, ok_q = _top_ids(q_top, "q_top")
    return (top_p == top_q) & ok_p & ok_q


def first_divergence(
    decode_ids: np.ndarray | Sequence[int], reference_ids: np.ndarray | Sequence[int]
) -> int | None:
    """First index where two token-id sequences differ, or None if they agree over their common
    length (a length difference alone is not a divergence)."""
    a = np.asarray(decode_ids).ravel()
    b = np.asarray(reference_ids).ravel()
    m = min(a.size, b.size)
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else None


def bit_exact_fraction(
    decode_logprobs: np.ndarray | Sequence[float], reference_logprobs: np.ndarray | Sequence[float]
) -> float:
    """Fraction (0..1) of positions whose two float logprobs are exactly equal.

    Values are compared as float64 (float32 inputs widen exactly); NaN never equals anything.
    Shapes: both ``(n,)``, n >= 1. Raises ValueError for different lengths or n = 0.
    """
    a = np.asarray(decode_logprobs, dtype=np.float64).ravel()
    b = np.asarray(reference_logprobs, dtype=np.float64).ravel()
    if a.size != b.size:
        raise ValueError(f"decode_logprobs and reference_logprobs differ in length: {a.size} != {b.size}")
    if a.size == 0:
        raise ValueError("bit_exact_fraction of empty sequences is undefined")
    return float(np.mean(a == b))
