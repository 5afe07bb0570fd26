"""What a planted defect logs beside the samples it reached: ``harness.note_defect_events`` on its
own, and end to end on the embedded engine, whose ``deferred-ops-dropped`` logs the same line a
build with ``defect:deferred-ops-dropped`` does (tests/builds/test_defect_patches.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalsvc.engines.base import EngineSpec
from evalsvc.engines.sglang_server import DEFECT_EVENT
from evalsvc.evaluate import evaluate, prepare
from evalsvc.harness import note_defect_events, read_defect_events
from evalsvc.matrix import load_matrix
from evalsvc.types import ScenarioResult


def result(n: int, reason: str = "") -> ScenarioResult:
    return ScenarioResult("chunked_hit", "fail", reason, {},
                          [{"sample_id": f"chunked_hit-{i}"} for i in range(n)])


def test_events_name_the_samples_they_reached(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("INFO before\n" + DEFECT_EVENT.format(name="d", rid="old-chunked_hit-0") + "\n")
    start = log.stat().st_size
    with log.open("a") as f:
        for rid in ("ab-chunked_hit-2", "ab-chunked_hit-0", "ab-chunked_hit-2", "other-rid"):
            f.write(f"[2026-12-05] WARNING {DEFECT_EVENT.format(name='d', rid=rid)}\n")
    events = read_defect_events(log, start)
    assert events == [("d", "ab-chunked_hit-2"), ("d", "ab-chunked_hit-0"),
                      ("d", "ab-chunked_hit-2"), ("d", "other-rid")]
    got = result(3, "extend KL (k3) 0.1 above the limit 0.005")
    note_defect_events(got, events, "ab-")
    assert [row["defect_acted"] for row in got.samples] == [["d"], [], ["d"]]
    assert got.metrics["defect_acted"] == 2
    assert got.reason == ("extend KL (k3) 0.1 above the limit 0.005; d acted on 2 of 3 measured "
                          "requests (chunked_hit-0, chunked_hit-2) and on 1 other requests")
    # nothing logged: nothing added, not even an empty count
    quiet = result(2, "")
    note_defect_events(quiet, read_defect_events(log, log.stat().st_size), "ab-")
    assert quiet.reason == "" and "defect_acted" not in quiet.metrics
    assert "defect_acted" not in quiet.samples[0]
    assert read_defect_events(None, 0) == [] and read_defect_events(tmp_path / "gone", 0) == []


@pytest.mark.slow
def test_chunked_hit_fails_where_the_defect_acts_and_says_on_which_requests(tmp_path: Path):
    """no_buffer, chunked prefill 64: every chunked_hit request's prefill after its prefix hit is
    split, so ``deferred-ops-dropped`` drops every copy-on-write and the scenario fails naming the
    requests; the clean engine passes it with no event."""
    matrix = load_matrix("smoke")
    matrix.workload.num_prompts = 3
    matrix.scenarios = ["chunked_hit"]
    rows = {}
    for label, env in (("clean", {}), ("defect", {"EVALSVC_ENGINE_DEFECTS": "deferred-ops-dropped"})):
        spec = EngineSpec(kind="embedded", env=env)
        configs, prompts = prepare(matrix, spec, configs=["mamba2-nb-sync-c64"])
        [run] = evaluate(matrix, configs, prompts, spec, tmp_path / label)
        [rows[label]] = run.scenarios
    clean, broken = rows["clean"], rows["defect"]
    assert clean.verdict == "pass" and "acted" not in clean.reason
    # the whole prefix hit, then 1.5 chunks of 64 new tokens (scored from the second on)
    assert all(s["hit"] and s["cached_tokens"] == s["prompt_tokens"] - 96
               and s["extend_tokens"] == 95 for s in clean.samples), clean.samples
    assert broken.verdict == "fail", broken.reason
    assert broken.metrics["defect_acted"] == 3
    assert broken.reason.endswith("deferred-ops-dropped acted on 3 of 3 measured requests "
                                  "(chunked_hit-0, chunked_hit-1, chunked_hit-2)")
