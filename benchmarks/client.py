"""The harness's engine client against a bare asyncio client, on the same requests.

    .venv/bin/python benchmarks/client.py [--requests 2000] [--engine-requests 128]
        [--max-new-tokens 32] [--repeats 5] [--out benchmarks/results/client.json]

The requests are a scenario's measured ``/generate`` requests as ``evalsvc.scenarios`` builds
them (prompt token ids, sampling with a seed, logprobs of the generated tokens and of the prompt
after a cached prefix, top-5 lists). Each side sends all of them and waits for every answer; its
request rate is requests / wall time. Two servers:

* ``stand-in``: a minimal HTTP/1.1 server in a process of its own (``--serve``), which answers
  every ``/generate`` at once with a fixed response of the requests' shape (the tokens, their
  logprobs and top-5 lists): what is left is the cost of the clients;
* ``engine``: the embedded engine (``mamba2-eb-ov-c64`` of the smoke matrix), answering for real.

Sides, in turn within each repeat (the order rotated), so that the machine's load falls on all:

* ``harness``: ``EngineClient.generate_many`` with the workload's ``concurrency`` at the number of
  requests (all in flight), parsing every response into a ``Completion``;
* ``harness-16``: the same at the default concurrency, 16;
* ``threads-16``: the client before (16 threads over one blocking ``httpx.Client``);
* ``aiohttp``: a bare asyncio client, aiohttp, every request in flight at once, each response read
  and decoded from JSON (no parsing into a ``Completion``, no timeouts or bookkeeping);
* ``httpx-async``: the same with httpx's ``AsyncClient`` (stand-in only: at hundreds of requests
  in flight it is an order of magnitude slower than aiohttp, encode/httpx#3215).

Results go to ``benchmarks/results/client.json``; BENCHMARKS.md quotes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from rich.progress import Progress

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.engines.base import EngineSpec, launch  # noqa: E402
from evalsvc.engines.client import EngineClient, work_seconds  # noqa: E402
from evalsvc.engines.launch import free_port  # noqa: E402
from evalsvc.engines.sglang_server import build_generate_payload  # noqa: E402
from evalsvc.evaluate import prepare  # noqa: E402
from evalsvc.matrix import load_matrix  # noqa: E402
from evalsvc.scenarios import TOP_K  # noqa: E402
from evalsvc.tokenization import tokenized  # noqa: E402
from tests.oracles.responses import CACHED, PROMPT_TOKENS, response_body  # noqa: E402

RESULTS = Path(__file__).parent / "results"
ENGINE_CONFIG = "mamba2-eb-ov-c64"


# ---- the stand-in server --------------------------------------------------------------------------

class StandIn(asyncio.Protocol):
    """HTTP/1.1 with keep-alive: every request with a body answered with ``reply``."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            at = head.find(b"content-length:")
            length = int(head[at + 15:].split(b"\r\n", 1)[0]) if at >= 0 else 0
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length:]
            self.transport.write(self.reply)


async def serve(port: int, max_new_tokens: int) -> None:
    body = response_body(max_new_tokens)
    reply = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
             % len(body)) + body
    server = await asyncio.get_running_loop().create_server(
        lambda: StandIn(reply), "127.0.0.1", port, backlog=8192)
    print("serving", flush=True)
    await server.serve_forever()


def start_stand_in(max_new_tokens: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port),
                             "--max-new-tokens", str(max_new_tokens)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"serving"
    return proc, f"http://127.0.0.1:{port}"


# ---- the requests and the clients -----------------------------------------------------------------

def payloads(prompts: list[list[int]], n: int, max_new_tokens: int) -> list[dict]:
    """A scenario's measured requests over ``prompts`` (cycled to ``n``)."""
    return [build_generate_payload(prompts[i % len(prompts)], max_new_tokens=max_new_tokens,
                                   temperature=1.0, seed=i, top_logprobs_num=TOP_K,
                                   logprob_start_len=min(CACHED, len(prompts[i % len(prompts)]) - 1))
            for i in range(n)]


def harness(url: str, requests: list[dict], concurrency: int) -> None:
    client = EngineClient(url, concurrency=concurrency)
    try:
        out = client.generate_many(requests)
    finally:
        client.close()
    assert len(out) == len(requests)


def threads(url: str, requests: list[dict], width: int = 16) -> None:
    """The client before: blocking requests from a pool of threads over one ``httpx.Client``."""
    client = EngineClient(url)
    seconds = work_seconds(requests)
    try:
        with ThreadPoolExecutor(min(width, len(requests))) as pool:
            out = list(pool.map(lambda p: client.generate(p, seconds), requests))
    finally:
        client.close()
    assert len(out) == len(requests)


async def _aiohttp(url: str, requests: list[dict]) -> list[Any]:
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(payload: dict) -> Any:
            async with session.post("/generate", json=payload) as resp:
                return await resp.json()

        return await asyncio.gather(*(one(p) for p in requests))


async def _httpx(url: str, requests: list[dict]) -> list[Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(payload: dict) -> Any:
            return (await client.post("/generate", json=payload)).json()

        return await asyncio.gather(*(one(p) for p in requests))


def bare(fn: Callable, url: str, requests: list[dict]) -> None:
    out = asyncio.run(fn(url, requests))
    assert len(out) == len(requests) and all("meta_info" in o for o in out)


# ---- measuring ------------------------------------------------------------------------------------

def measure(sides: dict[str, Callable[[], None]], n: int, repeats: int,
            where: str) -> dict[str, Any]:
    """Requests per second of each side, once per repeat in turn (the order rotated)."""
    rates: dict[str, list[float]] = {k: [] for k in sides}
    names = list(sides)
    with Progress(transient=False) as progress:
        task = progress.add_task(f"{where}: warm-up", total=len(names) * (repeats + 1))
        for name in names:  # warm-up: connections, imports, the engine's first batches
            sides[name]()
            progress.advance(task)
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                progress.update(task, description=f"{where}: repeat {r + 1}/{repeats}, {name}")
                t0 = time.perf_counter()
                sides[name]()
                rates[name].append(n / (time.perf_counter() - t0))
                progress.advance(task)
    return {k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in rates.items()}


def ratio(rates: dict[str, Any], a: str, b: str) -> dict[str, float]:
    per = [x / y for x, y in zip(rates[a]["all"], rates[b]["all"], strict=True)]
    return {"min": min(per), "median": statistics.median(per)}


def against_stand_in(n: int, max_new_tokens: int, repeats: int) -> dict[str, Any]:
    proc, url = start_stand_in(max_new_tokens)
    try:
        reqs = payloads([list(range(i, i + PROMPT_TOKENS)) for i in range(64)], n, max_new_tokens)
        rates = measure({
            "harness": lambda: harness(url, reqs, n),
            "harness-16": lambda: harness(url, reqs, 16),
            "threads-16": lambda: threads(url, reqs),
            "aiohttp": lambda: bare(_aiohttp, url, reqs),
            "httpx-async": lambda: bare(_httpx, url, reqs),
        }, n, repeats, "stand-in")
    finally:
        proc.kill()
        proc.wait()
    return {"requests": n, "rates": rates,
            "harness_over_aiohttp": ratio(rates, "harness", "aiohttp"),
            "harness_over_threads": ratio(rates, "harness", "threads-16")}


def against_engine(n: int, max_new_tokens: int, repeats: int) -> dict[str, Any]:
    matrix = load_matrix("smoke")
    spec = EngineSpec(kind="embedded")
    configs, prompts = prepare(matrix, spec)
    config = next(c for c in configs if c.name == ENGINE_CONFIG)
    ids = [p for _, p in tokenized(matrix, spec, prompts)[config.model]]
    reqs = payloads([p[:PROMPT_TOKENS] for p in ids if len(p) > CACHED + 8], n, max_new_tokens)
    proc = launch(spec, config.args, free_port(), None)
    try:
        url = proc.base_url
        rates = measure({
            "harness": lambda: harness(url, reqs, n),
            "harness-16": lambda: harness(url, reqs, 16),
            "threads-16": lambda: threads(url, reqs),
            "aiohttp": lambda: bare(_aiohttp, url, reqs),
        }, n, repeats, "engine")
    finally:
        proc.stop()
    return {"requests": n, "config": ENGINE_CONFIG, "rates": rates,
            "harness_over_aiohttp": ratio(rates, "harness", "aiohttp"),
            "harness_16_over_threads_16": ratio(rates, "harness-16", "threads-16")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--engine-requests", type=int, default=128, help="0: skip the engine")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "client.json")
    args = parser.parse_args()
    if args.serve is not None:
        asyncio.run(serve(args.serve, args.max_new_tokens))
        return
    out: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                           "stand_in": against_stand_in(args.requests, args.max_new_tokens,
                                                        args.repeats)}
    if args.engine_requests:
        out["engine"] = against_engine(args.engine_requests, args.max_new_tokens, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    summary = {where: {k: v for k, v in part.items() if k != "rates"}
               | {"median_rates": {k: round(v["median"]) for k, v in part["rates"].items()}}
               for where, part in out.items() if isinstance(part, dict)}
    print(json.dumps(summary, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
