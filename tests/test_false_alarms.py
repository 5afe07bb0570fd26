"""No false alarms: the defect-free engine evaluated 20 times with different sampling seeds, each
evaluation judged against the ones before it as the next commit of a tracked series, raises no
regression. The config is the MTP one with the most scenarios, so both KL and acceptance are
judged by fixed limits, the history test (from the fourth evaluation on) and change points (from
the eighth). ``benchmarks/detection.py false-alarms`` does the same over the whole smoke matrix."""

from __future__ import annotations

import pytest

from evalsvc.store.db import Store
from tests.oracles.detection import false_alarms

pytestmark = pytest.mark.slow


def test_twenty_clean_evaluations_raise_no_alarm(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        out = false_alarms(store, tmp_path, seeds=20, num_prompts=4,
                           configs=["gdn-nb-sync-nochunk-mtp"], progress=lambda _: None)
    finally:
        store.close()
    assert out["runs"] == 20
    assert out["regression_verdicts"] == [] and out["regressions_opened"] == 0
    # the history test really ran, on both metrics of every scenario but the first three times
    assert out["verdicts"].get("pass/history", 0) >= 17 * 5
    assert out["inconclusive"] == []
    # the floor the same runs measure: each scenario's mean over the 20 evaluations, in float32
    # (a cold recompute to rounding)
    floor = {(r["config"], r["scenario"]): r for r in out["floor"]}
    assert {s for _, s in floor} >= {"cold", "prefill_hit", "speculative"}
    for row in floor.values():
        assert row["kl_k3_mean"]["n"] == 20
        assert 0 <= row["kl_k3_mean"]["min"] <= row["kl_k3_mean"]["mean"] \
            <= row["kl_k3_mean"]["max"] < 1e-8
    assert floor[("gdn-nb-sync-nochunk-mtp", "prefill_hit")]["extend_kl_k3_mean"]["n"] == 20


def test_same_seed_bf16_evaluations_raise_no_alarm(tmp_path):
    """The bf16 engine's runs differ by its own noise (batching, split-KV decode, chunk grids):
    evaluated eight times with the matrix's one seed, as a nightly series is, on the configs
    where that noise is largest (overlap; speculative decoding, whose greedy acceptance carries
    the tail test), no history test, tail test or pooled test alarms."""
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        out = false_alarms(store, tmp_path, seeds=8, num_prompts=5,
                           configs=["gdn-eb-ov-c64", "gdn-nb-sync-nochunk-mtp"],
                           matrix="smoke-bf16", same_seed=True, progress=lambda _: None)
    finally:
        store.close()
    assert out["runs"] == 16
    assert out["regression_verdicts"] == [] and out["regressions_opened"] == 0
    assert out["inconclusive"] == []
    # from the fourth evaluation on, every scenario's metrics and the pooled ones by history
    by_metric = out["verdicts_by_metric"]
    assert by_metric.get("pass/history/extend_kl_k3_mean", 0) >= 5 * (3 + 3 + 2)
    assert by_metric.get("pass/history/accept_length", 0) >= 5 * 6
