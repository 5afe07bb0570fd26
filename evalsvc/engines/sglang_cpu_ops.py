"""Reference ops: SGLang's gated-deltanet CPU ops in plain torch, so that real SGLang serves a
hybrid GDN model (Qwen3-Next) on any x86-64 CPU.

This module runs inside SGLang's engine processes, never in the service: the SGLang CPU
environment (``evalsvc.builds.sglang_cpu``) carries a copy of it as ``evalsvc_sglang_cpu_ops`` and
its ``sitecustomize.py`` calls :func:`install` when the engine's ``EVALSVC_CPU_OPS`` is
``reference`` (the matrix field ``cpu_ops``). It imports nothing of evalsvc.

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

import importlib.abc
import importlib.machinery
import itertools
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


def gated_delta_rule_chunked(q, k, v, g, beta, state, scale, chunk=CHUNK):
    """The same recurrence in chunks of ``chunk`` tokens (the WY form FLA's kernels and the CPU
    kernel use): inside a chunk, a unit lower-triangular solve in place of the token loop."""
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
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu: head_first layouts are not used "
                                  "by SGLang's GDN path")
    hv, dk = value.shape[2], key.shape[-1]
    scale = dk ** -0.5
    out = torch.empty_like(value)
    starts = cu_seqlens.tolist()
    slots = initial_state_indices.tolist()
    finals = []
    for i, (s, e) in enumerate(itertools.pairwise(starts)):
        qi = _per_value_head(query[0, s:e].float(), hv)
        ki = _per_value_head(key[0, s:e].float(), hv)
        if use_qk_l2norm_in_kernel:
            qi, ki = _l2norm(qi, eps), _l2norm(ki, eps)
        o, final = gated_delta_rule_chunked(qi, ki, value[0, s:e].float(), g[0, s:e].float(),
                                            beta[0, s:e].float(),
                                            _kv(initial_state[slots[i]]), scale)
        out[0, s:e] = o.to(out.dtype)
        initial_state[slots[i]] = final.transpose(-1, -2).to(initial_state.dtype)
        finals.append(final.transpose(-1, -2))
    final_states = torch.stack(finals) if finals else initial_state.new_empty(0)
    return out, final_states.to(initial_state.dtype)


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b,
                                               initial_state_source, initial_state_indices,
                                               cu_seqlens, use_qk_l2norm_in_kernel,
                                               softplus_beta=1.0, softplus_threshold=20.0):
    """Decode steps of a GDN layer with the gating fused in (``q``/``k`` ``[1, T, HK, K]``, ``v``
    ``[1, T, HV, V]``, ``a``/``b`` ``[T, HV]``): per sequence, token by token from and back into
    ``initial_state_source[initial_state_indices[i]]`` (``[HV, V, K]``), in place. Returns
    ``[T, 1, HV, V]`` in ``v``'s dtype, as the kernel does. A negative index (a padded row) leaves
    its output zero."""
    hv, dk = v.shape[2], k.shape[-1]
    scale = dk ** -0.5
    out = v.new_zeros(v.shape[1], 1, hv, v.shape[3])
    starts = cu_seqlens.tolist()
    slots = initial_state_indices.tolist()
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
        o, final = gated_delta_rule_recurrent(qi, ki, v[0, s:e].float(), g,
                                              torch.sigmoid(b2[s:e].float()),
                                              _kv(initial_state_source[slots[i]]), scale)
        out[s:e, 0] = o.to(out.dtype)
        initial_state_source[slots[i]] = final.transpose(-1, -2).to(initial_state_source.dtype)
    return out


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
}
REQUIRED_ATTRS = {"_use_cpu"}  # a flag the module must have; a name is replaced where bound
_LIBRARY: list[torch.library.Library] = []


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
                if hasattr(module, attr):
                    setattr(module, attr, value)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Answer SGLang's AMX check no, re-register the kernel's gated-deltanet ops with the
    functions above, and route the gated RMSNorm to its CPU op. Call before SGLang is imported."""
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
    sys.meta_path.insert(0, _SetAfterImport(MODULE_ATTRS))


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
    if choice == "reference":
        install()
    elif choice == "kernel":
        use_kernel(os.path.join(sys.prefix, "kernel-avx512"))
    else:
        raise SystemExit(f"{VARIABLE}={choice!r}: expected reference or kernel")
    return choice
