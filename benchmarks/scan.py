"""The embedded engine's recurrent scan (``RecurrentMixer.scan``, every float32 prefill and every
decode step) against the per-token loop it replaced, on the same inputs, bit for bit.

    .venv/bin/python benchmarks/scan.py [--repeats 5] [--against REV] [--out benchmarks/results/scan.json]

Shapes as an extend has them: a batch of ``B`` segments of up to ``L`` tokens (ragged: the others
a third shorter), both families (Mamba2 and gated deltanet) at the shipped models' sizes, float32.
Timed in turn within each repeat, so that the machine's load falls on both alike:

* ``scan``: ``evalsvc.engines.embedded.model.RecurrentMixer.scan``: each input split into its
  per-token views once, shaped to broadcast, a ragged mask per token made once and applied only
  past the shortest segment, Mamba2's skip term ``D x`` added once after the loop;
* ``loop``: ``reference_scan`` below, the loop before it (each input sliced at each token, the
  ragged mask made at each token), kept as the oracle ``tests/engines/embedded/test_scan.py`` pins
  ``scan`` against;
* with ``--against REV``, ``scan`` of the engine's model at git revision ``REV`` too (its
  ``evalsvc/engines/embedded/model.py``, the same weights), and the ratio ``scan / against``.

Results go to ``benchmarks/results/scan.json``; BENCHMARKS.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.engines.embedded.model import (  # noqa: E402
    GatedDeltaNetMixer,
    HybridConfig,
    Mamba2Mixer,
)

RESULTS = Path(__file__).parent / "results"


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


def model_at(rev: str) -> types.ModuleType:
    """The engine's model module (``evalsvc/engines/embedded/model.py``) as it was at ``rev``."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:evalsvc/engines/embedded/model.py"],
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"model_at_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{rev}:evalsvc/engines/embedded/model.py", "exec"), module.__dict__)
    return module


def mixer_at(module: types.ModuleType, mixer):
    """``mixer``'s weights in ``module``'s class of the same name."""
    other = getattr(module, type(mixer).__name__)(module.HybridConfig(family=mixer.family))
    other.load_state_dict(mixer.state_dict())
    return other


def seconds(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--against", metavar="REV", help="also time the scan at this git revision")
    ap.add_argument("--out", type=Path, default=RESULTS / "scan.json")
    args = ap.parse_args()
    against = model_at(args.against) if args.against else None
    torch.set_num_threads(1)  # as the engine runs (EVALSVC_ENGINE_THREADS)
    rows = []
    for family in FAMILIES:
        for b, big_l in ((1, 1), (4, 1), (4, 64), (4, 256)):
            lengths = [big_l] + [max(1, big_l - big_l // 3)] * (b - 1)
            mixer, case = make_case(family, lengths)
            calls = max(3, 2000 // big_l)
            with torch.inference_mode():
                got, want = mixer.scan(*case), reference_scan(mixer, *case)
                assert torch.equal(got.out, want[0]) and torch.equal(got.ssm, want[2])
                runs = {"scan": [], "loop": [], "against": []}
                if against is not None:
                    other = mixer_at(against, mixer)
                    assert torch.equal(other.scan(*case).out, got.out)
                for _ in range(args.repeats):
                    runs["scan"].append(seconds(lambda m=mixer, c=case: m.scan(*c), calls))
                    runs["loop"].append(seconds(lambda m=mixer, c=case: reference_scan(m, *c),
                                                calls))
                    if against is not None:
                        runs["against"].append(seconds(lambda m=other, c=case: m.scan(*c), calls))
            ratios = [lp / sc for sc, lp in zip(runs["scan"], runs["loop"], strict=True)]
            row = {"family": family, "batch": b, "tokens": big_l,
                   "scan_ms": round(statistics.median(runs["scan"]) * 1e3, 3),
                   "loop_ms": round(statistics.median(runs["loop"]) * 1e3, 3),
                   "speedup_min": round(min(ratios), 2),
                   "speedup_median": round(statistics.median(ratios), 2),
                   "speedup_max": round(max(ratios), 2)}
            if against is not None:
                times = [sc / ag for sc, ag in zip(runs["scan"], runs["against"], strict=True)]
                row |= {"against_ms": round(statistics.median(runs["against"]) * 1e3, 3),
                        "scan_over_against_min": round(min(times), 2),
                        "scan_over_against_median": round(statistics.median(times), 2),
                        "scan_over_against_max": round(max(times), 2)}
            rows.append(row)
            print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"repeats": args.repeats, "against": args.against, "rows": rows},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
