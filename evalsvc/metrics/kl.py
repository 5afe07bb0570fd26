"""KL-divergence estimators between a decode run and a reference run.

All logprobs are natural logs, so every divergence returned here is in **nats**. Two settings:

* Only the sampled token's logprob is known on each side (``token_kl``): per-token Monte-Carlo
  estimators of KL(decode || reference), the k1/k2/k3 family SGLang's own tests use. Tokens are
  sampled from the decode distribution, so averaging an unbiased estimator over tokens estimates
  the KL; a single token's value is noisy and can be negative (k1).
* Both sides returned their top-k (``topk_kl``): an exact KL between coarse-grained distributions,
  which is a lower bound of the true KL.

Plus exact-match diagnostics: ``same_top_token``, ``first_divergence``, ``bit_exact_fraction``.

``token_kl_by_sample`` is ``token_kl`` of many samples at once (a scenario's), in one pass over all
their tokens, with per-sample means and maxima equal to those of each sample's own arrays;
``kl_by_position`` sums their per-token k3 by position (where along an extend a KL sits).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


class _Irregular(Exception):
    """An input the pooled path does not take as it is: the per-sample path decides (and names
    the problem)."""


# Tokens per block of samples scored together: a block's temporaries (2 MB each) stay in cache
_BLOCK_TOKENS = 1 << 18


@dataclass
class SampleKL:
    """``token_kl`` of many samples (a scenario's), reduced per sample; shapes ``(n_samples,)``.

    ``lengths``: tokens per sample. ``k1_mean``, ``k2_mean``, ``k3_mean``, ``k3_max``: nats, each
    equal bit for bit to ``token_kl(decode[s], reference[s])[...].mean()`` (``.max()``) of the
    sample alone; NaN for a sample without tokens. ``first_above``: the index of a sample's first
    token whose two logprobs differ by more than the ``tol`` asked for, -1 if none. ``k3``: shape
    ``(n_tokens,)``, every sample's per-token k3 concatenated in sample order. ``equal``: tokens
    whose two logprobs are exactly equal.
    """

    lengths: np.ndarray
    k1_mean: np.ndarray
    k2_mean: np.ndarray
    k3_mean: np.ndarray
    k3_max: np.ndarray
    first_above: np.ndarray
    k3: np.ndarray
    equal: int


def token_kl_by_sample(decode: Sequence[Sequence[float] | np.ndarray],
                       reference: Sequence[Sequence[float] | np.ndarray],
                       tol: float = LOGPROB_TOL) -> SampleKL:
    """``token_kl`` of each pair ``(decode[s], reference[s])`` (one sample's two logprob
    sequences), reduced per sample (``SampleKL``): the same values, and the same error (the first
    failing sample's), as one call per sample, from one pass over all tokens in blocks of
    samples."""
    if len(decode) != len(reference):
        raise ValueError(f"decode and reference differ in number of samples: {len(decode)} != "
                         f"{len(reference)}")
    try:
        return _by_blocks(decode, reference, tol)
    except _Irregular:
        pass
    for d, r in zip(decode, reference, strict=True):  # raises the first sample's error
        token_kl(d, r)
    raise AssertionError("unreachable: a sample the pooled path refused passes token_kl")


@dataclass
class PositionKL:
    """Per-token k3 along the extend, by position over a scenario's samples: position 0 is each
    sample's first token after its cached prefix. ``sums`` and ``counts``: shape
    ``(longest extend,)``, the k3 (nats) summed over the samples whose extend reaches that
    position, and how many do; ``lengths``: the samples' extend lengths, ``(n_samples,)``."""

    sums: np.ndarray
    counts: np.ndarray
    lengths: np.ndarray


def kl_by_position(k3: np.ndarray, lengths: np.ndarray) -> PositionKL:
    """``PositionKL`` of samples whose per-token k3 are concatenated in ``k3`` (as
    ``SampleKL.k3``), ``lengths[s]`` tokens each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.arange(int(lengths.sum()), dtype=np.int64) - starts
    size = int(lengths.max()) if lengths.size else 0
    return PositionKL(np.bincount(positions, weights=np.asarray(k3, dtype=np.float64),
                                  minlength=size),
                      np.bincount(positions, minlength=size), lengths)


def _by_blocks(decode: Sequence[Sequence[float] | np.ndarray],
               reference: Sequence[Sequence[float] | np.ndarray], tol: float) -> SampleKL:
    try:
        lengths = np.array([len(d) for d in decode], dtype=np.int64)
        if lengths.tolist() != [len(r) for r in reference]:
            raise _Irregular
    except TypeError as exc:
        raise _Irregular from exc
    n = len(lengths)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = SampleKL(lengths, np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan),
                   np.full(n, np.nan), np.full(n, -1, dtype=np.int64),
                   np.empty(int(offsets[-1]), dtype=np.float64), 0)
    start = 0
    while start < n:
        # the samples of one block: at least one, about _BLOCK_TOKENS tokens
        stop = max(start + 1, int(np.searchsorted(offsets, offsets[start] + _BLOCK_TOKENS,
                                                  side="right")) - 1)
        _block(decode, reference, offsets, start, min(stop, n), tol, out)
        start = min(stop, n)
    return out


def _block(decode: Sequence[Sequence[float] | np.ndarray],
           reference: Sequence[Sequence[float] | np.ndarray], offsets: np.ndarray, start: int,
           stop: int, tol: float, out: SampleKL) -> None:
    """Samples ``start:stop``: their token_kl, into ``out``."""
    a, b = int(offsets[start]), int(offsets[stop])
    dec = _read(decode[start:stop], b - a)
    ref = _read(reference[start:stop], b - a)
    if not (_plain_logprobs(dec) and _plain_logprobs(ref)):
        raise _Irregular
    logr = ref - dec  # as token_kl computes each estimator, one token at a time
    k3 = out.k3[a:b]
    with np.errstate(over="ignore"):
        np.expm1(logr, out=k3)
    np.subtract(k3, logr, out=k3)
    np.maximum(k3, 0.0, out=k3)
    local = offsets[start: stop + 1] - a
    sel = slice(start, stop)
    out.k3_mean[sel] = _per_sample(k3, local, np.mean)
    out.k3_max[sel] = _per_sample(k3, local, np.max)
    out.k1_mean[sel] = _per_sample(-logr, local, np.mean)
    k2 = np.square(logr)
    np.multiply(k2, 0.5, out=k2)
    out.k2_mean[sel] = _per_sample(k2, local, np.mean)
    out.first_above[sel] = _first_above(np.abs(logr) > tol, local)
    out.equal += int(np.count_nonzero(dec == ref))


def _per_sample(values: np.ndarray, offsets: np.ndarray,
                reduce: Callable[..., np.ndarray]) -> np.ndarray:
    """Per sample (``values[offsets[s]:offsets[s + 1]]``), ``reduce`` of its values, equal bit for
    bit to ``reduce`` of that slice alone; NaN for a sample without values."""
    # numpy reduces each row of a C-ordered 2-D array as it reduces a 1-D array of that row
    # (pairwise summation along the row), so samples of one length are reduced as one block
    lengths = np.diff(offsets)
    result = np.full(len(lengths), np.nan)
    if len(lengths) and (lengths == lengths[0]).all():
        if lengths[0]:
            result[:] = reduce(values.reshape(len(lengths), int(lengths[0])), axis=1)
        return result
    order = np.argsort(lengths, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(lengths[order])) + 1):
        length = int(lengths[group[0]])
        if length == 0:
            continue
        starts = offsets[group]
        if len(group) == 1:
            result[group[0]] = reduce(values[starts[0]: starts[0] + length])
        else:
            result[group] = reduce(values[starts[:, None] + np.arange(length)], axis=1)
    return result


def _first_above(over: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per sample, the index within it of its first True in ``over``, -1 if none."""
    hits = np.flatnonzero(over)
    starts, ends = offsets[:-1], offsets[1:]
    if not len(hits):
        return np.full(len(starts), -1, dtype=np.int64)
    at = np.searchsorted(hits, starts)
    first = hits[np.minimum(at, len(hits) - 1)]
    return np.where((at < len(hits)) & (first < ends), first - starts, -1)


def _read(seqs: Sequence[Sequence[float] | np.ndarray], total: int) -> np.ndarray:
    """The sequences' values, concatenated, as float64 (as ``np.asarray(x, np.float64)`` each)."""
    try:
        if all(type(x) is list for x in seqs):
            values = np.fromiter(itertools.chain.from_iterable(seqs), np.float64, count=total)
        else:
            arrays = [np.asarray(x, dtype=np.float64) for x in seqs]
            if any(x.ndim != 1 for x in arrays):
                raise _Irregular
            values = np.concatenate(arrays) if arrays else np.zeros(0)
    except (TypeError, ValueError) as exc:
        raise _Irregular from exc
    if values.size != total:
        raise _Irregular
    return values


def _plain_logprobs(x: np.ndarray) -> bool:
    """No NaN, no inf, nothing above LOGPROB_TOL: what ``_check_logprob_values`` lets through."""
    return x.size == 0 or bool(x.max() <= LOGPROB_TOL and x.min() > -np.inf)


def top_arrays(top: TopK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-position top-k lists as padded arrays, shape ``(n_positions, k_max)`` each: token ids
    (int64, 0 where padded), logprobs (float64, -inf where padded; a None logprob is NaN) and
    which entries are listed (bool). Each position's pairs convert as ``np.asarray(pos,
    np.float64)`` converts them. No checks of the values (``topk_kl`` makes them)."""
    n = len(top)
    lengths = np.fromiter(map(len, top), np.int64, count=n)
    k_max = int(lengths.max()) if n else 0
    ids = np.zeros((n, k_max), dtype=np.int64)
    lps = np.full((n, k_max), -np.inf, dtype=np.float64)
    valid = np.arange(k_max) < lengths[:, None]
    total = int(lengths.sum())
    flat = None
    entries = itertools.chain.from_iterable(top)
    if total and set(map(len, itertools.chain.from_iterable(top))) == {2}:
        with contextlib.suppress(TypeError, ValueError):  # None logprobs: one position at a time
            flat = np.fromiter(itertools.chain.from_iterable(entries), np.float64,
                               count=2 * total).reshape(total, 2)
    if flat is not None:  # every pair at once, put in place by its position and rank
        ids[valid] = flat[:, 0].astype(np.int64)
        lps[valid] = flat[:, 1]
    else:
        for i, pos in enumerate(top):
            k = len(pos)
            if k:
                arr = np.asarray(pos, dtype=np.float64).reshape(k, 2)
                ids[i, :k] = arr[:, 0].astype(np.int64)
                lps[i, :k] = arr[:, 1]
    return ids, lps, valid


def _pad_topk(top: TopK, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pad per-position top-k lists into (ids, logprobs, valid) arrays of shape (n, k_max), and
    check them."""
    return _checked(top_arrays(top), name)


def _checked(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], name: str
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids, lps, valid = arrays
    _check_logprob_values(lps[valid], name, allow_neg_inf=True)
    k_max = ids.shape[1]
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
    return _topk_kl_padded(*_padded_sides(p_top, q_top))


Padded = tuple[np.ndarray, np.ndarray, np.ndarray]


def _padded_sides(p_top: TopK, q_top: TopK) -> tuple[Padded, Padded]:
    if len(p_top) != len(q_top):
        raise ValueError(f"p_top and q_top differ in number of positions: {len(p_top)} != {len(q_top)}")
    return _pad_topk(p_top, "p_top"), _pad_topk(q_top, "q_top")


def _topk_kl_padded(p: Padded, q: Padded) -> np.ndarray:
    (ids_p, lp_p, ok_p), (ids_q, lp_q, ok_q) = p, q
    n = len(ids_p)
    out = np.zeros(n, dtype=np.float64)
    if n == 0 or ids_p.shape[1] == 0 or ids_q.shape[1] == 0:
        return out
    step = max(1, _MAX_PAIR_ELEMENTS // (ids_p.shape[1] * ids_q.shape[1]))
    for s in range(0, n, step):
        sl = slice(s, s + step)
        out[sl] = _topk_kl_chunk(ids_p[sl], lp_p[sl], ok_p[sl], ids_q[sl], lp_q[sl], ok_q[sl])
    return out


def _top_ids(padded: Padded) -> tuple[np.ndarray, np.ndarray]:
    ids, lps, valid = padded
    nonempty = valid.any(axis=1)
    if ids.shape[1] == 0:
        return np.zeros(len(ids), dtype=np.int64), nonempty
    # np.argmax takes the first maximum: ties resolve to the earliest listed entry.
    best = np.argmax(np.where(valid, lps, -np.inf), axis=1)
    return ids[np.arange(len(ids)), best], nonempty


def _same_top_padded(p: Padded, q: Padded) -> np.ndarray:
    (top_p, ok_p), (top_q, ok_q) = _top_ids(p), _top_ids(q)
    return (top_p == top_q) & ok_p & ok_q


def same_top_token(p_top: TopK, q_top: TopK) -> np.ndarray:
    """Per position, whether both sides' highest-logprob token ids are equal. Shape ``(n,)`` bool.

    Ties within a list resolve to the earliest listed entry. A position where either list is empty
    is False. Raises ValueError when the sides differ in number of positions.
    """
    return _same_top_padded(*_padded_sides(p_top, q_top))


def topk_kl_and_same_top(p_top: TopK, q_top: TopK, p_arrays: Padded | None = None,
                         q_arrays: Padded | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(topk_kl(p_top, q_top), same_top_token(p_top, q_top))``, each side's lists read once;
    ``p_arrays`` / ``q_arrays``: ``top_arrays`` of them, when already made."""
    if p_arrays is None or q_arrays is None:
        p, q = _padded_sides(p_top, q_top)
    else:
        if len(p_top) != len(q_top):
            raise ValueError(f"p_top and q_top differ in number of positions: {len(p_top)} != "
                             f"{len(q_top)}")
        p, q = _checked(p_arrays, "p_top"), _checked(q_arrays, "q_top")
    return _topk_kl_padded(p, q), _same_top_padded(p, q)


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
