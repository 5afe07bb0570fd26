"""Run under the SGLang CPU environment's python: each reference op (the environment's
``evalsvc_sglang_cpu_ops``) against the ``sgl_kernel`` op it replaces, on the same inputs and pools,
in SGLang's own layouts. ``sgl_kernel`` is whichever build comes first on ``sys.path``: the
environment's portable (x86-64-v3) build, or the AVX-512 build where ``PYTHONPATH`` puts the
environment's ``kernel-avx512`` first. Ops the build has no path for on this CPU are reported as
``unavailable`` with the kernel's message.

Prints, as JSON, per op: the largest absolute difference of each output and pool, and the scale of
what was compared (the largest absolute value), so that the test judges differences relative to
bf16 rounding. The kernel keeps the SSM state transposed (``[HV, K, V]`` in a pool SGLang allocates
``[HV, V, K]``; it requires K == V), so its pool is given and read back transposed. Its varlen conv
ignores an initial state (upstream PR #29068), so the conv from pooled states is compared with the
kernel's non-varlen path on a one-slot view of the pool, which carries the state."""

import json
import sys

import evalsvc_sglang_cpu_ops as ref
import sgl_kernel
import torch

K = torch.ops.sgl_kernel
torch.manual_seed(0)
report: dict[str, dict] = {"sgl_kernel": sgl_kernel.__file__}
# the argument names of each op the reference ops replace, from the kernel's own schema
report["schemas"] = {name: [a.name for a in getattr(K, name).default._schema.arguments]
                     for name in ref.OPS}


def compare(name, pairs):
    report[name] = {key: {"max_abs_diff": float((a.float() - b.float()).abs().max()),
                          "scale": float(b.float().abs().max())} for key, (a, b) in pairs.items()}


def attempt(name, fn):
    try:
        fn()
    except RuntimeError as exc:
        report[name] = {"unavailable": str(exc).splitlines()[0][:300]}


HK, HV, DK = 2, 4, 64
LENS = [5, 70, 2]  # an extend shorter than the conv window, one over a chunk, one short
CU = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
T = int(CU[-1])
SLOTS = torch.tensor([4, 1, 3], dtype=torch.int32)


def gating():
    a, b = torch.randn(T, HV).bfloat16(), torch.randn(T, HV).bfloat16()
    A_log, dt = torch.randn(HV).bfloat16(), torch.randn(HV).bfloat16()
    g1, b1 = K.fused_gdn_gating_cpu(A_log, a, b, dt)
    g2, b2 = ref.fused_gdn_gating_cpu(A_log, a, b, dt)
    assert g1.shape == g2.shape and b1.shape == b2.shape and b1.dtype == b2.dtype
    compare("fused_gdn_gating_cpu", {"g": (g2, g1), "beta": (b2, b1)})


def rmsnorm_gated():
    x, z = torch.randn(T * HV, DK).bfloat16(), torch.randn(T * HV, DK).bfloat16()
    w = torch.randn(DK).bfloat16()
    compare("fused_rmsnorm_gated_cpu", {"out": (ref.fused_rmsnorm_gated_cpu(x, w, z, 1e-6),
                                                K.fused_rmsnorm_gated_cpu(x, w, z, 1e-6))})


def pool():
    return torch.randn(6, HV, DK, DK) * 0.1


def decode():
    n = 3
    q, k = torch.randn(1, n, HK, DK).bfloat16(), torch.randn(1, n, HK, DK).bfloat16()
    v = torch.randn(1, n, HV, DK).bfloat16()
    a, b = torch.randn(n, HV).bfloat16(), torch.randn(n, HV).bfloat16()
    A_log, dt = torch.randn(HV).bfloat16(), torch.randn(HV).bfloat16()
    cu, slots = torch.arange(n + 1, dtype=torch.int32), torch.tensor([0, 5, 2], dtype=torch.int32)
    start = pool()
    mine, theirs = start.clone(), start.transpose(-1, -2).contiguous()
    o2 = ref.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt, q, k, v, a, b, mine, slots, cu,
                                                        True)
    o1 = K.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt, q, k, v, a, b, theirs, slots, cu,
                                                      True)
    assert o1.shape == o2.shape, (o1.shape, o2.shape)
    compare("fused_sigmoid_gating_delta_rule_update_cpu",
            {"out": (o2, o1), "pool": (mine, theirs.transpose(-1, -2)),
             "moved": (mine, start)})


def chunked():
    q, k = torch.randn(1, T, HK, DK).bfloat16(), torch.randn(1, T, HK, DK).bfloat16()
    v = torch.randn(1, T, HV, DK).bfloat16()
    g, beta = -torch.rand(1, T, HV) * 0.5, torch.rand(1, T, HV).bfloat16()
    start = pool()
    mine, theirs = start.clone(), start.transpose(-1, -2).contiguous()
    o2, _ = ref.chunk_gated_delta_rule_cpu(q, k, v, g, beta, mine, True, CU, False, True, SLOTS)
    o1, _ = K.chunk_gated_delta_rule_cpu(q, k, v, g, beta, theirs, True, CU, False, True, SLOTS)
    compare("chunk_gated_delta_rule_cpu", {"out": (o2, o1), "pool": (mine, theirs.transpose(-1, -2)),
                                           "moved": (mine, start)})


DIM, WIDTH = 256, 4


def conv_pool():
    return torch.randn(6, DIM, WIDTH - 1).bfloat16()


def kernel_conv_pool(values):
    """The conv-state pool as SGLang allocates it on the kernel path (``_init_amx_conv_state``:
    shape ``[slot, dim, width - 1]``, stored width-major, which the kernel's writes assume)."""
    from sglang.srt.layers.amx_utils import _init_amx_conv_state

    pool = _init_amx_conv_state([torch.zeros(1, *values.shape, dtype=values.dtype)])[0][0]
    pool.copy_(values)
    return pool


def conv_fwd():
    # [dim, T] as the backend passes it: the transpose of the tokens' [T, dim] (the kernel checks)
    x, w = torch.randn(T, DIM).bfloat16().t(), torch.randn(DIM, WIDTH).bfloat16()
    bias = torch.randn(DIM).bfloat16()
    initial = torch.tensor([True, False, True])
    start = conv_pool()
    mine, theirs = start.clone(), kernel_conv_pool(start)
    o2 = ref.causal_conv1d_fwd_cpu(x, w, bias, mine, CU, SLOTS, initial, True, -1, False)
    outs = []
    for i, slot in enumerate(SLOTS.tolist()):  # per request, non-varlen, on a one-slot view
        s, e = CU[i].item(), CU[i + 1].item()
        view = theirs[slot:slot + 1]
        seq = x[:, s:e].t().contiguous()[None].transpose(1, 2)  # [1, dim, L], transposed too
        out = K.causal_conv1d_fwd_cpu(seq, w, bias, view, None,
                                      torch.tensor([0], dtype=torch.int32), initial[i:i + 1],
                                      True, -1, False)
        outs.append(out[0])
    o1 = torch.cat(outs, dim=1)
    compare("causal_conv1d_fwd_cpu", {"out": (o2, o1), "pool": (mine, theirs)})
    # the reference in the same per-request, non-varlen calls (the fix pr29068-cpu-conv-varlen-state)
    mine, outs = start.clone(), []
    for i, slot in enumerate(SLOTS.tolist()):
        s, e = CU[i].item(), CU[i + 1].item()
        seq = x[:, s:e].t().contiguous()[None].transpose(1, 2)
        outs.append(ref.causal_conv1d_fwd_cpu(seq, w, bias, mine[slot:slot + 1], None,
                                              torch.tensor([0], dtype=torch.int32),
                                              initial[i:i + 1], True, -1, False)[0])
    compare("causal_conv1d_fwd_cpu per request", {"out": (torch.cat(outs, dim=1), o1),
                                                  "pool": (mine, theirs)})
    # the varlen path SGLang takes: the same where no request starts from a state
    none = torch.zeros(3, dtype=torch.bool)
    mine, theirs = start.clone(), kernel_conv_pool(start)
    o2 = ref.causal_conv1d_fwd_cpu(x, w, bias, mine, CU, SLOTS, none, True, -1, False)
    o1 = K.causal_conv1d_fwd_cpu(x, w, bias, theirs, CU, SLOTS, none, True, -1, False)
    compare("causal_conv1d_fwd_cpu varlen, no initial state", {"out": (o2, o1),
                                                               "pool": (mine, theirs)})


def conv_update():
    x, w = torch.randn(3, DIM).bfloat16(), torch.randn(DIM, WIDTH).bfloat16()
    bias = torch.randn(DIM).bfloat16()
    start = conv_pool()
    mine, theirs = start.clone(), kernel_conv_pool(start)
    slots = torch.tensor([2, 0, 5], dtype=torch.int32)
    o2 = ref.causal_conv1d_update_cpu(x, mine, w, bias, True, None, slots, -1, False)
    o1 = K.causal_conv1d_update_cpu(x, theirs, w, bias, True, None, slots, -1, False)
    compare("causal_conv1d_update_cpu", {"out": (o2, o1), "pool": (mine, theirs)})


for name, fn in [("fused_gdn_gating_cpu", gating), ("fused_rmsnorm_gated_cpu", rmsnorm_gated),
                 ("fused_sigmoid_gating_delta_rule_update_cpu", decode),
                 ("chunk_gated_delta_rule_cpu", chunked), ("causal_conv1d_fwd_cpu", conv_fwd),
                 ("causal_conv1d_update_cpu", conv_update)]:
    attempt(name, fn)
json.dump(report, sys.stdout)
