"""``harness.score`` as the per-sample implementation it replaced (``straightforward_score``),
and scenario-shaped input for it (``make_samples``, ``scenario_config``): the oracle
``tests/test_scoring.py`` pins ``score`` against bit for bit, and the path
``benchmarks/scoring.py`` times it against. The summaries, bootstrap and top-k helpers below are
those functions as they were when ``score`` replaced this path, kept so that later changes to
``evalsvc.metrics`` are checked against them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from evalsvc import judging, metrics
from evalsvc.harness import DIVERGENCE_TOL
from evalsvc.matrix import Config, MatrixFile, expand, load_matrix
from evalsvc.metrics.kl import _check_logprob_values, _topk_kl_chunk
from evalsvc.metrics.stats import PERCENTILES
from evalsvc.scenarios import Sample
from evalsvc.types import Completion, ScenarioResult, TopLogprobs

# ---- input ---------------------------------------------------------------------------------------

def make_samples(n_samples: int, tokens: int, extend: int = 0, top_k: int = 0, seed: int = 0,
                 lengths: Sequence[int] | None = None) -> list[Sample]:
    """Scenario-shaped samples: per sample ``tokens`` generated tokens (or ``lengths[s]``) and
    ``extend`` extend tokens, Python floats in lists; with ``top_k``, both sides' top-k lists."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n_samples):
        n = tokens if lengths is None else lengths[s]
        dec = np.log(rng.uniform(0.02, 1.0, n))
        noise = rng.normal(0.0, 2e-3, n) * (rng.random(n) < 0.5)  # half the tokens equal
        ref = np.minimum(dec + noise, 0.0)
        ext = np.log(rng.uniform(0.02, 1.0, extend))
        ext_ref = np.minimum(ext + rng.normal(0.0, 2e-3, extend), 0.0)
        top = ref_top = None
        if top_k:
            ids = (rng.integers(0, 1024, (n, 1)) + 97 * np.arange(top_k)) % 1024  # distinct
            lps = np.sort(np.log(rng.dirichlet(np.ones(top_k + 1), n)[:, :top_k]), axis=1)[:, ::-1]
            top = TopLogprobs([list(zip(i, lp, strict=True)) for i, lp in
                               zip(ids.tolist(), lps.tolist(), strict=True)])
            ref_lps = np.minimum(lps + rng.normal(0.0, 2e-3, lps.shape), 0.0)
            ref_top = TopLogprobs([list(zip(i, lp, strict=True)) for i, lp in
                                   zip(ids.tolist(), ref_lps.tolist(), strict=True)])
        completion = Completion(token_ids=rng.integers(0, 1024, n).tolist(), logprobs=dec.tolist(),
                                prompt_tokens=200 + extend, cached_tokens=200, top=top)
        out.append(Sample("prefill_hit", f"prefill_hit-{s}", f"p{s}", list(range(200 + extend)),
                          completion, hit=True, reference=ref.tolist(), reference_top=ref_top,
                          extend=ext.tolist(), extend_reference=ext_ref.tolist()))
    return out


def scenario_config() -> tuple[Config, MatrixFile]:
    matrix = load_matrix("smoke")
    return expand(matrix)[0], matrix

# ---- the straightforward implementation (what score did before) ----------------------------------

def straightforward_score(name: str, samples: list[Sample], config: Config, matrix: MatrixFile,
                          resolved: dict[str, Any]) -> ScenarioResult:
    """``harness.score`` as it was: one ``token_kl`` and one row per sample, then the summaries."""
    per_sample_k3, per_sample_extend, rows = [], [], []
    topk_vals, same_top, exact = [], [], []
    for s in samples:
        dec, ref = np.asarray(s.completion.logprobs), np.asarray(s.reference)
        kl = metrics.token_kl(dec, ref)
        per_sample_k3.append(kl["k3"])
        extend = metrics.token_kl(np.asarray(s.extend), np.asarray(s.extend_reference))["k3"]
        per_sample_extend.append(extend)
        row = _sample_row(s, kl, extend)
        if s.completion.top is not None and s.reference_top is not None and len(dec):
            tk = _topk_kl(s.completion.top.positions, s.reference_top.positions)
            st = _same_top_token(s.completion.top.positions, s.reference_top.positions)
            topk_vals.append(tk)
            same_top.append(st)
            row["topk_kl_mean"] = float(tk.mean())
            row["same_top_rate"] = float(st.mean())
        if len(dec):
            exact.append(dec == ref)
        rows.append(row)
    m: dict[str, Any] = {}
    if any(len(x) for x in per_sample_k3):
        kl_summary = _summarize_kl(per_sample_k3, seed=0)
        m.update({f"kl_k3_{k}": v for k, v in kl_summary.items()})
        for est in ("k1", "k2"):
            m[f"kl_{est}_mean"] = float(np.mean([r[f"kl_{est}_mean"] for r in rows]))
    if any(len(x) for x in per_sample_extend):
        ext = _summarize_kl(per_sample_extend, seed=0)
        m.update({f"extend_kl_k3_{k}": ext[k] for k in ("mean", "ci_low", "ci_high", "n_samples",
                                                        "n_tokens", "p99", "max")})
    if topk_vals:
        m["topk_kl_mean"] = float(np.concatenate(topk_vals).mean())
        m["same_top_rate"] = float(np.concatenate(same_top).mean())
    if exact:
        m["bit_exact_fraction"] = float(np.concatenate(exact).mean())
    divergences = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    m["first_divergence_min"] = min(divergences) if divergences else None
    m["samples_diverged"] = len(divergences)
    hits = sum(s.hit for s in samples)
    m["hit_coverage"] = hits / len(samples) if samples else 0.0
    m["cached_tokens_mean"] = float(np.mean([s.completion.cached_tokens for s in samples]))
    counters = [s.completion.spec for s in samples if s.completion.spec is not None]
    if counters:
        m.update({f"accept_{k}": v for k, v in metrics.summarize_acceptance(
            counters, resolved.get("avg_spec_accept_length")).items()})
        m["accept_length"] = metrics.sglang_accept_length(counters)
    longest = max((len(e) for e in per_sample_extend), default=0)
    by_position = metrics.PositionKL(np.zeros(longest), np.zeros(longest, dtype=np.int64),
                                     np.array([len(e) for e in per_sample_extend], dtype=np.int64))
    for e in per_sample_extend:
        by_position.sums[: len(e)] += e
        by_position.counts[: len(e)] += 1
    # judged on its fixed limits, the extend placed by its own profile (``harness.score`` leaves
    # it measured: ``tests/test_scoring.py`` judges it with ``judging.judge_run``)
    verdict, reason = judging.judge_scenario(name, m, judging.scenario_limits(config, matrix, name),
                                             uses_mtp=config.uses_mtp, extend=by_position)
    return ScenarioResult(name, verdict, reason, m, rows)


def _sample_row(s: Sample, kl: dict[str, np.ndarray], extend_k3: np.ndarray) -> dict[str, Any]:
    dec, ref = np.asarray(s.completion.logprobs), np.asarray(s.reference)
    diff = np.abs(dec - ref)
    over = np.nonzero(diff > DIVERGENCE_TOL)[0]
    n = len(dec)
    return {
        "sample_id": s.sample_id, "prompt_id": s.prompt_id, "prompt_tokens": len(s.prompt_ids),
        "cached_tokens": s.completion.cached_tokens,
        "host_cached_tokens": s.completion.host_cached_tokens, "hit": s.hit,
        "completion_tokens": n,
        "kl_k1_mean": float(kl["k1"].mean()) if n else 0.0,
        "kl_k2_mean": float(kl["k2"].mean()) if n else 0.0,
        "kl_k3_mean": float(kl["k3"].mean()) if n else 0.0,
        "kl_k3_max": float(kl["k3"].max()) if n else 0.0,
        "first_divergence": int(over[0]) if len(over) else None,
        "extend_tokens": len(extend_k3),
        "extend_kl_k3_mean": float(extend_k3.mean()) if len(extend_k3) else None,
        "extend_kl_k3_max": float(extend_k3.max()) if len(extend_k3) else None,
        "extend_ids": list(s.extend_ids),
        "extend_logprobs": list(s.extend),
        "extend_reference_logprobs": list(s.extend_reference),
        "output_ids": list(s.completion.token_ids),
        "decode_logprobs": [float(x) for x in dec],
        "reference_logprobs": [float(x) for x in ref],
        "accept_length": (s.completion.spec.completion_tokens / s.completion.spec.verify_ct
                          if s.completion.spec else None),
        **_top_columns("decode", s.completion.top), **_top_columns("reference", s.reference_top),
    }


def _top_columns(side: str, top: TopLogprobs | None) -> dict[str, Any]:
    if top is None:
        return {f"{side}_top_ids": None, f"{side}_top_logprobs": None}
    positions = [pos or [] for pos in top.positions]
    return {f"{side}_top_ids": [[int(t) for t, _ in pos] for pos in positions],
            f"{side}_top_logprobs": [[None if lp is None else float(lp) for _, lp in pos]
                                     for pos in positions]}


_MAX_RESAMPLE_ELEMENTS = 4_000_000
_MAX_PAIR_ELEMENTS = 4_000_000


def _summarize_kl(per_sample_token_kl: Sequence[np.ndarray], confidence: float = 0.95,
                  seed: int = 0, n_boot: int = 2000) -> dict[str, float | int]:
    arrays = [np.asarray(a, dtype=np.float64).ravel() for a in per_sample_token_kl]
    nonempty = [a for a in arrays if a.size]
    if not nonempty:
        raise ValueError("summarize_kl needs at least one sample with at least one token")
    pooled = np.concatenate(nonempty)
    if not np.isfinite(pooled).all():
        raise ValueError("per_sample_token_kl contains NaN or inf")
    sample_means = np.array([a.mean() for a in nonempty])
    mean, low, high = _bootstrap_mean_ci(sample_means, confidence, n_boot, seed)
    out: dict[str, float | int] = {
        "mean": mean, "ci_low": low, "ci_high": high, "confidence": confidence,
        "token_mean": float(pooled.mean()), "n_samples": len(nonempty),
        "n_empty_samples": len(arrays) - len(nonempty), "n_tokens": int(pooled.size),
    }
    q = np.percentile(pooled, list(PERCENTILES.values()))
    out.update({name: float(v) for name, v in zip(PERCENTILES, q, strict=True)})
    return out


def _bootstrap_mean_ci(x: np.ndarray, confidence: float, n_boot: int,
                       seed: int) -> tuple[float, float, float]:
    mean = float(x.mean())
    if x.size == 1:
        return mean, mean, mean
    low, high = _bootstrap_quantiles(x[None, :], confidence, n_boot, seed)
    return mean, float(low[0]), float(high[0])


def _bootstrap_quantiles(x: np.ndarray, confidence: float, n_boot: int,
                         seed: int) -> tuple[np.ndarray, np.ndarray]:
    k, n = x.shape
    rng = np.random.default_rng(seed)
    rows = max(1, _MAX_RESAMPLE_ELEMENTS // n)
    draws = np.concatenate([rng.integers(0, n, size=(min(rows, n_boot - start), n))
                            for start in range(0, n_boot, rows)])  # (n_boot, n)
    means = np.empty((k, n_boot), dtype=np.float64)
    block = max(1, _MAX_RESAMPLE_ELEMENTS // (n_boot * n))
    for start in range(0, k, block):
        means[start: start + block] = x[start: start + block, draws].mean(axis=2)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0], axis=1)
    return low, high


def _pad_topk(top, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
        sentinel = np.iinfo(np.int64).min + np.arange(k_max)
        s = np.sort(np.where(valid, ids, sentinel), axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if dup.any():
            raise ValueError(f"{name} repeats a token id at position {int(np.flatnonzero(dup)[0])}")
    return ids, lps, valid


def _topk_kl(p_top, q_top) -> np.ndarray:
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


def _top_ids(top, name: str) -> tuple[np.ndarray, np.ndarray]:
    ids, lps, valid = _pad_topk(top, name)
    nonempty = valid.any(axis=1)
    if ids.shape[1] == 0:
        return np.zeros(len(top), dtype=np.int64), nonempty
    best = np.argmax(np.where(valid, lps, -np.inf), axis=1)
    return ids[np.arange(len(top)), best], nonempty


def _same_top_token(p_top, q_top) -> np.ndarray:
    if len(p_top) != len(q_top):
        raise ValueError(f"p_top and q_top differ in number of positions: {len(p_top)} != {len(q_top)}")
    top_p, ok_p = _top_ids(p_top, "p_top")
    top_q, ok_q = _top_ids(q_top, "q_top")
    return (top_p == top_q) & ok_p & ok_q
