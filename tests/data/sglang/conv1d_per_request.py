"""Run under the SGLang CPU environment's python, with the AVX-512 kernel first on ``PYTHONPATH``
and ``EVALSVC_CPU_OPS=kernel``, or on the reference ops (``EVALSVC_CPU_OPS=reference``):
SGLang 0.5.17's gated-deltanet prefill conv as its CPU branch binds it (``causal_conv1d_fn`` of
``sglang.srt.layers.attention.linear.gdn_backend``), unpatched (the environment's SGLang) and with
the fix ``pr29068-cpu-conv-varlen-state`` (the patched ``gdn_backend.py`` given as argv[1], loaded
as its own module), called as the backend calls it, in the pool layout and with the weights SGLang
uses on that path (the kernel's: its CPU pool layout and packed weights).

Three requests in slots 4, 1 and 3 of a pool whose every slot holds random values: first extends
from no state, then two more from the state each left (among them extends of 2 and 1 tokens, shorter
than the conv window). Prints, as JSON, per binding: the largest difference of each stage's
outputs from one pass over the whole sequences (over all and over each request's first width - 1
outputs), whether each request's conv state then holds its last width - 1 tokens, the final states'
difference from the one pass's, and how much the untouched slots moved; which function each module
binds; and the outputs' strides."""

import importlib.util
import json
import os
import sys

import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
import sglang.srt.layers.attention.linear.gdn_backend as unpatched
import torch
from sgl_kernel.mamba import causal_conv1d_fn_cpu
from sglang.srt.layers.amx_utils import _init_amx_conv_state

spec = importlib.util.spec_from_file_location("gdn_backend_patched", sys.argv[1])
patched = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patched)

torch.manual_seed(0)
DIM, WIDTH, SLOTS = 256, 4, [4, 1, 3]
STAGES = [[20, 9, 5], [12, 2, 1], [6, 7, 3]]  # tokens per request in each extend
KERNEL = os.environ.get("EVALSVC_CPU_OPS") == "kernel"  # else the reference ops replace the kernel's
weight = torch.randn(DIM, WIDTH).bfloat16()
if KERNEL:  # SGLang packs the conv weight where it takes the kernel path (its AMX check says yes)
    weight = torch.ops.sgl_kernel.causal_conv1d_weight_pack(weight)
bias = torch.randn(DIM).bfloat16()
tokens = [torch.randn(sum(s[r] for s in STAGES), DIM).bfloat16() for r in range(len(SLOTS))]
start_pool = torch.randn(6, DIM, WIDTH - 1).bfloat16()


def pool() -> torch.Tensor:
    """One layer's conv states as SGLang allocates them: its CPU layout on the kernel path, the GPU
    layout on the reference path."""
    if not KERNEL:
        return start_pool.clone()
    p = _init_amx_conv_state([torch.zeros(1, *start_pool.shape, dtype=torch.bfloat16)])[0][0]
    p.copy_(start_pool)
    return p


def call(fn, parts, states, initial):
    lens = [p.shape[0] for p in parts]
    x = torch.cat(parts).t()  # [dim, T]: the transpose of the tokens, as the backend passes it
    loc = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = fn(x, weight, bias, activation="silu", conv_states=states,
             has_initial_state=torch.tensor([initial] * len(parts)),
             cache_indices=torch.tensor(SLOTS, dtype=torch.int32), query_start_loc=loc,
             seq_lens_cpu=lens)
    return out, [out[:, a:b].t().float() for a, b in zip(loc[:-1].tolist(), loc[1:].tolist(), strict=True)]


def run(fn) -> dict:
    once_pool = pool()
    _, once = call(fn, tokens, once_pool, False)
    states, done, stages = pool(), [0] * len(SLOTS), []
    for k, lens in enumerate(STAGES):
        parts = [t[d:d + n] for t, d, n in zip(tokens, done, lens, strict=True)]
        out, outs = call(fn, parts, states, k > 0)
        stages.append({"lens": lens, "max_difference": max(
            float((o - w[d:d + n]).abs().max()) for o, w, d, n in zip(outs, once, done, lens, strict=True)),
            "first_tokens_difference": [float((o[:WIDTH - 1] - w[d:d + n][:WIDTH - 1]).abs().max())
                                        for o, w, d, n in zip(outs, once, done, lens, strict=True)]})
        done = [d + n for d, n in zip(done, lens, strict=True)]
        # the state each request leaves: its last width - 1 tokens so far (every one has 3 or more)
        stages[-1]["state_holds_last_tokens"] = [
            torch.equal(states[s].float(), t[d - (WIDTH - 1):d].t().float())
            for s, t, d in zip(SLOTS, tokens, done, strict=True)]
    others = [s for s in range(start_pool.shape[0]) if s not in SLOTS]
    return {"stages": stages, "stride": list(out.stride()), "dtype": str(out.dtype),
            "final_state_difference": float((states[SLOTS].float() - once_pool[SLOTS].float())
                                            .abs().max()),
            "other_slots_moved": float((states[others].float() - start_pool[others].float())
                                       .abs().max())}


print(json.dumps({
    "unpatched_binds": unpatched.causal_conv1d_fn.__qualname__,
    "unpatched_is_kernel_wrapper": unpatched.causal_conv1d_fn is causal_conv1d_fn_cpu,
    "patched_binds": patched.causal_conv1d_fn.__qualname__,
    "unpatched": run(unpatched.causal_conv1d_fn),
    "patched": run(patched.causal_conv1d_fn)}))
