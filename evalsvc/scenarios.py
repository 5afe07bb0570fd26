"""Scenarios: workload shapes that make a server take one cache path, then measure it.

Every scenario starts from an empty cache (``/flush_cache``), sends its setup requests (seeding,
pool pressure, a first turn), then the measured requests concurrently, each generating with
logprobs; the reference is then computed as SGLang's tests do (flush, and a teacher-forced cold
prefill of prompt + output) on the same server or on a reference server, one request at a time, so
that each reference is cut into chunks the same way in every run (concurrent prefills share the
chunk budget, which moves the boundaries and with them the rounding). A measured request counts as
a hit when ``cached_tokens`` shows the path was taken. Measured requests carry their sample id in
their ``rid``, so that what the server logs of a request (a defect patch's event, for instance)
can be laid beside its sample.

Two comparisons come out of one measured request of a hit scenario. SGLang's: the generated
tokens' logprobs (decode) against the reference's. And the *extend*: the request also asks for the
logprobs of its prompt tokens after the cached prefix (``logprob_start_len`` at the prefix), the
tokens prefilled right on top of the cached state, against the same positions of the cold
reference. A state the cache got wrong shows most there, before decoding dilutes it, and both sides
are prefills of fixed tokens: no sampling, so the clean floor is the lowest there is. (SGLang limits
its prefix match to ``logprob_start_len``, which is the cached prefix here, so the hit is kept.)

* ``cold``: nothing cached; the baseline of decode against prefill.
* ``prefill_hit``: each prompt's first 40-70 % prefilled first (one at a time), then the whole
  prompt generated.
* ``decode_hit``: a first turn generates past a ``--mamba-track-interval`` boundary; the second turn
  (prompt + output + more) must hit beyond the first prompt (SGLang's criterion).
* ``branching``: a shared prefix prefilled, then branches off it submitted together.
* ``host_tier``: prefixes seeded, then other prompts push them out of device memory; the measured
  requests must load them back from the host tier.
* ``speculative``: greedy generation under MTP, one request at a time; acceptance is measured on
  top of KL.
* ``chunked_hit`` (radix configs with a chunked-prefill size up to ``matrix.CHUNKED_HIT_MAX_CHUNK``): as
  ``prefill_hit``, but the new tokens after each cached prefix are one and a half chunks long, so
  that the hit's own prefill is split into chunks (the first starts on the state the hit copied);
  the measured requests go one at a time, so the chunk layout is the same in every run: a full chunk
  from the end of the prefix, then the rest.
* ``mixed_hit`` (configs with ``--enable-mixed-chunk``): as ``prefill_hit``, but each prefix is
  prefilled while other requests decode, and neither asks for logprobs, so the server mixes each
  prefill into a decode batch (SGLang's ``mix_with_running``); the measured requests then hit
  the prefixes prefilled that way. Only SGLang's public API: the decoding requests are streamed
  until their first tokens come, and aborted by ``rid`` once the prefixes are in.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from evalsvc.engines.client import EngineClient, ScenarioError
from evalsvc.engines.sglang_server import (
    build_generate_payload,
    build_plain_payload,
    build_reference_payload,
)
from evalsvc.types import Completion, TopLogprobs

TOP_K = 5


@dataclass
class Sample:
    scenario: str
    sample_id: str
    prompt_id: str
    prompt_ids: list[int]
    completion: Completion
    hit: bool
    reference: list[float] = field(default_factory=list)
    reference_top: TopLogprobs | None = None
    # the extend: the prompt tokens after the cached prefix (ids), their logprobs and the
    # reference's
    extend_ids: list[int] = field(default_factory=list)
    extend: list[float] = field(default_factory=list)
    extend_reference: list[float] = field(default_factory=list)


@dataclass
class Context:
    client: EngineClient
    reference: EngineClient  # the same client for SGLang's same-server reference
    prompts: list[tuple[str, list[int]]]  # (prompt id, token ids)
    max_new_tokens: int
    temperature: float
    seed: int
    track_interval: int = 256
    max_total_tokens: int | None = None
    device_states: int | None = None  # the Mamba pool's size in states; None: not known
    host_tokens: int | None = None  # the host tier's size in tokens; None: not known
    host_states: int | None = None  # the host tier's size in Mamba states; None: not known
    chunk_size: int | None = None  # the server's chunked-prefill size; None: not chunked
    rid_prefix: str = ""  # makes each measured request's rid unique on its server
    log_path: Path | None = None  # the server's log, where it reports what a planted defect did
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def payload(self, ids: list[int], i: int, *, greedy: bool = False,
                max_new_tokens: int | None = None, logprob_start_len: int = -1,
                rid: str | None = None) -> dict:
        return build_generate_payload(
            ids, max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            temperature=0.0 if greedy else self.temperature, seed=self.seed + i,
            top_logprobs_num=TOP_K, logprob_start_len=logprob_start_len,
            rid=None if rid is None else self.rid_prefix + rid)


def _measure(ctx: Context, name: str, items: list[tuple[str, list[int]]],
             is_hit: Callable[[int, Completion], bool], greedy: bool = False,
             prefixes: list[int] | None = None, one_at_a_time: bool = False) -> list[Sample]:
    """Generate from each item (concurrently, or ``one_at_a_time``) and add the reference.
    ``prefixes``: per item, the cached prefix's length, from which the request asks for its prompt
    logprobs (the extend)."""
    starts = prefixes or [-1] * len(items)
    payloads = [ctx.payload(ids, i, greedy=greedy, logprob_start_len=start, rid=f"{name}-{i}")
                for i, ((_, ids), start) in enumerate(zip(items, starts, strict=True))]
    outs = ([ctx.client.generate(p) for p in payloads] if one_at_a_time
            else ctx.client.generate_many(payloads))
    samples = [Sample(name, f"{name}-{i}", pid, ids, out, is_hit(i, out))
               for i, ((pid, ids), out) in enumerate(zip(items, outs, strict=True))]
    add_reference(ctx, samples)
    return samples


def add_reference(ctx: Context, samples: list[Sample]) -> None:
    """SGLang's method: an empty cache, then a teacher-forced prefill of prompt + output; one at a
    time, so that each is cut into chunks the same way whatever else the server runs."""
    ctx.reference.flush()
    refs = [ctx.reference.generate(build_reference_payload(
        s.prompt_ids, s.completion.token_ids, top_logprobs_num=TOP_K)) for s in samples]
    for s, ref in zip(samples, refs, strict=True):
        extend = s.completion.input_logprobs  # the last len(extend) prompt positions
        first = len(s.prompt_ids) - len(extend)
        for tid, got, want in zip(s.prompt_ids[first:], extend,
                                  ref.input_logprobs[first: len(s.prompt_ids)], strict=True):
            if got is not None and want is not None:
                s.extend_ids.append(tid)
                s.extend.append(float(got))
                s.extend_reference.append(float(want))
        n = len(s.completion.token_ids)
        if n == 0:
            continue
        tail = ref.input_logprobs[-n:]
        if len(tail) != n or any(x is None for x in tail):
            raise ScenarioError(f"{s.sample_id}: the reference returned {len(tail)} logprobs for "
                                f"{n} generated tokens")
        s.reference = [float(x) for x in tail]
        if ref.input_top is not None:
            s.reference_top = TopLogprobs(ref.input_top.positions[-n:])


def cold(ctx: Context) -> list[Sample]:
    ctx.client.flush()
    return _measure(ctx, "cold", ctx.prompts, lambda i, out: out.cached_tokens > 0)


def prefix_cuts(ctx: Context) -> list[int]:
    """Per prompt, a prefix to cache: long enough for a chunk-aligned snapshot (64 tokens), short
    enough to leave a real extend."""
    return [min(len(ids) - 2, max(80, int(len(ids) * ctx.rng.uniform(0.4, 0.7))))
            for _, ids in ctx.prompts]


def prefill_hit(ctx: Context) -> list[Sample]:
    ctx.client.flush()
    cuts = prefix_cuts(ctx)
    seed(ctx, [ids[:c] for (_, ids), c in zip(ctx.prompts, cuts, strict=True)])
    return _measure(ctx, "prefill_hit", ctx.prompts, lambda i, out: out.cached_tokens > 0,
                    prefixes=cuts)


def chunked_hit(ctx: Context) -> list[Sample]:
    """A cached prefix, then one and a half chunks of new tokens: the hit's prefill is split, its
    first chunk runs on the state the hit copied into the request's slot, the second on what the
    first left. Each measured prompt is the prompt's prefix followed by the workload's token stream
    from there on (the prompt's rest, then the next prompts'), one request at a time."""
    if not ctx.chunk_size or ctx.chunk_size <= 0:
        raise ScenarioError("chunked_hit needs a server with a chunked-prefill size")
    ctx.client.flush()
    cuts = prefix_cuts(ctx)
    new = ctx.chunk_size + ctx.chunk_size // 2
    items = []
    for k, ((pid, ids), cut) in enumerate(zip(ctx.prompts, cuts, strict=True)):
        stream = ids[cut:] + [t for j in range(1, len(ctx.prompts) + 1)
                              for t in ctx.prompts[(k + j) % len(ctx.prompts)][1]]
        if len(stream) < new:
            raise ScenarioError(f"chunked_hit: the workload's prompts hold {len(stream)} tokens "
                                f"after {pid}'s prefix, fewer than the {new} it needs")
        items.append((f"{pid}+{new}", ids[:cut] + stream[:new]))
    seed(ctx, [ids[:c] for (_, ids), c in zip(ctx.prompts, cuts, strict=True)])
    return _measure(ctx, "chunked_hit", items, lambda i, out: out.cached_tokens > 0,
                    prefixes=cuts, one_at_a_time=True)


def seed(ctx: Context, prefixes: list[list[int]]) -> None:
    """Prefill each prefix alone, so each is cut into chunks the same way whatever else runs
    (snapshots need whole chunk-aligned extends)."""
    for i, ids in enumerate(prefixes):
        ctx.client.generate(ctx.payload(ids, i, max_new_tokens=0))


def decode_hit(ctx: Context) -> list[Sample]:
    ctx.client.flush()
    first = ctx.client.generate_many([
        ctx.payload(ids, i, max_new_tokens=ctx.track_interval + 8)
        for i, (_, ids) in enumerate(ctx.prompts)])
    items, firsts = [], []
    for i, ((pid, ids), out) in enumerate(zip(ctx.prompts, first, strict=True)):
        follow = ctx.prompts[(i + 1) % len(ctx.prompts)][1][:8]
        items.append((f"{pid}/turn2", ids + out.token_ids + follow))
        firsts.append(len(ids))
    return _measure(ctx, "decode_hit", items,
                    lambda i, out: out.cached_tokens > firsts[i] + 1,
                    prefixes=[len(ids) - 8 for _, ids in items])


def branching(ctx: Context) -> list[Sample]:
    ctx.client.flush()
    base_id, base = ctx.prompts[0]
    shared = base[: max(1, len(base) * 3 // 5)]
    ctx.client.generate(ctx.payload(shared, 0, max_new_tokens=0))
    items = [(f"{base_id}+{pid}", shared + ids[len(ids) // 2:]) for pid, ids in ctx.prompts]
    return _measure(ctx, "branching", items, lambda i, out: out.cached_tokens > 0,
                    prefixes=[len(shared)] * len(items))


def _states(tokens: int, chunk: int | None) -> int:
    """The Mamba states a prompt of ``tokens`` leaves in the radix cache: one per prefill chunk."""
    return -(-tokens // chunk) if chunk else 1


def host_tier(ctx: Context) -> list[Sample]:
    ctx.client.flush()
    seeded = [max(1, int(len(ids) * 0.6)) for _, ids in ctx.prompts]
    seed(ctx, [ids[:n] for (_, ids), n in zip(ctx.prompts, seeded, strict=True)])
    # push the seeded prefixes out of device memory, and not out of the host tier: other token
    # sequences, until either of the device's pools has been filled past its size (tokens, or
    # Mamba states: a prompt leaves one per prefill chunk) and no further than midway to what a
    # write-through host tier (a copy of all that passed through the device) holds beside the
    # seeded prefixes. Each round rotates the reversed prompts further, so that no two share a
    # prefix (shared prefixes take no new memory, and few prompts would then press on nothing)
    device = ctx.max_total_tokens or 4096
    host = ctx.host_tokens or 2 * device
    token_budget = max(device, (device + host - sum(seeded)) // 2)
    state_budget = None
    if ctx.device_states and ctx.host_states:
        held = sum(_states(n, ctx.chunk_size) for n in seeded)
        state_budget = max(1, (ctx.device_states + ctx.host_states + 1) // 2 - held)
    pressure, used, states, k = [], 0, 0, 0
    while used < token_budget and (state_budget is None or states < state_budget):
        _, ids = ctx.prompts[k % len(ctx.prompts)]
        rev = list(reversed(ids))
        turn = 7 * (k // len(ctx.prompts)) % len(rev)
        seq = rev[turn:] + rev[:turn]
        pressure.append(seq)
        used += len(seq)
        states += _states(len(seq), ctx.chunk_size)
        k += 1
    for seq in pressure:  # one at a time, so eviction order follows recency
        ctx.client.generate(ctx.payload(seq, 0, max_new_tokens=0))
    return _measure(ctx, "host_tier", ctx.prompts, lambda i, out: out.host_cached_tokens > 0,
                    prefixes=seeded)


BACKGROUND_REQUESTS = 2  # requests decoding while mixed_hit's prefixes are prefilled
BACKGROUND_MAX_NEW_TOKENS = 2048  # each; aborted once the prefixes are in


def mixed_hit(ctx: Context) -> list[Sample]:
    ctx.client.flush()
    cuts = prefix_cuts(ctx)
    # reversed prompts: token sequences that share no prefix with the measured ones, so what
    # the background requests cache is never what a measured request hits
    background = []
    for k in range(BACKGROUND_REQUESTS):
        ids = list(reversed(ctx.prompts[k % len(ctx.prompts)][1]))[: 64 + k]
        room = (ctx.max_total_tokens or 65536) // (4 * BACKGROUND_REQUESTS) - len(ids)
        background.append(build_plain_payload(
            ids, max_new_tokens=max(16, min(BACKGROUND_MAX_NEW_TOKENS, room)),
            temperature=ctx.temperature, seed=ctx.seed + 10_000 + k))
    with ctx.client.decoding(background) as running:
        for i, ((_, ids), cut) in enumerate(zip(ctx.prompts, cuts, strict=True)):
            running.keep_decoding()  # one at a time, each prefilled beside decode steps
            ctx.client.generate(build_plain_payload(ids[:cut], max_new_tokens=0,
                                                    temperature=ctx.temperature,
                                                    seed=ctx.seed + i))
    return _measure(ctx, "mixed_hit", ctx.prompts, lambda i, out: out.cached_tokens > 0,
                    prefixes=cuts)


def speculative(ctx: Context) -> list[Sample]:
    """Greedy generation one request at a time (acceptance is a per-request property; batch
    size one is how draft acceptance is usually benchmarked)."""
    ctx.client.flush()
    outs = [ctx.client.generate(ctx.payload(ids, i, greedy=True, rid=f"speculative-{i}"))
            for i, (_, ids) in enumerate(ctx.prompts)]
    samples = [Sample("speculative", f"speculative-{i}", pid, ids, out, out.spec is not None)
               for i, ((pid, ids), out) in enumerate(zip(ctx.prompts, outs, strict=True))]
    add_reference(ctx, samples)
    return samples


SCENARIO_RUNNERS: dict[str, Callable[[Context], list[Sample]]] = {
    "cold": cold, "prefill_hit": prefill_hit, "decode_hit": decode_hit, "branching": branching,
    "host_tier": host_tier, "speculative": speculative, "mixed_hit": mixed_hit,
    "chunked_hit": chunked_hit,
}

