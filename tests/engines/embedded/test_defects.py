"""Each defect diverges in the paths where the real bug acts, and nowhere else.

The workload is the one of ``test_cache_paths``: a prefill hit, a partial-prefix hit (lands on a
snapshot taken between prefill chunks), a decode hit, and (HiCache) a host-tier hit, each against a
cold recompute after /flush_cache.
"""

from __future__ import annotations

import pytest

from .conftest import FAMILIES, LocalEngine, request, token_prompts
from .test_cache_paths import CHUNK, TOL, config_flags, run_cache_paths

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
