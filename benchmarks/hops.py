"""The way one REST job takes through the code: from ``api/routes.py:create_job`` to its stored
verdicts, as a newcomer would follow it.

    .venv/bin/python benchmarks/hops.py [--config NAME] [--show]

Runs the service in this process (SQLite in a temporary directory, the embedded engine, one
config of the smoke matrix at 4 prompts), posts the job through the API and records, with a
profiling hook on every thread, the first call of each evalsvc function between the POST and the
job's end. The walk is those functions in the order they were first called. Reported: its stops
(functions), the modules it visits, and its returns: how often the walk comes back to a module it
had left (a module visited once in one stretch returns 0 times). The engine's own process is not
in the walk (it is another process), nor are the threads that were busy before the POST with other
work (the nightly scheduler's). Also reported, its re-entries: the call sites where the job's call
chain calls back into a module already on its stack below another (A calls B, which calls A: a
callback), counted once each. ``--show`` prints the walk and the re-entries.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PACKAGE = str(ROOT / "evalsvc") + os.sep
RESULTS = Path(__file__).parent / "results"


def module_of(filename: str) -> str:
    return "evalsvc/" + filename[len(PACKAGE):]


class Walk:
    """The first call of each evalsvc function, in order, over every thread."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.stops: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.on = False
        self.stacks = threading.local()
        self.reentries: dict[tuple[str, str], int] = {}

    def hook(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE):
            return
        stack = self.stacks.__dict__.setdefault("frames", [])
        module = module_of(code.co_filename)
        if event == "return":
            if stack:
                stack.pop()
            return
        caller = stack[-1] if stack else None
        stack.append((module, code.co_qualname))
        if not self.on:
            return
        key = (code.co_filename, code.co_firstlineno)
        with self.lock:
            if key not in self.seen:
                self.seen.add(key)
                self.stops.append((module, code.co_qualname))
            # a comprehension or generator expression runs where another module consumes it,
            # yet a reader reads it in place: no re-entry
            inline = code.co_name.startswith("<") and code.co_name != "<lambda>"
            if caller is not None and caller[0] != module and not inline and \
                    any(m == module for m, _ in stack[:-1]):
                site = (f"{caller[0]}:{caller[1]}", f"{module}:{code.co_qualname}")
                self.reentries[site] = self.reentries.get(site, 0) + 1

    def summary(self) -> dict:
        modules: list[str] = []
        returns = 0
        last = None
        for module, _ in self.stops:
            if module != last:
                if module in modules:
                    returns += 1
                else:
                    modules.append(module)
                last = module
        return {"stops": len(self.stops), "modules": len(modules), "returns": returns,
                "reentries": len(self.reentries)}


def run(config: str, show: bool) -> dict:
    from fastapi.testclient import TestClient

    from evalsvc.app import create_app
    from evalsvc.settings import Settings

    with tempfile.TemporaryDirectory(prefix="evalsvc-hops-") as tmp:
        settings = Settings(data_dir=Path(tmp), nightly=False)
        walk = Walk()
        # hooked before the service starts its threads, recording from the POST on
        sys.setprofile(walk.hook)
        threading.setprofile(walk.hook)
        with TestClient(create_app(settings)) as client:
            walk.on = True
            resp = client.post("/api/v1/jobs", json={
                "matrix": "smoke", "configs": [config], "workload": {"num_prompts": 4}})
            assert resp.status_code == 201, resp.text
            job_id = resp.json()["id"]
            # polled through SQLite itself: the polling is not the job's way
            db = sqlite3.connect(tmp + "/evalsvc.db")
            deadline = time.monotonic() + 600
            while db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()[0] \
                    in ("queued", "running"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"job {job_id} did not end")
                time.sleep(0.5)
            db.close()
            walk.on = False
            threading.setprofile(None)
            sys.setprofile(None)
            job = client.get(f"/api/v1/jobs/{job_id}").json()
    if show:
        for module, name in walk.stops:
            print(f"{module}:{name}")
        print("re-entries (a call back into a module already on the call stack below another):")
        for (caller, callee), n in sorted(walk.reentries.items()):
            print(f"  {caller} -> {callee} ({n}x)")
    return {"config": config, "status": job["status"],
            "verdicts": [r["verdict"] for r in job["runs"]], **walk.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="mamba2-nb-sync-c64")
    parser.add_argument("--show", action="store_true")
    args = parser.parse_args()
    out = run(args.config, args.show)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hops.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
