"""The hybrid models (evalsvc/engines/embedded/model.py): training and serving forms agree, states
resume exactly, and the shipped models load and predict."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from evalsvc.engines.embedded.memory import KVPool, pool_zeros
from evalsvc.engines.embedded.model import (
    FAMILIES,
    HybridConfig,
    HybridLM,
    SegmentOutput,
    SegmentStates,
    chunk_gated_delta_rule,
    chunk_ssd,
    load_model,
    save_model,
)
from evalsvc.engines.embedded.tokenizer import TextTokenizer
from evalsvc.paths import MODELS_DIR

SHIPPED = ["hybrid-mamba2-tiny", "hybrid-gdn-tiny"]


# ---- helpers -----------------------------------------------------------------------------------
def small_model(family: str, seed: int = 0) -> HybridLM:
    cfg = HybridConfig(family=family, vocab_size=61, hidden_size=32, intermediate_size=48,
                       layer_types=["recurrent", "attention", "recurrent", "attention"],
                       num_attention_heads=2, head_dim=16, num_ssm_heads=2, ssm_head_dim=8,
                       ssm_state_size=4, conv_kernel=4, bos_token_id=58, eos_token_id=59,
                       pad_token_id=60)
    torch.manual_seed(seed)
    model = HybridLM(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "embed" in name else 0.1
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request) -> HybridLM:
    return small_model(request.param)


def random_ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def zero_states(model: HybridLM, batch: int, draft: bool = False) -> SegmentStates:
    mixers = [model.mtp.block.mixer] if draft else model.recurrent_mixers()
    conv, ssm = [], []
    for mixer in mixers:
        conv_shape, ssm_shape = mixer.state_shapes()
        conv.append(torch.zeros(batch, *conv_shape))
        ssm.append(torch.zeros(batch, *ssm_shape))
    return SegmentStates(conv, ssm)


def cat_states(states: list[SegmentStates]) -> SegmentStates:
    return SegmentStates([torch.cat(c) for c in zip(*(s.conv for s in states), strict=True)],
                         [torch.cat(s) for s in zip(*(s.ssm for s in states), strict=True)])


class ListKV:
    """A minimal KVAccess: per segment, per attention layer, the cached (k, v) of past tokens."""

    def __init__(self, past: list[list[tuple[torch.Tensor, torch.Tensor]]], lengths: list[int]):
        self.past = past
        self.lengths = lengths
        self.past_lens = [len(p[0][0]) if p else 0 for p in past]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        rows_k, rows_v = [], []
        for b, (nk, nv) in enumerate(zip(k.split(self.lengths), v.split(self.lengths), strict=True)):
            if self.past[b]:
                pk, pv = self.past[b][layer]
                nk, nv = torch.cat([pk, nk]), torch.cat([pv, nv])
            rows_k.append(nk)
            rows_v.append(nv)
        width = max(len(r) for r in rows_k)
        pad = [(0, 0, 0, 0, 0, width - len(r)) for r in rows_k]
        return (torch.stack([F.pad(r, p) for r, p in zip(rows_k, pad, strict=True)]),
                torch.stack([F.pad(r, p) for r, p in zip(rows_v, pad, strict=True)]))


def run_alone(model: HybridLM, ids: torch.Tensor, start: int = 0,
              past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
              states: SegmentStates | None = None, capture=()) -> SegmentOutput:
    """One segment ``ids`` at positions start.. after ``past`` KV and ``states``."""
    n = len(ids)
    kv = ListKV([past or []], [n])
    return model.forward_segments(ids, torch.arange(start, start + n), [n], kv,
                                  states if states is not None else zero_states(model, 1),
                                  capture=list(capture))


def kv_prefix(out: SegmentOutput, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(nk[:k], nv[:k]) for nk, nv in zip(out.new_k, out.new_v, strict=True)]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


# ---- training form == serving form ---------------------------------------------------------------
@torch.no_grad()
def test_train_forward_equals_serving_forward(model):
    n = 77  # spans two chunks of 64, the second one partial
    ids = random_ids(n, model.cfg.vocab_size, 1)
    train_logits, _ = model.forward_train(ids[None])
    out = run_alone(model, ids)
    serve_logits = model.logits(out.hidden)
    assert serve_logits.shape == (n, model.cfg.vocab_size)
    assert train_logits[0].abs().max() > 1e-2  # not a degenerate model
    assert max_diff(train_logits[0], serve_logits) < 1e-4


@torch.no_grad()
def test_serving_forward_through_kv_pool(model):
    n = 20
    ids = random_ids(n, model.cfg.vocab_size, 2)
    pool = KVPool(model, 64)
    slots = torch.tensor(pool.slots.alloc(n), dtype=torch.long)
    out = model.forward_segments(ids, torch.arange(n), [n],
                                 pool.access([torch.zeros(0, dtype=torch.long)], [slots]),
                                 zero_states(model, 1))
    train_logits, _ = model.forward_train(ids[None])
    assert max_diff(train_logits[0], model.logits(out.hidden)) < 1e-4
    # resume after 12 tokens from the pool's cached K/V and captured states
    k = 12
    first = model.forward_segments(ids[:k], torch.arange(k), [k],
                                   pool.access([torch.zeros(0, dtype=torch.long)], [slots[:k]]),
                                   zero_states(model, 1))
    new_slots = torch.tensor(pool.slots.alloc(n - k), dtype=torch.long)
    rest = model.forward_segments(ids[k:], torch.arange(k, n), [n - k],
                                  pool.access([slots[:k]], [new_slots]), first.states)
    assert max_diff(model.logits(rest.hidden), model.logits(out.hidden)[k:]) < 1e-5


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.long])
def test_pool_zeros_are_zeros_that_take_memory_only_where_written(dtype):
    """The pools' zeros: equal to ``torch.zeros``, writable, each its own memory; a pool of 256 MiB
    costs memory only for the pages touched (``torch.zeros`` wrote all of them up front)."""
    shape = (2**20, 4, 64 // dtype.itemsize)
    before = _rss_bytes()
    a, b = pool_zeros(*shape, dtype=dtype), pool_zeros(*shape, dtype=dtype)
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
    a[[0, 7, shape[0] - 1]] = 3
    assert _rss_bytes() - before < 32 * 2**20, "the untouched pages took memory"
    assert a.sum() == 3 * 3 * shape[1] * shape[2] and b.count_nonzero() == 0
    assert torch.equal(pool_zeros(3, 0, dtype=dtype), torch.zeros(3, 0, dtype=dtype))


@torch.no_grad()
@pytest.mark.parametrize("k", [1, 5, 17])
def test_resume_from_captured_state(model, k):
    n = 30
    ids = random_ids(n, model.cfg.vocab_size, 3)
    full = run_alone(model, ids, capture=[(0, k)])
    captured = full.captured[(0, k)]
    assert len(captured.conv) == len(model.cfg.recurrent_layers)
    rest = run_alone(model, ids[k:], start=k, past=kv_prefix(full, k), states=captured)
    assert max_diff(model.logits(rest.hidden), model.logits(full.hidden)[k:]) < 1e-5
    # the captured state is the final state of a run over the first k tokens
    head = run_alone(model, ids[:k])
    for a, b in zip(captured.conv + captured.ssm, head.states.conv + head.states.ssm, strict=True):
        assert max_diff(a, b) < 1e-5
    # and the final states agree too
    for a, b in zip(rest.states.conv + rest.states.ssm, full.states.conv + full.states.ssm,
                    strict=True):
        assert max_diff(a, b) < 1e-5


@torch.no_grad()
def test_batched_segments_equal_segments_alone(model):
    vocab = model.cfg.vocab_size
    past_lens = [0, 3, 9]
    new_lens = [7, 1, 12]
    starts, pasts, states, alone = [], [], [], []
    for b, (p, n) in enumerate(zip(past_lens, new_lens, strict=True)):
        ids = random_ids(p + n, vocab, 10 + b)
        if p:
            head = run_alone(model, ids[:p])
            past, st = kv_prefix(head, p), head.states
        else:
            past, st = [], zero_states(model, 1)
        pasts.append(past)
        states.append(st)
        starts.append(ids[p:])
        alone.append(run_alone(model, ids[p:], start=p, past=past, states=st,
                               capture=[(0, min(2, n))]))
    ids = torch.cat(starts)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(past_lens, new_lens, strict=True)])
    capture = [(b, min(2, n)) for b, n in enumerate(new_lens)]
    out = model.forward_segments(ids, positions, new_lens, ListKV(pasts, new_lens),
                                 cat_states(states), capture=capture)
    hidden = out.hidden.split(new_lens)
    for b, one in enumerate(alone):
        assert max_diff(hidden[b], one.hidden) < 1e-5
        assert max_diff(model.logits(hidden[b]), model.logits(one.hidden)) < 1e-5
        for layer in range(len(out.new_k)):
            assert max_diff(out.new_k[layer].split(new_lens)[b], one.new_k[layer]) < 1e-5
        for a, s in zip(out.states.conv + out.states.ssm, one.states.conv + one.states.ssm,
                        strict=True):
            assert max_diff(a[b: b + 1], s) < 1e-5
        got = out.captured[capture[b]]
        want = one.captured[(0, capture[b][1])]
        for a, s in zip(got.conv + got.ssm, want.conv + want.ssm, strict=True):
            assert max_diff(a, s) < 1e-5


# ---- chunked kernels == token-by-token recurrence -----------------------------------------------
def loop_gated_delta_rule(q, k, v, g, beta, state=None):
    b, n, h, dk = k.shape
    s = torch.zeros(b, h, dk, v.shape[-1]) if state is None else state.clone()
    ys = []
    for t in range(n):
        s = s * g[:, t].exp()[:, :, None, None]
        kt = k[:, t]
        mem = torch.einsum("bhk,bhkv->bhv", kt, s)
        delta = (v[:, t] - mem) * beta[:, t, :, None]
        s = s + kt[:, :, :, None] * delta[:, :, None, :]
        ys.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(ys, dim=1), s


def loop_ssd(dtx, a, bm, cm):
    b, n, h, p = dtx.shape
    s = torch.zeros(b, h, p, bm.shape[-1])
    ys = []
    for t in range(n):
        s = s * a[:, t].exp()[:, :, None, None] + dtx[:, t, :, :, None] * bm[:, t, None, None, :]
        ys.append(torch.einsum("bhpn,bn->bhp", s, cm[:, t]))
    return torch.stack(ys, dim=1)


@pytest.mark.parametrize(("length", "chunk"), [(37, 16), (32, 16), (5, 64), (70, 64)])
def test_chunk_gated_delta_rule_matches_recurrence(length, chunk):
    gen = torch.Generator().manual_seed(length)
    b, h, dk, dv = 2, 3, 8, 6
    q = torch.randn(b, length, h, dk, generator=gen)
    k = F.normalize(torch.randn(b, length, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, length, h, dv, generator=gen)
    g = -F.softplus(torch.randn(b, length, h, generator=gen)) * 0.5
    beta = torch.sigmoid(torch.randn(b, length, h, generator=gen))
    want, _ = loop_gated_delta_rule(q, k, v, g, beta)
    got = chunk_gated_delta_rule(q, k, v, g, beta, chunk)
    assert got.shape == (b, length, h, dv)
    assert max_diff(got, want) < 1e-4


def test_chunk_gated_delta_rule_from_initial_state():
    gen = torch.Generator().manual_seed(7)
    b, n, h, dk, dv = 1, 21, 2, 8, 8
    q = torch.randn(b, n, h, dk, generator=gen)
    k = F.normalize(torch.randn(b, n, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, n, h, dv, generator=gen)
    g = -F.softplus(torch.randn(b, n, h, generator=gen))
    beta = torch.sigmoid(torch.randn(b, n, h, generator=gen))
    state = torch.randn(b, h, dk, dv, generator=gen)
    want, _ = loop_gated_delta_rule(q, k, v, g, beta, state)
    got = chunk_gated_delta_rule(q, k, v, g, beta, 8, state=state.clone())
    assert max_diff(got, want) < 1e-4


@pytest.mark.parametrize(("length", "chunk"), [(37, 16), (32, 16), (5, 64), (70, 64)])
def test_chunk_ssd_matches_recurrence(length, chunk):
    gen = torch.Generator().manual_seed(100 + length)
    b, h, p, n = 2, 3, 5, 4
    dtx = torch.randn(b, length, h, p, generator=gen)
    a = -F.softplus(torch.randn(b, length, h, generator=gen)) * 0.5
    bm = torch.randn(b, length, n, generator=gen)
    cm = torch.randn(b, length, n, generator=gen)
    want = loop_ssd(dtx, a, bm, cm)
    got = chunk_ssd(dtx, a, bm, cm, chunk)
    assert got.shape == (b, length, h, p)
    assert max_diff(got, want) < 1e-4


# ---- MTP head ----------------------------------------------------------------------------------
@torch.no_grad()
def test_draft_segments_equal_training_mtp(model):
    n = 40
    ids = random_ids(n, model.cfg.vocab_size, 4)
    _, train_draft = model.forward_train(ids[None])
    assert train_draft.shape == (1, n - 1, model.cfg.vocab_size)
    out = run_alone(model, ids)
    x, states, _ = model.draft_segments(out.hidden[:-1], ids[1:], [n - 1],
                                        zero_states(model, 1, draft=True))
    assert max_diff(model.draft_logits(x), train_draft[0]) < 1e-4
    # resuming the draft head from captured state gives the same draft hidden states
    k = 15
    x1, _, captured = model.draft_segments(out.hidden[:-1], ids[1:], [n - 1],
                                           zero_states(model, 1, draft=True), capture=[(0, k)])
    x2, states2, _ = model.draft_segments(out.hidden[k:-1], ids[k + 1:], [n - 1 - k],
                                          captured[(0, k)])
    assert max_diff(x2, x1[k:]) < 1e-5
    for a, b in zip(states2.conv + states2.ssm, states.conv + states.ssm, strict=True):
        assert max_diff(a, b) < 1e-5


# ---- persistence -------------------------------------------------------------------------------
@torch.no_grad()
def test_save_load_round_trip(model, tmp_path):
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert loaded.cfg == model.cfg
    ids = random_ids(25, model.cfg.vocab_size, 5)[None]
    a_logits, a_draft = model.forward_train(ids)
    b_logits, b_draft = loaded.forward_train(ids)
    assert torch.equal(a_logits, b_logits)
    assert torch.equal(a_draft, b_draft)


def test_load_model_without_config_names_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(tmp_path)


def test_unknown_family_refused():
    with pytest.raises(ValueError, match="family"):
        HybridConfig(family="rwkv")


# ---- shipped models ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=SHIPPED)
def shipped(request):
    path = MODELS_DIR / request.param
    return load_model(path), TextTokenizer(path)


def test_shipped_model_loads(shipped):
    model, tok = shipped
    assert model.cfg.family in FAMILIES
    assert model.mtp is not None
    assert tok.eos_token_id == model.cfg.eos_token_id
    assert tok.vocab_size <= model.cfg.vocab_size


def test_shipped_tokenizer_round_trips_demo_prompts(shipped, demo_prompts):
    model, tok = shipped
    assert demo_prompts
    for text in demo_prompts:
        ids = tok.encode(text)
        assert ids and max(ids) < model.cfg.vocab_size
        assert tok.decode(ids) == text


@torch.no_grad()
def test_shipped_model_predictions_are_peaked(shipped, demo_prompts):
    model, tok = shipped
    encoded = [tok.encode(text) for text in demo_prompts]
    width = max(len(e) for e in encoded)
    # one batch, right-padded: a causal model's outputs at real positions ignore the padding
    ids = torch.full((len(encoded), width), model.cfg.pad_token_id)
    mask = torch.zeros(len(encoded), width, dtype=torch.bool)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = True
    logits, _ = model.forward_train(ids)
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    mean_entropy = float(entropy[mask].mean())
    assert mean_entropy < 0.5 * math.log(model.cfg.vocab_size), mean_entropy


def test_the_model_runs_here_with_the_torch_threads_of_an_engine_process():
    """The in-process model tests compute as an engine process does: with its torch threads
    (``EVALSVC_ENGINE_THREADS``, default 1; tests/conftest.py sets them), whatever torch's
    default for this machine's cores."""
    from evalsvc.engines.embedded.server import engine_threads

    assert torch.get_num_threads() == engine_threads()
