"""The embedded engine's recurrent scan as the per-token loop it replaced (``reference_scan``),
and random cases of the shipped sizes (``make_case``): the oracle
``tests/engines/embedded/test_scan.py`` pins ``RecurrentMixer.scan`` against, and the loop
``benchmarks/scan.py`` times it against."""

from __future__ import annotations

import math

import torch

from evalsvc.engines.embedded.model import GatedDeltaNetMixer, HybridConfig, Mamba2Mixer


def mamba2_inputs(mixer, pre):
    xs, bm, cm = mixer._split(pre)
    dt = pre["dt"]
    return {"x": xs, "dtx": xs * dt[..., None], "B": bm, "C": cm,
            "dA": torch.exp(dt * -torch.exp(mixer.A_log))}


def mamba2_step(mixer, h, inp):
    h = h * inp["dA"][:, :, None, None] + inp["dtx"][:, :, :, None] * inp["B"][:, None, None, :]
    y = (h * inp["C"][:, None, None, :]).sum(-1) + mixer.D[:, None] * inp["x"]
    return h, y


def gdn_inputs(mixer, pre):
    q, k, v = mixer._qkv(pre)
    return {"q": q, "k": k, "v": v, "beta": pre["beta"], "decay": torch.exp(pre["g"])}


def gdn_step(mixer, s, inp):
    s = s * inp["decay"][:, :, None, None]
    k = inp["k"]
    mem = (s * k[:, :, :, None]).sum(2)
    delta = (inp["v"] - mem) * inp["beta"][:, :, None]
    s = s + k[:, :, :, None] * delta[:, :, None, :]
    return s, (s * inp["q"][:, :, :, None]).sum(2)


FAMILIES = {"mamba2": (Mamba2Mixer, mamba2_inputs, mamba2_step),
            "gated_deltanet": (GatedDeltaNetMixer, gdn_inputs, gdn_step)}


def reference_scan(mixer, x, lengths, conv_state, ssm_state, capture):
    """The per-token loop ``scan`` replaced: (out, final conv, final ssm, captured states)."""
    _, inputs, step = FAMILIES[mixer.family]
    b, big_l, _ = x.shape
    pre = mixer.pre_conv(x)
    full = mixer._conv(pre, conv_state)
    width = mixer.conv.kernel - 1
    lens = torch.tensor(lengths)
    h = ssm_state.float()
    per = inputs(mixer, pre)
    ys, captured = [], {}
    for t in range(big_l):
        h_new, y = step(mixer, h, {k: v[:, t] for k, v in per.items()})
        valid = (lens > t).view(b, *([1] * (h.dim() - 1)))
        h = torch.where(valid, h_new, h)
        ys.append(y)
        for seg, k in capture:
            if k == t + 1:
                captured[(seg, k)] = (full[seg, :, k: k + width].clone(),
                                      h[seg].to(ssm_state.dtype, copy=True))
    y = torch.stack(ys, dim=1).to(x.dtype)
    conv = torch.stack([full[i, :, n: n + width] for i, n in enumerate(lengths)]).contiguous()
    return mixer.post(y, pre), conv, h.to(ssm_state.dtype), captured


def make_case(family: str, lengths: list[int], dtype=torch.float32, seed: int = 0):
    """A mixer of the shipped size with random weights, and random inputs and states."""
    torch.manual_seed(seed)
    cfg = HybridConfig(family=family)
    mixer = FAMILIES[family][0](cfg)
    mixer.family = family
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    mixer = mixer.to(dtype)
    b, big_l = len(lengths), max(lengths)
    conv_shape, ssm_shape = mixer.state_shapes()
    x = torch.randn(b, big_l, cfg.hidden_size).to(dtype)
    conv = torch.randn(b, *conv_shape).to(dtype)
    ssm = torch.randn(b, *ssm_shape) * 0.1
    capture = [(i, k) for i, n in enumerate(lengths) for k in sorted({1, n // 2, n}) if k]
    return mixer, (x, lengths, conv, ssm, capture)

