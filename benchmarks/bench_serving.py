"""SGLang's own benchmark client against the embedded engine, beside the engine's own benchmark.

    .venv/bin/python benchmarks/bench_serving.py [--version 0.5.23] [--out FILE.json]

For each shipped model, one engine with default flags (extra_buffer, overlap, chunked prefill
4096) serves, in turn: ``benchmarks/engine.py``'s decode measurement (32 concurrent non-streamed
``/generate`` requests of 128 tokens on short prompts), then ``python -m sglang.bench_serving
--backend sglang`` from the release's contract env (``evalsvc.builds.sglang_env``, built on first
use) on the same shape: 32 ``random-ids`` prompts of 64 tokens (no hub), 128 output tokens each,
all sent at once, streamed and (``--disable-stream``) not. bench_serving is run as SGLang ships it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine as engine_benchmark  # noqa: E402

from evalsvc.builds.sglang_env import ensure_sglang_env  # noqa: E402
from evalsvc.demo import demo_prompts  # noqa: E402

PROMPTS, INPUT_LEN, OUTPUT_LEN = 32, 64, 128
KEYS = ("completed", "duration", "request_throughput", "output_throughput", "total_throughput",
        "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "median_itl_ms",
        "p99_itl_ms", "mean_e2e_latency_ms", "total_output_tokens")


def bench_serving(python: Path, port: int, stream: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.jsonl"
        argv = [str(python), "-m", "sglang.bench_serving", "--backend", "sglang", "--host",
                "127.0.0.1", "--port", str(port), "--dataset-name", "random-ids",
                "--num-prompts", str(PROMPTS), "--random-input-len", str(INPUT_LEN),
                "--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1",
                "--seed", "0", "--output-file", str(out)]
        if not stream:
            argv.append("--disable-stream")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["HF_HUB_OFFLINE"] = "1"
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800,
                              check=False)
        if done.returncode != 0:
            raise SystemExit(f"bench_serving exited {done.returncode}:\n{done.stderr[-4000:]}")
        row = json.loads(out.read_text().splitlines()[-1])
    return {k: row[k] for k in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default="0.5.23", help="the SGLang release whose client runs")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" / "bench_serving.json")
    args = ap.parse_args()
    python = ensure_sglang_env(args.version)
    prompts = [p["text"] for p in demo_prompts()]
    rows = []
    for model in engine_benchmark.MODELS:
        with engine_benchmark.serve(model, []) as eng, \
                httpx.Client(base_url=eng.base_url, timeout=600) as client:
            row = {"model": model, "sglang": args.version,
                   "engine_decode_tok_s": engine_benchmark.decode_speed(client, prompts)}
            for stream in (True, False):
                client.post("/flush_cache")
                row["stream" if stream else "no_stream"] = bench_serving(python, eng.port, stream)
        rows.append(row)
        s, n = row["stream"], row["no_stream"]
        print(f"{model}: engine decode {row['engine_decode_tok_s']:.0f} tok/s; bench_serving "
              f"output {s['output_throughput']:.0f} tok/s streamed (TTFT {s['mean_ttft_ms']:.0f} "
              f"ms, ITL {s['mean_itl_ms']:.1f} ms), {n['output_throughput']:.0f} tok/s not")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
