"""With no defect, every cache path gives the numbers of a cold recompute.

For every combination of Mamba strategy, overlap, chunked prefill, HiCache and MTP that the flag
validation allows, and for both model families: prompt logprobs after a prefill hit, a decode hit
and (HiCache) a host-tier hit equal those of a cold recompute after /flush_cache (max |diff| < 1e-5,
float32), ``cached_tokens`` proves each hit, and greedy output equals that of a plain engine (no
cache, no MTP) token for token.
"""

from __future__ import annotations

import itertools
import random
from concurrent.futures import Future

import pytest

from .conftest import FAMILIES, LocalEngine, Probe, request, token_prompts

pytestmark = pytest.mark.model

TOL = 1e-5
CHUNK = 64
DECODE_TOKENS = 72  # past one --mamba-track-interval 64 boundary


def valid_configs():
    for strategy, overlap, chunked, hicache, mtp in itertools.product(
            ["no_buffer", "extra_buffer"], [False, True], [False, True], [False, True],
            [False, True]):
        if overlap and (strategy == "no_buffer" or mtp):
            continue  # refused (no_buffer) or turned off at start (MTP on CPU)
        yield strategy, overlap, chunked, hicache, mtp


def config_id(cfg) -> str:
    strategy, overlap, chunked, hicache, mtp = cfg
    return "-".join([strategy, "overlap" if overlap else "sync", f"chunk{CHUNK}" if chunked
                     else "nochunk", "hicache" if hicache else "device", "mtp" if mtp else "plain"])


def config_flags(model: str, cfg, longest: int) -> list[str]:
    strategy, overlap, chunked, hicache, mtp = cfg
    flags = ["--model-path", model, "--mamba-radix-cache-strategy", strategy, "--random-seed", "0",
             "--mamba-track-interval", "64", "--chunked-prefill-size", str(CHUNK if chunked else -1)]
    if not overlap:
        flags.append("--disable-overlap-schedule")
    if hicache:
        flags += ["--enable-hierarchical-cache", "--hicache-ratio", "4",
                  "--max-total-tokens", str(int(2.5 * longest) + 200),
                  "--max-mamba-cache-size", "16", "--max-running-requests", "4"]
    if mtp:
        flags += ["--speculative-algorithm", "NEXTN"]
    return flags


def run_cache_paths(eng: LocalEngine, prompts: list[list[int]],
                    hicache: bool) -> tuple[list[Probe], list[int]]:
    """Seed, hit, and recompute cold; returns the probes and the greedy turn-1 output."""
    p, q, b = prompts[0], prompts[1][:80], prompts[2]
    partial = p[: len(p) * 3 // 5] + prompts[3][:40]
    eng.one(p, "seed")
    if hicache:  # push the seeded prefix out of the device pools, into the host tier
        for i, other in enumerate(prompts[4:9]):
            eng.one(other, f"pressure{i}")
    hit = eng.one(p + q, "hit", logprob_start_len=len(p), max_new_tokens=8)
    part = eng.one(partial, "partial", logprob_start_len=len(p) * 3 // 5, max_new_tokens=8)
    turn1 = eng.one(b, "turn1", max_new_tokens=DECODE_TOKENS)
    t2 = b + turn1.output_ids + q[:16]
    turn2_start = len(b) + len(turn1.output_ids)
    turn2 = eng.one(t2, "turn2", logprob_start_len=turn2_start, max_new_tokens=8)
    cold = []
    for name, ids, start in [("cold-hit", p + q, len(p)), ("cold-partial", partial, len(p) * 3 // 5),
                             ("cold-turn2", t2, turn2_start)]:
        eng.flush()
        cold.append(eng.one(ids, name, logprob_start_len=start, max_new_tokens=8))
    probes = []
    for name, h, c, seed in zip(["prefill_hit", "partial_hit", "decode_hit"], [hit, part, turn2],
                                cold, [len(p), len(p), len(b)], strict=True):
        assert c.cached_tokens == 0, f"{name}: the cold recompute hit the cache"
        probes.append(Probe(name, h.prompt_len, seed, h.cached_tokens, h.host_cached_tokens,
                            h.input_logprobs + h.output_logprobs,
                            c.input_logprobs + c.output_logprobs, h.output_ids, c.output_ids))
    return probes, turn1.output_ids


@pytest.fixture(scope="module")
def plain():
    """A plain engine per family (no radix cache, no overlap, no MTP) and its greedy outputs."""
    engines = {m: LocalEngine(["--model-path", m, "--disable-radix-cache",
                               "--disable-overlap-schedule", "--random-seed", "0"]) for m in FAMILIES}
    memo: dict = {}

    def greedy(model: str, ids: list[int]) -> list[int]:
        key = (model, tuple(ids))
        if key not in memo:
            memo[key] = engines[model].one(ids, "plain", max_new_tokens=DECODE_TOKENS).output_ids
        return memo[key]

    yield engines, greedy
    for eng in engines.values():
        eng.close()


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("cfg", list(valid_configs()), ids=config_id)
def test_cache_hits_equal_cold_recompute(model, cfg, plain, demo_prompts, engine_factory):
    engines, greedy_plain = plain
    prompts = token_prompts(engines[model].tok, demo_prompts)
    longest = max(len(x) for x in prompts)
    eng = engine_factory(config_flags(model, cfg, longest))
    probes, greedy = run_cache_paths(eng, prompts, hicache=cfg[3])
    by_name = {p.name: p for p in probes}
    for probe in probes:
        assert probe.max_diff < TOL, f"{probe.name}: max |logprob diff| {probe.max_diff:.2e}"
        assert probe.hit_out == probe.cold_out, f"{probe.name}: greedy output differs from cold"
    prefill, decode = by_name["prefill_hit"], by_name["decode_hit"]
    assert prefill.cached > 0, "the prefill-hit request did not hit the cache"
    assert decode.cached > len(prompts[2]) + 1, f"decode hit too short: {decode.cached}"
    if cfg[0] == "extra_buffer":  # snapshots land on chunk-aligned / track-interval lengths
        assert prefill.cached % 64 == 0 and decode.cached % 64 == 0
    if cfg[3]:
        assert prefill.host_cached > 0, "the hit did not come from the host tier"
    assert greedy == greedy_plain(model, prompts[2]), "greedy output differs from the plain engine's"


DETERMINISTIC = [("extra_buffer", True, True, True, False), ("no_buffer", False, True, False, True)]


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("cfg", DETERMINISTIC, ids=config_id)
def test_deterministic_inference_makes_hits_bit_identical(model, cfg, plain, demo_prompts,
                                                          engine_factory):
    engines, _ = plain
    prompts = token_prompts(engines[model].tok, demo_prompts)
    flags = [*config_flags(model, cfg, max(len(x) for x in prompts)),
             "--enable-deterministic-inference"]
    probes, _ = run_cache_paths(engine_factory(flags), prompts, hicache=cfg[3])
    for probe in probes:
        assert probe.max_diff == 0.0, f"{probe.name}: max |diff| {probe.max_diff:.2e}, not bit-exact"


@pytest.mark.parametrize("model", FAMILIES)
def test_deterministic_inference_is_batch_invariant(model, demo_prompts, engine_factory):
    eng = engine_factory(["--model-path", model, "--enable-deterministic-inference",
                          "--random-seed", "0"])
    prompts = [ids[:48] for ids in token_prompts(eng.tok, demo_prompts)[:4]]
    alone = eng.one(prompts[0], "alone", logprob_start_len=0, max_new_tokens=12)
    eng.flush()
    batch = eng.generate([request(f"b{i}", p, logprob_start_len=0, max_new_tokens=12)
                          for i, p in enumerate(prompts)])[0]
    assert batch.output_ids == alone.output_ids
    assert batch.input_logprobs + batch.output_logprobs == alone.input_logprobs + alone.output_logprobs


def test_a_flush_sent_as_the_last_request_is_answered_succeeds_under_overlap(demo_prompts,
                                                                            engine_factory):
    """The overlap scheduler has the next step in flight when a request's last token comes back;
    a flush sent the moment the request is answered is not refused for that step."""
    eng = engine_factory(["--model-path", FAMILIES[0], "--random-seed", "0"])
    assert not eng.args.disable_overlap_schedule
    ids = token_prompts(eng.tok, demo_prompts)[0][:40]
    flushed: Future = Future()

    def answered(req) -> None:  # on the scheduler's thread, as the request's answer goes out
        eng.sched.inbox.put(("flush", flushed))

    eng.sched.submit(request("r", ids, max_new_tokens=4), answered)
    assert flushed.result(timeout=60) is True
    assert eng.one(ids, "again", max_new_tokens=1).cached_tokens == 0


@pytest.mark.parametrize("model", FAMILIES)
def test_a_request_sent_as_another_is_answered_hits_its_decode_snapshot(model, demo_prompts,
                                                                        engine_factory):
    """Under overlap a finished request is put into the tree before it is answered (as in SGLang):
    a follow-up sent at that moment (a chat's next turn) hits the state its decode tracked."""
    interval = 64
    eng = engine_factory(["--model-path", model, "--random-seed", "0",
                          "--mamba-track-interval", str(interval)])
    assert not eng.args.disable_overlap_schedule
    ids = token_prompts(eng.tok, demo_prompts)[0][:40]
    follow: Future = Future()

    def answered(first) -> None:  # on the scheduler's thread, as the answer goes out
        eng.sched.submit(request("next", first.origin + first.output_ids, max_new_tokens=1),
                         follow.set_result)

    eng.sched.submit(request("first", ids, max_new_tokens=interval - len(ids) + 8), answered)
    nxt = follow.result(timeout=60)
    assert nxt.error is None, nxt.error
    assert nxt.cached_tokens == interval


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("chunk", [64, 4096])
def test_a_decode_snapshot_survives_a_step_ahead_that_snapshots_past_the_end(model, chunk,
                                                                             demo_prompts,
                                                                             engine_factory):
    """Prompt + max_new_tokens on a track boundary: under overlap the step launched ahead of the
    last one snapshots at that boundary and is dropped. As in SGLang (a snapshot belongs to the
    batch that took it, ``mamba_track_mask_cpu``), the finished request still caches the snapshot
    its decode took before, and the next turn hits it (SGLang's multi-turn bound, at least
    ``(prompt + output - 1) // interval * interval``)."""
    interval = 64
    eng = engine_factory(["--model-path", model, "--random-seed", "0", "--chunked-prefill-size",
                          str(chunk), "--mamba-track-interval", str(interval)])
    assert not eng.args.disable_overlap_schedule
    assert eng.args.mamba_radix_cache_strategy == "extra_buffer"
    ids = token_prompts(eng.tok, demo_prompts)[0][:100]  # two prefill chunks of 64
    new = 3 * interval - len(ids)  # prompt + output == 192: the dropped step would snapshot 192
    first = eng.one(ids, "first", max_new_tokens=new)
    assert len(first.output_ids) == new
    turn2 = first.origin + first.output_ids + ids[:8]
    nxt = eng.one(turn2, "next", logprob_start_len=len(turn2) - 8, max_new_tokens=4)
    bound = (len(ids) + new - 1) // interval * interval
    assert nxt.cached_tokens == bound == 2 * interval
    eng.flush()
    cold = eng.one(turn2, "cold", logprob_start_len=len(turn2) - 8, max_new_tokens=4)
    assert cold.cached_tokens == 0
    assert nxt.input_logprobs + nxt.output_logprobs == pytest.approx(
        cold.input_logprobs + cold.output_logprobs, abs=TOL)


def test_a_prefill_chunk_started_off_the_grid_snapshots_relative_to_its_start(engine_factory):
    """As SGLang without decode context parallelism: a request that joins a batch after another
    one's last chunk gets the rest of the chunk budget (the cut is not rounded to the Mamba chunk
    grid, ``mamba_prefill_chunk_grid``), and its prefill snapshots lie a whole number of chunks
    past each extend's start (``_mamba_radix_cache_v2_req_prepare_for_extend``), off the absolute
    grid. Its next turn hits the last of them."""
    eng = engine_factory(["--model-path", FAMILIES[0], "--random-seed", "0",
                          "--chunked-prefill-size", str(CHUNK)])
    rng = random.Random(0)
    first = [rng.randint(1, 255) for _ in range(15 * CHUNK + 40)]  # leaves 24 of its last chunk
    second = [rng.randint(1, 255) for _ in range(16 * CHUNK)]
    _, out = eng.generate([request("first", first, max_new_tokens=4),
                           request("second", second, max_new_tokens=4)])
    nxt = eng.one(second + out.output_ids + second[:8], "next", max_new_tokens=1)
    assert nxt.cached_tokens == 24 + 15 * CHUNK
