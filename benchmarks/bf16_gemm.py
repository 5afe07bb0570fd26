"""The embedded engine's bf16 GEMM (``model.linear``) against torch's own bf16 ``F.linear``.

    .venv/bin/python benchmarks/bf16_gemm.py [--repeats 300]   # benchmarks/results/bf16_gemm.json

On one torch thread, as an engine computes, for the shapes of the shipped models' layers: the
median time of each, their ratio, and the share of outputs in which they differ (the summation
order). Where torch has a native bf16 GEMM (``model.NATIVE_BF16_GEMM``) both are the same call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.engines.embedded.model import NATIVE_BF16_GEMM, linear  # noqa: E402

# rows x in -> out: decode batches and extends through the tiny models' projections and logits
SHAPES = [(1, 128, 512), (8, 128, 512), (64, 256, 128), (256, 128, 512), (256, 128, 1024)]


def median_us(fn, x: torch.Tensor, w: torch.Tensor, repeats: int) -> float:
    fn(x, w)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x, w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bf16_gemm.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        torch_us = median_us(F.linear, x, w, args.repeats)
        engine_us = median_us(linear, x, w, args.repeats)
        differ = float((F.linear(x, w) != linear(x, w)).float().mean())
        rows.append({"shape": f"{m} x {k} -> {n}", "torch_bf16_us": round(torch_us, 1),
                     "engine_us": round(engine_us, 1), "engine_over_torch": round(engine_us / torch_us, 3),
                     "outputs_differing": differ})
        print(f"{m:>4} x {k} -> {n:<5} torch bf16 {torch_us:9.1f} us  engine {engine_us:8.1f} us  "
              f"ratio {engine_us / torch_us:.3f}  differing {differ:.1e}")
    report = {"native_bf16_gemm": NATIVE_BF16_GEMM, "torch": torch.__version__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"native bf16 GEMM: {NATIVE_BF16_GEMM}; written to {args.out}")


if __name__ == "__main__":
    main()
