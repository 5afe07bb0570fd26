"""One REST job's way through the code, as a newcomer would follow it: from
``api/routes.py:create_job`` to its stored verdicts (``walk_job``). Used by
``tests/test_job_walk.py`` (the job's call chain calls back into no module) and
``benchmarks/hops.py`` (its size, reported in BENCHMARKS.md).

The service runs in this process (SQLite in a temporary directory, the embedded engine, one config
of the smoke matrix at 4 prompts); the job is posted through the API and, with a profiling hook on
every thread, the first call of each evalsvc function between the POST and the job's end is
recorded. The walk is those functions in the order they were first called: its stops (functions),
the modules it visits, and its returns: how often the walk comes back to a module it had left (a
module visited once in one stretch returns 0 times). The engine's own process is not in the walk
(it is another process), nor are the threads that were busy before the POST with other work (the
nightly scheduler's). Also recorded, its re-entries: the call sites where the job's call chain
calls back into a module already on its stack below another (A calls B, which calls A: a
callback), or up into a module on a higher floor than its caller's (``tests/test_layers.py``: a
lower layer can reach a higher one only through a callable handed down to it, as a callback run
on another thread, where the stack below it is not the job's), counted once each.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.test_layers import floor

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "evalsvc") + os.sep
RESULTS = Path(__file__).parent / "results"


def module_of(filename: str) -> str:
    return "evalsvc/" + filename[len(PACKAGE):]


def floor_of(module: str) -> int:
    """``tests/test_layers.py``'s floor of a walk's module (``evalsvc/jobs/run.py``)."""
    return floor(module.removesuffix(".py").removesuffix("/__init__").replace("/", "."))


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
            if caller is not None and caller[0] != module and not inline and (
                    any(m == module for m, _ in stack[:-1])
                    or floor_of(module) > floor_of(caller[0])):
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


def wait_ended(db_path: Path, job_id: str, timeout: float = 600) -> None:
    """Polled through SQLite itself: the polling is not the job's way."""
    db = sqlite3.connect(db_path)
    try:
        deadline = time.monotonic() + timeout
        while db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()[0] \
                in ("queued", "running"):
            assert time.monotonic() < deadline, f"job {job_id} did not end"
            time.sleep(0.5)
    finally:
        db.close()


def walk_job(config: str = "mamba2-nb-sync-c64") -> tuple[Walk, dict]:
    """The walk of one job of ``config`` and the job as the API answers it at its end."""
    from fastapi.testclient import TestClient

    from evalsvc.app import create_app
    from evalsvc.settings import Settings

    with tempfile.TemporaryDirectory(prefix="evalsvc-hops-") as tmp:
        settings = Settings(data_dir=Path(tmp), nightly=False)
        walk = Walk()
        # hooked before the service starts its threads, recording from the POST on
        sys.setprofile(walk.hook)
        threading.setprofile(walk.hook)
        try:
            with TestClient(create_app(settings)) as client:
                walk.on = True
                resp = client.post("/api/v1/jobs", json={
                    "matrix": "smoke", "configs": [config], "workload": {"num_prompts": 4}})
                assert resp.status_code == 201, resp.text
                job_id = resp.json()["id"]
                wait_ended(Path(tmp) / "evalsvc.db", job_id)
                walk.on = False
                threading.setprofile(None)
                sys.setprofile(None)
                job = client.get(f"/api/v1/jobs/{job_id}").json()
        finally:
            threading.setprofile(None)
            sys.setprofile(None)
    return walk, job
