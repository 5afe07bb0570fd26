"""The embedded engine's numerics (``--dtype``, ``--mamba-ssm-dtype``; model.py ``Numerics``).

float32 runs one recurrence and one attention for prefill and decode, so a hit equals a cold
recompute to float32 rounding (test_cache_paths.py). bfloat16 computes as a GPU engine: the chunked
forms for an extend, the recurrent step for decode and verify, split-KV decode attention whose split
count follows the batch size, and bf16 storage. Its kernels are checked exact in float32 here (the
same algebra as the recurrence), and its serving differences are checked to be the ones a GPU
engine has: a hit close to a cold recompute but not equal, decode depending on the batch, and
deterministic inference still bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from evalsvc.engines.embedded.memory import HostPool, KVPool, StatePool
from evalsvc.engines.embedded.model import (
    FLOAT32_PARAMS,
    Attention,
    Numerics,
    SegmentStates,
    chunk_gated_delta_rule,
    chunk_ssd,
    kv_splits,
    linear,
)

from .conftest import FAMILIES, request, token_prompts
from .test_model import ListKV, max_diff, random_ids, small_model, zero_states

GPU_FLOAT32 = Numerics(gpu_kernels=True)  # the GPU kernels' algebra, without bf16 rounding
BF16 = Numerics.from_args("bfloat16", "float32")


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_a_bf16_gemm_is_exact_products_and_a_float32_accumulator_rounded_once(rows):
    """``linear`` in bf16, whichever GEMM runs it on this CPU (torch's own where the CPU has bf16
    instructions, a float32 GEMM of the same values elsewhere): the float32 GEMM of the bf16
    values (the products exact, one float32 accumulator), rounded to bf16 once; only the
    summation order may differ, which moves a rare output by one unit in the last place. Torch's
    own bf16 GEMM agrees the same way. In float32 it is torch's GEMM."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g).bfloat16()
    w = torch.randn(512, 256, generator=g).bfloat16()
    exact = torch.nn.functional.linear(x.double(), w.double())
    out = linear(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 512)
    for got in (out, torch.nn.functional.linear(x, w)):
        off = got.double() != exact.bfloat16().double()
        assert off.float().mean() < 2e-3
        ulp = exact.abs().clamp_min(1e-30).log2().floor().exp2() * 2.0 ** -7
        assert ((got.double() - exact).abs()[off] <= 1.01 * ulp[off]).all()
    assert torch.equal(linear(x.float(), w.float()), torch.nn.functional.linear(x.float(), w.float()))


def test_numerics_from_the_flags():
    assert Numerics.from_args("auto", "float32") == Numerics()
    assert not Numerics.from_args("float32", "bfloat16").gpu_kernels
    bf16 = Numerics.from_args("bfloat16", "bfloat16")
    assert bf16.gpu_kernels and bf16.dtype == bf16.ssm_dtype == torch.bfloat16


def test_kv_splits_fall_with_the_batch_size():
    assert [kv_splits(b) for b in (1, 2, 4, 8, 64)] == [8, 4, 2, 1, 1]


# ---- the chunked forms from a state ----------------------------------------------------------
def recurrence_ssd(dtx, a, bm, cm, h):
    ys = []
    for t in range(dtx.shape[1]):
        h = h * torch.exp(a[:, t])[..., None, None] + dtx[:, t, :, :, None] * bm[:, t, None, None]
        ys.append((h * cm[:, t, None, None]).sum(-1))
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("length", [5, 64, 100])
def test_chunk_ssd_from_a_state_returns_the_state_after(length):
    g = torch.Generator().manual_seed(length)
    b, h, p, n = 2, 3, 4, 5
    dtx, bm, cm = (torch.randn(b, length, *s, generator=g) for s in ((h, p), (n,), (n,)))
    a = -torch.rand(b, length, h, generator=g)
    h0 = torch.randn(b, h, p, n, generator=g)
    y, h_end = chunk_ssd(dtx, a, bm, cm, 16, initial_state=h0.clone(), return_state=True)
    want_y, want_h = recurrence_ssd(dtx, a, bm, cm, h0)
    assert max_diff(y, want_y) < 1e-4 and max_diff(h_end, want_h) < 1e-4


def test_chunk_gated_delta_rule_returns_the_state_after():
    g = torch.Generator().manual_seed(3)
    q, k = (torch.nn.functional.normalize(torch.randn(1, 40, 2, 8, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(1, 40, 2, 8, generator=g)
    gate, beta = -torch.rand(1, 40, 2, generator=g), torch.rand(1, 40, 2, generator=g)
    s0 = torch.randn(1, 2, 8, 8, generator=g)
    whole, s_end = chunk_gated_delta_rule(q, k, v, gate, beta, 16, state=s0.clone(),
                                          return_state=True)
    first, s_mid = chunk_gated_delta_rule(q[:, :25], k[:, :25], v[:, :25], gate[:, :25],
                                          beta[:, :25], 16, state=s0.clone(), return_state=True)
    rest, s_end2 = chunk_gated_delta_rule(q[:, 25:], k[:, 25:], v[:, 25:], gate[:, 25:],
                                          beta[:, 25:], 16, state=s_mid, return_state=True)
    assert max_diff(torch.cat([first, rest], 1), whole) < 1e-4
    assert max_diff(s_end2, s_end) < 1e-4


# ---- the GPU kernels compute what the recurrence does ---------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("family", ["mamba2", "gated_deltanet"])
def test_gpu_kernels_in_float32_equal_the_recurrence(family):
    """An extend of two ragged segments from nonzero states, with states captured inside them,
    then a decode step of both: chunked forms and split-KV attention against the recurrence."""
    model = small_model(family)
    lengths = [150, 70]
    ids = torch.cat([random_ids(n, model.cfg.vocab_size, i) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    warm = run_one(model, random_ids(9, model.cfg.vocab_size, 7))  # a nonzero starting state
    start = SegmentStates.concat([warm.states, warm.states])
    capture = [(0, 64), (0, 100), (1, 33), (1, 70)]
    outs = {}
    for name, numerics in (("recurrent", Numerics()), ("gpu", GPU_FLOAT32)):
        model.numerics = numerics
        ext = model.forward_segments(ids, positions, lengths, ListKV([[], []], lengths), start,
                                     capture)
        past = [kv_prefix_of(ext, lengths, b) for b in range(2)]
        nxt = torch.tensor([5, 6])
        dec = model.forward_segments(nxt, torch.tensor(lengths), [1, 1], ListKV(past, [1, 1]),
                                     ext.states, mode="decode")
        outs[name] = (ext, dec)
    model.numerics = Numerics()
    (ext_r, dec_r), (ext_g, dec_g) = outs["recurrent"], outs["gpu"]
    assert max_diff(model.logits(ext_g.hidden), model.logits(ext_r.hidden)) < 1e-4
    assert max_diff(model.logits(dec_g.hidden), model.logits(dec_r.hidden)) < 1e-4
    for key in capture:
        for a, b in zip(ext_g.captured[key].conv + ext_g.captured[key].ssm,
                        ext_r.captured[key].conv + ext_r.captured[key].ssm, strict=True):
            assert max_diff(a, b) < 1e-4, key


def run_one(model, ids, states=None):
    n = len(ids)
    return model.forward_segments(ids, torch.arange(n), [n], ListKV([[]], [n]),
                                  states if states is not None else zero_states(model, 1))


def kv_prefix_of(out, lengths, b):
    start = sum(lengths[:b])
    return [(k[start: start + lengths[b]], v[start: start + lengths[b]])
            for k, v in zip(out.new_k, out.new_v, strict=True)]


def test_split_kv_decode_attention_equals_one_pass():
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 3, 50, 2, 16
    q = torch.randn(b, 1, h, d, generator=g)
    keys, vals = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g)
    past = [49, 20, 0]  # the valid keys: 0..past[b]; some splits of short rows hold none
    got = Attention.attend_decode(q, keys, vals, past)
    want = Attention.attend_batch(q, keys, vals, past)
    assert max_diff(got, want) < 1e-5


# ---- bf16: what a GPU engine's numbers look like ---------------------------------------------
@torch.no_grad()
def test_bf16_weights_states_and_pools():
    model = small_model("gated_deltanet").set_numerics(Numerics.from_args("bfloat16", "bfloat16"))
    for name, param in model.named_parameters():
        want = torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32_PARAMS else torch.bfloat16
        assert param.dtype == want, name
    kv, states = KVPool(model, 16), StatePool(model, 4, with_draft=True)
    assert kv.k[0].dtype == torch.bfloat16 and kv.bytes_per_token() == 2 * 2 * 2 * 2 * 16
    assert states.conv[0].dtype == states.ssm[0].dtype == states.draft_hidden.dtype == torch.bfloat16
    host = HostPool(kv, states, 8, 2)
    assert [t.dtype for t in host.state] == [t.dtype for t in states.target_tensors()
                                             + states.draft_tensors()]
    model.set_numerics(BF16)
    assert StatePool(model, 4, with_draft=False).ssm[0].dtype == torch.float32  # SGLang's default
    out = run_one(model, random_ids(20, model.cfg.vocab_size, 1), SegmentStates(
        [c.bfloat16() for c in zero_states(model, 1).conv], zero_states(model, 1).ssm))
    assert out.hidden.dtype == out.states.conv[0].dtype == torch.bfloat16
    assert out.states.ssm[0].dtype == torch.float32
    assert model.logits(out.hidden).dtype == torch.float32


def bf16_flags(model: str, *extra: str) -> list[str]:
    return ["--model-path", model, "--dtype", "bfloat16", "--random-seed", "0",
            "--disable-overlap-schedule", "--mamba-radix-cache-strategy", "no_buffer", *extra]


@pytest.mark.parametrize("model", FAMILIES)
def test_bf16_hit_is_close_to_a_cold_recompute_but_not_equal(model, demo_prompts,
                                                             engine_factory):
    """A prefix hit continues a chunked prefill from a cached state on another chunk grid than the
    cold prefill: close (bf16 noise), not bit-identical (float32 is, test_cache_paths.py)."""
    eng = engine_factory(bf16_flags(model, "--chunked-prefill-size", "-1"))
    prompts = token_prompts(eng.tok, demo_prompts)
    p, q = prompts[0], prompts[1][:80]
    eng.one(p[:100], "seed")
    hit = eng.one(p + q, "hit", logprob_start_len=len(p), max_new_tokens=8)
    eng.flush()
    cold = eng.one(p + q, "cold", logprob_start_len=len(p), max_new_tokens=8)
    assert hit.cached_tokens == 100 and cold.cached_tokens == 0
    a = torch.tensor(hit.input_logprobs + hit.output_logprobs)
    b = torch.tensor(cold.input_logprobs + cold.output_logprobs)
    assert 0 < max_diff(a, b) < 0.5
    assert float((a - b).abs().mean()) < 0.05


@pytest.mark.parametrize("model", FAMILIES)
def test_bf16_decode_depends_on_the_batch(model, demo_prompts, engine_factory):
    """Split-KV decode attention: requests decoded alone and in a batch of eight get other
    logprobs (their KV splits differ), close to each other. Partial sums are float32, so the
    bf16 output moves only where they round differently: some tokens, not every one."""
    eng = engine_factory(bf16_flags(model, "--disable-radix-cache"))
    prompts = [ids[:60] for ids in token_prompts(eng.tok, demo_prompts)[:8]]
    batch = eng.generate([request(f"b{i}", p, logprob_start_len=len(p), max_new_tokens=16)
                          for i, p in enumerate(prompts)])
    diffs = []
    for i, p in enumerate(prompts):
        alone = eng.one(p, f"alone{i}", logprob_start_len=len(p), max_new_tokens=16)
        n = next((t for t, (x, y) in enumerate(zip(alone.output_ids, batch[i].output_ids,
                                                    strict=True)) if x != y), 16)
        diffs.append(max_diff(torch.tensor(alone.output_logprobs[:n]),
                              torch.tensor(batch[i].output_logprobs[:n])) if n else 0.0)
    assert 0 < max(diffs) < 0.5, diffs


@pytest.mark.model  # one request and one token at a time: seconds per test
@pytest.mark.parametrize("model", FAMILIES)
def test_bf16_deterministic_inference_stays_bit_exact(model, demo_prompts, engine_factory):
    eng = engine_factory(bf16_flags(model, "--enable-deterministic-inference",
                                    "--mamba-ssm-dtype", "bfloat16", "--chunked-prefill-size",
                                    "64"))
    prompts = token_prompts(eng.tok, demo_prompts)
    p, q = prompts[0], prompts[1][:40]
    eng.one(p, "seed")
    hit = eng.one(p + q, "hit", logprob_start_len=len(p), max_new_tokens=6)
    eng.flush()
    cold = eng.one(p + q, "cold", logprob_start_len=len(p), max_new_tokens=6)
    assert hit.cached_tokens > 0
    assert hit.input_logprobs + hit.output_logprobs == cold.input_logprobs + cold.output_logprobs
