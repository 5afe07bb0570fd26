"""KL estimators: hand values, convergence to the exact KL (scipy, torch), top-k lower bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from evalsvc.metrics import (
    bit_exact_fraction,
    first_divergence,
    kl_by_position,
    same_top_token,
    token_kl,
    topk_kl,
)


def _random_dist(rng: np.random.Generator, v: int, alpha: float = 1.0) -> np.ndarray:
    p = rng.dirichlet(np.full(v, alpha))
    p = np.maximum(p, 1e-12)
    return p / p.sum()


def _full_list(p: np.ndarray, rng: np.random.Generator, k: int | None = None) -> list[tuple[int, float]]:
    """Top-k (token_id, logprob) list of p, in shuffled order (order must not matter)."""
    order = np.argsort(-p, kind="stable")[: k if k is not None else p.size]
    order = rng.permutation(order)
    return [(int(i), float(np.log(p[i]))) for i in order]


# --- token_kl -------------------------------------------------------------------------------------


def test_token_kl_hand_values() -> None:
    dec = [-1.0, -0.5, -2.0]
    ref = [-1.5, -0.5, -1.0]
    out = token_kl(dec, ref)
    # logr = ref - dec = [-0.5, 0, 1]
    np.testing.assert_allclose(out["logr"], [-0.5, 0.0, 1.0])
    np.testing.assert_allclose(out["k1"], [0.5, 0.0, -1.0])
    np.testing.assert_allclose(out["k2"], [0.125, 0.0, 0.5])
    np.testing.assert_allclose(out["k3"], [math.exp(-0.5) - 1 + 0.5, 0.0, math.e - 1 - 1], rtol=1e-15)
    assert out["k3"][0] == pytest.approx(0.10653065971263342, rel=1e-14)
    assert out["k3"][2] == pytest.approx(0.7182818284590451, rel=1e-14)
    for key in ("k1", "k2", "k3", "logr"):
        assert out[key].shape == (3,) and out[key].dtype == np.float64


def test_k3_nonnegative_and_zero_iff_equal() -> None:
    rng = np.random.default_rng(1)
    dec = -rng.exponential(2.0, size=10_000)
    ref = -rng.exponential(2.0, size=10_000)
    ref[:100] = dec[:100]
    ref[100] = dec[100] - 1e-12  # tiny difference: k3 must stay > 0, not round to a negative
    k3 = token_kl(dec, ref)["k3"]
    assert (k3 >= 0).all()
    assert (k3[:100] == 0).all()
    assert (k3[100:] > 0).all()


def test_token_kl_accepts_tiny_positive_logprob() -> None:
    out = token_kl([5e-5, -1.0], [0.0, -1.0])
    assert out["k3"][1] == 0.0


@pytest.mark.parametrize(
    ("dec", "ref", "match"),
    [
        ([-1.0, -2.0], [-1.0], "differ in length"),
        ([-1.0, float("nan")], [-1.0, -1.0], "NaN"),
        ([-1.0, -1.0], [-1.0, -float("inf")], "inf"),
        ([-1.0, 0.01], [-1.0, -1.0], "positive"),
        ([[-1.0]], [[-1.0]], "1-D"),
    ],
)
def test_token_kl_rejects_bad_input(dec: list, ref: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        token_kl(dec, ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimators_converge_to_exact_kl(seed: int) -> None:
    """Sample tokens x ~ P; logp(x), logq(x) play decode and reference. mean(k1), mean(k3) -> KL(P||Q).

    Tolerance: both are unbiased, so their sample mean is within 5 standard errors of the exact KL
    with probability > 1 - 6e-7 (CLT); the standard error uses the exact variance of each
    estimator under P, computed over the whole vocabulary.
    """
    rng = np.random.default_rng(seed)
    v, n = 50, 200_000
    p = _random_dist(rng, v)
    q = _random_dist(rng, v)
    exact = float(scipy.stats.entropy(p, q))
    assert exact > 0.05  # the check is meaningful: distributions really differ

    logr_all = np.log(q) - np.log(p)
    per_token_exact = {"k1": -logr_all, "k3": np.exp(logr_all) - 1 - logr_all}

    x = rng.choice(v, size=n, p=p)
    out = token_kl(np.log(p)[x], np.log(q)[x])
    for key in ("k1", "k3"):
        mean_exact = float(np.sum(p * per_token_exact[key]))
        assert mean_exact == pytest.approx(exact, rel=1e-10)  # both are unbiased
        se = math.sqrt(float(np.sum(p * (per_token_exact[key] - exact) ** 2)) / n)
        assert abs(out[key].mean() - exact) < 5 * se, (key, out[key].mean(), exact, se)
    assert (out["k3"] >= 0).all()


def test_exact_kl_scipy_matches_torch() -> None:
    torch = pytest.importorskip("torch")  # the engine extra; not needed for the rest of this module
    import torch.nn.functional as F

    rng = np.random.default_rng(7)
    for _ in range(5):
        p = _random_dist(rng, 50)
        q = _random_dist(rng, 50)
        lp = torch.tensor(np.log(p), dtype=torch.float64)
        lq = torch.tensor(np.log(q), dtype=torch.float64)
        # kl_div(input=log q, target=log p) = sum p (log p - log q) = KL(P || Q)
        t = F.kl_div(lq, lp, reduction="sum", log_target=True).item()
        s = float(scipy.stats.entropy(p, q))
        assert t == pytest.approx(s, rel=1e-12)
        assert float(np.sum(p * np.log(p / q))) == pytest.approx(s, rel=1e-12)


# --- topk_kl ------------------------------------------------------------------------------------


def test_topk_full_lists_equal_exact_kl() -> None:
    rng = np.random.default_rng(3)
    v = 50
    ps = [_random_dist(rng, v) for _ in range(20)]
    qs = [_random_dist(rng, v) for _ in range(20)]
    got = topk_kl([_full_list(p, rng) for p in ps], [_full_list(q, rng) for q in qs])
    want = np.array([scipy.stats.entropy(p, q) for p, q in zip(ps, qs, strict=True)])
    assert got.shape == (20,)
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-9)


def test_topk_partial_lists_lower_bound_and_monotone_in_k() -> None:
    rng = np.random.default_rng(4)
    v, n = 50, 40
    ps = [_random_dist(rng, v, alpha=0.3) for _ in range(n)]
    # Q: a perturbation of P, so the top-k lists overlap substantially
    qs = [_random_dist(rng, v, alpha=0.3) * 0.3 + p * 0.7 for p in ps]
    exact = np.array([scipy.stats.entropy(p, q) for p, q in zip(ps, qs, strict=True)])
    prev = np.zeros(n)
    for k in (1, 3, 5, 10, 20, 35, 50):
        got = topk_kl([_full_list(p, rng, k) for p in ps], [_full_list(q, rng, k) for q in qs])
        assert (got >= 0).all()
        assert (got <= exact + 1e-9).all(), k
        # top-k sets nest, so the intersection partition refines as k grows: the bound can only rise
        assert (got >= prev - 1e-9).all(), k
        prev = got
    np.testing.assert_allclose(prev, exact, rtol=1e-8, atol=1e-9)
    assert (prev > 0).all()


def test_topk_identical_inputs_give_zero() -> None:
    rng = np.random.default_rng(5)
    ps = [_random_dist(rng, 30) for _ in range(5)]
    lists = [_full_list(p, rng, 5) for p in ps]
    assert (topk_kl(lists, lists) == 0).all()
    full = [_full_list(p, rng) for p in ps]
    np.testing.assert_allclose(topk_kl(full, full), 0.0, atol=1e-15)


def test_topk_hand_example_with_rest_bucket() -> None:
    # P lists {1: .5, 2: .3}, Q lists {1: .4, 3: .4}: intersection {1}.
    # Coarse P = [.5, rest .5], coarse Q = [.4, rest .6].
    p = [[(1, math.log(0.5)), (2, math.log(0.3))]]
    q = [[(3, math.log(0.4)), (1, math.log(0.4))]]
    want = 0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6)
    assert topk_kl(p, q)[0] == pytest.approx(want, rel=1e-9)
    # and the other direction uses the same partition
    want_rev = 0.4 * math.log(0.4 / 0.5) + 0.6 * math.log(0.6 / 0.5)
    assert topk_kl(q, p)[0] == pytest.approx(want_rev, rel=1e-9)


def test_topk_empty_intersection_and_empty_lists() -> None:
    p = [[(1, math.log(0.9))], [], [(4, -0.1)]]
    q = [[(2, math.log(0.9))], [(2, -0.1)], []]
    np.testing.assert_array_equal(topk_kl(p, q), [0.0, 0.0, 0.0])
    assert topk_kl([], []).shape == (0,)


def test_topk_zero_rest_bucket_on_one_side_is_finite() -> None:
    # P puts all its mass on token 0; Q lists token 0 at 0.5: coarse P = [1, 0], Q = [.5, .5].
    p = [[(0, 0.0)]]
    q = [[(0, math.log(0.5)), (1, math.log(0.25))]]
    got = topk_kl(p, q)[0]
    assert got == pytest.approx(math.log(2), rel=1e-8)
    # reverse: Q's rest .5 against P's ~0 rest: finite thanks to the floor, large
    rev = topk_kl(q, p)[0]
    assert math.isfinite(rev) and rev > 5


def test_topk_chunking_matches_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    import evalsvc.metrics.kl as kl_mod

    rng = np.random.default_rng(6)
    ps = [_full_list(_random_dist(rng, 30), rng, 8) for _ in range(25)]
    qs = [_full_list(_random_dist(rng, 30), rng, 6) for _ in range(25)]
    whole = topk_kl(ps, qs)
    monkeypatch.setattr(kl_mod, "_MAX_PAIR_ELEMENTS", 100)  # 2 positions per chunk
    np.testing.assert_array_equal(topk_kl(ps, qs), whole)


@pytest.mark.parametrize(
    ("p", "q", "match"),
    [
        ([[(1, -0.1)]], [], "number of positions"),
        ([[(1, -0.1), (1, -0.2)]], [[(1, -0.1)]], "repeats a token id"),
        ([[(1, float("nan"))]], [[(1, -0.1)]], "NaN"),
        ([[(1, 0.5)]], [[(1, -0.1)]], "positive"),
    ],
)
def test_topk_rejects_bad_input(p: list, q: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        topk_kl(p, q)


def test_topk_allows_neg_inf_logprob() -> None:
    p = [[(1, -0.1), (2, -float("inf"))]]
    q = [[(1, -0.2), (2, -3.0)]]
    assert math.isfinite(topk_kl(p, q)[0])


# --- exact-match diagnostics ----------------------------------------------------------------------


def test_same_top_token() -> None:
    p = [[(5, -0.1), (6, -2.0)], [(7, -1.0), (8, -0.5)], [(1, -0.7), (2, -0.7)], [], [(3, -0.1)]]
    q = [[(6, -2.0), (5, -0.2)], [(7, -0.3)], [(1, -0.1)], [(1, -0.1)], []]
    np.testing.assert_array_equal(same_top_token(p, q), [True, False, True, False, False])
    assert same_top_token([], []).shape == (0,)
    with pytest.raises(ValueError, match="number of positions"):
        same_top_token(p, q[:2])


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([4, 2], [1, 2]) == 0
    assert first_divergence([1, 2, 3], [1, 2]) is None  # length difference alone
    assert first_divergence([], [1]) is None
    assert first_divergence(np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5])) == 3
    assert isinstance(first_divergence([1, 2], [1, 3]), int)


def test_bit_exact_fraction() -> None:
    a = [-0.5, -1.25, -2.0, -3.0]
    b = [-0.5, -1.25 + 1e-15, -2.0, np.nextafter(-3.0, 0.0)]
    assert bit_exact_fraction(a, b) == 0.5
    assert bit_exact_fraction(a, a) == 1.0
    # float32 values widen exactly
    f32 = np.array([-0.1, -0.2], dtype=np.float32)
    assert bit_exact_fraction(f32, f32.astype(np.float64)) == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        bit_exact_fraction(a, b[:3])
    with pytest.raises(ValueError, match="empty"):
        bit_exact_fraction([], [])


# --- kl_by_position -------------------------------------------------------------------------------


def test_kl_by_position_sums_each_position_over_the_samples_that_reach_it() -> None:
    # samples of 3, 0, 1 and 2 tokens, concatenated
    k3 = np.array([1.0, 2.0, 3.0, 10.0, 20.0, 40.0])
    out = kl_by_position(k3, np.array([3, 0, 1, 2]))
    assert out.sums.tolist() == [31.0, 42.0, 3.0]
    assert out.counts.tolist() == [3, 2, 1]
    assert out.lengths.tolist() == [3, 0, 1, 2]


def test_kl_by_position_of_no_tokens_is_empty() -> None:
    for lengths in ([], [0, 0]):
        out = kl_by_position(np.zeros(0), np.array(lengths, dtype=np.int64))
        assert out.sums.size == out.counts.size == 0
