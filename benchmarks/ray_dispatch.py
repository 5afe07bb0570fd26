"""Ray dispatch against the local dispatcher: the overhead per run, on the trimmed smoke job.

    .venv/bin/python benchmarks/ray_dispatch.py [--num-prompts 4] [--configs NAME ...]
                                                [--repeats 2] [--out PATH]

Ray binds to the machine's address, so the benchmark runs in a network namespace of its own with
loopback alone: it starts itself again under ``unshare --net`` (root, or a user namespace) unless
it is in one. There it starts a Ray cluster (a head without slots and a CPU-only worker with one
``engine_slot``, token authentication on; ``tests/dispatch/raycluster.py``) and hands the smoke
job's runs (every config, ``--num-prompts`` prompts: the tasks ``JobService`` makes) to each
dispatcher in turn, one run at a time:

* ``local``: ``LocalDispatcher(1)`` (the cluster idles meanwhile, so both see the same machine);
* ``ray-client``: ``RayDispatcher("ray://127.0.0.1:10001")``, a Ray Client as in the compose
  deployment;
* ``ray-driver``: ``RayDispatcher("127.0.0.1:6379")``, a driver on the cluster's network.

Builds: each dispatcher's ``prepare_build`` of ``sglang==0.5.23`` (the release's wheel from
the wheel cache, over ``tests/data/fake-python`` as the SGLang environment): the first call makes
the build in that machine's cache (here, or on the worker), the next ones find it, which is what
the service pays per build of a job; and ``engine_for`` on a cache hit, what each run pays on its
machine before its engine starts.

A run's overhead is the wall time from ``submit`` to its result, less the harness's own time for it
(``RunResult.seconds``: engine start, scenarios, metrics): for Ray, placing the task, starting it
on a worker, its reports, bringing the result and the engine log back. The first run of each
block is reported apart (a Ray worker process starts for it); so is connecting to the cluster
(importing the backend, ``ray.init``, the board actor), in a new process. The blocks repeat
``--repeats`` times, in turn, to spread the machine's changing load over all three.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evalsvc.builds.embedded import embedded_build  # noqa: E402
from evalsvc.dispatch.base import RunTask, build_request, engine_for, prepare_build  # noqa: E402
from evalsvc.dispatch.local import LocalDispatcher  # noqa: E402
from evalsvc.engines.base import EngineSpec  # noqa: E402
from evalsvc.matrix import WorkloadSpec, expand, load_matrix  # noqa: E402
from evalsvc.settings import Settings  # noqa: E402
from evalsvc.tokenization import tokenized  # noqa: E402
from evalsvc.workloads import load_prompts, workload_version  # noqa: E402
from tests.dispatch.raycluster import RayCluster, loopback_only  # noqa: E402

MODES = ("local", "ray-client", "ray-driver")
BUILD_SOURCE = "sglang==0.5.23"
FAKE_PYTHON = str(ROOT / "tests" / "data" / "fake-python")
FOUND_CALLS = 5  # prepare_build calls after the first, per block


def in_loopback_namespace() -> bool:
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def reexec_in_namespace() -> int:
    for cmd in (["unshare", "--net"], ["unshare", "--net", "--map-root-user"]):
        if subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
            return subprocess.run([*cmd, sys.executable, *sys.argv]).returncode
    print("error: cannot make a network namespace (unshare --net); Ray must not bind the "
          "machine's address", file=sys.stderr)
    return 2


def smoke_tasks(num_prompts: int, configs: list[str] | None, log_dir: Path) -> list[RunTask]:
    """The runs of the smoke job as the job service makes them."""
    matrix = load_matrix("smoke")
    matrix.workload = WorkloadSpec(**{**matrix.workload.model_dump(), "num_prompts": num_prompts})
    prompts = load_prompts(matrix.workload)
    by_model = tokenized(matrix, EngineSpec(kind="embedded"), prompts)
    engine = EngineSpec(kind="embedded", env=embedded_build(None, []).env)
    chosen = [c for c in expand(matrix, hardware="cpu",
                                workload_version=workload_version(matrix.workload, prompts))
              if not configs or c.name in configs]
    return [RunTask.make("bench", i, matrix, c, engine, by_model[c.model], log_dir)
            for i, c in enumerate(chosen, 1)]


def connect_in_a_new_process(address: str) -> float:
    """Seconds a new process takes to import the Ray backend, connect and be ready (what a
    service adds to its start)."""
    code = ("import time; t = time.monotonic()\n"
            "from evalsvc.dispatch.ray_backend import RayDispatcher\n"
            f"d = RayDispatcher({address!r}, 'engine_slot')\n"
            "print(time.monotonic() - t); d.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, timeout=300)
    return round(float(out.stdout.strip().splitlines()[-1]), 2)


def block(dispatcher, tasks: list[RunTask]) -> list[dict]:
    rows = []
    for task in tasks:
        t0 = time.monotonic()
        result = dispatcher.submit(task).result()
        wall = time.monotonic() - t0
        assert result.verdict == "pass", (task.config.name, result.verdict, result.reason)
        rows.append({"config": task.config.name, "wall": round(wall, 3),
                     "seconds": round(result.seconds, 3),
                     "overhead": round(wall - result.seconds, 3)})
    return rows


def build_block(dispatcher) -> dict:
    """Seconds of the first ``prepare_build`` of a block and of the next ones."""
    calls = []
    for _ in range(1 + FOUND_CALLS):
        t0 = time.monotonic()
        info = dispatcher.prepare_build(BUILD_SOURCE, [], FAKE_PYTHON)
        calls.append(round(time.monotonic() - t0, 4))
    return {"calls": calls, "key": info["manifest"]["key"]}


def run_check_seconds(repeats: int = 20) -> list[float]:
    """``engine_for`` on a cache hit (this machine's cache holds the build)."""
    here = Settings().resolved_builds_dir()
    request = build_request(prepare_build(BUILD_SOURCE, [], FAKE_PYTHON, here))
    spec = EngineSpec(kind="sglang", python=FAKE_PYTHON)
    out = []
    for _ in range(repeats):
        t0 = time.monotonic()
        engine_for(spec, request, here)
        out.append(time.monotonic() - t0)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--configs", nargs="*", help="default: every config of the smoke matrix")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ray_dispatch.json")
    args = parser.parse_args()
    if not in_loopback_namespace():
        return reexec_in_namespace()
    loopback_only()
    work = Path(tempfile.mkdtemp(prefix="evalsvc-raybench-"))
    tasks = smoke_tasks(args.num_prompts, args.configs, work / "logs")
    cluster = RayCluster(work / "ray")
    blocks: dict[str, list[dict]] = {m: [] for m in MODES}
    builds: dict[str, list[dict]] = {m: [] for m in MODES}
    os.environ["EVALSVC_BUILDS_DIR"] = str(work / "builds-here")  # this machine's builds cache
    os.environ["FAKE_SGLANG_PYTHON"] = sys.executable
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.add_worker(1, env={"EVALSVC_BUILDS_DIR": str(work / "builds-worker"),
                                   "FAKE_SGLANG_PYTHON": sys.executable})
        cluster.wait_resources(1)
        cluster_seconds = time.monotonic() - t0
        os.environ.update(cluster.driver_env)  # token authentication, for the Ray dispatchers
        for _ in range(args.repeats):
            for mode in MODES:
                t0 = time.monotonic()
                if mode == "local":
                    dispatcher = LocalDispatcher(1, Settings().resolved_builds_dir())
                else:
                    from evalsvc.dispatch.ray_backend import RayDispatcher

                    dispatcher = RayDispatcher(cluster.client_address if mode == "ray-client"
                                               else cluster.address, "engine_slot")
                connect = time.monotonic() - t0
                try:
                    rows = block(dispatcher, tasks)
                    builds[mode].append(build_block(dispatcher))
                finally:
                    dispatcher.shutdown()
                blocks[mode].append({"connect": round(connect, 3), "runs": rows})
                print(mode, f"connect {connect:.2f} s, overhead per run "
                      f"{[r['overhead'] for r in rows]}, prepare_build "
                      f"{builds[mode][-1]['calls']}", flush=True)
        run_check = run_check_seconds()
        fresh = {mode: connect_in_a_new_process(cluster.client_address if mode == "ray-client"
                                                else cluster.address) for mode in MODES[1:]}
    finally:
        left = cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    if left:
        print(f"warning: processes left by the cluster, killed: {left}", file=sys.stderr)

    summary = {}
    for mode in MODES:
        first = [b["runs"][0]["overhead"] for b in blocks[mode]]
        rest = [r["overhead"] for b in blocks[mode] for r in b["runs"][1:]]
        seconds = [r["seconds"] for b in blocks[mode] for r in b["runs"]]
        walls = [r["wall"] for b in blocks[mode] for r in b["runs"]]
        summary[mode] = {
            "connect_seconds": fresh.get(mode, 0.0),
            "first_run_overhead": round(statistics.median(first), 3),
            "overhead_per_run_median": round(statistics.median(rest), 3),
            "overhead_per_run_max": round(max(rest), 3),
            "run_seconds_median": round(statistics.median(seconds), 2),
            "wall_over_run_seconds": round(sum(walls) / sum(seconds), 4)}
    assert len({b["key"] for m in MODES for b in builds[m]}) == 1, "one build everywhere"
    made = {"local": builds["local"][0]["calls"][0],
            # the first Ray block makes it on the worker; every later one finds it there
            "ray": builds[MODES[1]][0]["calls"][0]}
    summary["builds"] = {
        "source": BUILD_SOURCE, "made_seconds": made,
        "found_seconds_median": {m: round(statistics.median(
            c for b in builds[m] for c in b["calls"][1:]), 4) for m in MODES},
        "run_check_seconds_median": round(statistics.median(run_check), 4)}
    report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()},
              "runs": [t.config["name"] for t in tasks], "num_prompts": args.num_prompts,
              "repeats": args.repeats, "cluster_start_seconds": round(cluster_seconds, 1),
              "summary": summary, "blocks": blocks, "builds": builds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
