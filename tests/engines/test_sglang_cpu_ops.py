"""The reference ops real SGLang serves its gated-deltanet layers with on any CPU
(``evalsvc.engines.sglang_cpu_ops``), each against a plain loop written here from the ops'
definitions, in SGLang's own layouts: pooled states by slot index, the SSM state ``[HV, V, K]`` as
SGLang allocates it (``o = S q``, ``S <- S + beta (v - S k) k^T``, the GPU kernels' convention),
conv states ``[dim, width - 1]``. And the properties that make a prefix hit right: an extend split
in two, from the state the first part left, computes what one pass does, a short extend included.

Against the kernel ops themselves (in the SGLang CPU environment): test_sglang_cpu_server.py."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from evalsvc.engines import sglang_cpu_ops as ops

torch.manual_seed(0)
DIM, WIDTH, HK, HV, DK, DV = 16, 4, 2, 4, 8, 12  # K != V: the pool layout matters


def conv_loop(x, weight, bias, state, silu=True):
    """Causal depthwise conv token by token: out[:, t] = sum_j w[:, j] * window[:, t + j]."""
    window = torch.cat([state.float(), x.float()], dim=1)
    out = torch.empty(x.shape, dtype=torch.float32)
    for t in range(x.shape[1]):
        y = (weight.float() * window[:, t:t + WIDTH]).sum(1) + bias.float()
        out[:, t] = F.silu(y) if silu else y
    return out, window[:, -(WIDTH - 1):]


def delta_rule_loop(q, k, v, g, beta, state):
    """Per token and head: S <- exp(g) S; S <- S + beta (v - S k) k^T; o = S (q / sqrt(K)), with q
    and k l2-normalized, key head h // (HV / HK) for value head h; state [HV, V, K]."""
    state = state.clone().float()
    out = torch.empty(q.shape[0], HV, DV)
    for t in range(q.shape[0]):
        for h in range(HV):
            kh = k[t, h // (HV // HK)].float()
            qh = q[t, h // (HV // HK)].float()
            kh = kh / torch.sqrt((kh * kh).sum() + 1e-6)
            qh = qh / torch.sqrt((qh * qh).sum() + 1e-6)
            s = state[h] * torch.exp(g[t, h])
            s = s + beta[t, h] * torch.outer(v[t, h].float() - s @ kh, kh)
            state[h] = s
            out[t, h] = s @ (qh * DK ** -0.5)
    return out, state


def test_the_conv_forward_from_pooled_states_is_the_token_loop():
    slots, initial = [4, 1, 3], [True, True, False]  # 5, 2 and 9 tokens
    cu = torch.tensor([0, 5, 7, 16], dtype=torch.int32)
    x, w, b = torch.randn(DIM, 16), torch.randn(DIM, WIDTH), torch.randn(DIM)
    pool = torch.randn(6, DIM, WIDTH - 1)
    start = pool.clone()
    out = ops.causal_conv1d_fwd_cpu(x, w, b, pool, cu, torch.tensor(slots, dtype=torch.int32),
                                    torch.tensor(initial), True, -1, False)
    for i, slot in enumerate(slots):
        s, e = cu[i].item(), cu[i + 1].item()
        head = start[slot] if initial[i] else torch.zeros(DIM, WIDTH - 1)
        want, state = conv_loop(x[:, s:e], w, b, head)
        torch.testing.assert_close(out[:, s:e], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], state)  # a 2-token extend keeps an old input
    for other in (0, 2, 5):
        assert torch.equal(pool[other], start[other])


def test_a_padded_conv_row_is_left_alone():
    pool = torch.randn(3, DIM, WIDTH - 1)
    start = pool.clone()
    ops.causal_conv1d_fwd_cpu(torch.randn(DIM, 4), torch.randn(DIM, WIDTH), None, pool,
                              torch.tensor([0, 4], dtype=torch.int32),
                              torch.tensor([-1], dtype=torch.int32), torch.tensor([True]), True,
                              -1, False)
    assert torch.equal(pool, start)


@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_a_conv_extend_split_anywhere_computes_what_one_pass_does(cut):
    """What the kernel's varlen path gets wrong (upstream PR #29068): the rest of a sequence,
    started from the conv state its prefix left, equals the one-pass conv at every position."""
    x, w, b = torch.randn(DIM, 12), torch.randn(DIM, WIDTH), torch.randn(DIM)
    one = torch.zeros(1, DIM, WIDTH - 1)
    whole = ops.causal_conv1d_fwd_cpu(x, w, b, one, torch.tensor([0, 12], dtype=torch.int32),
                                      torch.tensor([0], dtype=torch.int32), torch.tensor([False]),
                                      True, -1, False)
    pool = torch.zeros(1, DIM, WIDTH - 1)
    parts = []
    for s, e, initial in ((0, cut, False), (cut, 12, True)):
        parts.append(ops.causal_conv1d_fwd_cpu(
            x[:, s:e].contiguous(), w, b, pool, torch.tensor([0, e - s], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), torch.tensor([initial]), True, -1, False))
    torch.testing.assert_close(torch.cat(parts, dim=1), whole)
    torch.testing.assert_close(pool, one)


def test_the_batched_conv_layout_is_the_varlen_conv_per_sequence():
    """Without query_start_loc (``[B, dim, L]``, as SGLang's prefill conv calls it per request on a
    one-slot view of the pool with the fix pr29068-cpu-conv-varlen-state): each sequence is the
    varlen conv of it alone, from its own slot's state, in the input's memory layout."""
    x = torch.randn(2, 5, DIM).transpose(1, 2)  # [B, dim, L], transposed memory as the kernel's
    w, b = torch.randn(DIM, WIDTH), torch.randn(DIM)
    pool = torch.randn(4, DIM, WIDTH - 1)
    start, varlen = pool.clone(), pool.clone()
    slots, initial = torch.tensor([3, 1], dtype=torch.int32), torch.tensor([True, False])
    out = ops.causal_conv1d_fwd_cpu(x, w, b, pool, None, slots, initial, True, -1, False)
    assert out.shape == x.shape and out.stride() == x.stride()
    want = ops.causal_conv1d_fwd_cpu(torch.cat(list(x), dim=1), w, b, varlen,
                                     torch.tensor([0, 5, 10], dtype=torch.int32), slots, initial,
                                     True, -1, False)
    torch.testing.assert_close(torch.cat(list(out), dim=1), want)
    torch.testing.assert_close(pool, varlen)
    assert torch.equal(pool[[0, 2]], start[[0, 2]]) and not torch.equal(pool[3], start[3])
    view = start[3:4].clone()  # the one-slot view: index 0
    one = ops.causal_conv1d_fwd_cpu(x[:1], w, b, view, None, torch.tensor([0], dtype=torch.int32),
                                    initial[:1], True, -1, False)
    torch.testing.assert_close(one[0], out[0])
    torch.testing.assert_close(view[0], pool[3])


def test_the_conv_update_is_one_step_of_the_forward():
    w, b = torch.randn(DIM, WIDTH), torch.randn(DIM)
    pool = torch.randn(5, DIM, WIDTH - 1)
    start = pool.clone()
    x = torch.randn(3, DIM)
    slots = torch.tensor([2, -1, 4], dtype=torch.int32)
    out = ops.causal_conv1d_update_cpu(x, pool, w, b, True, None, slots, -1, False)
    for row, slot in ((0, 2), (2, 4)):
        want, state = conv_loop(x[row][:, None], w, b, start[slot])
        torch.testing.assert_close(out[row], want[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], state)
    assert torch.equal(out[1], torch.zeros(DIM))  # the padded row
    for other in (0, 1, 3):
        assert torch.equal(pool[other], start[other])


def _gdn_inputs(length):
    q, k = torch.randn(1, length, HK, DK), torch.randn(1, length, HK, DK)
    v = torch.randn(1, length, HV, DV)
    g, beta = -torch.rand(1, length, HV), torch.rand(1, length, HV)
    return q, k, v, g, beta


def test_the_chunked_delta_rule_is_the_token_loop_from_and_into_the_pool():
    slots = [2, 0, 3]  # 3, 150 (past two chunks of 64) and 1 tokens
    cu = torch.tensor([0, 3, 153, 154], dtype=torch.int32)
    q, k, v, g, beta = _gdn_inputs(154)
    pool = torch.randn(5, HV, DV, DK) * 0.1
    start = pool.clone()
    out, finals = ops.chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, True, cu, False, True,
                                                 torch.tensor(slots, dtype=torch.int32))
    assert out.shape == v.shape and finals.shape == (3, HV, DV, DK)
    for i, slot in enumerate(slots):
        s, e = cu[i].item(), cu[i + 1].item()
        want, state = delta_rule_loop(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e], beta[0, s:e],
                                      start[slot])
        torch.testing.assert_close(out[0, s:e], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slot], state, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(finals[i], state, rtol=1e-4, atol=1e-4)
    for other in (1, 4):
        assert torch.equal(pool[other], start[other])
    # 0.5.13's CPU branch passes the sequences' states gathered, without indices, and writes the
    # final states back itself: the same outputs and finals
    gathered = start[slots].clone()
    out2, finals2, h = ops.chunk_gated_delta_rule_with_h(q, k, v, g, beta, gathered, cu,
                                                         use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(finals2, finals)
    assert h.shape == (1, 1 + 3 + 1, HV, DV, DK)  # a state per 64-token chunk of each sequence


def test_an_extend_then_decode_steps_compute_what_one_extend_does():
    """A prefix hit's path: an extend into the pool, then fused decode steps from it, equal one
    extend over all the tokens, output by output and in the state left."""
    n, steps = 40, 3
    q, k, v, g, beta = _gdn_inputs(n + steps)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    a, b = torch.randn(n + steps, HV), torch.randn(n + steps, HV)
    g = (-A_log.exp() * F.softplus(a + dt_bias))[None]
    beta = torch.sigmoid(b)[None]
    one = torch.zeros(1, HV, DV, DK)
    whole, _ = ops.chunk_gated_delta_rule_cpu(q, k, v, g, beta, one, True,
                                              torch.tensor([0, n + steps], dtype=torch.int32),
                                              False, True, torch.tensor([0], dtype=torch.int32))
    pool = torch.zeros(1, HV, DV, DK)
    first, _ = ops.chunk_gated_delta_rule_cpu(q[:, :n], k[:, :n], v[:, :n], g[:, :n],
                                              beta[:, :n], pool, True,
                                              torch.tensor([0, n], dtype=torch.int32), False,
                                              True, torch.tensor([0], dtype=torch.int32))
    torch.testing.assert_close(first, whole[:, :n], rtol=1e-4, atol=1e-4)
    for t in range(n, n + steps):
        out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log, dt_bias, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[t:t + 1], b[t:t + 1],
            pool, torch.tensor([0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            True)
        assert out.shape == (1, 1, HV, DV)  # [T, 1, HV, V], as the kernel returns it
        torch.testing.assert_close(out[0, 0], whole[0, t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool, one, rtol=1e-4, atol=1e-4)


def test_decode_rows_each_take_their_own_slot_and_padded_rows_are_skipped():
    q, k, v, _, _ = _gdn_inputs(3)
    a, b = torch.randn(3, HV), torch.randn(3, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    pool = torch.randn(4, HV, DV, DK) * 0.1
    start = pool.clone()
    slots = [3, -1, 0]
    out = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q, k, v, a, b, pool, torch.tensor(slots, dtype=torch.int32),
        torch.arange(4, dtype=torch.int32), True)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    for row, slot in ((0, 3), (2, 0)):
        want, state = delta_rule_loop(q[0, row:row + 1], k[0, row:row + 1], v[0, row:row + 1],
                                      g[row:row + 1], torch.sigmoid(b[row:row + 1]), start[slot])
        torch.testing.assert_close(out[row, 0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], state, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros(1, HV, DV))
    for other in (1, 2):
        assert torch.equal(pool[other], start[other])


def test_the_gates_norm_and_shared_expert_gate_follow_their_formulas():
    a, b = torch.randn(7, HV).bfloat16(), torch.randn(7, HV).bfloat16()
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    g, beta = ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    assert g.shape == beta.shape == (1, 7, HV) and g.dtype == torch.float32
    assert beta.dtype == torch.bfloat16
    torch.testing.assert_close(g[0], -A_log.exp() * torch.log1p((a.float() + dt_bias).exp()))
    torch.testing.assert_close(beta[0], torch.sigmoid(b.float()).bfloat16())
    x, z, w = torch.randn(5, DK), torch.randn(5, DK), torch.randn(DK)
    rms = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(ops.fused_rmsnorm_gated_cpu(x, w, z, 1e-6),
                               rms * w * z * torch.sigmoid(z))
    h, gate_w, shared = torch.randn(5, DIM), torch.randn(DIM), torch.randn(5, DIM)
    final = torch.randn(5, DIM)
    want = final + torch.sigmoid(h @ gate_w)[:, None] * shared
    ops.fused_gate_sigmoid_mul_add(h, gate_w, shared, final)
    torch.testing.assert_close(final, want)


def test_the_reference_ops_keep_the_kernels_schemas():
    """Each replaces a kernel op of the same name, so each takes the kernel schema's arguments
    (``sgl_kernel``'s torch_extension_cpu.cpp, as SGLang 0.5.17 calls them) by position."""
    import inspect

    schemas = {  # the kernel's argument names, in order
        "causal_conv1d_fwd_cpu": ["x", "weight", "bias", "conv_states", "query_start_loc",
                                  "cache_indices", "has_initial_state", "silu_activation",
                                  "pad_slot_id", "is_vnni"],
        "causal_conv1d_update_cpu": ["x", "conv_states", "weight", "bias", "silu_activation",
                                     "cache_seqlens", "conv_state_indices", "pad_slot_id",
                                     "is_vnni"],
        "fused_gdn_gating_cpu": ["A_log", "a", "b", "dt_bias"],
        "chunk_gated_delta_rule_cpu": ["query", "key", "value", "g", "beta", "initial_state",
                                       "output_final_state", "cu_seqlens", "head_first",
                                       "use_qk_l2norm_in_kernel", "initial_state_indices", "eps"],
        "fused_sigmoid_gating_delta_rule_update_cpu": [
            "A_log", "dt_bias", "q", "k", "v", "a", "b", "initial_state_source",
            "initial_state_indices", "cu_seqlens", "use_qk_l2norm_in_kernel", "softplus_beta",
            "softplus_threshold"],
        "fused_rmsnorm_gated_cpu": ["input", "weight", "gate", "eps"],
    }
    assert set(ops.OPS) == set(schemas)
    for name, fn in ops.OPS.items():
        assert list(inspect.signature(fn).parameters) == schemas[name], name


# ---- target verify (MTP): the Triton kernels' extra arguments, on the CPU ----------------------

def test_the_verify_conv_is_the_conv_of_each_draft_prefix_and_keeps_every_window():
    """A draft chain of L tokens: token t's output and window are those of the conv over the
    state and tokens 0..t; the windows go to the intermediate buffer by the row's index there,
    and the conv state takes the last width - 1 inputs, as the Triton kernel leaves them."""
    w, b = torch.randn(DIM, WIDTH), torch.randn(DIM)
    pool = torch.randn(4, DIM, WIDTH - 1)
    start = pool.clone()
    length = 3
    x = torch.randn(2, DIM, length)
    windows = torch.zeros(3, length, DIM, WIDTH - 1)
    out = ops.causal_conv1d_update_verify(
        x, pool, w, b, True, conv_state_indices=torch.tensor([3, 1]),
        intermediate_conv_window=windows, intermediate_state_indices=torch.tensor([0, 2]))
    for row, (slot, cache) in enumerate(((3, 0), (1, 2))):
        want, state = conv_loop(x[row], w, b, start[slot])
        torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[slot], state)
        for t in range(length):
            _, after = conv_loop(x[row, :, :t + 1], w, b, start[slot])
            torch.testing.assert_close(windows[cache, t], after)
    assert torch.equal(windows[1], torch.zeros(length, DIM, WIDTH - 1))
    for other in (0, 2):
        assert torch.equal(pool[other], start[other])


def test_the_verify_conv_of_a_draft_tree_follows_each_tokens_ancestors():
    """EAGLE's tree (topk 2): root 0, children 1 and 2, and 3 a child of 2. Token 3's window is
    the state's last input, then tokens 0, 2, 3; the parents are written back as the kernel
    writes them."""
    w, b = torch.randn(DIM, WIDTH), torch.randn(DIM)
    pool = torch.randn(1, DIM, WIDTH - 1)
    start = pool.clone()
    x = torch.randn(1, DIM, 4)
    next_token = torch.tensor([[1, -1, 3, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1]])
    parents = torch.full((1, 4), 9)
    windows = torch.zeros(1, 4, DIM, WIDTH - 1)
    out = ops.causal_conv1d_update_verify(
        x, pool, w, b, True, conv_state_indices=torch.tensor([0]),
        intermediate_conv_window=windows, intermediate_state_indices=torch.tensor([0]),
        retrieve_next_token=next_token, retrieve_next_sibling=next_sibling,
        retrieve_parent_token=parents)
    assert parents.tolist() == [[0, 0, 0, 2]]
    path = torch.stack([x[0, :, 0], x[0, :, 2], x[0, :, 3]], dim=1)
    want, after = conv_loop(path, w, b, start[0])
    torch.testing.assert_close(out[0, :, 3], want[:, 2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(windows[0, 3], after)
    want1, _ = conv_loop(x[0, :, :2][:, [0, 1]], w, b, start[0])
    torch.testing.assert_close(out[0, :, 1], want1[:, 1], rtol=1e-5, atol=1e-5)


def test_the_verify_delta_rule_keeps_each_draft_state_and_leaves_the_pool():
    """Each draft token's state is the token loop's after it, written to the intermediate buffer;
    with ``disable_state_update`` (as verify calls it) the pool keeps the state it had."""
    length = 3
    q, k, v, _, _ = _gdn_inputs(2 * length)
    a, b = torch.randn(2 * length, HV), torch.randn(2 * length, HV)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV)
    pool = torch.randn(4, HV, DV, DK) * 0.1
    start = pool.clone()
    states = torch.zeros(2, length, HV, DV, DK)
    out = ops.gated_delta_rule_verify(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool,
        initial_state_indices=torch.tensor([2, 0]), cu_seqlens=torch.tensor([0, length,
                                                                               2 * length]),
        use_qk_l2norm_in_kernel=True, is_kda=False, disable_state_update=True,
        intermediate_states_buffer=states, intermediate_state_indices=torch.tensor([1, 0]),
        cache_steps=length)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    for row, (slot, cache) in enumerate(((2, 1), (0, 0))):
        s = row * length
        want, _ = delta_rule_loop(q[0, s:s + length], k[0, s:s + length], v[0, s:s + length],
                                  g[s:s + length], torch.sigmoid(b[s:s + length]), start[slot])
        torch.testing.assert_close(out[s:s + length, 0], want, rtol=1e-5, atol=1e-5)
        for t in range(length):
            _, after = delta_rule_loop(q[0, s:s + t + 1], k[0, s:s + t + 1], v[0, s:s + t + 1],
                                       g[s:s + t + 1], torch.sigmoid(b[s:s + t + 1]), start[slot])
            torch.testing.assert_close(states[cache, t], after, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, start)


def test_the_verify_bindings_send_only_verify_calls_to_the_verify_ops():
    """SGLang's GDN backend binds one name for decode and verify: decode calls keep the op bound
    before (the kernel's or a reference op), verify calls take the verify op."""
    seen = []
    wrapped = ops.HOST_ATTRS["sglang.srt.layers.attention.linear.kernels.gdn_triton"][
        "fused_sigmoid_gating_delta_rule_update"].factory(lambda **kw: seen.append(sorted(kw)))
    wrapped(A_log=1, is_kda=False)
    assert seen == [["A_log"]]  # the Triton-only flag at its default is not passed on
    with pytest.raises(NotImplementedError, match="is_kda"):
        wrapped(A_log=1, is_kda=True)
    conv = ops.HOST_ATTRS["sglang.srt.layers.attention.linear.gdn_backend"][
        "causal_conv1d_update"].factory(lambda *a, **kw: "bound")
    assert conv(1, 2, conv_state_indices=3) == "bound"


def test_the_accepted_step_is_scattered_into_each_requests_slot():
    dst = torch.zeros(2, 5, 3)  # [layers, slots, state]
    src = torch.randn(2, 3, 4, 3)  # [layers, requests, steps, state]
    ops.state_scatter_with_mask(dst, src, torch.tensor([4, 1, 2]), torch.tensor([2, -1, 0]))
    torch.testing.assert_close(dst[:, 4], src[:, 0, 2])
    torch.testing.assert_close(dst[:, 2], src[:, 2, 0])
    assert torch.equal(dst[:, [0, 1, 3]], torch.zeros(2, 3, 3))  # request 1 rejected all
    # 0.5.23's scratch rows: request i's states are in row src_indices_raw[i]
    dst.zero_()
    ops.state_scatter_with_mask(dst, src, torch.tensor([4, 1]), torch.tensor([2, 1]),
                                torch.tensor([2, 0]))
    torch.testing.assert_close(dst[:, 4], src[:, 2, 2])
    torch.testing.assert_close(dst[:, 1], src[:, 0, 1])
    with pytest.raises(ValueError, match="length mismatch"):
        ops.state_scatter_with_mask(dst, src, torch.tensor([4]), torch.tensor([2]),
                                    torch.tensor([0, 1]))


def test_the_multi_pair_conv_scatter_commits_the_accepted_steps_and_the_track_slots():
    pairs = [(torch.zeros(2, 6, 3, 4), torch.randn(2, 2, 3, 3, 4)),  # [layers, slots, dim, win]
             (torch.zeros(2, 6, 5, 2), torch.randn(2, 2, 3, 5, 2))]  # and [layers, req, step, ...]
    ops.conv_window_scatter_multi(pairs, torch.tensor([1, 3]), torch.tensor([2, -1]),
                                  torch.tensor([5, 0]), torch.tensor([0, 1]))
    for dst, src in pairs:
        torch.testing.assert_close(dst[:, 1], src[:, 0, 2])  # accepted step 2 of request 0
        torch.testing.assert_close(dst[:, 5], src[:, 0, 0])  # request 0's track slot, step 0
        torch.testing.assert_close(dst[:, 0], src[:, 1, 1])  # request 1's track slot, step 1
        assert not dst[:, [2, 3, 4]].any()  # request 1 rejected every draft: its slot untouched
    before = [dst.clone() for dst, _ in pairs]
    ops.conv_window_scatter_multi(pairs, torch.tensor([2]), torch.tensor([1]))  # no track set
    for (dst, src), old in zip(pairs, before, strict=True):
        torch.testing.assert_close(dst[:, 2], src[:, 0, 1])
        assert torch.equal(dst[:, [0, 1, 3, 4, 5]], old[:, [0, 1, 3, 4, 5]])


HOST_EDITED = {  # module -> the one function each edit may change
    "sglang.srt.mem_cache.memory_pool": ("MambaPool", "__init__"),
    "sglang.srt.models.qwen3_next": (None, "set_embed_and_head"),
    "sglang.srt.speculative.draft_utils": ("DraftBackendFactory", "create_draft_extend_backend"),
    "sglang.srt.arg_groups.mamba_hook": (None, "validate_mamba_extra_buffer"),  # 0.5.19 on
    "sglang.srt.server_args": ("ServerArgs", "_validate_mamba_extra_buffer"),
}


def _functions(tree):
    return {(cls.name if cls else None, f.name, f.lineno): ast.dump(f)
            for cls in [None, *(c for c in ast.walk(tree) if isinstance(c, ast.ClassDef))]
            for f in (cls.body if cls else tree.body) if isinstance(f, ast.FunctionDef)}


def test_the_host_adapters_edit_only_the_functions_they_list(sglang_python):
    """The source edits change the listed function of each listed module and nothing else of
    SGLang's serving logic: every other function of the module parses the same. Run on the
    release of the SGLang CPU environment."""
    assert set(ops.SOURCE_EDITS) == set(HOST_EDITED)
    root = Path(subprocess.run(
        [str(sglang_python), "-c", "import importlib.util; "
         "print(importlib.util.find_spec('sglang').origin)"],
        capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]},
    ).stdout.strip()).parent
    for name, (cls, function) in HOST_EDITED.items():
        path = (root / Path(*name.split(".")[1:])).with_suffix(".py")
        if name == "sglang.srt.arg_groups.mamba_hook" and not path.exists():
            continue  # a later release's module
        source = path.read_text()
        edited, count = ops.edited_source(name, source)
        assert count >= 1, name
        before, after = _functions(ast.parse(source)), _functions(ast.parse(edited))
        assert before.keys() == after.keys()
        changed = {key[:2] for key in before if before[key] != after[key]}
        assert changed and all(f == function and cls in (None, c) for c, f in changed), \
            (name, changed)
        # idempotent: an edited module has nothing left to edit
        assert ops.edited_source(name, edited)[1] == 0, name


@pytest.mark.parametrize("test", [
    "is_cuda() or is_musa() or is_npu()",  # ServerArgs, 0.5.12.post1 to 0.5.17
    "get_platform().is_cuda or get_platform().is_npu",  # mamba_hook, 0.5.19 to 0.5.22
    "_platform_supports_mamba_cache_extra_buffer()"])  # mamba_hook, 0.5.23
def test_the_extra_buffers_platform_assertion_admits_the_reference_ops(test):
    source = (f"def validate(view):\n    assert supports(view), 'extra_buffer is not supported'\n"
              f"    assert {test}, 'extra_buffer needs CUDA (FLA)'\n    assert {test}, 'other'\n")
    for module in ("sglang.srt.server_args", "sglang.srt.arg_groups.mamba_hook"):
        edited, count = ops.edited_source(module, source)
        assert count == 1, module  # the platform assertion naming extra_buffer, only
        assert f"assert {test} or {ops.REFERENCE_OPS}(), 'extra_buffer needs" in edited
        assert ops.edited_source(module, edited)[1] == 0


DRAFT_UTILS = """
class DraftBackendFactory:
    def _create_backend(self, backend_map):
        {unpack} = backend_map["torch_native"]()
        return backend

    def create_draft_extend_backend(self):
        backend_map = {{
            "triton": self._create_triton_prefill_backend,
        }}
        return self._create_backend(backend_map)

    def _create_triton_prefill_backend(self):
        return {made}
"""


@pytest.mark.parametrize("unpack, made", [("backend", "'triton backend'"),
                                          ("stamp, backend", "('triton', 'triton backend')")])
def test_the_draft_extend_entry_follows_the_releases_convention(unpack, made):
    """0.5.17's backend entries return the backend, 0.5.19's its name with it: the torch entry
    the edit adds is built as the release builds its own, and the factory returns the backend."""
    source = DRAFT_UTILS.format(unpack=unpack, made=made)
    edited, count = ops.edited_source("sglang.srt.speculative.draft_utils", source)
    assert count == 1
    scope = {ops.TORCH_NATIVE_DRAFT: lambda runner: ("torch backend for", runner)}
    exec(compile(edited, "draft_utils", "exec"), scope)
    factory = scope["DraftBackendFactory"]()
    factory.draft_model_runner = "draft runner"
    assert factory.create_draft_extend_backend() == ("torch backend for", "draft runner")


def test_the_overlap_schedulers_speculative_extras_are_gathered_by_row():
    idx = torch.tensor([2, 0])
    p, i, t, h = torch.randn(3, 4), torch.arange(12).view(3, 4), torch.tensor([7, 8, 9]), None
    got = ops.gather_spec_extras(idx, p, i, t, h)
    assert torch.equal(got[0], p[[2, 0]]) and torch.equal(got[1], i[[2, 0]])
    assert got[2].tolist() == [9, 7] and got[3] is None
    hidden = torch.randn(3, 5)
    assert torch.equal(ops.gather_spec_extras(idx, p, i, t, hidden)[3], hidden[[2, 0]])


def test_the_multi_layer_drafts_ids_move_left_and_take_the_new_token_last():
    """rotate_input_ids, as the Triton kernel writes it: each request's ids (int32, as 0.5.19
    passes them) one to the left, its new token at its end, or at ``select_index``."""
    ids = torch.arange(100, 110, dtype=torch.int32)
    starts, lens = torch.tensor([0, 4, 7]), torch.tensor([4, 3, 3])
    ops.rotate_input_ids(ids, starts, lens, torch.tensor([[1], [2], [3]]))
    assert ids.dtype == torch.int32
    assert ids.tolist() == [101, 102, 103, 1, 105, 106, 2, 108, 109, 3]
    ids = torch.arange(100, 110)
    ops.rotate_input_ids(ids, starts, torch.tensor([4, 0, 3]), torch.tensor([1, 2, 3]),
                         select_index=torch.tensor([1, 5, 8]))
    assert ids.tolist() == [101, 1, 103, 103, 104, 105, 106, 108, 3, 109]


def test_the_interpreters_autotuner_takes_the_largest_blocks_untimed():
    """Under Triton's interpreter every config ties (nothing to time) and the first is taken: the
    configs come ordered by block size, largest first (fewest program instances)."""

    class Config:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class Autotuner:
        def __init__(self, configs):
            self.configs = configs

    init = ops.INTERPRETER_ATTRS["triton.runtime.autotuner"]["Autotuner.__init__"]
    tuner = Autotuner.__new__(Autotuner)
    init.factory(Autotuner.__init__)(tuner, [Config(BLOCK_T=1, BLOCK_D=128),
                                             Config(BLOCK_T=64, BLOCK_D=256, SPLIT=True),
                                             Config(BLOCK_T=128, BLOCK_D=64)])
    assert [c.kwargs["BLOCK_T"] for c in tuner.configs] == [64, 128, 1]
    bench = ops.INTERPRETER_ATTRS["triton.runtime.autotuner"]["Autotuner.do_bench"].fget(tuner)
    assert bench(lambda: 1 / 0, quantiles=(0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]


def test_record_stream_is_a_no_op_on_cpu_tensors_only():
    calls = []
    record = ops.cpu_record_stream(lambda tensor, stream: calls.append(stream))
    assert record(torch.zeros(2), "cpu stream") is None and calls == []

    class OnDevice:
        device = torch.device("meta")

    record(OnDevice(), "stream")
    assert calls == ["stream"]


def test_the_host_adapters_touch_only_the_listed_places():
    """SGLang's scheduler, caches, pools and speculative workers stay its own: the adapters bind
    ops and attention where SGLang binds them, and touch managers/, mem_cache/ and speculative/
    only where the README's list says."""
    touched = {f"{module}.{attr}" for module, attrs in
               [*ops.HOST_ATTRS.items(), *ops.MODULE_ATTRS.items(),
                *ops.INTERPRETER_ATTRS.items()] for attr in attrs}
    touched |= {f"{module}.{cls or '*'}.{fn}" for module, (cls, fn) in HOST_EDITED.items()}
    logic = sorted(t for t in touched if any(f".{part}." in t for part in
                                              ("managers", "mem_cache", "speculative")))
    assert logic == [
        # the multi-layer EAGLE draft's input rotation: a kernel op binding, not worker code
        "sglang.kernels.ops.speculative.multi_layer_eagle.rotate_input_ids_cpu",
        "sglang.srt.managers.overlap_utils.gather_spec_extras",
        "sglang.srt.mem_cache.memory_pool.MambaPool.__init__",
        "sglang.srt.mem_cache.memory_pool_host.transfer_kv_all_layer_direct_lf_pf",
        "sglang.srt.mem_cache.memory_pool_host.transfer_kv_direct",
        "sglang.srt.mem_cache.memory_pool_host.transfer_kv_per_layer_direct_pf_lf",
        "sglang.srt.mem_cache.pool_host.common._cuda_host_register",
        "sglang.srt.mem_cache.pool_host.common._cuda_host_unregister",
        "sglang.srt.mem_cache.pool_host.mha.transfer_kv_all_layer_direct_lf_pf",
        "sglang.srt.mem_cache.pool_host.mha.transfer_kv_direct",
        "sglang.srt.mem_cache.pool_host.mha.transfer_kv_per_layer_direct_pf_lf",
        "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend",
    ]
    # one finder per module: a module both edited and bound would lose one of the two
    assert not set(ops.SOURCE_EDITS) & (set(ops.HOST_ATTRS) | set(ops.MODULE_ATTRS))


def test_the_extend_keeps_the_state_at_each_chunk_start_for_the_extra_buffer():
    """FLA's ``h``: per sequence, the state before each 64-token chunk, sequences back to back,
    in the pool's layout; the outputs and pool writes are the reference op's."""
    cu = torch.tensor([0, 150, 214], dtype=torch.int32)  # 3 chunks, then exactly one
    q, k, v, g, beta = _gdn_inputs(214)
    pool = torch.randn(3, HV, DV, DK) * 0.1
    start = pool.clone()
    slots = torch.tensor([2, 0], dtype=torch.int32)
    other = pool.clone()
    want, _ = ops.chunk_gated_delta_rule_cpu(q, k, v, g, beta, other, True, cu, False, True,
                                             slots)
    out, finals, h = ops.chunk_gated_delta_rule_with_h(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu, head_first=False,
        use_qk_l2norm_in_kernel=True, initial_state_indices=slots)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(pool, other)
    assert h.shape == (1, 4, HV, DV, DK) and finals.shape == (2, HV, DV, DK)
    for i, (slot, chunk) in enumerate([(2, 0), (2, 1), (2, 2), (0, 0)]):
        s = 0 if slot == 2 else 150
        _, state = delta_rule_loop(q[0, s:s + 64 * chunk], k[0, s:s + 64 * chunk],
                                   v[0, s:s + 64 * chunk], g[0, s:s + 64 * chunk],
                                   beta[0, s:s + 64 * chunk], start[slot])
        torch.testing.assert_close(h[0, i], state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("all_layers", [False, True])
def test_decode_tracking_copies_the_masked_rows_states_to_their_track_slots(all_layers):
    conv, ssm = torch.randn(2, 6, DIM, WIDTH - 1), torch.randn(2, 6, HV, DV, DK)
    if not all_layers:
        conv, ssm = conv[0], ssm[0]
    before = (conv.clone(), ssm.clone())
    track = ops.track_states_all_layers if all_layers else ops.track_states
    track(conv, ssm, torch.tensor([1, 2, -1]), torch.tensor([True, False, True]),
          torch.tensor([4, 5, 3]), 3, check_freed_slots=True)
    at = (lambda t, i: t[:, i]) if all_layers else (lambda t, i: t[i])
    for new, old in zip((conv, ssm), before, strict=True):
        assert torch.equal(at(new, 4), at(old, 1))  # row 0: tracked
        assert torch.equal(at(new, 5), at(old, 5))  # row 1: not masked
        assert torch.equal(at(new, 3), at(old, 3))  # row 2: a freed slot, skipped


def test_pinning_is_a_no_op_without_an_accelerator():
    pin = ops.cpu_pin_memory(lambda tensor: "pinned")
    t = torch.zeros(3)
    assert pin(t) is (t if not torch.cuda.is_available() else "pinned")
    if torch.cuda.is_available():
        return
    with pytest.raises(RuntimeError, match="pin_memory"):  # what SGLang's own call meets
        torch.tensor([1, 2], dtype=torch.int64, pin_memory=True)
    for name in ops.PINNING_FACTORIES:
        make = ops.unpinned(getattr(torch, name))
        args = ([1, 2],) if name == "tensor" else ((3,), 7) if name == "full" else (3,)
        made = make(*args, dtype=torch.int64, pin_memory=True)
        assert not made.is_pinned() and made.dtype == torch.int64
        assert torch.equal(made, getattr(torch, name)(*args, dtype=torch.int64)) or name == "empty"


def test_hicaches_direct_transfers_move_pages_between_the_tiers_layouts():
    """The direct io backend's copies: a layer-first device pool (``[token, ...]`` per layer)
    and a page-first host pool (``[page, layer, page_size, ...]``), page by page, both ways."""
    layers, page, heads = 3, 2, 4
    device = [torch.randn(10, heads) for _ in range(2 * layers)]  # keys' layers, then values'
    host = [torch.zeros(5, layers, page, heads) for _ in range(2)]
    src, dst = torch.tensor([4, 5, 8, 9]), torch.tensor([2, 3, 6, 7])  # tokens, page-aligned
    ops.transfer_kv_all_layer_direct_lf_pf(device, host, src, dst, page)
    for j in range(2):
        for layer in range(layers):
            assert torch.equal(host[j][1, layer], device[j * layers + layer][4:6])
            assert torch.equal(host[j][3, layer], device[j * layers + layer][8:10])
    assert torch.equal(host[0][0], torch.zeros(layers, page, heads))
    back = [torch.zeros(10, heads) for _ in range(2)]
    ops.transfer_kv_per_layer_direct_pf_lf(host, back, dst, torch.tensor([0, 1, 6, 7]), 1, page)
    assert torch.equal(back[1][0:2], device[layers + 1][4:6])
    assert torch.equal(back[0][6:8], device[1][8:10])
    rows = [torch.zeros(10, heads)]
    ops.transfer_kv_direct([device[0]], rows, torch.tensor([1, 3]), torch.tensor([0, 9]), 1)
    assert torch.equal(rows[0][[0, 9]], device[0][[1, 3]])


def test_host_registration_is_a_no_op_without_cuda():
    calls = []
    register = ops.host_register_on_cpu(lambda buffer: calls.append(buffer))
    register(torch.zeros(2))
    assert calls == ([] if not torch.cuda.is_available() else calls)
