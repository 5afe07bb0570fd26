"""``--enable-mixed-chunk`` and ``--page-size``: a prefill merged into a decode batch, page-aligned
chunks and matches, and the defect of SGLang PR #39342 (``mixed-chunk-tracking-dropped``).

A prompt is *seeded by a mixed prefill* when it arrives, without logprobs, while another request
decodes (also without logprobs): its prefill runs in the same batch as that decode step. A later
request that hits the seeded prefix is compared with a cold recompute after /flush_cache.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future

import pytest
import torch

from evalsvc.engines.client import EngineClient
from evalsvc.engines.embedded.radix import RadixCache
from evalsvc.engines.sglang_server import build_plain_payload
from evalsvc.scenarios import Context, mixed_hit

from .conftest import FAMILIES, LocalEngine, request
from .test_cache_paths import TOL
from .test_server import new_engine

pytestmark = pytest.mark.model

DIVERGED = 1e-3
CHUNK = 128


def flags(model: str, *extra: str) -> list[str]:
    return ["--model-path", model, "--random-seed", "0", "--chunked-prefill-size", str(CHUNK),
            "--mamba-track-interval", "64", *extra]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 255) for _ in range(n)]


def seed_while_decoding(eng: LocalEngine, seed: list[int], *, seed_logprobs: bool = False,
                        bg_logprobs: bool = False) -> list[int]:
    """Seed ``seed`` (prefill only) while a background request decodes; returns the background
    request's output (it is aborted once the seed is done)."""
    decoding, done = threading.Event(), Future()
    bg = request("bg", tokens(40, 99), max_new_tokens=2000,
                 logprob_start_len=40 if bg_logprobs else None)
    eng.sched.submit(bg, done.set_result, lambda req: decoding.set())
    assert decoding.wait(60), "the background request did not start decoding"
    eng.one(seed, "seed", logprob_start_len=len(seed) if seed_logprobs else None)
    eng.sched.abort("bg")
    out = done.result(timeout=60)
    assert out.finished_reason["type"] == "abort", out.finished_reason
    return out.output_ids


def hit_and_cold(eng: LocalEngine, seed: list[int]) -> tuple[int, float]:
    """(cached tokens, max |logprob diff| against a cold recompute) of a request extending
    ``seed``."""
    ids = seed + tokens(24, 7)
    hit = eng.one(ids, "hit", logprob_start_len=len(seed), max_new_tokens=8)
    eng.flush()
    cold = eng.one(ids, "cold", logprob_start_len=len(seed), max_new_tokens=8)
    assert cold.cached_tokens == 0
    a, b = hit.input_logprobs + hit.output_logprobs, cold.input_logprobs + cold.output_logprobs
    return hit.cached_tokens, max(abs(x - y) for x, y in zip(a, b, strict=True))


CONFIGS = {"overlap": (), "sync-p16": ("--disable-overlap-schedule", "--page-size", "16")}


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_a_prefix_seeded_by_a_mixed_prefill_hits_as_a_cold_recompute(model, cfg, engine_factory):
    eng = engine_factory(flags(model, "--enable-mixed-chunk", *CONFIGS[cfg]))
    assert eng.args.mamba_radix_cache_strategy == "extra_buffer"
    seed = tokens(150, 1)
    bg_out = seed_while_decoding(eng, seed)
    # 150 tokens in chunks of at most 128 less the one decoding request: both chunks are mixed
    assert eng.sched.stats.mixed_batches == 2
    cached, diff = hit_and_cold(eng, seed)
    assert cached == 64 and diff < TOL, (cached, diff)
    # the decode rows of the mixed batches computed what plain decode steps do
    plain = engine_factory(flags(model, "--disable-radix-cache", "--disable-overlap-schedule"))
    assert len(bg_out) > 2
    assert plain.one(tokens(40, 99), "bg", max_new_tokens=len(bg_out)).output_ids == bg_out


@pytest.mark.parametrize(("extra", "seed_logprobs", "bg_logprobs"), [
    (("--enable-mixed-chunk",), True, False),  # the prefill asks for logprobs
    (("--enable-mixed-chunk",), False, True),  # a running request does
    (("--enable-mixed-chunk", "--chunked-prefill-size", "-1"), False, False),  # no chunking
    ((), False, False),  # not asked for
], ids=["seed-logprobs", "running-logprobs", "nochunk", "off"])
def test_no_mixed_batch_where_sglang_does_not_mix(extra, seed_logprobs, bg_logprobs,
                                                  engine_factory):
    eng = engine_factory(flags(FAMILIES[0], *extra))
    seed_while_decoding(eng, tokens(150, 1), seed_logprobs=seed_logprobs, bg_logprobs=bg_logprobs)
    assert eng.sched.stats.mixed_batches == 0


@pytest.mark.parametrize("model", FAMILIES)
def test_mixed_chunk_track_dropped_acts_only_on_prefills_mixed_into_decode(model, engine_factory):
    defect = ("--inject-defect", "mixed-chunk-tracking-dropped")
    seed = tokens(150, 1)
    eng = engine_factory(flags(model, "--enable-mixed-chunk", *defect))
    seed_while_decoding(eng, seed)
    cached, diff = hit_and_cold(eng, seed)
    assert cached == 64 and diff > DIVERGED, (cached, diff)  # resumed from an unwritten slot
    # the same engine, the seed not mixed (it asks for logprobs): exact
    eng.flush()
    seed_while_decoding(eng, seed, seed_logprobs=True)
    cached, diff = hit_and_cold(eng, seed)
    assert cached == 64 and diff < TOL, (cached, diff)
    # mixed, but no_buffer takes no snapshots to drop; and without mixed chunk nothing mixes
    for extra in (("--enable-mixed-chunk", "--mamba-radix-cache-strategy", "no_buffer",
                   "--disable-overlap-schedule"), ()):
        other = engine_factory(flags(model, *extra, *defect))
        seed_while_decoding(other, seed)
        cached, diff = hit_and_cold(other, seed)
        assert cached > 0 and diff < TOL, (extra, cached, diff)


@pytest.mark.parametrize(("page", "cached"), [(1, 191), (16, 288)])
def test_mixed_chunks_are_cut_on_pages(page, cached, engine_factory):
    """A 300-token prompt mixed with one decoding request gets chunks of 128 - 1 tokens, cut down
    to whole pages: page 1 cuts at 127 and 254 (snapshots 64 and 127 + 64 after each chunk's
    start; the last 46 tokens take none), page 16 at 112 and 224 (snapshots 64, 176, 288)."""
    eng = engine_factory(flags(FAMILIES[0], "--enable-mixed-chunk", "--page-size", str(page)))
    seed = tokens(300, 2)
    seed_while_decoding(eng, seed)
    assert eng.sched.stats.mixed_batches == 3
    got, diff = hit_and_cold(eng, seed)
    assert got == cached and diff < TOL, (got, diff)


def test_decode_snapshots_land_on_the_grid_of_chunk_and_track_interval(engine_factory):
    """SGLang 0.5.23 tracks decode states where the length is a multiple of both the Mamba cache
    chunk (64) and --mamba-track-interval: lcm(64, 96) = 192, not 96 (a 300-token turn's newest
    snapshot is at 192, not 288)."""
    eng = engine_factory(["--model-path", FAMILIES[0], "--random-seed", "0",
                          "--mamba-track-interval", "96", "--disable-overlap-schedule",
                          "--page-size", "16"])
    ids = tokens(40, 3)
    first = eng.one(ids, "first", max_new_tokens=300 - len(ids))
    turn2 = ids + first.output_ids + tokens(8, 4)
    nxt = eng.one(turn2, "next", logprob_start_len=len(turn2) - 8, max_new_tokens=1)
    assert nxt.cached_tokens == 192


class _Owner:
    def free_kv(self, idx) -> None: ...
    def free_state(self, slot: int) -> None: ...
    def backup_node(self, node) -> bool: return False
    def free_host(self, node) -> None: ...


def test_a_paged_tree_holds_whole_pages_only():
    tree = RadixCache(_Owner(), page_size=16)
    key = list(range(1, 33))
    tree.insert(key, torch.arange(32), 5)
    assert tree.match_prefix([*key, 99]).length == 32
    assert tree.match_prefix(key[:31]).length == 0  # 31 tokens: one whole page, no state there
    with pytest.raises(AssertionError, match="page 16"):
        tree.insert(list(range(1, 21)), torch.arange(20), 6)


# ---- over HTTP: the client's background requests and the mixed_hit scenario --------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with new_engine(tmp_path_factory.mktemp("mixed"), [
            "--enable-mixed-chunk", "--chunked-prefill-size", str(CHUNK), "--page-size", "16",
            "--disable-overlap-schedule", "--mamba-track-interval", "64"]) as eng:
        client = EngineClient(eng.base_url)
        yield eng, client
        client.close()


def test_background_requests_decode_until_aborted(server):
    _, client = server
    short = build_plain_payload(tokens(30, 5), max_new_tokens=2, temperature=0.0)
    long = build_plain_payload(tokens(30, 6), max_new_tokens=5000, temperature=0.0)
    with client.decoding([short, long]) as running:
        first = list(running.rids)
        running.threads[0].join(30)  # the short one ends by itself
        running.keep_decoding()
        assert running.rids[0] != first[0] and running.rids[1] == first[1]  # sent again
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 30 and not any(t.is_alive() for t in running.threads)
    client.flush(timeout=5)  # nothing left running: a flush is not refused


def test_mixed_hit_scenario_hits_prefixes_prefilled_beside_decode_steps(server):
    _, client = server
    prompts = [(f"p{i}", tokens(160 + 10 * i, 20 + i)) for i in range(3)]
    ctx = Context(client=client, reference=client, prompts=prompts, max_new_tokens=8,
                  temperature=1.0, seed=0, track_interval=64, max_total_tokens=65536)
    samples = mixed_hit(ctx)
    assert [s.hit for s in samples] == [True] * 3
    assert all(s.completion.cached_tokens % 64 == 0 for s in samples)
    for s in samples:  # float32: the hit reproduces the cold reference
        assert max(abs(a - b) for a, b in zip(s.completion.logprobs, s.reference, strict=True)) < TOL
        assert s.extend and max(abs(a - b) for a, b in zip(s.extend, s.extend_reference,
                                                            strict=True)) < TOL
        assert s.extend_ids == s.prompt_ids[len(s.prompt_ids) - len(s.extend):]
