"""Embedded engine: model quality (entropy, draft acceptance) and speed (start-up, prefill, decode).

    .venv/bin/python benchmarks/engine.py [--out benchmarks/results/engine.json]

Quality: mean next-token entropy of each shipped model over the demo prompts against the uniform
distribution's ln(V); greedy acceptance length with 3 MTP draft steps (SGLang's convention:
completion tokens / verify steps) against a "repeat the last token" drafter on the same outputs.
Speed: seconds from spawn to a healthy server; prefill tokens/s (32 prompts, no generation); decode
tokens/s (32 concurrent requests, 128 tokens each), plain and with MTP. All through real engine
processes over HTTP.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.demo import demo_prompts  # noqa: E402
from evalsvc.engines.embedded.args import resolve_model_path  # noqa: E402
from evalsvc.engines.embedded.model import load_model  # noqa: E402
from evalsvc.engines.embedded.tokenizer import TextTokenizer  # noqa: E402
from evalsvc.engines.launch import EngineProcess, embedded_command, free_port  # noqa: E402

MODELS = ["hybrid-mamba2-tiny", "hybrid-gdn-tiny"]
STEPS = 3


def entropy(model_name: str, prompts: list[str]) -> dict:
    path = resolve_model_path(model_name)
    model, tok = load_model(path), TextTokenizer(path)
    ents = []
    with torch.inference_mode():
        for text in prompts:
            ids = torch.tensor([tok.encode(text)])
            logits, _ = model.forward_train(ids)
            lp = torch.log_softmax(logits[0], -1)
            ents.append(float(-(lp.exp() * lp).sum(-1).mean()))
    v = model.cfg.vocab_size
    return {"mean_entropy_nats": sum(ents) / len(ents), "uniform_nats": math.log(v), "vocab": v}


def repeat_last_accept_length(prompt_last: int, output: list[int]) -> float:
    """Acceptance length if every draft repeated the newest token (a collapsed drafter)."""
    seq = [prompt_last, *output]
    pos, verifies = 1, 0  # seq[pos] is the next token to produce
    while pos < len(seq):
        verifies += 1
        last, j = seq[pos - 1], 0
        while j < STEPS and pos + j < len(seq) and seq[pos + j] == last:
            j += 1
        pos += j + 1  # accepted drafts plus the bonus token
    return len(output) / verifies


def serve(model: str, flags: list[str]):
    port = free_port()
    return EngineProcess(embedded_command(port, ["--model-path", model, "--random-seed", "0",
                                                 *flags]), port)


def post_all(client: httpx.Client, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        resps = list(pool.map(lambda b: client.post("/generate", json=b), bodies))
    for r in resps:
        r.raise_for_status()
    return [r.json() for r in resps]


def quality_and_speed(model: str, prompts: list[str]) -> dict:
    out: dict = {"model": model, **entropy(model, prompts)}
    greedy = {"temperature": 0.0, "max_new_tokens": 128, "ignore_eos": True}
    # acceptance: each prompt alone so batch composition plays no part
    with serve(model, ["--speculative-algorithm", "NEXTN"]) as eng, \
            httpx.Client(base_url=eng.base_url, timeout=600) as client:
        tok = TextTokenizer(resolve_model_path(model))
        lengths, repeat = [], []
        for text in prompts:
            res = client.post("/generate", json={"text": text, "sampling_params": greedy}).json()
            m = res["meta_info"]
            lengths.append(m["spec_accept_length"])
            repeat.append(repeat_last_accept_length(tok.encode(text)[-1], res["output_ids"]))
        out["accept_length"] = sum(lengths) / len(lengths)
        out["accept_length_repeat_last"] = sum(repeat) / len(repeat)
        out["mtp_decode_tok_s"] = decode_speed(client, prompts)
    with serve(model, []) as eng, httpx.Client(base_url=eng.base_url, timeout=600) as client:
        out["startup_s"] = eng.startup_seconds
        bodies = [{"text": prompts[i % len(prompts)] + f"# {i}\n",
                   "sampling_params": {"max_new_tokens": 0}} for i in range(32)]
        t0 = time.perf_counter()
        res = post_all(client, bodies)
        dt = time.perf_counter() - t0
        out["prefill_tok_s"] = sum(r["meta_info"]["prompt_tokens"] for r in res) / dt
        out["decode_tok_s"] = decode_speed(client, prompts)
    return out


def decode_speed(client: httpx.Client, prompts: list[str]) -> float:
    """Generated tokens/s with 32 concurrent requests on short prompts (decode dominates)."""
    bodies = [{"text": prompts[i % len(prompts)][:64],
               "sampling_params": {"max_new_tokens": 128, "ignore_eos": True,
                                   "temperature": 0.0}} for i in range(32)]
    client.post("/flush_cache")
    t0 = time.perf_counter()
    res = post_all(client, bodies)
    dt = time.perf_counter() - t0
    return sum(r["meta_info"]["completion_tokens"] for r in res) / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine.json")
    args = ap.parse_args()
    prompts = [p["text"] for p in demo_prompts()]
    rows = [quality_and_speed(m, prompts) for m in MODELS]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    for r in rows:
        print(f"{r['model']}: entropy {r['mean_entropy_nats']:.2f} nats (uniform "
              f"{r['uniform_nats']:.2f}); accept length {r['accept_length']:.2f} (repeat-last "
              f"{r['accept_length_repeat_last']:.2f}); start-up {r['startup_s']:.1f} s; prefill "
              f"{r['prefill_tok_s']:.0f} tok/s; decode {r['decode_tok_s']:.0f} tok/s, with MTP "
              f"{r['mtp_decode_tok_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
