"""The smoke matrix end to end: clean with no defect, and each defect caught where it acts only.

This is the evaluation's detection matrix. Every run goes through the real path: the matrix file,
engine processes on free ports, the scenarios over HTTP, SGLang's reference method, the metrics
and the verdicts. The workload is trimmed to 5 prompts to keep five full matrix runs affordable.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from benchmarks.detection import WHERE
from evalsvc.engines.base import EngineSpec
from evalsvc.evaluate import evaluate, prepare, summary_rows
from evalsvc.matrix import load_matrix

pytestmark = pytest.mark.slow

# (config, scenario) pairs that must fail with each defect, and pairs that may also fail because
# they take the same path for some prompts; everything else must pass (benchmarks/detection.py)
EXPECTED = WHERE


def run_smoke(tmp_path: Path, defect: str | None) -> list[dict]:
    matrix = load_matrix("smoke")
    matrix.workload.num_prompts = 5
    env = {"EVALSVC_ENGINE_DEFECTS": defect} if defect else {}
    spec = EngineSpec(kind="embedded", env=env)
    configs, prompts = prepare(matrix, spec)
    results = evaluate(matrix, configs, prompts, spec, tmp_path / (defect or "clean"))
    return summary_rows(results)


def test_smoke_without_defects_passes_everywhere(tmp_path):
    rows = run_smoke(tmp_path, None)
    bad = [(r["config"], r["scenario"], r["verdict"], r["reason"]) for r in rows
           if r["verdict"] != "pass"]
    assert not bad, bad
    assert all(r["kl_k3_mean"] < 1e-6 for r in rows)
    assert (tmp_path / "clean" / "summary.json").is_file()
    assert (tmp_path / "clean" / "samples.parquet").is_file()


@pytest.mark.parametrize("defect", list(EXPECTED))
def test_each_defect_fails_exactly_its_paths(tmp_path, defect):
    rows = run_smoke(tmp_path, defect)
    failed = {(r["config"], r["scenario"]) for r in rows if r["verdict"] == "fail"}
    other = [(r["config"], r["scenario"], r["verdict"], r["reason"]) for r in rows
             if r["verdict"] not in ("pass", "fail")]
    assert not other, other
    expected = EXPECTED[defect]
    assert expected["must"] <= failed, f"{defect} missed: {sorted(expected['must'] - failed)}"
    extra = failed - expected["must"] - expected["may"]
    assert not extra, f"{defect} flagged paths it does not act in: {sorted(extra)}"
    if defect == "stale-spec-metadata":  # KL unchanged: only acceptance moves
        assert all(r["kl_k3_mean"] < 1e-6 for r in rows)
    if defect == "host-load-race":  # a failing scenario had hits served from the host tier
        samples = pd.read_parquet(tmp_path / defect / "samples.parquet")
        host = samples[samples.host_cached_tokens > 0].groupby(["config", "scenario"]).size()
        assert all(pair in host.index for pair in failed), (sorted(failed), host)
