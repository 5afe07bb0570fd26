"""A fake SGLang server for the harness's error tests: SGLang's HTTP API, deterministic logprobs.

Started by ``tests/data/fake-python`` as ``fake_sglang.py --model-path M --host H --port P FLAGS``.
``FAKE_SGLANG_MODE`` picks the behaviour:

* ``ok``: serves consistent logprobs (decode and teacher-forced prefill agree, so KL is 0) and
  counts as cached the longest prefix shared with an earlier request since the last flush.
* ``die_at_start``: prints an error and exits 1 before binding its port.
* ``die_mid``: serves, starts a child process (left in its process group), and exits at the first
  ``/generate`` without answering.
* ``die_at_info``: serves its health check, then exits 3 at ``/server_info`` (the harness's first
  question after start-up, before any scenario) without answering.
* ``nan``: NaN output logprobs. ``malformed``: ``output_token_logprobs`` is not a list.
* ``slow_start``: takes ``FAKE_SGLANG_START_SECONDS`` (default 10) to start, then serves as ``ok``.

``FAKE_SGLANG_VERSION`` is the release it reports (default ``0.0.0+fake``). Its radix-tree core
follows SGLang's rules for that release (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, default
``rust`` from 0.5.21): with ``FAKE_SGLANG_RUST_CORE=absent`` a Rust core it cannot load falls back
to Python and says so in SGLang's own log line ("Using the Python TreeCore: ...").

``FAKE_SGLANG_WHEN=field=value`` limits the mode to servers started with that flag value (the others
run ``ok``); ``FAKE_SGLANG_PIDFILE`` collects the pids of the server and its child.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = os.environ.get("FAKE_SGLANG_VERSION", "0.0.0+fake")
MODES = ("ok", "die_at_start", "die_mid", "die_at_info", "nan", "malformed", "slow_start")


def parse_flags(argv: list[str]) -> dict:
    """``--a-b v --flag`` -> {"a_b": v, "flag": True}; numbers become int or float."""
    flags: dict = {}
    i = 0
    while i < len(argv):
        key = argv[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[key] = _number(argv[i + 1])
            i += 2
        else:
            flags[key] = True
            i += 1
    return flags


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def logprob(pos: int, tid: int) -> float:
    """The same value for a token at a position whether decoded or prefilled."""
    return -1.0 - ((pos * 7 + tid) % 5) / 10


def top(pos: int, tid: int, k: int) -> list:
    return [[logprob(pos, tid), tid, None]] + [[-2.0 - j / 2, tid + j, None] for j in range(1, k)]


SEEN: list[list[int]] = []  # inputs since the last /flush_cache


def cached(ids: list[int]) -> int:
    best = 0
    for seen in list(SEEN):
        n = 0
        while n < min(len(ids) - 1, len(seen)) and ids[n] == seen[n]:
            n += 1
        best = max(best, n)
    return best


def generate(body: dict, mode: str) -> dict:
    ids = list(body.get("input_ids") or [])
    hit = cached(ids)
    SEEN.append(ids)
    n = int(body.get("sampling_params", {}).get("max_new_tokens", 16))
    k = int(body.get("top_logprobs_num") or 0)
    start = int(body.get("logprob_start_len", -1))
    out = [(sum(ids) + 31 * j) % 1000 + 1 for j in range(n)]
    lps = [logprob(len(ids) + j, t) for j, t in enumerate(out)]
    if mode == "nan" and lps:
        lps[0] = math.nan
    meta = {"id": f"fake-{time.monotonic_ns()}", "prompt_tokens": len(ids), "completion_tokens": n,
            "cached_tokens": hit, "finish_reason": {"type": "length", "length": n},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out, strict=True)]}
    if mode == "malformed":
        meta["output_token_logprobs"] = {"logprobs": lps}
    inputs = range(start, len(ids)) if start >= 0 else range(0)
    meta["input_token_logprobs"] = [[None if p == 0 else logprob(p, ids[p]), ids[p], None]
                                    for p in inputs]
    if k:
        meta["output_top_logprobs"] = [top(len(ids) + j, t, k) for j, t in enumerate(out)]
        meta["input_top_logprobs"] = [None if p == 0 else top(p, ids[p], k) for p in inputs]
    return {"text": " ".join(map(str, out)), "output_ids": out, "meta_info": meta}


def make_handler(flags: dict, mode: str):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet: the log is for start-up and errors
            pass

        def _send(self, code: int, obj) -> None:
            data = json.dumps(obj).encode()  # NaN goes out as the bare token, as Python servers do
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health_generate":
                self._send(200, {})
            elif self.path in ("/server_info", "/get_server_info"):
                if mode == "die_at_info":
                    print("fake sglang: scheduler crashed (die_at_info)", file=sys.stderr, flush=True)
                    os._exit(3)
                self._send(200, {**flags, "version": VERSION, "internal_states": [{}]})
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/flush_cache":
                SEEN.clear()
                self._send(200, {})
            elif self.path == "/generate":
                if mode == "die_mid":
                    print("fake sglang: scheduler crashed (die_mid)", file=sys.stderr, flush=True)
                    os._exit(3)
                self._send(200, generate(json.loads(body), mode))
            else:
                self._send(404, {"error": f"no route {self.path}"})

    return Handler


def main(argv: list[str]) -> None:
    if argv == ["--child"]:  # a worker the server leaves in its process group
        time.sleep(600)
        return
    flags = parse_flags(argv)
    mode = os.environ.get("FAKE_SGLANG_MODE", "ok")
    if mode not in MODES:
        sys.exit(f"fake sglang: FAKE_SGLANG_MODE={mode!r} is not one of {MODES}")
    when = os.environ.get("FAKE_SGLANG_WHEN")
    if when and str(flags.get(when.split("=")[0])) != when.split("=", 1)[1]:
        mode = "ok"
    pids = [os.getpid()]
    print(f"fake sglang: mode {mode}, flags {flags}", file=sys.stderr, flush=True)
    if mode == "die_at_start":
        print("fake sglang: RuntimeError: the model could not be loaded (die_at_start)",
              file=sys.stderr, flush=True)
        sys.exit(1)
    if mode == "slow_start":
        time.sleep(float(os.environ.get("FAKE_SGLANG_START_SECONDS", "10")))
    if mode == "die_mid":
        pids.append(subprocess.Popen([sys.executable, __file__, "--child"]).pid)
    if os.environ.get("FAKE_SGLANG_PIDFILE"):
        with open(os.environ["FAKE_SGLANG_PIDFILE"], "a") as f:
            f.write("".join(f"{p}\n" for p in pids))
    release = tuple(int(p) for p in VERSION.split("+")[0].split(".")[:3])
    core = os.environ.get("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND",
                          "rust" if release >= (0, 5, 21) else "python")
    if (core == "rust" and release >= (0, 5, 21) and not flags.get("disable_radix_cache")
            and os.environ.get("FAKE_SGLANG_RUST_CORE") == "absent"):
        print("[2026-12-05 13:00:00 TP0] Using the Python TreeCore: this installation contains "
              "neither the Rust TreeCore extension nor its sources", file=sys.stderr, flush=True)
    server = ThreadingHTTPServer((flags.get("host", "127.0.0.1"), int(flags["port"])),
                                 make_handler(flags, mode))
    print(f"fake sglang: serving on port {flags['port']}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
