"""What an embedded engine's start costs, and how much of it a fork server could save.

    .venv/bin/python benchmarks/engine_start.py [--starts 5]   # benchmarks/results/engine_start.json

Three ways to a healthy engine (``/health_generate`` answers 200), in turn within each round so
that the machine's load falls on all of them alike; the CPU (user + system) of the process that
serves is read from ``/proc`` the moment it first answers:

* ``exec``: ``python -m evalsvc.engines.embedded``, as the harness starts every engine;
* ``imports only``: a process that imports only the third-party modules the engine imports (torch,
  numpy, FastAPI, uvicorn, pydantic, safetensors) and exits: what a fork server would hold loaded;
* ``forked``: a parent that has imported those modules forks, and the child runs the engine's
  ``main`` without an exec: what each engine would still pay under a fork server. The parent keeps
  no threads and runs no torch op before the fork.

``exec`` minus ``forked`` is the most a fork server saves per engine; a server costs one
``imports only`` per process that starts engines (``benchmarks/suite_cpu.py`` counts those in the
test suite). Nothing here is how evalsvc starts engines: the harness execs every one of them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.suite_cpu import read_stat  # noqa: E402
from evalsvc.engines.launch import embedded_command, free_port  # noqa: E402

PRELOAD = ("torch", "numpy", "fastapi", "uvicorn", "pydantic", "safetensors.torch")


def wait_healthy(pid: int, port: int, timeout: float = 120.0) -> float:
    """The server's CPU seconds when it first answers healthy."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(f"http://127.0.0.1:{port}/health_generate").status_code == 200:
                    return read_stat(str(pid))[1]
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"engine on port {port} not healthy after {timeout:.0f} s")


def start_exec() -> float:
    port = free_port()
    proc = subprocess.Popen(embedded_command(port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return wait_healthy(proc.pid, port)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def imports_only() -> float:
    out = subprocess.run([sys.executable, "-c", f"import {', '.join(PRELOAD)}, resource; "
                          "r = resource.getrusage(resource.RUSAGE_SELF); "
                          "print(r.ru_utime + r.ru_stime)"],
                         capture_output=True, text=True, check=True)
    return float(out.stdout)


def start_forked() -> float:
    """Fork this process (which has imported PRELOAD) and run the engine's main in the child."""
    port = free_port()
    pid = os.fork()
    if pid == 0:  # the child: a session of its own, as the harness gives an engine
        code = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            from evalsvc.engines.embedded.app import main
            code = main(["--port", str(port)]) or 0
        finally:
            os._exit(code if isinstance(code, int) else 1)
    try:
        return wait_healthy(pid, port)
    finally:
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--starts", type=int, default=5, help="rounds, each side once per round")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/engine_start.json")
    args = ap.parse_args()
    os.environ.setdefault("EVALSVC_ENGINE_THREADS", "1")
    for module in PRELOAD:  # this process is the fork server's stand-in
        importlib.import_module(module)
    sides: dict[str, list[float]] = {"exec": [], "imports only": [], "forked": []}
    start_exec()  # warm-up: the page cache, the bytecode
    for i in range(args.starts):
        for name in list(sides)[i % 3:] + list(sides)[:i % 3]:
            value = {"exec": start_exec, "imports only": imports_only,
                     "forked": start_forked}[name]()
            sides[name].append(value)
        print(f"round {i + 1}/{args.starts}: " + ", ".join(
            f"{k} {v[-1]:.2f} s" for k, v in sides.items()), flush=True)
    saved = [e - f for e, f in zip(sides["exec"], sides["forked"], strict=True)]
    result = {"cpu_s": {k: summary(v) for k, v in sides.items()},
              "saved_per_engine_s": summary(saved), "starts": args.starts,
              "cpu": next((line.split(":", 1)[1].strip() for line in
                           Path("/proc/cpuinfo").read_text().splitlines()
                           if line.startswith("model name")), "?")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
