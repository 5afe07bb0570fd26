"""The change-point test of the verdicts (``evalsvc.metrics.stats.change_point``, run on every
tracked metric's history at each judgement) against the per-shuffle loop it replaced, on the same
series, with the same result.

    .venv/bin/python benchmarks/change_point.py [--repeats 7] [--out benchmarks/results/change_point.json]

For histories of 8, 20 and 60 runs (1,999 permutations, the default), timed in turn within each
repeat so that the machine's load falls on both alike:

* ``change_point``: the shuffles drawn in one ``Generator.permuted`` call;
* ``loop``: one ``Generator.permutation`` per shuffle, as before; both from the same seed, so the
  shuffles, the statistic and the p-value are the same (checked here, and pinned by
  ``tests/test_verdicts.py``).

Results go to ``benchmarks/results/change_point.json``; BENCHMARKS.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.metrics.stats import change_point  # noqa: E402
from tests.oracles.change_point import PERMUTATIONS, loop_change_point  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def timed(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", type=Path, default=RESULTS / "change_point.json")
    args = ap.parse_args(argv)
    rows = []
    for n in (8, 20, 60):
        x = np.random.default_rng(n).normal(1.0, 0.05, n)
        x[2 * n // 3:] += 0.1
        cp = change_point(x)
        same = (cp["statistic"], cp["p_value"]) == loop_change_point(x)
        new, old = [], []
        for _ in range(args.repeats):
            new.append(timed(lambda x=x: change_point(x), args.calls))
            old.append(timed(lambda x=x: loop_change_point(x), args.calls))
        ratios = [o / c for o, c in zip(old, new, strict=True)]
        rows.append({"runs": n, "permutations": PERMUTATIONS, "same_result": same,
                     "change_point_ms": round(statistics.median(new), 3),
                     "loop_ms": round(statistics.median(old), 3),
                     "loop_over_change_point": round(statistics.median(ratios), 1),
                     "ratio_min": round(min(ratios), 1), "ratio_max": round(max(ratios), 1)})
        print(rows[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeats": args.repeats, "calls": args.calls, "rows": rows},
                                   indent=1) + "\n")
    return 0 if all(r["same_result"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
