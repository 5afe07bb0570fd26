"""Each defect diverges in the paths where the real bug acts, and nowhere else.

The workload is the one of ``test_cache_paths``: a prefill hit, a partial-prefix hit (lands on a
snapshot taken between prefill chunks), a decode hit, and (HiCache) a host-tier hit, each against a
cold recompute after /flush_cache.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from evalsvc.engines.embedded.defects import Defect, affects, defect_fraction

from .conftest import FAMILIES, LocalEngine, request, token_prompts
from .test_cache_paths import CHUNK, TOL, config_flags, run_cache_paths

pytestmark = pytest.mark.model

DIVERGED = 1e-3  # a defect's effect is orders of magnitude above the no-defect noise (< 1e-5)

# config: (strategy, overlap, chunked, hicache, mtp)
EB_OVERLAP_CHUNKED = ("extra_buffer", True, True, False, False)
EB_SYNC_CHUNKED = ("extra_buffer", False, True, False, False)
EB_OVERLAP = ("extra_buffer", True, False, False, False)
NB_CHUNKED = ("no_buffer", False, True, False, False)
NB = ("no_buffer", False, False, False, False)
NB_CHUNKED_HICACHE = ("no_buffer", False, True, True, False)
EB_HICACHE = ("extra_buffer", False, False, True, False)


def snapshot_race_acts(cfg, probe) -> bool:
    """Overlap, extra_buffer and chunked prefill, and the hit landed on a snapshot taken between
    two chunks of the seeding prefill (the last chunk's snapshot is cached after its forward)."""
    return cfg[:3] == ("extra_buffer", True, True) and 0 < probe.cached < probe.seed_len


def deferred_ops_dropped_acts(cfg, probe) -> bool:
    """no_buffer, and a request that hit the cache has a prefill split into chunks."""
    return (cfg[0] == "no_buffer" and cfg[2] and probe.cached > 0
            and probe.length - probe.cached > CHUNK)


def host_load_race_acts(cfg, probe) -> bool:
    """A hit whose state came back from the host tier."""
    return probe.host_cached > 0


# defect -> (where it acts, configs to run it in); at least one probe per run must be in its path
# where the config is one the defect acts in
CASES = {
    "snapshot-race": (snapshot_race_acts, [EB_OVERLAP_CHUNKED, EB_SYNC_CHUNKED, EB_OVERLAP,
                                           NB_CHUNKED]),
    "deferred-ops-dropped": (deferred_ops_dropped_acts, [NB_CHUNKED, NB, EB_SYNC_CHUNKED]),
    "host-load-race": (host_load_race_acts, [NB_CHUNKED_HICACHE, EB_HICACHE, NB_CHUNKED,
                                             EB_SYNC_CHUNKED]),
    "stale-spec-metadata": (lambda cfg, probe: False, [EB_SYNC_CHUNKED, NB_CHUNKED_HICACHE]),
    # acts in mixed batches only (test_mixed_chunk.py): none of these configs mixes
    "mixed-chunk-tracking-dropped": (lambda cfg, probe: False, [EB_OVERLAP_CHUNKED, EB_SYNC_CHUNKED]),
}
ACTING = {("snapshot-race", EB_OVERLAP_CHUNKED), ("deferred-ops-dropped", NB_CHUNKED),
          ("host-load-race", NB_CHUNKED_HICACHE), ("host-load-race", EB_HICACHE)}


def cases():
    for defect, (_, configs) in CASES.items():
        for cfg in configs:
            for model in FAMILIES:
                cid = "-".join(str(x) for x in cfg)
                yield pytest.param(defect, cfg, model, id=f"{defect}-{cid}-{model}")


@pytest.mark.parametrize(("defect", "cfg", "model"), list(cases()))
def test_defect_diverges_only_in_its_paths(defect, cfg, model, demo_prompts, engine_factory):
    probe_eng = engine_factory(["--model-path", model, "--disable-radix-cache",
                                "--disable-overlap-schedule"])
    prompts = token_prompts(probe_eng.tok, demo_prompts)
    flags = config_flags(model, cfg, max(len(p) for p in prompts))
    eng = engine_factory([*flags, "--inject-defect", defect])
    probes, _ = run_cache_paths(eng, prompts, hicache=cfg[3])
    acts = CASES[defect][0]
    in_path = [p for p in probes if acts(cfg, p)]
    if (defect, cfg) in ACTING:
        assert in_path, f"{defect}: the workload did not reach the defect's path"
    for probe in probes:
        if probe in in_path:
            assert probe.max_diff > DIVERGED, (
                f"{defect} should diverge on {probe.name}: max |diff| {probe.max_diff:.2e}")
        else:
            assert probe.max_diff < TOL, (
                f"{defect} must not touch {probe.name}: max |diff| {probe.max_diff:.2e}")


def _spec_run(model: str, strategy: str, defect: str | None, prompts) -> tuple[float, list, list]:
    flags = ["--model-path", model, "--mamba-radix-cache-strategy", strategy,
             "--disable-overlap-schedule", "--speculative-algorithm", "NEXTN", "--random-seed", "0"]
    if defect:
        flags += ["--inject-defect", defect]
    eng = LocalEngine(flags)
    try:
        head = prompts[0][:120]  # a shared prefix so later requests hit the cache
        reqs = [eng.one(head + p[:60], f"s{i}", max_new_tokens=40, logprob_start_len=len(head))
                for i, p in enumerate(prompts[1:9])]
        reqs += eng.generate([request(f"c{i}", p, max_new_tokens=40)
                              for i, p in enumerate(prompts[9:17])])
    finally:
        eng.close()
    accept = sum(len(r.output_ids) for r in reqs) / sum(r.spec_verify_ct for r in reqs)
    return accept, [r.output_ids for r in reqs], [r.input_logprobs + r.output_logprobs for r in reqs]


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
@pytest.mark.parametrize("model", FAMILIES)
def test_stale_spec_metadata_drops_acceptance_only(model, strategy, demo_prompts):
    tok = LocalEngine(["--model-path", model, "--disable-radix-cache",
                       "--disable-overlap-schedule"])
    prompts = token_prompts(tok.tok, demo_prompts)
    tok.close()
    good_accept, good_out, good_lp = _spec_run(model, strategy, None, prompts)
    bad_accept, bad_out, bad_lp = _spec_run(model, strategy, "stale-spec-metadata", prompts)
    assert bad_out == good_out, "the target's greedy output must not change"
    for a, b in zip(good_lp, bad_lp, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < TOL, "logprobs must not change"
    assert bad_accept < 0.97 * good_accept, (
        f"acceptance length should drop: {good_accept:.3f} -> {bad_accept:.3f}")


# ---- strength: the fraction of requests a defect affects -------------------------------------------

def test_defect_selection_is_a_deterministic_function_of_name_and_prompt():
    ids = list(range(300))
    frac = defect_fraction(Defect.SNAPSHOT_RACE, ids)
    assert 0.0 <= frac < 1.0
    assert defect_fraction("snapshot-race", list(ids)) == frac
    assert defect_fraction(Defect.HOST_LOAD_RACE, ids) != frac  # the name is part of the key
    assert defect_fraction(Defect.SNAPSHOT_RACE, ids[:-1]) != frac
    # the same in another process (no per-process salt, unlike Python's hash())
    code = ("from evalsvc.engines.embedded.defects import defect_fraction; "
            "print(repr(defect_fraction('snapshot-race', list(range(300)))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "random"})
    assert float(out.stdout) == frac


@pytest.mark.parametrize("defect", list(Defect))
def test_roughly_the_requested_fraction_of_distinct_prompts_is_selected(defect):
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 400))] for _ in range(4000)]
    picked = {s: {i for i, p in enumerate(prompts) if affects(defect, p, s)}
              for s in (0.1, 0.25, 0.5, 1.0)}
    for strength, chosen in picked.items():
        assert abs(len(chosen) / len(prompts) - strength) < 0.03, (strength, len(chosen))
    assert picked[0.1] <= picked[0.25] <= picked[0.5] <= picked[1.0]  # nested: a threshold
    assert len(picked[1.0]) == len(prompts)
    assert affects(defect, [], 1.0)  # full strength: every request, even an empty prompt


def _hit_divergence(strength: str, seeds: list[list[int]], hits: list[list[int]],
                    cold: list[list[float]], engine_factory) -> list[bool]:
    """Whether each hit request's prompt logprobs diverge from the cold recompute."""
    eng = engine_factory(["--model-path", "hybrid-mamba2-tiny", *NB_CHUNKED_FLAGS,
                          "--inject-defect", f"deferred-ops-dropped@{strength}"])
    eng.generate([request(f"seed{i}", s) for i, s in enumerate(seeds)])
    out = []
    for i, (seed, hit) in enumerate(zip(seeds, hits, strict=True)):
        r = eng.one(hit, f"hit{i}", logprob_start_len=len(seed))
        assert r.cached_tokens == len(seed), f"hit{i} did not hit its seed: {r.cached_tokens}"
        diff = max(abs(a - b) for a, b in zip(r.input_logprobs, cold[i], strict=True))
        assert diff < TOL or diff > DIVERGED, f"hit{i}: |diff| {diff:.2e} neither exact nor broken"
        out.append(diff > DIVERGED)
    return out


NB_CHUNKED_FLAGS = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
                    "--chunked-prefill-size", str(CHUNK), "--random-seed", "0"]


def test_half_strength_breaks_the_selected_hits_and_full_strength_all(demo_prompts,
                                                                       engine_factory):
    """deferred-ops-dropped@0.5: exactly the prefill hits whose prompts it selects diverge from a
    cold recompute (some, not all); @1.0: every one."""
    cold_eng = engine_factory(["--model-path", "hybrid-mamba2-tiny", "--disable-radix-cache",
                               *NB_CHUNKED_FLAGS])
    prompts = token_prompts(cold_eng.tok, demo_prompts)[:10]
    seeds = [p[:80] for p in prompts]
    hits = [p[:80 + 2 * CHUNK] for p in prompts]  # the rest after the hit is split into chunks
    cold = [cold_eng.one(h, f"cold{i}", logprob_start_len=80).input_logprobs
            for i, h in enumerate(hits)]
    selected = [affects(Defect.DEFERRED_OPS_DROPPED, h, 0.5) for h in hits]
    assert any(selected) and not all(selected), "pick prompts that split at strength 0.5"
    assert _hit_divergence("0.5", seeds, hits, cold, engine_factory) == selected
    assert all(_hit_divergence("1.0", seeds, hits, cold, engine_factory))
