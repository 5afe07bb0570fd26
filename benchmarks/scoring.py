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
  in ``tests/oracles/scoring.py``, the oracle ``tests/test_scoring.py`` pins ``score`` against).

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc import metrics  # noqa: E402
from evalsvc.harness import DIVERGENCE_TOL, score  # noqa: E402
from evalsvc.metrics.stats import PERCENTILES  # noqa: E402
from evalsvc.scenarios import Sample  # noqa: E402
from tests.oracles.scoring import (  # noqa: E402
    make_samples,
    scenario_config,
    straightforward_score,
)

RESULTS = Path(__file__).parent / "results"
TOP_K = 5


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
