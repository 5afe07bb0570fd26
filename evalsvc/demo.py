"""``make run`` for now: the embedded engine serving requests that really hit its prefix cache."""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from evalsvc.engines.launch import EngineProcess, embedded_command, free_port


def demo_prompts() -> list[dict]:
    text = resources.files("evalsvc").joinpath("assets/prompts/demo.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_demo(flags: list[str]) -> int:
    console = Console()
    prompts = [p["text"] for p in demo_prompts()]
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"evalsvc-demo-engine-{port}.log"
    console.print(f"[bold]Starting the embedded engine[/] on port {port} (log: {log_path})")
    with EngineProcess(embedded_command(port, ["--random-seed", "0", *flags]), port,
                       log_path=log_path) as eng, httpx.Client(base_url=eng.base_url,
                                                               timeout=120) as client:
        info = client.get("/server_info").json()
        console.print(f"ready in {eng.startup_seconds:.1f} s: {info['model']['architecture']}, "
                      f"strategy={info['mamba_radix_cache_strategy']}, "
                      f"overlap={'off' if info['disable_overlap_schedule'] else 'on'}, "
                      f"chunked_prefill_size={info['chunked_prefill_size']}")

        def gen(text: str, **kw) -> dict:
            body = {"text": text, "sampling_params": {"temperature": 0.0,
                                                      "max_new_tokens": kw.pop("n", 32)}, **kw}
            resp = client.post("/generate", json=body)
            resp.raise_for_status()
            return resp.json()

        rows = []
        first = gen(prompts[0])
        rows.append(("turn 1", first))
        turn2 = prompts[0] + first["text"] + "\n"
        rows.append(("turn 2 (decode hit)", gen(turn2)))
        shared = prompts[1]
        with ThreadPoolExecutor(4) as pool:
            branches = list(pool.map(lambda s: gen(shared + s), ["    # a\n", "    # b\n",
                                                                  "    # c\n", "    # d\n"]))
        gen(shared, n=0)  # seed the shared prefix
        rows += [(f"branch {i}", b) for i, b in enumerate(branches)]
        rows.append(("branch after seed", gen(shared + "    # e\n")))

        table = Table(title="What came back")
        for col in ("request", "prompt", "cached", "completion", "text"):
            table.add_column(col)
        for name, out in rows:
            m = out["meta_info"]
            table.add_row(name, str(m["prompt_tokens"]), str(m["cached_tokens"]),
                          str(m["completion_tokens"]), repr(out["text"][:48]))
        console.print(table)

        # a cache hit against a cold recompute: prompt logprobs must agree
        probe = {"return_logprob": True, "logprob_start_len": len(shared.encode()), "n": 0}
        hit = gen(shared + "    return None\n", **probe)
        client.post("/flush_cache").raise_for_status()
        cold = gen(shared + "    return None\n", **probe)
        a = [x[0] for x in hit["meta_info"]["input_token_logprobs"][1:]]
        b = [x[0] for x in cold["meta_info"]["input_token_logprobs"][1:]]
        diff = max(abs(x - y) for x, y in zip(a, b, strict=True)) if a else float("nan")
        console.print(f"prompt logprobs after a hit ({hit['meta_info']['cached_tokens']} cached "
                      f"tokens) vs a cold recompute (0 cached): max |diff| = {diff:.2e} over "
                      f"{len(a)} positions")
    console.print("engine stopped")
    return 0
