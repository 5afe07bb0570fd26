"""Small hybrid recurrent + attention language models with an MTP draft head.

Two families, as SGLang serves them:

* ``mamba2``: Mamba2-style mixers (one decay per head, state ``[heads, head_dim, state_size]``),
  interleaved with attention, like Nemotron-H.
* ``gated_deltanet``: gated delta-rule mixers (state ``[heads, key_dim, value_dim]``), interleaved
  with attention, like Qwen3-Next.

Every recurrent mixer keeps two pieces of per-request state: the last ``conv_kernel - 1`` inputs of
its short causal convolution (``conv``, ``[channels, conv_kernel - 1]``) and its recurrent state
(``ssm``). Serving runs the recurrence one token at a time from an explicit initial state, so a state
saved after ``k`` tokens and resumed gives the same numbers as one pass over the whole sequence.
Training uses the equivalent parallel forms.

The MTP head is DeepSeek-style: at position ``s`` it reads the target's last hidden state ``h_s`` and
the embedding of token ``s + 1`` and predicts token ``s + 2``; its output hidden state feeds the next
draft step (EAGLE-style chaining). It has one recurrent block of the model's family, so a request
also owns *draft state*: that block's conv and ssm state plus the target hidden state at the last
position (``hidden``), which the next draft step pairs with the newest token.

Numerics (:class:`Numerics`, ``--dtype`` / ``--mamba-ssm-dtype``). In float32 (the default) prefill
and decode run the same per-token recurrence, so a cache hit reproduces a cold recompute to float32
rounding. In bfloat16 the engine computes as a GPU engine does, and a hit is only as close to a cold
recompute as that arithmetic allows:

* weights, activations, the residual stream, KV cache and conv states in bf16; the recurrent (ssm)
  state in ``--mamba-ssm-dtype`` (float32 by default, as SGLang keeps it); norms, gates, rotary
  embedding and the mixers' inner arithmetic in float32 on bf16 inputs, rounded to bf16 on output;
* an extend (prefill) runs the mixers in their chunked parallel form over 64-token chunks (the
  chunked scan / chunked delta rule of FLA's kernels), from the cached state; decode and
  speculative verify run the recurrent step;
* decode attention splits the keys into KV splits whose number depends on the batch size
  (flash-decoding, as SGLang's triton backend chooses ``num_kv_splits``) and merges them by
  log-sum-exp; an extend attends in one pass;
* linear layers and the logits are bf16 GEMMs: exact products, float32 accumulation, the output
  rounded to bf16 (:func:`linear`); logits are taken to float32 for the logprobs.

All logprobs are natural-log.
"""

from __future__ import annotations

import json
import math
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("mamba2", "gated_deltanet")
_mode = threading.local()


@contextmanager
def batch_invariant(on: bool = True):
    """Within this block (on this thread) the serving forward runs one request and one token at a
    time, so every number depends only on the token's own history: not on what else is batched,
    how a prompt is chunked, or whether a prefix came from the cache (elementwise kernels round
    the tail of a tensor differently from its body, so shapes must not vary). This is the embedded
    engine's ``--enable-deterministic-inference``; a cache hit then gives bit-identical logprobs."""
    old = getattr(_mode, "invariant", False)
    _mode.invariant = on
    try:
        yield
    finally:
        _mode.invariant = old


def _invariant() -> bool:
    return getattr(_mode, "invariant", False)


@dataclass(frozen=True)
class Numerics:
    """How the serving forward computes (see the module docstring)."""

    dtype: torch.dtype = torch.float32  # weights, activations, KV cache, conv state
    ssm_dtype: torch.dtype = torch.float32  # the recurrent state as stored between forwards
    # chunked prefill, recurrent decode and split-KV decode attention; without: one recurrence
    # and one attention for everything
    gpu_kernels: bool = False

    @classmethod
    def from_args(cls, dtype: str, ssm_dtype: str) -> Numerics:
        """``--dtype`` (``auto``: the checkpoint's float32) and ``--mamba-ssm-dtype``: bfloat16
        computes as a GPU engine does, float32 with the one exact recurrence."""
        dt = DTYPES["float32" if dtype == "auto" else dtype]
        return cls(dt, DTYPES[ssm_dtype], gpu_kernels=dt != torch.float32)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# parameters that stay float32 in every dtype (SGLang loads the decay and skip terms in float32)
FLOAT32_PARAMS = ("A_log", "dt_bias", "D")
MIXER_CHUNK = 64  # FLA's chunk size for the chunked forms of an extend
MAX_KV_SPLITS = 8


def kv_splits(batch: int) -> int:
    """Decode attention's KV splits for a batch of ``batch`` requests: as many as keep the device
    busy (flash-decoding), so the reduction order of one request depends on what it is batched
    with."""
    return max(1, min(MAX_KV_SPLITS, MAX_KV_SPLITS // batch))


def _native_bf16_gemm() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# torch's own bf16 GEMM where the CPU has bf16 instructions (oneDNN on AVX-512 or AMX); without
# them torch emulates it, 3 to 12 times slower than a float32 GEMM (BENCHMARKS.md)
NATIVE_BF16_GEMM = _native_bf16_gemm()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T``. A bf16 GEMM multiplies bf16 inputs exactly in float32 (8-bit mantissas: a
    product fits), accumulates in float32 and rounds the output to bf16, as a GPU's tensor cores
    do. Where torch has no native bf16 GEMM on this CPU, a float32 GEMM of the same values,
    rounded, computes exactly that: the same products, the same accumulator. Only the summation
    order can differ, from torch's emulation (about 1 output in 10,000 a unit in the last place
    apart) and between shapes: the float32 GEMM sums a product of 1 to 3 rows in another order
    than a larger one, so there, as a GPU's GEMMs do, a rare output depends on the batch."""
    if x.dtype != torch.bfloat16 or NATIVE_BF16_GEMM:
        return F.linear(x, weight)
    return F.linear(x.float(), weight.float()).to(torch.bfloat16)


class Linear(nn.Linear):
    """``nn.Linear`` without bias, through :func:`linear` (same parameters, same checkpoints)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def _rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    if not _invariant() or x.dim() != 2:
        return fn(x)
    return torch.cat([fn(x[i: i + 1]) for i in range(x.shape[0])])


@dataclass
class HybridConfig:
    family: str = "mamba2"
    vocab_size: int = 259
    hidden_size: int = 128
    intermediate_size: int = 256
    layer_types: list[str] = field(default_factory=lambda: ["recurrent", "attention"] * 2)
    num_attention_heads: int = 4
    head_dim: int = 32
    rope_theta: float = 10000.0
    # recurrent mixer
    num_ssm_heads: int = 4
    ssm_head_dim: int = 32
    ssm_state_size: int = 16  # mamba2 only; gated_deltanet uses ssm_head_dim for keys and values
    conv_kernel: int = 4
    # MTP head
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-5
    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"config.json: family must be one of {FAMILIES}, got {self.family!r}")
        bad = [t for t in self.layer_types if t not in ("recurrent", "attention")]
        if bad:
            raise ValueError(f"config.json: unknown layer_types {bad}")

    @property
    def architecture(self) -> str:
        if self.family == "mamba2":
            return "EvalsvcMamba2HybridForCausalLM"
        return "EvalsvcGatedDeltaNetHybridForCausalLM"

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "recurrent"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "attention"]

    def to_json(self) -> dict:
        data = asdict(self)
        return {"architectures": [self.architecture], "model_type": "evalsvc_hybrid",
                "torch_dtype": "float32", **data}

    @classmethod
    def from_json(cls, data: dict) -> HybridConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # computed in float32 on a bf16 input, rounded on output
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
                * self.weight.float()).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding; x: [..., T, H, D], positions: [T] (or broadcastable)."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32) / half))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, half]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inner = cfg.num_attention_heads * cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * inner)
        self.o = Linear(inner, cfg.hidden_size)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [T, D] -> q, k, v: [T, H, Dh] with rotary applied to q and k."""
        h, d = self.cfg.num_attention_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).view(x.shape[0], 3, h, d).unbind(1)
        return rope(q, positions, self.cfg.rope_theta), rope(k, positions, self.cfg.rope_theta), v

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pos = torch.arange(t)
        q, k, v = self.project(x.reshape(b * t, -1), pos.repeat(b))
        q, k, v = (z.view(b, t, *z.shape[1:]).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))

    @staticmethod
    def attend_batch(q, keys, vals, past_lens):
        """Attention of B segments in one call.

        q: [B, L, H, Dh], the new tokens of each segment right-padded to L; keys/vals:
        [B, S, H, Dh], each segment's cached keys followed by its new ones, right-padded to S.
        Segment b's query i sits at position ``past_lens[b] + i`` and sees keys up to it.
        Returns [B, L, H*Dh].
        """
        b, big_l, h, d = q.shape
        j = torch.arange(keys.shape[1])[None, None, :]
        i = torch.arange(big_l)[None, :, None]
        mask = j <= torch.tensor(past_lens)[:, None, None] + i  # [B, L, S]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                             vals.transpose(1, 2), attn_mask=mask[:, None])
        return out.transpose(1, 2).reshape(b, big_l, h * d)

    @staticmethod
    def attend_decode(q, keys, vals, past_lens):
        """Decode attention (one query per segment) split over the keys, flash-decoding style:
        each of ``kv_splits(B)`` splits gets its own float32 softmax, merged by log-sum-exp.
        q: [B, 1, H, Dh]; keys/vals: [B, S, H, Dh] (segment b's valid keys: 0..past_lens[b]).
        Returns [B, 1, H*Dh] in the inputs' dtype."""
        b, s, h, d = keys.shape
        scores = torch.einsum("bhd,bshd->bhs", q[:, 0].float() / math.sqrt(d), keys.float())
        valid = torch.arange(s)[None, :] <= torch.tensor(past_lens)[:, None]  # [B, S]
        scores = scores.masked_fill(~valid[:, None, :], -torch.inf)
        size = -(-s // kv_splits(b))
        outs, lses = [], []
        for i in range(0, s, size):
            part = scores[..., i: i + size]
            m = part.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
            p = torch.exp(part - m)
            total = p.sum(-1, keepdim=True)
            outs.append(torch.einsum("bhs,bshd->bhd", p, vals[:, i: i + size].float())
                        / total.clamp_min(1e-30))
            lses.append(m + torch.log(total))  # -inf for a split without valid keys
        lse = torch.stack(lses)  # [splits, B, H, 1]
        weights = torch.exp(lse - torch.logsumexp(lse, dim=0, keepdim=True))
        out = (weights * torch.stack(outs)).sum(0)
        return out.reshape(b, 1, h * d).to(q.dtype)


class CausalConv(nn.Module):
    """Depthwise causal conv1d whose state is the last ``kernel - 1`` inputs."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel) / math.sqrt(kernel))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.kernel = kernel

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, C] -> [B, L, C] from a zero state."""
        xt = F.pad(x.transpose(1, 2), (self.kernel - 1, 0))
        return F.conv1d(xt, self.weight, self.bias, groups=x.shape[-1]).transpose(1, 2)

    def forward_state(self, x: torch.Tensor, state: torch.Tensor):
        """x: [B, L, C] (padded), state: [B, C, K-1] -> (out [B, L, C] in float32, before the
        activation; full input [B, C, K-1+L] in x's dtype, whose tail is the next conv state)."""
        full = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)
        out = F.conv1d(full.float(), self.weight.float(), self.bias.float(),
                       groups=x.shape[-1]).transpose(1, 2)
        return out, full


@dataclass
class ScanResult:
    """Output of a recurrent mixer over padded segments.

    ``out``: [B, L, D]; ``conv``/``ssm``: final state per segment (after ``lengths[b]`` tokens);
    ``captured``: {(b, k): (conv, ssm)}: state after ``k`` tokens of segment ``b``.
    """

    out: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor
    captured: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


def _conv_state_after(full: torch.Tensor, b: int, k: int, width: int) -> torch.Tensor:
    return full[b, :, k: k + width].clone()


class RecurrentMixer(nn.Module):
    """Shared serving loop for both families: conv, then the scan, per token (``scan``) or in
    chunks (``scan_chunked``).

    The arithmetic inside a mixer is float32 whatever the dtype (bf16 inputs are taken to float32,
    as the kernels do); its output is rounded to the input's dtype, conv states keep the input's
    dtype and ssm states the dtype they came in (the pool's ``--mamba-ssm-dtype``)."""

    conv_channels: int
    conv: CausalConv

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    def _conv(self, pre: dict[str, torch.Tensor], conv_state: torch.Tensor) -> torch.Tensor:
        conv_out, full = self.conv.forward_state(pre["conv_in"], conv_state)
        pre["conv_out"] = F.silu(conv_out).to(pre["conv_in"].dtype)
        return full

    def scan(self, x: torch.Tensor, lengths: list[int], conv_state: torch.Tensor,
             ssm_state: torch.Tensor, capture: list[tuple[int, int]]) -> ScanResult:
        """The recurrent form. x: [B, L, D] (segments right-padded), lengths: tokens per segment,
        states: [B, ...]."""
        b, big_l, _ = x.shape
        pre = self.pre_conv(x)
        full = self._conv(pre, conv_state)
        want: dict[int, list[int]] = {}
        for seg, k in capture:
            want.setdefault(k, []).append(seg)
        captured: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        width = self.conv.kernel - 1
        h = ssm_state.float()
        per_token, after = self.scan_inputs(pre)
        # each input as its L per-token views, taken in one call each: the same data, strides and
        # arithmetic as slicing token t in the loop, without a dispatch per input and token
        per_token = [v.unbind(1) for v in per_token]
        # every segment runs up to the shortest; past it, segment b runs at token t if valid[t][b]
        shortest = min(lengths)
        if shortest < big_l:
            valid = (torch.tensor(lengths)[None, :] > torch.arange(big_l)[:, None])
            valid = valid.view(big_l, b, *([1] * (h.dim() - 1))).unbind(0)
        ys = []
        for t in range(big_l):
            h_new, y = self.step(h, *(v[t] for v in per_token))
            h = h_new if t < shortest else torch.where(valid[t], h_new, h)
            ys.append(y)
            for seg in want.get(t + 1, ()):
                captured[(seg, t + 1)] = (_conv_state_after(full, seg, t + 1, width),
                                          h[seg].to(ssm_state.dtype, copy=True))
        y = self.finish(torch.stack(ys, dim=1), *after).to(x.dtype)
        conv_final = torch.stack([full[i, :, n: n + width] for i, n in enumerate(lengths)])
        return ScanResult(self.post(y, pre), conv_final.contiguous(), h.to(ssm_state.dtype),
                          captured)

    def scan_chunked(self, x: torch.Tensor, lengths: list[int], conv_state: torch.Tensor,
                     ssm_state: torch.Tensor, capture: list[tuple[int, int]]) -> ScanResult:
        """The chunked parallel form (an extend on a GPU engine): each segment alone, in
        ``MIXER_CHUNK``-token chunks from its state; a state captured after ``k`` tokens ends a
        piece there (the kernels hand out states at the ends of what they ran)."""
        pre = self.pre_conv(x)
        width = self.conv.kernel - 1
        wanted = set(capture)
        captured: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        ys, convs, ssms = [], [], []
        for b, n in enumerate(lengths):
            conv_s, h = conv_state[b: b + 1], ssm_state[b: b + 1].float()
            cuts = sorted({k for seg, k in capture if seg == b and 0 < k < n} | {n})
            start, parts = 0, []
            for end in cuts:
                piece = {k: v[b: b + 1, start: end] for k, v in pre.items()}
                full = self._conv(piece, conv_s)
                y, h = self.chunk_scan(piece, h)
                parts.append(y)
                conv_s = full[:, :, -width:]
                if (b, end) in wanted:
                    captured[(b, end)] = (conv_s[0].clone(), h[0].to(ssm_state.dtype, copy=True))
                start = end
            y = torch.cat(parts, dim=1)
            ys.append(F.pad(y, (0, 0) * (y.dim() - 2) + (0, x.shape[1] - n)))
            convs.append(conv_s[0])
            ssms.append(h[0])
        y = torch.cat(ys).to(x.dtype)
        return ScanResult(self.post(y, pre), torch.stack(convs).contiguous(),
                          torch.stack(ssms).to(ssm_state.dtype), captured)

    def chunk_scan(self, pre: dict[str, torch.Tensor], h: torch.Tensor):
        """One piece of one segment, chunk-parallel from state ``h`` (float32): (y in float32,
        the state after it)."""
        raise NotImplementedError

    # family-specific pieces
    def pre_conv(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def scan_inputs(self, pre: dict[str, torch.Tensor]
                    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """What ``step`` takes per token, [B, L, ...] each and shaped to broadcast against the
        state, and what ``finish`` takes once, [B, L, ...]."""
        raise NotImplementedError

    def step(self, h: torch.Tensor, *inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: (the state after it, its output before ``finish``)."""
        raise NotImplementedError

    def finish(self, y: torch.Tensor, *inp: torch.Tensor) -> torch.Tensor:
        """The outputs, float32 [B, L, ...], from the steps' [B, L, ...]: what does not depend on
        the state, added once rather than at each token."""
        return y

    def post(self, y: torch.Tensor, pre: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.h, self.p, self.n = cfg.num_ssm_heads, cfg.ssm_head_dim, cfg.ssm_state_size
        self.inner = self.h * self.p
        self.conv_channels = self.inner + 2 * self.n
        self.in_proj = Linear(cfg.hidden_size, 2 * self.inner + 2 * self.n + self.h)
        self.conv = CausalConv(self.conv_channels, cfg.conv_kernel)
        self.dt_bias = nn.Parameter(torch.log(torch.expm1(torch.linspace(1e-3, 1e-1, self.h))))
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, self.h)))
        self.D = nn.Parameter(torch.ones(self.h))
        self.norm = RMSNorm(self.inner, cfg.rms_norm_eps)
        self.out_proj = Linear(self.inner, cfg.hidden_size)

    def state_shapes(self):
        return (self.conv_channels, self.conv.kernel - 1), (self.h, self.p, self.n)

    def pre_conv(self, x):
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_channels, self.h], dim=-1)
        return {"z": z, "conv_in": xbc, "dt": F.softplus(dt.float() + self.dt_bias)}

    def _split(self, pre):
        xs, bm, cm = pre["conv_out"].float().split([self.inner, self.n, self.n], dim=-1)
        return xs.unflatten(-1, (self.h, self.p)), bm, cm

    def scan_inputs(self, pre):
        """Per token: the decay, dt x, B and C, shaped to broadcast against the state
        [B, H, P, N] (views: no copy); once: the skip D x [B, L, H, P]."""
        xs, bm, cm = self._split(pre)
        dt = pre["dt"]
        da = torch.exp(dt * -torch.exp(self.A_log))
        return ((da[..., None, None], (xs * dt[..., None])[..., None], bm[:, :, None, None, :],
                 cm[:, :, None, None, :]), (self.D[:, None] * xs,))

    def step(self, h, da, dtx, bm, cm):
        h = h * da + dtx * bm
        return h, (h * cm).sum(-1)

    def finish(self, y, dx):
        return y + dx

    def chunk_scan(self, pre, h):
        xs, bm, cm = self._split(pre)
        dt = pre["dt"]
        y, h = chunk_ssd(xs * dt[..., None], dt * -torch.exp(self.A_log), bm, cm, MIXER_CHUNK,
                         initial_state=h, return_state=True)
        return y + self.D[:, None] * xs, h

    def post(self, y, pre):
        y = y.flatten(-2) * F.silu(pre["z"])
        return self.out_proj(self.norm(y))

    def forward_train(self, x: torch.Tensor, chunk: int = 64) -> torch.Tensor:
        """Chunked parallel (SSD) form over [B, L, D] from a zero state."""
        pre = self.pre_conv(x)
        pre["conv_out"] = F.silu(self.conv.forward_train(pre["conv_in"]))
        xs, bm, cm = self._split(pre)
        dt = pre["dt"]  # [B, L, H]
        y = chunk_ssd(xs * dt[..., None], dt * -torch.exp(self.A_log), bm, cm, chunk)
        return self.post(y + self.D[:, None] * xs, pre)


def chunk_ssd(dtx, a, bm, cm, chunk: int = 64, initial_state=None, return_state: bool = False):
    """Mamba2 scan, chunk-parallel. dtx: [B, L, H, P], a (log decay): [B, L, H], bm, cm: [B, L, N].

    Returns y [B, L, H, P] with y_t = C_t . h_t and h_t = exp(a_t) h_{t-1} + dtx_t (x) B_t, from
    ``initial_state`` h_0 ([B, H, P, N], zeros if None); with ``return_state``, (y, h_L).
    """
    b, big_l, h, p = dtx.shape
    pad = (chunk - big_l % chunk) % chunk
    dtx = F.pad(dtx, (0, 0, 0, 0, 0, pad)).view(b, -1, chunk, h, p)
    a = F.pad(a, (0, 0, 0, pad)).view(b, -1, chunk, h).permute(0, 3, 1, 2)  # [B, H, n, c]
    bm = F.pad(bm, (0, 0, 0, pad)).view(b, -1, chunk, bm.shape[-1])  # [B, n, c, N]
    cm = F.pad(cm, (0, 0, 0, pad)).view(b, -1, chunk, cm.shape[-1])
    cum = a.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, -torch.inf))
    cb = cm @ bm.transpose(-1, -2)  # [B, n, c, c]
    xh = dtx.permute(0, 3, 1, 2, 4)  # [B, H, n, c, P]
    y = (decay * cb[:, None]) @ xh  # intra-chunk
    to_end = torch.exp(cum[..., -1:] - cum)  # [B, H, n, c]
    states = (xh * to_end[..., None]).transpose(-1, -2) @ bm[:, None]  # [B, H, n, P, N]
    run = torch.zeros(b, h, p, bm.shape[-1]) if initial_state is None else initial_state
    inter = []
    for i in range(cum.shape[2]):
        inter.append(run)
        run = run * torch.exp(cum[:, :, i, -1])[..., None, None] + states[:, :, i]
    prev = torch.stack(inter, dim=2)  # state entering each chunk [B, H, n, P, N]
    y = y + (cm[:, None] @ prev.transpose(-1, -2)) * torch.exp(cum)[..., None]
    y = y.permute(0, 2, 3, 1, 4).reshape(b, -1, h, p)[:, :big_l]
    return (y, run) if return_state else y


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNetMixer(RecurrentMixer):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.h, self.dk = cfg.num_ssm_heads, cfg.ssm_head_dim
        self.inner = self.h * self.dk
        self.conv_channels = 3 * self.inner
        self.in_proj = Linear(cfg.hidden_size, 4 * self.inner + 2 * self.h)
        self.conv = CausalConv(self.conv_channels, cfg.conv_kernel)
        self.dt_bias = nn.Parameter(torch.zeros(self.h))
        self.A_log = nn.Parameter(torch.log(torch.linspace(0.5, 8.0, self.h)))
        self.norm = RMSNorm(self.dk, cfg.rms_norm_eps)
        self.out_proj = Linear(self.inner, cfg.hidden_size)

    def state_shapes(self):
        return (self.conv_channels, self.conv.kernel - 1), (self.h, self.dk, self.dk)

    def pre_conv(self, x):
        qkv, z, b, a = self.in_proj(x).split([self.conv_channels, self.inner, self.h, self.h], -1)
        g = -torch.exp(self.A_log) * F.softplus(a.float() + self.dt_bias)
        return {"conv_in": qkv, "z": z, "beta": torch.sigmoid(b.float()), "g": g}

    def _qkv(self, pre):
        q, k, v = pre["conv_out"].float().split([self.inner] * 3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.h, self.dk)) for t in (q, k, v))
        return _l2norm(q) / math.sqrt(self.dk), _l2norm(k), v

    def scan_inputs(self, pre):
        """Per token: the decay, k, v, beta and q, shaped to broadcast against the state
        [B, H, dk, dv] (views: no copy)."""
        q, k, v = self._qkv(pre)
        decay = torch.exp(pre["g"])[..., None, None]
        return (decay, k[..., None], v, pre["beta"][..., None], q[..., None]), ()

    def step(self, s, decay, k, v, beta, q):
        s = s * decay
        mem = (s * k).sum(2)  # [B, H, dv]
        delta = (v - mem) * beta
        s = s + k * delta[:, :, None, :]
        return s, (s * q).sum(2)

    def chunk_scan(self, pre, h):
        q, k, v = self._qkv(pre)
        return chunk_gated_delta_rule(q, k, v, pre["g"], pre["beta"], MIXER_CHUNK, state=h,
                                      return_state=True)

    def post(self, y, pre):
        z = pre["z"].unflatten(-1, (self.h, self.dk))
        y = (self.norm(y) * F.silu(z)).flatten(-2)
        return self.out_proj(y)

    def forward_train(self, x: torch.Tensor, chunk: int = 64) -> torch.Tensor:
        """Chunked parallel form (WY representation) over [B, L, D] from a zero state."""
        pre = self.pre_conv(x)
        pre["conv_out"] = F.silu(self.conv.forward_train(pre["conv_in"]))
        q, k, v = self._qkv(pre)
        y = chunk_gated_delta_rule(q, k, v, pre["g"], pre["beta"], chunk)
        return self.post(y, pre)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int = 64, state=None,
                           return_state: bool = False):
    """q, k, v: [B, L, H, D]; g (log decay), beta: [B, L, H] -> y [B, L, H, Dv].

    Same values as the token-by-token recurrence from ``state`` ([B, H, Dk, Dv], zeros if None),
    computed chunk-parallel (training, and an extend in GPU-like numerics); with
    ``return_state``, (y, the state after the last token).
    """
    b, big_l, h, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk - big_l % chunk) % chunk
    q, k, v = (F.pad(t.transpose(1, 2), (0, 0, 0, pad)) for t in (q, k, v))  # [B, H, Lp, D]
    g, beta = (F.pad(t.transpose(1, 2), (0, pad)) for t in (g, beta))  # [B, H, Lp]
    n = q.shape[2] // chunk
    q, k, v = (t.reshape(b, h, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    g = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    decay = torch.exp((g[..., :, None] - g[..., None, :]).masked_fill(~lower, -torch.inf))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strict = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)
    a = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(chunk)
    t_inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False)
    u = t_inv @ v_beta  # [B, H, N, C, dv]
    w = t_inv @ (k_beta * g.exp()[..., None])  # [B, H, N, C, dk]
    s = torch.zeros(b, h, dk, dv) if state is None else state
    outs = []
    for i in range(n):
        qi, ki, gi = q[:, :, i], k[:, :, i], g[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ s
        intra = (qi @ ki.transpose(-1, -2) * decay[:, :, i]) @ v_new
        outs.append((qi * gi.exp()[..., None]) @ s + intra)
        to_end = (ki * (gi[..., -1:] - gi).exp()[..., None]).transpose(-1, -2)
        s = s * gi[..., -1, None, None].exp() + to_end @ v_new
    y = torch.stack(outs, dim=2).reshape(b, h, n * chunk, dv)[:, :, :big_l].transpose(1, 2)
    return (y, s) if return_state else y


def make_mixer(cfg: HybridConfig) -> RecurrentMixer:
    return Mamba2Mixer(cfg) if cfg.family == "mamba2" else GatedDeltaNetMixer(cfg)


class Block(nn.Module):
    def __init__(self, cfg: HybridConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = Attention(cfg) if kind == "attention" else make_mixer(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer.forward_train(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MTPHead(nn.Module):
    """DeepSeek-style next-next-token head with one recurrent block."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.block = Block(cfg, "recurrent")
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.hnorm(hidden), self.enorm(emb)], dim=-1))

    def forward_train(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.block.forward_train(self.fuse(hidden, emb))


class KVAccess(Protocol):
    """Where attention layers keep keys and values (the engine's KV pool)."""

    past_lens: list[int]  # cached positions of each segment

    def step(self, b: int, t: int) -> KVAccess:
        """The same store, for token t of segment b alone (earlier tokens become its past)."""

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Keep the new k, v ([T, H, Dh], segments concatenated) of attention layer ``layer``;
        return that layer's keys and values per segment, past then new, right-padded:
        ([B, S, H, Dh], [B, S, H, Dh])."""


@dataclass
class SegmentStates:
    """Recurrent states for B segments: per recurrent layer, conv [B, C, K-1] and ssm [B, ...]."""

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]


    def select(self, b: int) -> SegmentStates:
        return SegmentStates([c[b: b + 1] for c in self.conv], [s[b: b + 1] for s in self.ssm])

    @staticmethod
    def concat(parts: list[SegmentStates]) -> SegmentStates:
        return SegmentStates([torch.cat(c) for c in zip(*(p.conv for p in parts), strict=True)],
                             [torch.cat(s) for s in zip(*(p.ssm for p in parts), strict=True)])


@dataclass
class SegmentOutput:
    hidden: torch.Tensor  # [T, D] last hidden state (before the final norm), concatenated
    new_k: list[torch.Tensor]  # per attention layer [T, H, Dh]
    new_v: list[torch.Tensor]
    states: SegmentStates  # final states per segment
    captured: dict[tuple[int, int], SegmentStates]  # (segment, k) -> states after k tokens, B=1


class HybridLM(nn.Module):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(Block(cfg, t) for t in cfg.layer_types)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mtp = MTPHead(cfg) if cfg.num_nextn_predict_layers else None
        self.numerics = Numerics()

    def set_numerics(self, numerics: Numerics) -> HybridLM:
        """Serve in these numerics: weights cast to its dtype (the decay and skip parameters stay
        float32)."""
        for name, param in self.named_parameters():
            want = torch.float32 if name.rsplit(".", 1)[-1] in FLOAT32_PARAMS else numerics.dtype
            param.data = param.data.to(want)
        self.numerics = numerics
        return self

    # ----- training -------------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, computed in the model's dtype (as SGLang's logits processor does)."""
        return _rowwise(lambda h: linear(self.final_norm(h), self.embed.weight), hidden).float()

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.mtp is not None
        return _rowwise(lambda h: linear(self.mtp.final_norm(h), self.embed.weight), hidden).float()

    def forward_train(self, ids: torch.Tensor):
        """ids [B, L] -> (target logits [B, L, V], draft logits [B, L-1, V] for token s+2)."""
        x = self.embed(ids)
        for layer in self.layers:
            x = layer.forward_train(x)
        logits = self.logits(x)
        draft = None
        if self.mtp is not None:
            d = self.mtp.forward_train(x[:, :-1].detach(), self.embed(ids[:, 1:]))
            draft = self.draft_logits(d)
        return logits, draft

    # ----- serving ----------------------------------------------------------------------------
    def recurrent_mixers(self) -> list[RecurrentMixer]:
        return [self.layers[i].mixer for i in self.cfg.recurrent_layers]

    def forward_segments(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        lengths: list[int],
        kv: KVAccess,
        states: SegmentStates,
        capture: list[tuple[int, int]] = (),
        mode: str = "extend",
    ) -> SegmentOutput:
        """Run B segments (one per request) continuing from their states.

        ids, positions: [T] concatenated tokens of all segments (T = sum(lengths)); ``kv`` stores
        each attention layer's new keys and values and returns every segment's full keys and
        values (see :class:`KVAccess`);
        ``states`` are the recurrent states each segment starts from. ``capture`` lists
        (segment, k) pairs whose states after k tokens are returned as well. ``mode`` is the
        forward's kind, ``extend``, ``decode`` or ``target_verify``: in GPU-like numerics an
        extend runs the chunked forms and the rest the recurrent step, and decode attention is
        split over the keys (in float32 everything runs the one recurrence).
        """
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        if _invariant():  # one token at a time, every one the same way: a decode step
            mode = "decode"
            if lengths != [1]:
                return self._token_by_token(ids, positions, lengths, offsets, kv, states, capture)
        gpu_like = self.numerics.gpu_kernels
        x = self.embed(ids)
        new_k, new_v, conv_out, ssm_out = [], [], [], []
        captured: dict[tuple[int, int], SegmentStates] = {c: SegmentStates([], []) for c in capture}
        r = 0
        for layer in self.layers:
            h = layer.norm1(x)
            if layer.kind == "attention":
                q, k, v = layer.mixer.project(h, positions)
                keys, vals = kv.store(len(new_k), k, v)
                new_k.append(k)
                new_v.append(v)
                attend = (Attention.attend_decode if gpu_like and mode == "decode"
                          else Attention.attend_batch)
                out = attend(_pad_segments(q.flatten(1), offsets).unflatten(-1, q.shape[1:]),
                             keys, vals, kv.past_lens)
                mixed = layer.mixer.o(_unpad_segments(out, lengths))
            else:
                scan = (layer.mixer.scan_chunked if gpu_like and mode == "extend"
                        else layer.mixer.scan)
                res = scan(_pad_segments(h, offsets), lengths, states.conv[r], states.ssm[r],
                           list(capture))
                mixed = _unpad_segments(res.out, lengths)
                conv_out.append(res.conv)
                ssm_out.append(res.ssm)
                for key, (c, st) in res.captured.items():
                    captured[key].conv.append(c[None])
                    captured[key].ssm.append(st[None])
                r += 1
            x = x + mixed
            x = x + layer.mlp(layer.norm2(x))
        return SegmentOutput(x, new_k, new_v, SegmentStates(conv_out, ssm_out), captured)

    def _token_by_token(self, ids, positions, lengths, offsets, kv, states, capture):
        outs = []
        for b, n in enumerate(lengths):
            st, steps = states.select(b), []
            for t in range(n):
                i = offsets[b] + t
                out = self.forward_segments(ids[i: i + 1], positions[i: i + 1], [1], kv.step(b, t),
                                            st, [(0, 1)] if (b, t + 1) in capture else [])
                st = out.states
                if out.captured:
                    out.captured = {(0, t + 1): out.captured[(0, 1)]}
                steps.append(out)
            outs.append(_merge_steps(steps, st))
        return _merge(outs)

    def draft_segments(self, hidden: torch.Tensor, next_ids: torch.Tensor, lengths: list[int],
                       states: SegmentStates, capture: list[tuple[int, int]] = (),
                       mode: str = "decode"):
        """MTP head over pairs (hidden_s, token_{s+1}) -> (draft hidden [T, D], states, captured).
        ``mode``: ``extend`` (the draft-extend after a prefill: chunked in GPU-like numerics) or
        ``decode`` (draft steps, and the draft-extend after a verify: recurrent)."""
        assert self.mtp is not None
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        if _invariant() and lengths != [1]:
            hid, finals, captured = [], [], {}
            for b, n in enumerate(lengths):
                st = states.select(b)
                for t in range(n):
                    i = offsets[b] + t
                    h, st, cap = self.draft_segments(hidden[i: i + 1], next_ids[i: i + 1], [1], st,
                                                     [(0, 1)] if (b, t + 1) in capture else [])
                    hid.append(h)
                    if cap:
                        captured[(b, t + 1)] = cap[(0, 1)]
                finals.append(st)
            return torch.cat(hid), SegmentStates.concat(finals), captured
        x = self.mtp.fuse(hidden, self.embed(next_ids))
        block = self.mtp.block
        scan = (block.mixer.scan_chunked if self.numerics.gpu_kernels and mode == "extend"
                and not _invariant() else block.mixer.scan)
        res = scan(_pad_segments(block.norm1(x), offsets), lengths, states.conv[0], states.ssm[0],
                   list(capture))
        x = x + _unpad_segments(res.out, lengths)
        x = x + block.mlp(block.norm2(x))
        captured = {key: SegmentStates([c[None]], [s[None]]) for key, (c, s) in res.captured.items()}
        return x, SegmentStates([res.conv], [res.ssm]), captured


def _merge_steps(steps: list[SegmentOutput], final: SegmentStates) -> SegmentOutput:
    """One segment's single-token outputs, in order, as one segment's output."""
    return SegmentOutput(
        hidden=torch.cat([o.hidden for o in steps]),
        new_k=[torch.cat(k) for k in zip(*(o.new_k for o in steps), strict=True)],
        new_v=[torch.cat(v) for v in zip(*(o.new_v for o in steps), strict=True)],
        states=final,
        captured={(0, k): v for o in steps for (_, k), v in o.captured.items()})


def _merge(outs: list[SegmentOutput]) -> SegmentOutput:
    """Concatenate single-segment outputs in segment order."""
    return SegmentOutput(
        hidden=torch.cat([o.hidden for o in outs]),
        new_k=[torch.cat(k) for k in zip(*(o.new_k for o in outs), strict=True)],
        new_v=[torch.cat(v) for v in zip(*(o.new_v for o in outs), strict=True)],
        states=SegmentStates.concat([o.states for o in outs]),
        captured={(b, k): v for b, o in enumerate(outs) for (_, k), v in o.captured.items()})


def _pad_segments(x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    lengths = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    big_l = max(lengths)
    if all(n == big_l for n in lengths):
        return x.view(len(lengths), big_l, -1)
    out = x.new_zeros(len(lengths), big_l, x.shape[-1])
    for b, n in enumerate(lengths):
        out[b, :n] = x[offsets[b]: offsets[b] + n]
    return out


def _unpad_segments(y: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    if all(n == y.shape[1] for n in lengths):
        return y.reshape(-1, y.shape[-1])
    return torch.cat([y[b, :n] for b, n in enumerate(lengths)])


def load_model(path: str | Path, numerics: Numerics | None = None) -> HybridLM:
    """Load a model directory (config.json + model.safetensors), to serve in ``numerics``
    (default: float32)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no config.json in the model directory")
    cfg = HybridConfig.from_json(json.loads(cfg_file.read_text()))
    model = HybridLM(cfg)
    weights_file = path / "model.safetensors"
    if not weights_file.is_file():
        raise FileNotFoundError(f"{weights_file}: no such file (the model's weights)")
    weights = load_file(str(weights_file))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path / 'model.safetensors'}: missing {missing}, unexpected {unexpected}")
    model.eval()
    return model.set_numerics(numerics) if numerics is not None else model


def save_model(model: HybridLM, path: str | Path) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.cfg.to_json(), indent=2) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
