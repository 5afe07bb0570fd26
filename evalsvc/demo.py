"""What ``make run`` shows: the service evaluating the smoke matrix (``run_service_demo``), then
where its dashboard shows the job (kept up until Ctrl-C when run from a terminal), and the embedded
engine serving requests that hit its prefix cache (``run_engine_demo``)."""

from __future__ import annotations

import json
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from evalsvc.engines.launch import EngineProcess, embedded_command, free_port
from evalsvc.evaluate import EXIT_ERRORED, EXIT_FAILED
from evalsvc.tls import tls_context
from evalsvc.types import FINISHED_JOB_STATUSES, JobStatus, RunStatus


def demo_prompts() -> list[dict]:
    text = resources.files("evalsvc").joinpath("assets/prompts/demo.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_engine_demo(flags: list[str]) -> int:
    console = Console()
    prompts = [p["text"] for p in demo_prompts()]
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"evalsvc-demo-engine-{port}.log"
    console.print(f"[bold]Starting the embedded engine[/] on port {port} (log: {log_path})")
    with EngineProcess(embedded_command(port, ["--random-seed", "0", *flags]), port,
                       log_path=log_path) as eng, \
            httpx.Client(base_url=eng.base_url, timeout=120, verify=tls_context()) as client:
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


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_service_demo(matrix: str, configs: list[str] | None = None,
                     num_prompts: int | None = None, keep: bool | None = None) -> int:
    """Start ``evalsvc serve`` (SQLite in ./data), submit a job for ``matrix`` (``configs`` of it,
    ``num_prompts`` prompts), follow it, print the table, where the results are and where the
    dashboard shows the job. ``keep``: the service stays up for the dashboard until Ctrl-C (None:
    when stdin is a terminal); else it stops."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from evalsvc.settings import Settings

    console = Console(width=max(Console().width, 150))
    settings = Settings()
    if keep is None:
        keep = sys.stdin.isatty()
    # the usual port when it is free, so the dashboard's address is the one `evalsvc serve` has
    port = settings.port if port_free(settings.port) else free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = settings.data_dir / "service.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]Starting the service[/] at {base} (database "
                  f"{settings.resolved_database_url()}, log {log_path})")
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "evalsvc.cli", "serve", "--port", str(port)],
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "EVALSVC_NIGHTLY": "false"})
    try:
        with httpx.Client(base_url=base, timeout=30, verify=tls_context()) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    console.print(f"[red]the service did not start[/]; see {log_path}")
                    return 1
                time.sleep(0.2)
            body: dict = {"matrix": matrix}
            if configs:
                body["configs"] = configs
            if num_prompts:
                body["workload"] = {"num_prompts": num_prompts}
            resp = client.post("/api/v1/jobs", json=body)
            if resp.status_code != 201:
                console.print(f"[red]job refused ({resp.status_code}):[/] {resp.text}")
                return 1
            job_id = resp.json()["id"]
            console.print(f"submitted job {job_id}")
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn())
            with Progress(*columns, console=console) as progress:
                task = progress.add_task(f"job {job_id}", total=None)
                while True:
                    job = client.get(f"/api/v1/jobs/{job_id}").json()
                    done = sum(v for k, v in job["progress"].items() if k != RunStatus.PENDING
                               and k != RunStatus.RUNNING)
                    progress.update(task, total=max(1, len(job["runs"])) if job["runs"] else None,
                                    completed=done, description=f"job {job_id}: {job['status']}")
                    if job["status"] in FINISHED_JOB_STATUSES:
                        break
                    time.sleep(1)
            errored = job.get("runs_errored", 0)
            table = Table(title=f"{matrix}: job {job_id} {job['status']}"
                                + (f", {errored} of {len(job['runs'])} runs errored" if errored
                                   else ""))
            for col in ("config", "scenario", "KL k3 mean [95% CI]", "hit cov.", "accept len",
                        "verdict"):
                table.add_column(col, no_wrap=True)
            judged: dict[str, int] = {}
            for run in job["runs"]:
                detail = client.get(f"/api/v1/runs/{run['id']}").json()
                for v in detail["verdicts"]:
                    key = f"{v['verdict']} ({v['method']})"
                    judged[key] = judged.get(key, 0) + 1
                for scen in detail["scenarios"]:
                    m = scen["metrics"]
                    kl = m.get("kl_k3_mean") or {}
                    kl_text = (f"{kl['value']:.2e} [{kl['ci_low']:.1e}, {kl['ci_high']:.1e}]"
                               if kl.get("ci_low") is not None else "")
                    cov = (m.get("hit_coverage") or {}).get("value")
                    acc = (m.get("accept_length") or {}).get("value")
                    table.add_row(run["config"], scen["scenario"], kl_text,
                                  "" if cov is None else f"{cov:.2f}",
                                  "" if acc is None else f"{acc:.2f}", scen["verdict"])
            console.print(table)
            console.print("verdicts per scenario and metric: " + ", ".join(
                f"{n} {k}" for k, n in sorted(judged.items())))
            # evalsvc run's exit status for runs that errored (a job whose every run errored is
            # failed); else 0 for a job done, 1 for one failed or cancelled
            outcome = EXIT_ERRORED if errored else 0 if job["status"] == JobStatus.DONE else EXIT_FAILED
            later = f"http://127.0.0.1:{settings.port}"
            console.print(
                f"Where to read the results:\n"
                f"  database     {settings.resolved_database_url()}\n"
                f"  samples      {settings.results_dir() / job_id}/*.parquet\n"
                f"  engine logs  {settings.data_dir / 'logs' / job_id}\n"
                f"  export       .venv/bin/evalsvc export out/{job_id}.csv --job {job_id}\n"
                f"  later        .venv/bin/evalsvc serve, then {later}/jobs/{job_id} (dashboard), "
                f"/regressions, /api/v1/jobs/{job_id} (REST), /docs (OpenAPI)", soft_wrap=True)
            if not keep:
                console.print(f"The service stops now (`evalsvc demo --keep` keeps it up for the "
                              f"dashboard at {base}/jobs/{job_id}).", soft_wrap=True)
                return outcome
            console.print(f"[bold]Dashboard of this job: {base}/jobs/{job_id}[/] (jobs {base}/jobs, "
                          f"regressions {base}/regressions, API {base}/docs). The service stays up "
                          "for it until Ctrl-C.", soft_wrap=True)
            try:
                while proc.poll() is None:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                console.print("stopping the service")
                return outcome
            console.print(f"[red]the service stopped[/]; see {log_path}")
            return 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
