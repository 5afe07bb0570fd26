"""The change-point test's per-shuffle loop, which ``evalsvc.metrics.stats.change_point``
replaced: the oracle ``tests/test_verdicts.py`` pins ``change_point`` against, and the loop
``benchmarks/change_point.py`` times it against."""

from __future__ import annotations

import numpy as np

from evalsvc.metrics.stats import _split_statistics

PERMUTATIONS = 1999


def loop_change_point(x: np.ndarray, permutations: int = PERMUTATIONS, seed: int = 0,
                      min_segment: int = 2) -> tuple[float, float]:
    """(statistic, p_value) as ``change_point`` computed them before: a shuffle per call (the
    oracle ``tests/test_verdicts.py`` pins ``change_point`` against)."""
    rng = np.random.default_rng(seed)
    perms = np.stack([x] + [rng.permutation(x) for _ in range(permutations)])
    stats = _split_statistics(perms, min_segment)
    observed = stats[0].max()
    exceed = int(np.sum(stats[1:].max(axis=1) >= observed - 1e-12 * abs(observed)))
    return float(observed), (1 + exceed) / (1 + permutations)
