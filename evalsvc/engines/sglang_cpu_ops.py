"""Reference ops: SGLang's gated-deltanet CPU ops in plain torch, so that real SGLang serves a
hybrid GDN model (Qwen3-Next) on any x86-64 CPU.

This module runs inside SGLang's engine processes, never in the service: the SGLang CPU
environment (``evalsvc.builds.sglang_cpu``) carries a copy of it as ``evalsvc_sglang_cpu_ops`` and
its ``sitecustomize.py`` calls :func:`activate`, which applies the engine's ``EVALSVC_CPU_OPS``
(the matrix field ``cpu_ops``: ``reference``, the default, or ``kernel``). It imports nothing of
evalsvc.

On both paths, :func:`activate` also applies the *host adapters*: what SGLang's MTP and
extra-buffer paths call in CUDA or Triton, which the CPU lacks (the verify ops and the accepted
step's scatter, the decode tracking, torch attention for verify, pinning and stream hints), bound
where SGLang binds them (:data:`HOST_ATTRS`), and a few CUDA-only lines edited in the modules'
source as they are imported (:data:`SOURCE_EDITS`, located in the parse). The README lists each
with the line it replaces and why the replacement is faithful.

SGLang's CPU path calls its kernel package (``sgl_kernel``) for these ops. The kernel is built for
AVX-512-BF16 (and its AVX2 build raises "scalar path not implemented" for most of them), and its
varlen causal conv ignores the conv state an extend starts from (upstream PR #29068). What
:func:`install` does, and nothing else:

* SGLang's AMX check (``torch.cpu._is_amx_tile_supported``) answers no, so SGLang takes its
  native torch paths for linear layers, MoE, norms, rope and activations, and keeps the Mamba
  pool in the GPU layout (conv state ``[slot, dim, width - 1]``, SSM state ``[slot, HV, V, K]``);
* the kernel's gated-deltanet ops are re-registered for the CPU dispatch key with the functions
  below (same schemas, same in-place writes to the pool), so every call site that SGLang binds,
  ``torch.ops.sgl_kernel.X`` or ``sgl_kernel.mamba``'s wrappers, runs them;
* the gated RMSNorm, whose non-AMX path is a Triton kernel, takes its CPU branch (the module flag
  ``_use_cpu`` of the two FLA norm modules), which calls ``fused_rmsnorm_gated_cpu``, re-registered
  here too.

Every op computes in float32 and rounds its outputs to the input dtype, as the kernel does. Shapes
follow the kernel's schemas (``torch.ops.sgl_kernel.<op>.default._schema``): ``T`` tokens of ``N``
sequences back to back (``query_start_loc`` / ``cu_seqlens``, ``[N + 1]``), ``HK`` / ``HV`` key and
value heads of dims ``K`` / ``V``.
"""

from __future__ import annotations

import ast
import copy
import importlib.abc
import importlib.machinery
import itertools
import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F

VARIABLE = "EVALSVC_CPU_OPS"
# what the AVX-512 kernel build executes, as /proc/cpuinfo names it (evalsvc.builds.sglang_cpu)
KERNEL_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
CHUNK = 64


def _silu_if(y: torch.Tensor, silu: bool) -> torch.Tensor:
    return F.silu(y) if silu else y


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices,
                          has_initial_state, silu_activation, pad_slot_id, is_vnni):
    """Depthwise causal conv over each sequence of ``x`` (``[dim, T]``; weight ``[dim, width]``),
    started from the sequence's conv state ``conv_states[cache_indices[i]]`` (``[dim, width - 1]``,
    the last inputs before it) where ``has_initial_state[i]``, else from zeros; then that state
    becomes the sequence's last ``width - 1`` inputs. Returns ``[dim, T]``. Without
    ``query_start_loc``, ``x`` is ``[B, dim, L]`` (B sequences of L tokens) and so is the result.
    (``is_vnni``: the kernel's packed-weight flag; weights are unpacked on this path, where SGLang
    packs nothing.)"""
    del is_vnni
    if query_start_loc is None:
        # the batched layout ([B, dim, L], sequence b in slot cache_indices[b]), which SGLang's
        # prefill conv takes per request with the fix pr29068-cpu-conv-varlen-state
        out = torch.empty_like(x)
        length = torch.tensor([0, x.shape[-1]], dtype=torch.int32)
        for b in range(x.shape[0]):
            slot = torch.tensor([b]) if cache_indices is None else cache_indices[b:b + 1]
            initial = None if has_initial_state is None else has_initial_state[b:b + 1]
            out[b] = causal_conv1d_fwd_cpu(x[b], weight, bias, conv_states, length, slot, initial,
                                           silu_activation, pad_slot_id, False)
        return out
    dim, width = weight.shape
    w = weight.float().unsqueeze(1)
    b = None if bias is None else bias.float()
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    slots = cache_indices.tolist() if cache_indices is not None else list(range(len(starts) - 1))
    initial = has_initial_state.tolist() if has_initial_state is not None else []
    for i, (s, e) in enumerate(itertools.pairwise(starts)):
        slot = slots[i]
        if slot == pad_slot_id:
            continue
        if conv_states is not None and i < len(initial) and initial[i]:
            head = conv_states[slot].float()
        else:
            head = x.new_zeros(dim, width - 1, dtype=torch.float32)
        window = torch.cat([head, x[:, s:e].float()], dim=1)
        y = F.conv1d(window.unsqueeze(0), w, b, groups=dim)[0]
        out[:, s:e] = _silu_if(y, silu_activation).to(x.dtype)
        if conv_states is not None:
            conv_states[slot] = window[:, window.shape[1] - (width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x, conv_states, weight, bias, silu_activation, cache_seqlens,
                             conv_state_indices, pad_slot_id, is_vnni):
    """One decode step (``x`` ``[B, dim]``), or ``L`` tokens (``[B, dim, L]``), of the causal conv
    from each row's conv state ``conv_states[conv_state_indices[b]]``, which then holds the last
    ``width - 1`` inputs. Rows whose index is ``pad_slot_id`` are left alone (output zeros)."""
    del is_vnni
    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update_cpu: circular conv states "
                                  "(cache_seqlens) are not used by SGLang's GDN path")
    single = x.dim() == 2
    xs = x.unsqueeze(-1) if single else x
    dim, width = weight.shape
    rows = (conv_state_indices.long() if conv_state_indices is not None
            else torch.arange(xs.shape[0]))
    valid = rows != pad_slot_id
    out = torch.zeros_like(xs)
    if bool(valid.any()):
        slots = rows[valid]
        window = torch.cat([conv_states[slots].float(), xs[valid].float()], dim=-1)
        y = F.conv1d(window, weight.float().unsqueeze(1),
                     None if bias is None else bias.float(), groups=dim)
        out[valid] = _silu_if(y, silu_activation).to(x.dtype)
        conv_states[slots] = window[..., window.shape[-1] - (width - 1):].to(conv_states.dtype)
    return out.squeeze(-1) if single else out


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """The gates of a GDN layer: ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and
    ``beta = sigmoid(b)`` (``b``'s dtype), each ``[1, T, HV]``."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    beta = torch.sigmoid(b.float()).to(b.dtype)
    return g.unsqueeze(0), beta.unsqueeze(0)


def _kv(state: torch.Tensor) -> torch.Tensor:
    """A pool slot's state, stored ``[HV, V, K]`` as SGLang allocates it (``Mamba2StateShape``:
    heads, head_dim, state_size), as the ``[HV, K, V]`` float32 matrix the recurrence updates."""
    return state.float().transpose(-1, -2)


def _per_value_head(x: torch.Tensor, hv: int) -> torch.Tensor:
    """``[L, HK, D]`` -> ``[L, HV, D]``: value head ``h`` reads key head ``h // (HV / HK)``."""
    return x.repeat_interleave(hv // x.shape[1], dim=1) if x.shape[1] != hv else x


def gated_delta_rule_recurrent(q, k, v, g, beta, state, scale):
    """The gated delta rule token by token, the plain loop the chunked form must equal:
    per head, ``S <- exp(g_t) S``; ``S <- S + k_t beta_t (v_t - S^T k_t)^T``;
    ``o_t = S^T (scale q_t)``. ``q``, ``k``: ``[L, HV, K]``, ``v``: ``[L, HV, V]``, ``g``, ``beta``:
    ``[L, HV]``, ``state``: ``[HV, K, V]``; all float32. Returns (``[L, HV, V]``, the final
    state)."""
    out = v.new_empty(v.shape)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", state, q[t] * scale)
    return out, state


def gated_delta_rule_chunked(q, k, v, g, beta, state, scale, chunk=CHUNK, boundaries=None):
    """The same recurrence in chunks of ``chunk`` tokens (the WY form FLA's kernels and the CPU
    kernel use): inside a chunk, a unit lower-triangular solve in place of the token loop. With
    a list as ``boundaries``, the state at the start of each chunk is appended to it (FLA's
    ``h``, which SGLang's extra buffer tracks)."""
    length, hv, _ = k.shape
    pad = (-length) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    # [HV, n, C, D]
    q, k, v = (t.reshape(n, chunk, hv, -1).permute(2, 0, 1, 3) for t in (q * scale, k, v))
    g = g.reshape(n, chunk, hv).permute(2, 0, 1).cumsum(-1)
    beta = beta.reshape(n, chunk, hv).permute(2, 0, 1)
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()
    strictly = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)
    k_beta = k * beta[..., None]
    lower = (k_beta @ k.transpose(-1, -2) * decay) * strictly
    eye = torch.eye(chunk, dtype=q.dtype)
    solve = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False)
    u = solve @ (v * beta[..., None])
    w = solve @ (k_beta * g.exp()[..., None])
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    out = v.new_empty(hv, n, chunk, v.shape[-1])
    s = state
    for i in range(n):
        if boundaries is not None:
            boundaries.append(s.clone())  # the first is a view of the pool slot
        qi, ki, gi = q[:, i], k[:, i], g[:, i]
        attn = (qi @ ki.transpose(-1, -2) * decay[:, i]) * causal
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = (qi * gi.exp()[..., None]) @ s + attn @ v_new
        last = gi[:, -1]
        s = s * last.exp()[:, None, None] + (
            ki * (last[:, None] - gi).exp()[..., None]).transpose(-1, -2) @ v_new
    out = out.permute(1, 2, 0, 3).reshape(n * chunk, hv, -1)[:length]
    return out, s


def chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state,
                               cu_seqlens, head_first, use_qk_l2norm_in_kernel,
                               initial_state_indices, eps=1e-6):
    """The gated delta rule over each sequence of an extend (``query``/``key`` ``[1, T, HK, K]``,
    ``value`` ``[1, T, HV, V]``, ``g``/``beta`` ``[1, T, HV]``), from and back into the pool's state
    ``initial_state[initial_state_indices[i]]`` (``[HV, V, K]``, float32), in place. Returns
    (``[1, T, HV, V]`` in ``value``'s dtype, the final states ``[N, HV, V, K]``)."""
    return _extend(query, key, value, g, beta, initial_state, cu_seqlens, head_first,
                   use_qk_l2norm_in_kernel, initial_state_indices, eps, None)


def chunk_gated_delta_rule_with_h(q, k, v, g, beta, initial_state, cu_seqlens,
                                  head_first=False, use_qk_l2norm_in_kernel=False,
                                  initial_state_indices=None):
    """The extend's delta rule as SGLang's GDN backend calls it where it tracks states for the
    extra buffer (``kernels/gdn_triton.py``'s ``chunk_gated_delta_rule``, FLA on a GPU): the
    reference op's outputs and final states, and FLA's ``h``: the state at the start of each
    64-token chunk of each sequence, back to back (``[1, sum of ceil(L / 64), HV, V, K]``, the
    pool's layout), from which SGLang copies the state at the last chunk boundary a prefix
    tracks. (The CPU kernel's wrapper returns ``h = None``: "Todo: add return h support".)"""
    h = []
    out, finals = _extend(q, k, v, g, beta, initial_state, cu_seqlens, head_first,
                          use_qk_l2norm_in_kernel, initial_state_indices, 1e-6, h)
    return out, finals, _pool_layout(h, initial_state).unsqueeze(0)


def _pool_layout(states, pool):
    """``[HV, K, V]`` float32 states -> ``[n, HV, V, K]`` in the pool's layout and dtype."""
    if not states:
        return pool.new_empty(0, *pool.shape[1:])
    return torch.stack(states).transpose(-1, -2).to(pool.dtype)


def _extend(query, key, value, g, beta, initial_state, cu_seqlens, head_first, l2norm, slots,
            eps, boundaries):
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule: head_first layouts are not used by "
                                  "SGLang's GDN path")
    hv, dk = value.shape[2], key.shape[-1]
    scale = dk ** -0.5
    out = torch.empty_like(value)
    # without indices (0.5.13's CPU branch), ``initial_state`` holds one state per sequence, a
    # gathered copy: the caller writes the final states back
    slots = list(range(len(cu_seqlens) - 1)) if slots is None else slots.tolist()
    finals = []
    for i, (s, e) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        qi = _per_value_head(query[0, s:e].float(), hv)
        ki = _per_value_head(key[0, s:e].float(), hv)
        if l2norm:
            qi, ki = _l2norm(qi, eps), _l2norm(ki, eps)
        o, final = gated_delta_rule_chunked(qi, ki, value[0, s:e].float(), g[0, s:e].float(),
                                            beta[0, s:e].float(),
                                            _kv(initial_state[slots[i]]), scale,
                                            boundaries=boundaries)
        out[0, s:e] = o.to(out.dtype)
        initial_state[slots[i]] = final.transpose(-1, -2).to(initial_state.dtype)
        finals.append(final)
    return out, _pool_layout(finals, initial_state)


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b,
                                               initial_state_source, initial_state_indices,
                                               cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta=1.0, softplus_threshold=20.0):
    """Decode steps of a GDN layer with the gating fused in (``q``/``k`` ``[1, T, HK, K]``, ``v``
    ``[1, T, HV, V]``, ``a``/``b`` ``[T, HV]``): per sequence, token by token from and back into
    ``initial_state_source[initial_state_indices[i]]`` (``[HV, V, K]``), in place. Returns
    ``[T, 1, HV, V]`` in ``v``'s dtype, as the kernel does. A negative index (a padded row) leaves
    its output zero."""
    return gated_delta_rule_verify(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                   initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                   softplus_beta, softplus_threshold)


def draft_parents(retrieve_next_token, retrieve_next_sibling, length: int) -> list[int]:
    """Each draft token's parent in an EAGLE tree from its first-child and next-sibling links
    (``-1``: none), as SGLang's Triton verify conv derives them: token 0 is the root (parent 0,
    whose inputs before it are the conv state's)."""
    first_child, sibling = retrieve_next_token.tolist(), retrieve_next_sibling.tolist()
    parents = [0] * length
    for t in range(length):
        if 0 <= first_child[t] < length:
            parents[first_child[t]] = t
        if 0 <= sibling[t] < length:
            parents[sibling[t]] = parents[t]
    return parents


def causal_conv1d_update_verify(x, conv_state, weight, bias=None, activation=None,
                                cache_seqlens=None, conv_state_indices=None,
                                num_accept_tokens=None, intermediate_conv_window=None,
                                intermediate_state_indices=None, retrieve_next_token=None,
                                retrieve_next_sibling=None, retrieve_parent_token=None,
                                pad_slot_id=-1, metadata=None, validate_data=False):
    """SGLang's Triton ``causal_conv1d_update`` (``kernels/ops/mamba/causal_conv1d_triton.py``)
    as target verify calls it: the ``L`` draft tokens of each row (``x`` ``[B, dim, L]``) from
    the row's conv state; token ``t``'s window is its own input after its ancestors' (the chain
    ``t-1, t-2, ...``, or the EAGLE tree's parents from ``retrieve_next_token`` /
    ``retrieve_next_sibling``, written to ``retrieve_parent_token``), reaching back into the conv
    state; each window after token ``t`` (the last ``width - 1`` inputs) goes to
    ``intermediate_conv_window[intermediate_state_indices[b], t]``, from which SGLang restores the
    accepted step; and the conv state takes the last ``width - 1`` inputs in token order, as the
    Triton kernel leaves it. Returns ``[B, dim, L]``."""
    del validate_data, metadata
    if cache_seqlens is not None or num_accept_tokens is not None:
        raise NotImplementedError("causal_conv1d_update_verify: circular conv states and "
                                  "accepted-token offsets are not used by SGLang's GDN verify")
    silu = activation in (True, "silu", "swish")
    single = x.dim() == 2
    xs = x.unsqueeze(-1) if single else x
    batch, _, length = xs.shape
    width = weight.shape[1]
    w = weight.float()
    out = torch.zeros_like(xs)
    rows = (conv_state_indices.tolist() if conv_state_indices is not None
            else list(range(batch)))
    for b in range(batch):
        slot = rows[b]
        if slot == pad_slot_id:
            continue
        history = conv_state[slot].float()  # [dim, width - 1]
        inputs = xs[b].float()  # [dim, L]
        if retrieve_next_token is not None:
            parents = draft_parents(retrieve_next_token[b], retrieve_next_sibling[b], length)
            if retrieve_parent_token is not None:
                retrieve_parent_token[b, :length] = torch.tensor(
                    parents, dtype=retrieve_parent_token.dtype)
        else:
            parents = [t - 1 for t in range(length)]
        for t in range(length):
            chain, node = [inputs[:, t]], t
            while len(chain) < width and node > 0:
                node = parents[node]
                chain.append(inputs[:, node])
            back = width - len(chain)
            window = torch.stack(chain[::-1], dim=1)  # ancestors first, token t last
            if back:
                window = torch.cat([history[:, history.shape[1] - back:], window], dim=1)
            y = (window * w).sum(1) + (0 if bias is None else bias.float())
            out[b, :, t] = _silu_if(y, silu).to(out.dtype)
            if intermediate_conv_window is not None:
                intermediate_conv_window[intermediate_state_indices[b], t] = window[:, 1:].to(
                    intermediate_conv_window.dtype)
        tail = torch.cat([history, inputs], dim=1)
        conv_state[slot] = tail[:, tail.shape[1] - (width - 1):].to(conv_state.dtype)
    return out.squeeze(-1) if single else out


def gated_delta_rule_verify(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                            initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                            softplus_beta=1.0, softplus_threshold=20.0,
                            is_kda=False, disable_state_update=False,
                            intermediate_states_buffer=None, intermediate_state_indices=None,
                            cache_steps=None, retrieve_parent_token=None):
    """SGLang's fused sigmoid-gating delta rule as target verify calls it (the Triton
    ``fused_sigmoid_gating_delta_rule_update`` with ``intermediate_states_buffer``): per row, the
    draft tokens token by token from the pool's state, token ``t`` starting from its parent's
    state where an EAGLE tree is given (``retrieve_parent_token``), each token's state written to
    ``intermediate_states_buffer[intermediate_state_indices[i], t]`` (``[HV, V, K]``), the pool's
    state left alone when ``disable_state_update``. Returns ``[T, 1, HV, V]`` in ``v``'s dtype,
    the CPU kernel's layout. (``cache_steps``: the buffer's steps, read from its shape here.)"""
    del cache_steps
    if is_kda:
        raise NotImplementedError("gated_delta_rule_verify: KDA gates are not Qwen3-Next's")
    hv, dk = v.shape[2], k.shape[-1]
    scale = dk ** -0.5
    out = v.new_zeros(v.shape[1], 1, hv, v.shape[3])
    starts = cu_seqlens.tolist()
    slots = initial_state_indices.tolist()
    caches = (intermediate_state_indices.tolist() if intermediate_state_indices is not None
              else [-1] * len(slots))
    a2, b2 = a.reshape(-1, hv), b.reshape(-1, hv)
    for i, (s, e) in enumerate(itertools.pairwise(starts)):
        if slots[i] < 0:
            continue
        g = -A_log.float().exp() * F.softplus(a2[s:e].float() + dt_bias.float(),
                                               beta=softplus_beta, threshold=softplus_threshold)
        qi = _per_value_head(q[0, s:e].float(), hv)
        ki = _per_value_head(k[0, s:e].float(), hv)
        if use_qk_l2norm_in_kernel:
            qi, ki = _l2norm(qi), _l2norm(ki)
        beta = torch.sigmoid(b2[s:e].float())
        vi = v[0, s:e].float()
        state = _kv(initial_state_source[slots[i]])
        steps = []
        for t in range(e - s):
            if retrieve_parent_token is not None and t > 0:
                state = steps[int(retrieve_parent_token[i, t])]
            o, state = gated_delta_rule_recurrent(qi[t:t + 1], ki[t:t + 1], vi[t:t + 1],
                                                  g[t:t + 1], beta[t:t + 1], state, scale)
            out[s + t, 0] = o[0].to(out.dtype)
            steps.append(state)
            if intermediate_states_buffer is not None and caches[i] >= 0:
                intermediate_states_buffer[caches[i], t] = state.transpose(-1, -2).to(
                    intermediate_states_buffer.dtype)
        if not disable_state_update:
            initial_state_source[slots[i]] = state.transpose(-1, -2).to(
                initial_state_source.dtype)
    return out


def state_scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None):
    """SGLang's Triton ``fused_mamba_state_scatter_with_mask`` (and its conv-window twin), which
    commits the accepted verify step: for each request ``i`` whose step is valid (``>= 0``),
    ``dst[:, dst_indices_raw[i]] = src[:, row, step_indices_raw[i]]`` for every layer, where
    ``row`` is ``i``, or ``src_indices_raw[i]`` (the verify scratch row, from 0.5.23) where given;
    indices out of range are skipped, as the kernel's bounds check does."""
    steps, slots = step_indices_raw.tolist(), dst_indices_raw.tolist()
    rows = range(len(steps)) if src_indices_raw is None else src_indices_raw.tolist()
    if len(rows) != len(steps):
        raise ValueError(f"source indices length mismatch: {len(rows)} vs {len(steps)}")
    for row, step, slot in zip(rows, steps, slots, strict=True):
        if 0 <= step < src.shape[2] and 0 <= slot < dst.shape[1] and 0 <= row < src.shape[1]:
            dst[:, slot] = src[:, row, step]


def conv_window_scatter_multi(pairs, dst_indices_raw, step_indices_raw, dst_indices2_raw=None,
                              step_indices2_raw=None):
    """SGLang's Triton ``fused_conv_window_scatter_multi`` (0.5.19): the conv-window scatter of
    ``fused_conv_window_scatter_with_mask`` over several ``(dst, src)`` pairs and up to two index
    sets (the accepted steps, then the track slots) in one launch; here pair by pair, set by set
    (the sets write different slots)."""
    for dst, src in pairs:
        state_scatter_with_mask(dst, src, dst_indices_raw, step_indices_raw)
        if step_indices2_raw is not None and step_indices2_raw.shape[0]:
            state_scatter_with_mask(dst, src, dst_indices2_raw, step_indices2_raw)


def track_states(conv_states, ssm_states, cache_indices, mamba_track_mask,
                 mamba_track_indices, batch_size, check_freed_slots=False):
    """SGLang's Triton ``track_mamba_states_if_needed`` (one layer's pools, ``[slot, ...]``) and
    ``track_mamba_states_all_layers`` (``[layer, slot, ...]``; called with ``layer_axis``): the
    extra buffer's decode tracking. Each row whose mask is set copies its conv and SSM state from
    its slot (``cache_indices``) to its track slot; with ``check_freed_slots``, rows with a
    negative slot on either side are skipped."""
    return _track(conv_states, ssm_states, cache_indices, mamba_track_mask, mamba_track_indices,
                  batch_size, check_freed_slots, layer_axis=False)


def track_states_all_layers(conv_states_pool, ssm_states_pool, cache_indices, mamba_track_mask,
                            mamba_track_indices, batch_size, check_freed_slots=False):
    return _track(conv_states_pool, ssm_states_pool, cache_indices, mamba_track_mask,
                  mamba_track_indices, batch_size, check_freed_slots, layer_axis=True)


def _track(conv, ssm, cache_indices, mask, track_indices, batch_size, check_freed_slots,
           layer_axis):
    for b in range(batch_size):
        if not bool(mask[b]):
            continue
        src, dst = int(cache_indices[b]), int(track_indices[b])
        if check_freed_slots and (src < 0 or dst < 0):
            continue
        for pool in (conv, ssm):
            if layer_axis:
                pool[:, dst] = pool[:, src]
            else:
                pool[dst] = pool[src]


def gather_spec_extras(indices, topk_p_buf, topk_index_buf, output_tokens_buf,
                       hidden_states_buf):
    """SGLang's Triton ``gather_spec_extras`` (the overlap scheduler's speculative path): the rows
    ``indices`` of the draft's top-k probabilities and indices, its bonus tokens and (when
    captured) hidden states, each a new tensor."""
    rows = indices.long()
    return (topk_p_buf[rows], topk_index_buf[rows], output_tokens_buf[rows],
            None if hidden_states_buf is None else hidden_states_buf[rows])


def rotate_input_ids(input_ids, extend_start_loc, extend_seq_lens, topk_index, select_index=None):
    """SGLang's ``rotate_input_ids`` for the multi-layer EAGLE draft (``kernels/ops/speculative/
    multi_layer_eagle.py``; its CPU branch calls the kernel package's ``rotate_input_ids_cpu``,
    whose 0.4.5 build takes int64 ids where 0.5.19 passes int32): each request's ids move one to
    the left, in place, and its new token goes last (or to ``select_index``), as the Triton kernel
    does."""
    new_tokens, starts = topk_index.reshape(-1), extend_start_loc.tolist()
    for i, n in enumerate(extend_seq_lens.tolist()):  # a program per request, as the kernel's grid
        start = starts[i]
        if n > 0:
            input_ids[start:start + n - 1] = input_ids[start + 1:start + n].clone()
            last = start + n - 1 if select_index is None else int(select_index[i])
            input_ids[last] = new_tokens[i]


def _untimed_bench(self):
    """Triton's autotuner under its interpreter (``TRITON_INTERPRET=1``), which has no device to
    time a config on: every config ties, and the first is taken (see :func:`_largest_blocks_first`;
    the kernel's result is the same under each, only its speed differs)."""
    return lambda fn, quantiles=None, **kwargs: [0.0, 0.0, 0.0]


def _largest_blocks_first(init):
    """The autotuner's configs ordered by their block sizes' product, largest first: the
    interpreter runs one program instance at a time, each over whole numpy blocks, so the fewest
    programs are the fastest."""

    def call(self, *args, **kwargs):
        init(self, *args, **kwargs)

        def size(config):
            return -math.prod(v for v in config.kwargs.values() if type(v) is int)

        self.configs = sorted(self.configs, key=size)

    call.__wrapped__ = init
    return call


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """The kernel package's ``transfer_kv_direct`` (HiCache's ``direct`` io backend, which SGLang
    binds only on CUDA or ROCm: on the CPU the name is undefined where its host pools call it):
    for each layer, the rows ``src_indices`` of the source go to the rows ``dst_indices`` of the
    destination (a page of ``page_size`` tokens is its rows)."""
    del page_size
    src_rows, dst_rows = src_indices.long(), dst_indices.long()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_rows] = src[src_rows].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id,
                                       page_size):
    """The kernel package's ``direct`` load of one layer from a page-first host pool (``[page,
    layer, page_size, ...]``) into a layer-first device pool (``[token, ...]``): page by page, the
    host page of ``src_indices[i]`` at ``layer_id`` goes to the ``page_size`` device rows from
    ``dst_indices[i]`` (the kernel package's own test reference, ``ref_copy_with_indices_pf_direct``)."""
    starts = range(0, len(src_indices), page_size)
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        for i in starts:
            row, page = int(dst_indices[i]), int(src_indices[i]) // page_size
            dst[row:row + page_size] = src[page, layer_id].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """The ``direct`` backup of every layer: ``src_ptrs`` holds each destination's layers in turn
    (keys' layers, then values'), each ``[token, ...]``; the ``page_size`` rows from
    ``src_indices[i]`` go to the host page of ``dst_indices[i]`` at that layer."""
    layers = len(src_ptrs) // len(dst_ptrs)
    starts = range(0, len(src_indices), page_size)
    for j, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[j * layers + layer]
            for i in starts:
                row, page = int(src_indices[i]), int(dst_indices[i]) // page_size
                dst[page, layer] = src[row:row + page_size].to(dst.device)


def without_cuda(otherwise):
    """A binding that only serves a CUDA device, kept where CUDA is there and answering
    ``otherwise(first argument)`` where it is not. For host-memory pinning, which only speeds
    copies to a device: HiCache's host pools pin their buffers with ``cudaHostRegister``
    (``_cuda_host_register``: nothing to do), and SGLang's extra-buffer path calls
    ``Tensor.pin_memory`` on the track mask (``ScheduleBatch.prepare_for_decode``) before copying
    it to the batch's device, the CPU here (the tensor itself, unpinned, is what that copy needs).
    torch refuses both without an accelerator."""

    def factory(bound):
        def call(first, *args, **kwargs):
            if torch.cuda.is_available():
                return bound(first, *args, **kwargs)
            return otherwise(first)

        call.__wrapped__ = bound
        return call

    return factory


host_register_on_cpu = without_cuda(lambda buffer: None)
cpu_pin_memory = without_cuda(lambda tensor: tensor)
PINNING_FACTORIES = ("tensor", "empty", "zeros", "full", "arange")


def unpinned(factory):
    """A torch tensor factory that makes its tensor unpinned where no accelerator is there:
    SGLang asks for pinned host tensors that it then copies to the device (``pin_memory=True``:
    the extra buffer's track slots in ``schedule_batch.py``; in 0.5.12.post1 also the logits
    processor's indices and the forward batch's token counts, unconditionally), which torch refuses
    without an accelerator. Pinning only speeds a copy to a device; the copy to the CPU needs none.
    """
    def make(*args, **kwargs):
        if kwargs.get("pin_memory") is True and not torch.cuda.is_available():
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    make.__wrapped__ = factory
    return make


def verify_as_extend(forward_extend):
    """``TorchNativeAttnBackend.forward_extend`` for target verify, whose batch carries no
    ``extend_*`` fields: each request extends its ``seq_lens`` tokens by the ``draft_token_num``
    draft tokens, causally (a draft chain, ``topk`` 1), as SGLang's CPU verify derives it for its
    AMX backend (``IntelAMXAttnBackend._build_extend_metadata``). A token tree (``topk`` > 1)
    needs the tree mask, which the torch backend does not take: refused."""

    def call(self, q, k, v, layer, forward_batch, *args, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs)
        spec = forward_batch.spec_info
        if spec.tree_topk != 1:
            raise NotImplementedError("target verify of a draft tree (speculative_eagle_topk > 1) "
                                      "on the torch attention backend: use topk 1")
        batch = copy.copy(forward_batch)
        draft = spec.draft_token_num
        batch.extend_prefix_lens = forward_batch.seq_lens
        batch.extend_seq_lens = torch.full_like(forward_batch.seq_lens, draft)
        batch.seq_lens = forward_batch.seq_lens + draft
        return forward_extend(self, q, k, v, layer, batch, *args, **kwargs)

    call.__wrapped__ = forward_extend
    return call


def _keep_overlap(server_args) -> None:
    """SGLang's ``_disable_overlap_schedule_for_cpu``, which turns the overlap scheduler off for
    speculative decoding on ``--device cpu`` ("not implemented ... on CPU"), where a GPU server
    keeps it: here it keeps it too, so that MTP runs with the overlap scheduler as on a GPU."""
    del server_args


def cpu_record_stream(record_stream):
    """``Tensor.record_stream`` tells CUDA's caching allocator that a stream still uses a tensor;
    a CPU tensor has no stream and no such allocator, and torch refuses the call (the CPU stream
    object is "unknown parameter type"). SGLang's overlap scheduler calls it on the speculative
    path's indices (``managers/overlap_utils.py``, ``_resolve_spec_extras``): on the CPU it is a
    no-op, as every op there has completed when it returns."""

    def call(self, stream):
        if self.device.type == "cpu":
            return None
        return record_stream(self, stream)

    call.__wrapped__ = record_stream
    return call


class Define:
    """A value of :data:`HOST_ATTRS` bound even where the module does not bind the name (SGLang
    imports some kernels only on CUDA and calls them unconditionally)."""

    def __init__(self, value) -> None:
        self.value = value


class Wrap:
    """A value of :data:`HOST_ATTRS`: the module's binding is replaced by ``factory(binding)``."""

    def __init__(self, factory) -> None:
        self.factory = factory


def verifying(verify, extra: tuple[str, ...], dropped: dict[str, object]) -> Wrap:
    """A CPU op binding of SGLang's GDN backend that target verify (MTP) calls with the Triton
    kernel's extra arguments, which the CPU kernel's op does not take: calls with them go to
    ``verify``, the rest to the op bound before (the kernel's, or a reference op), less the
    Triton-only ``dropped`` flags at their defaults."""

    def factory(bound):
        def call(*args, **kwargs):
            if any(kwargs.get(name) is not None for name in extra) or \
                    kwargs.get("disable_state_update"):
                return verify(*args, **kwargs)
            for name, default in dropped.items():
                if kwargs.get(name, default) != default:
                    raise NotImplementedError(f"{name}={kwargs[name]!r} on the CPU op")
                kwargs.pop(name, None)
            return bound(*args, **kwargs)

        call.__wrapped__ = bound
        return call

    return Wrap(factory)


def fused_rmsnorm_gated_cpu(input, weight, gate, eps):
    """``rmsnorm(input) * weight * silu(gate)`` over the last dim, in float32, as input's dtype."""
    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * F.silu(gate.float())).to(input.dtype)


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    """SGLang's Triton shared-expert gate of Qwen2-MoE-style blocks (``kernels/ops/elementwise``),
    which it takes wherever the gate is not on the AMX backend: ``final += sigmoid(h . w) *
    shared`` per token, in float32, in place, as the Triton kernel computes it."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())
    final_hidden_states.copy_(final_hidden_states.float() + gate[:, None] * shared_output.float())


OPS = {
    "causal_conv1d_fwd_cpu": causal_conv1d_fwd_cpu,
    "causal_conv1d_update_cpu": causal_conv1d_update_cpu,
    "fused_gdn_gating_cpu": fused_gdn_gating_cpu,
    "chunk_gated_delta_rule_cpu": chunk_gated_delta_rule_cpu,
    "fused_sigmoid_gating_delta_rule_update_cpu": fused_sigmoid_gating_delta_rule_update_cpu,
    "fused_rmsnorm_gated_cpu": fused_rmsnorm_gated_cpu,
}
# What SGLang's Python binds to Triton on a CPU without AMX, set in its modules as they are
# imported: the FLA gated-norm modules' CPU branch flag (``_use_cpu``: it calls
# fused_rmsnorm_gated_cpu), and the names bound to Triton kernels, where the module binds them.
MODULE_ATTRS: dict[str, dict[str, object]] = {
    "sglang.kernels.ops.attention.fla.layernorm_gated": {"_use_cpu": True},
    "sglang.kernels.ops.attention.fla.fused_norm_gate": {"_use_cpu": True},
    "sglang.kernels.ops.elementwise.elementwise": {
        "fused_gate_sigmoid_mul_add": fused_gate_sigmoid_mul_add},
    "sglang.srt.models.qwen2_moe": {"fused_gate_sigmoid_mul_add": fused_gate_sigmoid_mul_add},
    # the extend's delta rule with FLA's per-chunk states, which the extra buffer tracks
    "sglang.srt.layers.attention.linear.kernels.gdn_triton": {
        "chunk_gated_delta_rule": chunk_gated_delta_rule_with_h},
}
# MTP speculative decoding on the CPU, on either path (reference ops or kernel): what SGLang's
# speculative path calls in Triton or CUDA, bound where SGLang binds it. Target verify's conv and
# fused delta rule (the GDN backend's CPU bindings, which the verify branch calls with the Triton
# kernels' extra arguments), the accepted step's scatter, verify on the torch attention backend,
# the overlap scheduler's gather of the draft's extras, and SGLang's CPU-only rule that turns the
# overlap scheduler off for speculative decoding. The README lists them ("host adapters").
HOST_ATTRS: dict[str, dict[str, object]] = {
    "sglang.srt.layers.attention.linear.gdn_backend": {
        "causal_conv1d_update": verifying(
            causal_conv1d_update_verify,
            ("intermediate_conv_window", "intermediate_state_indices", "retrieve_next_token",
             "retrieve_next_sibling", "retrieve_parent_token"), {})},
    "sglang.srt.layers.attention.linear.kernels.gdn_triton": {
        "fused_sigmoid_gating_delta_rule_update": verifying(
            gated_delta_rule_verify,
            ("intermediate_states_buffer", "intermediate_state_indices",
             "retrieve_parent_token"), {"is_kda": False})},
    "sglang.kernels.ops.mamba.mamba_state_scatter_triton": {
        "fused_mamba_state_scatter_with_mask": state_scatter_with_mask,
        "fused_conv_window_scatter_with_mask": state_scatter_with_mask,
        "fused_conv_window_scatter_multi": conv_window_scatter_multi,
        "track_mamba_states_if_needed": track_states,
        "track_mamba_states_all_layers": track_states_all_layers},
    "sglang.srt.layers.attention.torch_native_backend": {
        "TorchNativeAttnBackend.forward_extend": Wrap(verify_as_extend)},
    "sglang.srt.managers.overlap_utils": {"gather_spec_extras": gather_spec_extras},
    # 0.5.13 and before: the decode tracking's Triton launcher lives in the backend's module;
    # 0.5.12.post1 imports FLA's chunk size there on CUDA only, and reads it to track the extend
    "sglang.srt.layers.attention.hybrid_linear_attn_backend": {
        "track_mamba_states_if_needed": track_states, "FLA_CHUNK_SIZE": Define(CHUNK)},
    # HiCache with the direct io backend and the page-first direct layout (the Mamba host pool's)
    "sglang.srt.mem_cache.pool_host.common": {
        "_cuda_host_register": Wrap(host_register_on_cpu),
        "_cuda_host_unregister": Wrap(host_register_on_cpu)},
    **{module: {"transfer_kv_direct": Define(transfer_kv_direct),
                "transfer_kv_per_layer_direct_pf_lf": Define(transfer_kv_per_layer_direct_pf_lf),
                "transfer_kv_all_layer_direct_lf_pf": Define(transfer_kv_all_layer_direct_lf_pf)}
       for module in ("sglang.srt.mem_cache.pool_host.mha",
                      "sglang.srt.mem_cache.memory_pool_host")},
    "sglang.srt.arg_groups.speculative_hook": {
        "_disable_overlap_schedule_for_cpu": _keep_overlap},
    # the multi-layer EAGLE draft (0.5.19 and later; Inkling's MTP): the CPU branch's kernel op
    "sglang.kernels.ops.speculative.multi_layer_eagle": {"rotate_input_ids_cpu": rotate_input_ids},
}
# SGLang's Triton kernels that have no CPU branch (Inkling's short convolutions and their metadata)
# run in Triton's own interpreter where the engine asks for it (``TRITON_INTERPRET=1``, read by
# Triton at import); its autotuner then has nothing to time.
INTERPRETER_ATTRS = {"triton.runtime.autotuner": {
    "Autotuner.do_bench": property(_untimed_bench),
    "Autotuner.__init__": Wrap(_largest_blocks_first)}}
# Where earlier releases (0.5.12.post1, 0.5.13) kept the kernel modules named above: the same
# bindings apply there.
EARLIER_HOMES = {"sglang.kernels.ops.attention.fla.": "sglang.srt.layers.attention.fla.",
                 "sglang.kernels.ops.mamba.": "sglang.srt.layers.attention.mamba."}
REQUIRED_ATTRS = {"_use_cpu"}  # a flag the module must have; a name is replaced where bound
_LIBRARY: list[torch.library.Library] = []


# ---- host adapters: SGLang's CUDA-only lines on its CPU speculative path, edited at import ----
#
# Each edit is located in the module's parse (class, function, call or literal), never by line
# number or text, and changes nothing else; a module where the edit finds nothing to change (a
# release without that line) is left as it is. The list, with the lines replaced and why each
# replacement is faithful, is in the README ("Real SGLang on the CPU: host adapters").


def _span(lines: list[str], node: ast.AST) -> tuple[int, int]:
    """A node's source span as offsets into the joined ``lines``."""
    starts = list(itertools.accumulate((len(line) for line in lines), initial=0))
    return (starts[node.lineno - 1] + node.col_offset,
            starts[node.end_lineno - 1] + node.end_col_offset)


def _methods(tree: ast.Module, cls: str | None, name: str) -> list[ast.FunctionDef]:
    """``cls.name`` (any class's ``name`` where ``cls`` is None)."""
    return [f for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and cls in (None, c.name)
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name == name]


def pool_device(tree: ast.Module, lines: list[str]) -> list[tuple[int, int, str]]:
    """``MambaPool.__init__`` allocates the speculative intermediate SSM states and conv windows
    with ``device="cuda"``; the pool's own states use its ``device`` argument: so do these."""
    return [(*_span(lines, k.value), "device") for f in _methods(tree, "MambaPool", "__init__")
            if "device" in {a.arg for a in f.args.args + f.args.kwonlyargs}
            for k in ast.walk(f) if isinstance(k, ast.keyword) and k.arg == "device"
            and isinstance(k.value, ast.Constant) and k.value.value == "cuda"]


def no_cuda_synchronize(tree: ast.Module, lines: list[str]) -> list[tuple[int, int, str]]:
    """``set_embed_and_head`` (the draft model's embedding and head shared with the target) ends
    with ``torch.cuda.synchronize()``, which waits for a GPU's streams: on a CPU every op has
    completed when it returns, so the statement becomes ``pass``."""
    return [(*_span(lines, stmt), "pass") for f in _methods(tree, None, "set_embed_and_head")
            for stmt in ast.walk(f) if isinstance(stmt, ast.Expr)
            and ast.unparse(stmt.value) == "torch.cuda.synchronize()"]


TORCH_NATIVE_DRAFT = "_evalsvc_torch_native_draft_backend"


def _torch_native_draft_backend(draft_model_runner):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend(draft_model_runner)


def draft_extend_torch_native(tree: ast.Module, lines: list[str]) -> list[tuple[int, int, str]]:
    """``DraftBackendFactory.create_draft_extend_backend`` maps attention backends to the draft
    model's extend backend and has no ``torch_native`` entry (CPUs without AMX): the entry builds
    the torch backend for the draft runner, as the target's own is built
    (``TorchNativeAttnBackend(model_runner)``). Where the release's entries return the backend
    with its name (``("triton", TritonAttnBackend(...))``, which ``_create_backend`` unpacks, as
    in 0.5.19), the new entry does too."""
    stamped = any(isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)
                  for f in _methods(tree, "DraftBackendFactory", "_create_triton_prefill_backend")
                  for r in ast.walk(f))
    entry = f"{TORCH_NATIVE_DRAFT}(self.draft_model_runner)"
    if stamped:
        entry = f"(\"torch_native\", {entry})"
    edits = []
    for f in _methods(tree, "DraftBackendFactory", "create_draft_extend_backend"):
        for node in ast.walk(f):
            if isinstance(node, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "triton" for k in node.keys) \
                    and not any(isinstance(k, ast.Constant) and k.value == "torch_native"
                                for k in node.keys):
                end = _span(lines, node.values[-1])[1]
                edits.append((end, end, f", \"torch_native\": lambda: {entry}"))
    return edits


REFERENCE_OPS = "_evalsvc_reference_ops"


def _reference_ops() -> bool:
    return os.environ.get(VARIABLE, "reference") == "reference"


def extra_buffer_on_cpu(tree: ast.Module, lines: list[str]) -> list[tuple[int, int, str]]:
    """SGLang asserts a CUDA, MUSA, NPU or ROCm device for the extra buffer: FLA's chunked delta
    rule is what returns the states at the chunk boundaries that the extra buffer tracks. On the
    reference ops the CPU has them (:func:`chunk_gated_delta_rule_with_h`), so the assertion admits
    the CPU there too; the kernel path's op returns none, and stays refused. The assertion is found
    by its message (naming extra_buffer) and its test (a platform check): ``is_cuda() or ...`` in
    ``ServerArgs`` (``_validate_mamba_extra_buffer`` in 0.5.17, ``_handle_mamba_radix_cache``
    before), ``get_platform().is_cuda or ...`` in ``arg_groups/mamba_hook.py``'s
    ``validate_mamba_extra_buffer`` (0.5.19 to 0.5.22), ``_platform_supports_mamba_cache_extra_
    buffer()`` there (0.5.23)."""
    def platform_check(test: ast.expr) -> bool:
        text = ast.unparse(test)
        return (f"{REFERENCE_OPS}()" not in text
                and ("is_cuda" in text or "_platform_supports_mamba_cache_extra_buffer" in text))

    return [(_span(lines, node.test)[1], _span(lines, node.test)[1], f" or {REFERENCE_OPS}()")
            for node in ast.walk(tree) if isinstance(node, ast.Assert)
            and node.msg is not None and "extra_buffer" in ast.unparse(node.msg)
            and platform_check(node.test)]


SOURCE_EDITS = {
    "sglang.srt.mem_cache.memory_pool": (pool_device,),
    "sglang.srt.models.qwen3_next": (no_cuda_synchronize,),
    "sglang.srt.speculative.draft_utils": (draft_extend_torch_native,),
    "sglang.srt.server_args": (extra_buffer_on_cpu,),
    "sglang.srt.arg_groups.mamba_hook": (extra_buffer_on_cpu,),
}
SOURCE_GLOBALS = {"sglang.srt.speculative.draft_utils":
                  {TORCH_NATIVE_DRAFT: _torch_native_draft_backend},
                  "sglang.srt.server_args": {REFERENCE_OPS: _reference_ops},
                  "sglang.srt.arg_groups.mamba_hook": {REFERENCE_OPS: _reference_ops}}


def edited_source(name: str, source: str) -> tuple[str, int]:
    """``source`` of module ``name`` with its :data:`SOURCE_EDITS` made; and how many."""
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    edits = sorted((e for edit in SOURCE_EDITS[name] for e in edit(tree, lines)), reverse=True)
    text = "".join(lines)
    for start, end, replacement in edits:
        text = text[:start] + replacement + text[end:]
    return text, len(edits)


class _EditSource(importlib.abc.MetaPathFinder):
    """Executes the modules of :data:`SOURCE_EDITS` from their edited source."""

    def find_spec(self, name, path, target=None):
        if name not in SOURCE_EDITS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        def exec_module(module):
            source, count = edited_source(name, loader.get_source(name))
            print(f"{VARIABLE}: host adapters: {name}: {count} edit(s)", file=sys.stderr)
            module.__dict__.update(SOURCE_GLOBALS.get(name, {}))
            exec(compile(source, loader.get_filename(name), "exec"), module.__dict__)

        loader.exec_module = exec_module
        return spec


class _SetAfterImport(importlib.abc.MetaPathFinder):
    """Sets ``attrs`` on a module right after it executes (before anyone imports from it)."""

    def __init__(self, attrs: dict[str, dict[str, object]]) -> None:
        self.attrs = attrs

    def find_spec(self, name, path, target=None):
        if name not in self.attrs:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, values = spec.loader, self.attrs[name]
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            missing = [a for a in values if a in REQUIRED_ATTRS and not hasattr(module, a)]
            if missing:
                raise ImportError(f"{VARIABLE}=reference: {name} has no {', '.join(missing)} "
                                  "(this SGLang release binds its gated RMSNorm otherwise)")
            for attr, value in values.items():
                owner, _, attr = attr.rpartition(".")
                owner = getattr(module, owner) if owner else module
                if isinstance(value, Wrap):
                    if hasattr(owner, attr):  # a release without the name is left alone
                        setattr(owner, attr, value.factory(getattr(owner, attr)))
                elif isinstance(value, Define):
                    setattr(owner, attr, value.value)
                elif hasattr(owner, attr):
                    setattr(owner, attr, value)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Answer SGLang's AMX check no and re-register the kernel's gated-deltanet ops with the
    functions above (:func:`activate` then binds :data:`MODULE_ATTRS` as SGLang's modules are
    imported). Call before SGLang is imported."""
    if _LIBRARY:
        return
    torch.cpu._is_amx_tile_supported = lambda: False
    import sgl_kernel  # noqa: F401  (registers the kernel's ops, which the lines below replace)

    library = torch.library.Library("sgl_kernel", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point
        warnings.simplefilter("ignore", UserWarning)
        for name, fn in OPS.items():
            library.impl(name, fn, "CPU")
    _LIBRARY.append(library)


def use_kernel(kernel_dir: str, cpuinfo: str | None = None) -> None:
    """The kernel path: the AVX-512 build of ``sgl_kernel`` (unpacked in ``kernel_dir``) first on
    ``sys.path``, and SGLang's AMX check answered yes where the CPU has no AMX tiles (the kernel's
    matrix products run on AVX-512-BF16 through oneDNN's brgemm; without that answer SGLang's
    gated-deltanet layers fall back to Triton). Exits, naming what is missing, on a CPU that would
    die with SIGILL at ``import sgl_kernel``, or where the environment has no such build."""
    if cpuinfo is None:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    flags = next((line.partition(":")[2].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), [])
    missing = [f for f in KERNEL_FEATURES if f not in flags]
    if missing:
        raise SystemExit(f"{VARIABLE}=kernel: this CPU lacks {', '.join(missing)}, which the "
                         "AVX-512 build of SGLang's CPU kernel runs; use "
                         f"{VARIABLE}=reference (cpu_ops: reference)")
    if not os.path.isdir(os.path.join(kernel_dir, "sgl_kernel")):
        raise SystemExit(f"{VARIABLE}=kernel: this environment has no AVX-512 kernel build in "
                         f"{kernel_dir} (make sglang-cpu with EVALSVC_SGLANG_CPU_KERNEL set)")
    sys.path.insert(0, kernel_dir)
    if not torch.cpu._is_amx_tile_supported():
        torch.cpu._is_amx_tile_supported = lambda: True


def activate(environ=None) -> str:
    """What the environment's ``sitecustomize.py`` calls in SGLang's engine processes: the CPU ops
    ``EVALSVC_CPU_OPS`` asks for, ``reference`` (the default) or ``kernel``. Returns the choice."""
    environ = os.environ if environ is None else environ
    choice = environ.get(VARIABLE, "reference")
    if choice not in ("reference", "kernel"):
        raise SystemExit(f"{VARIABLE}={choice!r}: expected reference or kernel")
    attrs = {name: dict(values) for name, values in HOST_ATTRS.items()}
    if choice == "reference":
        for name, values in MODULE_ATTRS.items():
            attrs.setdefault(name, {}).update(values)
    if environ.get("TRITON_INTERPRET") == "1":
        attrs.update(INTERPRETER_ATTRS)
    for name, values in list(attrs.items()):
        for home, earlier in EARLIER_HOMES.items():
            if name.startswith(home):
                attrs.setdefault(earlier + name.removeprefix(home), {}).update(values)
    sys.meta_path.insert(0, _SetAfterImport(attrs))
    sys.meta_path.insert(0, _EditSource())
    if not hasattr(torch.Tensor.record_stream, "__wrapped__"):
        torch.Tensor.record_stream = cpu_record_stream(torch.Tensor.record_stream)
        torch.Tensor.pin_memory = cpu_pin_memory(torch.Tensor.pin_memory)
        for name in PINNING_FACTORIES:
            setattr(torch, name, unpinned(getattr(torch, name)))
    if choice == "reference":
        install()
    elif choice == "kernel":
        use_kernel(os.path.join(sys.prefix, "kernel-avx512"))
    return choice
