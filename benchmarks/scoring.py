"""What scoring a scenario costs at ten million token pairs, against the numpy floor of the same run.

    .venv/bin/python benchmarks/scoring.py [--samples 10000] [--tokens 1000] [--extend 0]
        [--top-samples 200] [--repeats 5] [--out benchmarks/results/scoring.json]

Scenario-shaped input, as the harness hands it to ``harness.score``: ``--samples`` samples of
``--tokens`` generated tokens each, every logprob a Python float in a list (as
``parse_completion`` makes them), the reference a bf16-like perturbation of the decode side (half
the tokens equal), and ``--extend`` prompt tokens per sample on both sides (the extend). Timed in
turn within each repeat, so that the machine's load falls on all of them alike:

* ``floor``: what no scoring can skip: the lists read into numpy arrays, one k3 pass over the
  token pairs, and the reported percentiles of it (``floor_arrays``: the same from arrays already
  made, for reference);
* ``kl``: the KL part of ``score`` alone (``token_kl_by_sample`` and ``summarize_pooled_kl``);
* ``score``: ``evalsvc.harness.score``, everything it computes for the scenario (estimators,
  per-sample rows, summaries with their bootstrap intervals, divergences, the verdict);
* ``straightforward``: the per-sample implementation ``score`` replaced (``straightforward_score``
  below, kept as the oracle ``tests/test_scoring.py`` pins ``score`` against).

A second input (``--top-samples`` samples of ``--tokens`` tokens) carries both sides' top-5 lists,
which ``score`` turns into a top-k KL per position; its figures are per position, since a
Python list of tuples for ten million positions would not fit here.

Results go to ``benchmarks/results/scoring.json``; BENCHMARKS.md quotes them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc import metrics  # noqa: E402
from evalsvc.harness import DIVERGENCE_TOL, decide, score  # noqa: E402
from evalsvc.matrix import Config, MatrixFile, expand, load_matrix  # noqa: E402
from evalsvc.metrics.kl import _check_logprob_values, _topk_kl_chunk  # noqa: E402
from evalsvc.metrics.stats import PERCENTILES  # noqa: E402
from evalsvc.scenarios import Sample  # noqa: E402
from evalsvc.types import Completion, ScenarioResult, TopLogprobs  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TOP_K = 5


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


# ---- the floor -----------------------------------------------------------------------------------

def floor(samples: list[Sample]) -> dict[str, float]:
    """One k3 pass over every token pair (decode and extend) and its percentiles, from the
    samples' lists."""
    dec = np.concatenate([np.asarray(s.completion.logprobs, dtype=np.float64) for s in samples]
                         + [np.asarray(s.extend, dtype=np.float64) for s in samples])
    ref = np.concatenate([np.asarray(s.reference, dtype=np.float64) for s in samples]
                         + [np.asarray(s.extend_reference, dtype=np.float64) for s in samples])
    return floor_arrays(dec, ref)


def floor_arrays(dec: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    logr = ref - dec
    k3 = np.expm1(logr) - logr
    q = np.percentile(k3, list(PERCENTILES.values()))
    return dict(zip(PERCENTILES, q.tolist(), strict=True))


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
    verdict, reason = decide(name, m, config, matrix, extend=by_position)
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


# ---- timing --------------------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, float]]:
    """Each side once per repeat, in turn (the order rotated each repeat): min and median s."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    names = list(sides)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timed(sides[name]))
    return {k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in times.items()}


def ratios(times: dict[str, dict[str, float]], a: str, b: str) -> dict[str, float]:
    """a / b per repeat (the two measured in the same repeat): min and median."""
    per = [x / y for x, y in zip(times[a]["all"], times[b]["all"], strict=True)]
    return {"min": min(per), "median": statistics.median(per)}


def kl_and_summary(samples: list[Sample]) -> dict[str, float | int]:
    """The KL part of ``score`` alone: every sample's token KL in one pass
    (``token_kl_by_sample``) and the scenario's summary of it (``summarize_pooled_kl``)."""
    kl = metrics.token_kl_by_sample([s.completion.logprobs for s in samples],
                                    [s.reference for s in samples], DIVERGENCE_TOL)
    nonempty = kl.lengths > 0
    return metrics.summarize_pooled_kl(kl.k3, kl.k3_mean[nonempty], int((~nonempty).sum()),
                                       seed=0)


def run(n_samples: int, tokens: int, extend: int, repeats: int,
        straightforward: bool) -> dict[str, Any]:
    """The floor, ``score`` and (optionally) the straightforward path on one input, in turn."""
    config, matrix = scenario_config()
    samples = make_samples(n_samples, tokens, extend)
    dec = np.concatenate([np.asarray(s.completion.logprobs) for s in samples]
                         + [np.asarray(s.extend) for s in samples])
    ref = np.concatenate([np.asarray(s.reference) for s in samples]
                         + [np.asarray(s.extend_reference) for s in samples])
    sides = {"floor": lambda: floor(samples), "floor_arrays": lambda: floor_arrays(dec, ref),
             "kl": lambda: kl_and_summary(samples),
             "score": lambda: score("prefill_hit", samples, config, matrix, {})}
    if straightforward:
        sides["straightforward"] = lambda: straightforward_score("prefill_hit", samples, config,
                                                                 matrix, {})
    times = measure(sides, repeats)
    out: dict[str, Any] = {
        "samples": n_samples, "tokens": tokens, "extend": extend, "token_pairs": int(dec.size),
        "repeats": repeats, "seconds": times,
        "kl_over_floor": ratios(times, "kl", "floor"),
        "score_over_floor": ratios(times, "score", "floor"),
        "score_over_floor_arrays": ratios(times, "score", "floor_arrays")}
    if straightforward:
        out["straightforward_over_score"] = ratios(times, "straightforward", "score")
    return out


def run_top(n_samples: int, tokens: int, repeats: int, straightforward: bool) -> dict[str, Any]:
    """``score`` (and the straightforward path) on samples with both sides' top-5 lists."""
    config, matrix = scenario_config()
    top = make_samples(n_samples, tokens, top_k=TOP_K, seed=1)
    sides = {"score": lambda: score("prefill_hit", top, config, matrix, {})}
    if straightforward:
        sides["straightforward"] = lambda: straightforward_score("prefill_hit", top, config,
                                                                 matrix, {})
    times = measure(sides, repeats)
    positions = n_samples * tokens
    out: dict[str, Any] = {
        "samples": n_samples, "positions": positions, "seconds": times,
        "score_us_per_position": {k: 1e6 * v / positions for k, v in times["score"].items()
                                  if k != "all"}}
    if straightforward:
        out["straightforward_over_score"] = ratios(times, "straightforward", "score")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=1_000)
    parser.add_argument("--extend", type=int, default=0, help="extend tokens per sample")
    parser.add_argument("--top-samples", type=int, default=200,
                        help="samples of the top-5 input (0: none)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-straightforward", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "scoring.json")
    args = parser.parse_args()
    config, matrix = scenario_config()
    score("prefill_hit", make_samples(4, 8), config, matrix, {})  # imports, thresholds read
    straight = not args.skip_straightforward
    out = run(args.samples, args.tokens, args.extend, args.repeats, straight)
    if args.top_samples:
        out["top5"] = run_top(args.top_samples, args.tokens, args.repeats, straight)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "seconds"}, indent=2, default=str))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
