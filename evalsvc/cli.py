"""The ``evalsvc`` command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Accuracy and KL evaluation for SGLang's Mamba-hybrid serving paths.")


PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True,
               "help_option_names": []}


@app.command(context_settings=PASSTHROUGH)
def engine(ctx: typer.Context) -> None:
    """Run the embedded CPU engine (SGLang's flags and HTTP API; --help lists the flags)."""
    from evalsvc.engines.embedded.app import main

    raise typer.Exit(main(list(ctx.args)))


@app.command("engine-demo")
def engine_demo(
    model: Annotated[str | None, typer.Option("--model-path",
                                              help="model directory or shipped name")] = None,
    flags: Annotated[str, typer.Option(help="extra engine flags, space-separated")] = "",
) -> None:
    """Start the embedded engine, send requests that hit the prefix cache, print what came back."""
    from evalsvc.demo import run_engine_demo

    extra = flags.split()
    if model:
        extra = ["--model-path", model, *extra]
    raise typer.Exit(run_engine_demo(extra))


@app.command()
def demo(
    matrix: Annotated[str, typer.Option(help="the matrix to submit")] = "smoke",
    configs: Annotated[list[str] | None, typer.Option(
        "--config", help="only these configs of the matrix")] = None,
    num_prompts: Annotated[int | None, typer.Option(help="prompts per scenario")] = None,
    keep: Annotated[bool | None, typer.Option(
        "--keep/--no-keep", help="keep the service up for the dashboard until Ctrl-C "
                                 "(default: when run from a terminal)")] = None,
) -> None:
    """`make run`: start the service on the embedded defaults, submit the smoke job, wait for it,
    print its results, where to read them and where the dashboard shows it (kept up until Ctrl-C
    from a terminal), and stop the service."""
    from evalsvc.demo import run_service_demo

    raise typer.Exit(run_service_demo(matrix, configs, num_prompts, keep))


@app.command()
def run(
    matrix: Annotated[str, typer.Argument(help="matrix name (NAME.yaml in EVALSVC_CONFIGS_DIR or the shipped "
                                                      "evalsvc/configs) or a YAML file")],
    engine: Annotated[str | None, typer.Option(
        help="embedded or sglang (default: the matrix's engine)")] = None,
    engine_python: Annotated[str | None, typer.Option(
        help="python of the SGLang engine build")] = None,
    engine_env: Annotated[str | None, typer.Option(
        help="the SGLang environment by its name (evalsvc engine-envs lists them), instead of "
             "--engine-python")] = None,
    sglang_version: Annotated[str | None, typer.Option(
        help="SGLang release to spell flags for (default: the build's, else the one installed "
             "in --engine-python, else the newest)")] = None,
    model: Annotated[str | None, typer.Option(
        help="model replacing every model of the matrix: a name (evalsvc models) or a path")]
    = None,
    out: Annotated[Path | None, typer.Option(
        help="output directory (default: out/<matrix>-<time>)")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="print engine command lines, one JSON list per line; launch nothing")] = False,
    inject_defect: Annotated[list[str] | None, typer.Option(
        "--inject-defect", help="embedded engine: switch a known defect on")] = None,
    configs: Annotated[list[str] | None, typer.Option(
        "--config", help="run only these config names")] = None,
    repository: Annotated[str | None, typer.Option(
        help="repository of the evaluated build (default: sgl-project/sglang, or "
             "evalsvc/embedded for the embedded engine)")] = None,
    commit: Annotated[str | None, typer.Option(help="commit sha of the evaluated build")] = None,
    commit_time: Annotated[str | None, typer.Option(help="its commit time (ISO 8601)")] = None,
    branch: Annotated[str | None, typer.Option(help="its branch")] = None,
    store: Annotated[bool, typer.Option(
        "--store/--no-store", help="record the results in the store (EVALSVC_DATABASE_URL or "
                                   "SQLite in EVALSVC_DATA_DIR)")] = True,
    track: Annotated[bool, typer.Option(
        help="a tracked run of its series, as a nightly's: its verdicts open and close the "
             "series' regressions (and alert)")] = False,
    source: Annotated[str | None, typer.Option(
        help="SGLang build source: sglang==VERSION, git:REPO@COMMIT or path:DIR (laid over "
             "--engine-python's environment)")] = None,
    patch: Annotated[list[str] | None, typer.Option(
        "--patch", help="with --source: a known fix to patch in")] = None,
    cpu_ops: Annotated[str | None, typer.Option(
        help="real SGLang on a CPU: reference (torch, any x86-64 CPU) or kernel (SGLang's CPU "
             "kernel, AVX-512-BF16); default: the matrix's cpu_ops")] = None,
) -> None:
    """Evaluate a configuration matrix: KL against the reference and acceptance, per scenario.

    Exits 0 when every run passed, 1 when a run failed its verdict (fail or invalid), else 4 when
    a run errored (no verdict reached: its engine did not start or died, or it could not be
    recorded), 2 when the matrix, an option or the build is refused before any run."""
    import json
    import logging
    import time
    from dataclasses import replace

    from pydantic import ValidationError
    from rich.console import Console
    from rich.text import Text

    from evalsvc.builds.build import BuildError
    from evalsvc.children import exit_on_sigterm
    from evalsvc.engines.base import EngineSpec
    from evalsvc.engines.registry import ENGINES, kinds_with, known_engines
    from evalsvc.evaluate import prepare, results_table, run_local
    from evalsvc.jobs import BuildSpec, JobSpec, UnknownConfigs, mint_id
    from evalsvc.jobs import run as job_run
    from evalsvc.jobs.builds import ReadyBuild
    from evalsvc.logs import setup_logging
    from evalsvc.matrix import MatrixError, load_matrix
    from evalsvc.settings import Settings
    from evalsvc.validation import describe_errors
    from evalsvc.workloads import WorkloadError

    exit_on_sigterm()  # stopped by SIGTERM, it stops its engines first, as on Ctrl-C

    console = Console()  # a terminal's own width (the table fits 100 columns)
    if not console.is_terminal:  # a pipe or a file: at least 150 columns (COLUMNS: more)
        console = Console(width=max(console.width, 150))
    setup_logging(logging.WARNING)
    try:
        mat = load_matrix(matrix, allow_path=True)  # the operator may name a file
        if cpu_ops is not None:
            mat = mat.with_cpu_ops(cpu_ops)
    except MatrixError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    kind = engine or mat.engine
    if kind not in ENGINES:
        console.print(f"[red]error:[/] --engine {kind}: use {known_engines()}")
        raise typer.Exit(2)
    entry = ENGINES[kind]
    if inject_defect and not entry.injects_defects:
        console.print(f"[red]error:[/] --inject-defect needs the "
                      f"{' or '.join(kinds_with('injects_defects'))} engine")
        raise typer.Exit(2)
    if track and not store:
        console.print("[red]error:[/] --track needs the store (drop --no-store)")
        raise typer.Exit(2)
    if (source or patch) and (entry.local_builds or not source):
        console.print(f"[red]error:[/] --source/--patch need --engine "
                      f"{' or '.join(kinds_with('local_builds', has=False))} and a --source")
        raise typer.Exit(2)
    try:  # the checks every client's build gets (a release names a version number)
        wanted = BuildSpec(source=source, patches=[*(patch or []),
                                                   *(f"defect:{d}" for d in inject_defect or [])])
    except ValidationError as exc:
        console.print(Text.assemble(("error:", "red"), f" --{describe_errors(exc, tidy=True)}"))
        raise typer.Exit(2) from None
    settings = Settings()
    if engine_env is not None:
        from evalsvc.builds.engine_envs import EngineEnvError, resolve

        if engine_python or not entry.uses_engine_envs:
            console.print(f"[red]error:[/] --engine-env needs --engine "
                          f"{' or '.join(kinds_with('uses_engine_envs'))}, and no --engine-python")
            raise typer.Exit(2)
        try:
            engine_python = resolve(settings, engine_env, "--engine-env").python
        except EngineEnvError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
    base = EngineSpec(kind=kind, python=engine_python or (sys.executable if entry.uses_engine_envs
                                                          else None))
    builds = settings.resolved_builds_dir()
    ready = None
    if entry.local_builds or source or not dry_run:  # a dry run makes no build, but a source's
        from evalsvc.dispatch.base import engine_for, prepare_build
        from evalsvc.jobs.builds import Provenance, ready_build

        said = Provenance(repository, commit,
                          _commit_time(commit_time) if commit_time else None, branch)
        try:
            ready = ready_build(base, wanted,
                                lambda src, ps, py, _name=None: prepare_build(src, ps, py,
                                                                              builds), builds,
                                said)
            # the build this machine made, as each run of a job finds it where it runs
            spec = (engine_for(ready.engine, ready.request, builds)
                    if ready.request is not None else ready.engine)
        except BuildError as exc:
            console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(2) from None
    else:
        from evalsvc.builds.build import installed_version

        spec = EngineSpec(kind=kind, python=engine_python,
                          version=installed_version(base.python))
    if sglang_version:  # the operator's release to spell flags for
        spec = replace(spec, version=sglang_version)
    model_name = model
    if model:  # a model's name (evalsvc models) is its directory
        from evalsvc.model_catalog import named

        model = named(model, kind, settings)
    try:
        cfgs, prompts = prepare(mat, spec, model, configs)
    except UnknownConfigs as exc:
        console.print(f"[red]error:[/] --config {', '.join(exc.unknown)}: not in matrix "
                      f"{mat.name} ({', '.join(exc.known)})")
        raise typer.Exit(2) from None
    except (WorkloadError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    # the job as the service stores it too: the matrix as run (its model and CPU ops applied)
    job = JobSpec(matrix_name=mat.name, matrix=mat, engine=kind, builds=[wanted],
                  configs=configs or None, model=model_name, engine_env=engine_env,
                  track=track)
    job_id = mint_id("cli", digits=6)
    if dry_run:
        outcome = job_run.run_job(job_id, job, None, None, job_run.RunOptions(
            engine=spec, prompts=prompts, configs=cfgs, dry_run=True))
        for argv in outcome.commands:
            print(json.dumps(argv))
        return
    out = out or Path("out") / job_id
    db = None
    if store:
        from evalsvc.store.db import Store

        db = Store(settings.resolved_database_url())
    t0 = time.monotonic()
    try:  # with a store, the job's end is written however it stops (Ctrl-C: cancelled)
        outcome = run_local(job_id, job, spec, cfgs, prompts, out, console, store=db,
                            results_dir=settings.results_dir(),
                            build=ReadyBuild(spec, ready.ref, None) if ready else None,
                            trigger="cli")
    finally:
        if db is not None:
            db.close()
    results = outcome.results
    console.print(results_table(results, f"{mat.name}: {len(cfgs)} configs, "
                                         f"{time.monotonic() - t0:.0f} s"))
    console.print(f"results: {out}/summary.json, {out}/samples.parquet, logs in {out}/logs")
    if db is not None:
        patch_set = ready.ref.patch_set
        console.print(f"recorded as job {job_id} ({outcome.status}) of build {ready.ref.ref}"
                      f"{' +' + patch_set if patch_set else ''} in "
                      f"{settings.resolved_database_url()}")
    for failure in outcome.failures:
        console.print(f"not recorded: {failure}", markup=False, style="red")
    status, errored = run_outcome(results, outcome.unrecorded)
    if errored:
        console.print(f"[red]{len(errored)} of {len(results)} runs errored[/] (no verdict reached)")
    raise typer.Exit(status)


def run_outcome(results, unrecorded: set[str]) -> tuple[int, set[str]]:
    """``evalsvc run``'s exit status for its results (EXIT_FAILED, EXIT_ERRORED or 0) and the
    names of the configs whose run errored (``unrecorded``: those that could not be recorded)."""
    from evalsvc.evaluate import EXIT_ERRORED, EXIT_FAILED
    from evalsvc.types import Verdict

    errored = {r.config for r in results if r.verdict == Verdict.ERROR} | unrecorded
    if any(r.verdict in (Verdict.FAIL, Verdict.INVALID) for r in results):
        return EXIT_FAILED, errored
    return (EXIT_ERRORED if errored else 0), errored


def _commit_time(text: str):
    """--commit-time as an aware time (a naive one taken as UTC)."""
    from datetime import UTC, datetime

    when = datetime.fromisoformat(text)
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


@app.command()
def probe(
    source: Annotated[str, typer.Argument(help="sglang==VERSION, git:REPO@COMMIT or path:DIR")],
    as_json: Annotated[bool, typer.Option("--json", help="an object per fix")] = False,
) -> None:
    """Which known fixes a SGLang source has: present, absent or not applicable, with evidence."""
    import json

    from evalsvc.builds.build import BuildError, make_build
    from evalsvc.settings import Settings

    try:
        build = make_build(source, root=Settings().resolved_builds_dir())
    except BuildError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    results = build.manifest["probes_before"]
    if as_json:
        typer.echo(json.dumps([{"fix": r["fix"], "status": r["status"],
                                "evidence": r["evidence"]} for r in results], indent=2))
        return
    for r in results:
        typer.echo(f"{r['fix']}: {r['status']}")
        for line in r["evidence"]:
            typer.echo(f"    {line}")


@app.command()
def build(
    source: Annotated[str, typer.Argument(help="sglang==VERSION, git:REPO@COMMIT or path:DIR")],
    patch: Annotated[list[str] | None, typer.Option("--patch", help="a fix to patch in")] = None,
    base_python: Annotated[str | None, typer.Option(
        help="python of the base environment (torch, kernels) to record")] = None,
) -> None:
    """Make (or reuse) an engine build and print its manifest."""
    import json

    from evalsvc.builds.build import BuildError, make_build
    from evalsvc.settings import Settings

    try:
        b = make_build(source, patch or [], base_python=base_python,
                       root=Settings().resolved_builds_dir())
    except BuildError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps({"directory": str(b.directory), "reused": b.reused, **b.manifest},
                          indent=2))


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="default: EVALSVC_HOST or 127.0.0.1")] = None,
    port: Annotated[int | None, typer.Option(help="default: EVALSVC_PORT or 8000")] = None,
) -> None:
    """Run the service: REST API, job runner and nightly schedules (uvicorn)."""
    import ipaddress
    import logging

    import uvicorn

    from evalsvc.app import create_app
    from evalsvc.logs import setup_logging
    from evalsvc.settings import Settings
    from evalsvc.store import shown_url

    settings = Settings()
    host = host or settings.host
    port = port or settings.port
    # a write token: EVALSVC_API_TOKEN or a write user's (a trusted header alone is no token)
    write_token = settings.api_token or any(u.role == "write" for u in settings.users)
    if not write_token:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            typer.echo(f"error: --host {host}: without EVALSVC_API_TOKEN (or a user of role write "
                       "in EVALSVC_USERS) the service binds to loopback only (set a token to "
                       "serve other hosts)", err=True)
            raise typer.Exit(2)
    setup_logging(logging.INFO)
    log = logging.getLogger("evalsvc.serve")
    if not write_token and not (settings.read_token or settings.users
                                or settings.trusted_user_header):
        log.warning("no EVALSVC_API_TOKEN: mutating endpoints are open, so the service binds to "
                    "%s (loopback) only", host)
    if settings.session_secret is None and (settings.api_token or settings.read_token
                                            or settings.users):
        log.info("no EVALSVC_SESSION_SECRET: dashboard sign-ins last until the service stops")
    # the port first, then the store's lock, then recovery (the app's start-up): a second
    # service on a port or a store in use exits before it touches anything
    try:
        sock = _listen(host, port)
    except OSError as exc:
        typer.echo(f"error: --port {port} on {host}: {exc.strerror or exc} (is another service "
                   "running there?)", err=True)
        raise typer.Exit(2) from None
    log.info("database %s; docs at http://%s:%d/docs", shown_url(settings.resolved_database_url()),
             host, port)
    config = uvicorn.Config(create_app(settings), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:  # the start-up failed (logged): e.g. the store is in use
        typer.echo("error: the service did not start (see the log above)", err=True)
        raise typer.Exit(3)


def _listen(host: str, port: int):
    """A listening socket on host:port (OSError if the address is in use), as uvicorn binds."""
    import socket

    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


@app.command()
def nightly(
    once: Annotated[bool, typer.Option("--once", help="fire every enabled schedule now")] = False,
    schedule: Annotated[list[str] | None, typer.Option(help="only these schedules")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="run the submitted jobs here and wait "
                                                       "for them")] = False,
) -> None:
    """Fire the nightly schedules once: resolve the newest commit or release, skip what is
    evaluated, submit a job with trigger nightly. Exit status, as ``evalsvc run``'s: 1 when (with
    --wait) a run failed its verdict (fail or invalid); else 4 when a schedule could not fire, a
    job did not end done or a run reached no verdict; 2 for a bad schedules file; else 0."""
    import time
    from collections import Counter

    from sqlalchemy import select

    from evalsvc.evaluate import EXIT_ERRORED, EXIT_FAILED
    from evalsvc.jobs import JobService
    from evalsvc.nightly import NightlyError, fire, load_schedules
    from evalsvc.settings import Settings
    from evalsvc.store.db import Store
    from evalsvc.store.models import Job, Run
    from evalsvc.types import FINISHED_JOB_STATUSES, JobStatus, Verdict

    if not once:
        typer.echo("error: use --once (the service runs the schedules on their crons)", err=True)
        raise typer.Exit(2)
    settings = Settings()
    try:
        schedules = [s for s in load_schedules(settings.nightly_file)
                     if s.enabled and (not schedule or s.name in schedule)]
    except NightlyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    store = Store(settings.resolved_database_url())
    jobs = JobService(settings, store, dispatcher=None)  # submits; with --wait a runner below
    submitted = []
    status = 0
    try:
        for s in schedules:
            try:
                job_id = fire(s, jobs, store)
            except (NightlyError, ValueError) as exc:
                typer.echo(f"{s.name}: error: {exc}", err=True)
                status = EXIT_ERRORED
                continue
            typer.echo(f"{s.name}: " + (f"submitted job {job_id}" if job_id
                                        else "newest already evaluated"))
            if job_id:
                submitted.append(job_id)
        if wait and submitted:
            from evalsvc.store.lock import StoreLocked

            jobs = JobService(settings, store, _dispatcher(settings))
            try:
                jobs.start()
            except StoreLocked:  # the service running on this store runs them
                typer.echo("a service runs on this store: waiting for it to run them")
            while True:
                with store.session() as sess:
                    states = {j: sess.get(Job, j).status for j in submitted}
                if all(v in FINISHED_JOB_STATUSES for v in states.values()):
                    break
                time.sleep(1)
            with store.session() as sess:
                verdicts = {j: list(sess.scalars(select(Run.verdict).where(Run.job_id == j)))
                            for j in submitted}
            for j, v in states.items():
                counts = Counter(str(x) for x in verdicts[j])
                typer.echo(f"job {j}: {v} (" + ", ".join(
                    f"{n} {verdict}" for verdict, n in sorted(counts.items())) + ")")
            every = [x for vs in verdicts.values() for x in vs]
            if any(x in (Verdict.FAIL, Verdict.INVALID) for x in every):
                status = EXIT_FAILED
            elif status == 0 and (any(v != JobStatus.DONE for v in states.values()) or any(
                    x in (None, Verdict.ERROR, Verdict.CANCELLED) for x in every)):
                status = EXIT_ERRORED
    finally:
        jobs.stop()
        store.close()
    raise typer.Exit(status)


@app.command()
def bisect(
    repository: Annotated[str | None, typer.Option(
        "--repo", help="git repository (path or URL), or pypi:sglang for SGLang's releases")]
    = None,
    good: Annotated[str | None, typer.Option(help="a commit (or release) where the config "
                                                  "passes")] = None,
    bad: Annotated[str | None, typer.Option(help="a later one where it fails")] = None,
    config: Annotated[str | None, typer.Option(help="the failing config")] = None,
    scenario: Annotated[str | None, typer.Option(help="the failing scenario")] = None,
    metric: Annotated[str | None, typer.Option(help="kl_k3_mean or accept_length (default: any "
                                                    "failure of the scenario)")] = None,
    matrix: Annotated[str, typer.Option(
        help="matrix name (EVALSVC_CONFIGS_DIR or evalsvc/configs)")] = "smoke",
    patch: Annotated[list[str] | None, typer.Option(help="patch (repeatable)")] = None,
    num_prompts: Annotated[int | None, typer.Option(help="workload size override")] = None,
    regression: Annotated[int | None, typer.Option(help="bisect this stored regression")] = None,
    engine_env: Annotated[str | None, typer.Option(
        help="engine sglang: the SGLang environment of the steps, by name (default: the "
             "regression's, else the service's default)")] = None,
    server: Annotated[str | None, typer.Option(help="a running service to ask (its URL); "
                                                    "default: run here, in the local store")]
    = None,
) -> None:
    """Find the first bad commit (or release) between GOOD and BAD, running only CONFIG on
    midpoints."""
    import time

    from evalsvc.bisect import BisectCreate, Bisector
    from evalsvc.jobs import JobError

    body = BisectCreate(repository=repository, good=good, bad=bad, config=config,
                        scenario=scenario, metric=metric, matrix=matrix, patches=patch or [],
                        workload={"num_prompts": num_prompts} if num_prompts else None,
                        engine_env=engine_env, regression_id=regression)

    def show(step: dict) -> None:
        how = "stored run" if step["reused"] else f"job {step['job_id']}"
        typer.echo(f"  {step['sha'][:12]}  {'bad ' if step['bad'] else 'good'}  ({how}, run "
                   f"{step['run_id']}){': ' + step['reason'] if step['bad'] else ''}")

    if server is not None:
        import httpx

        from evalsvc.settings import Settings
        from evalsvc.tls import tls_context

        token = Settings().api_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with httpx.Client(base_url=server.rstrip("/") + "/api/v1", headers=headers,
                          timeout=60, verify=tls_context()) as client:
            resp = client.post("/bisections", json=body.model_dump(exclude_none=True))
            if resp.status_code != 201:
                typer.echo(f"error: {resp.json().get('detail', resp.text)}", err=True)
                raise typer.Exit(2)
            b = resp.json()
            typer.echo(f"bisection {b['id']}: {len(b['candidates'])} candidate commits")
            seen = 0
            while b["status"] not in ("done", "failed"):
                time.sleep(2)
                b = client.get(f"/bisections/{b['id']}").json()
                for step in b["steps"][seen:]:
                    show(step)
                seen = len(b["steps"])
        _bisect_result(b["first_bad"], b["runs_used"], b["error"])
        return

    from evalsvc.jobs import JobService
    from evalsvc.settings import Settings
    from evalsvc.store.db import Store
    from evalsvc.store.lock import StoreLock, StoreLocked
    from evalsvc.store.models import Bisection

    settings = Settings()
    lock = StoreLock(settings.resolved_database_url())  # this runs a job runner on the store
    try:
        lock.acquire()
    except StoreLocked as exc:
        typer.echo(f"error: {exc} (or ask it: --server URL)", err=True)
        raise typer.Exit(2) from None
    try:
        dispatcher = _dispatcher(settings)
        store = Store(settings.resolved_database_url())
    except BaseException:
        lock.release()
        raise
    jobs = JobService(settings, store, dispatcher)
    bisector = Bisector(store, jobs)
    try:
        try:
            bisect_id = bisector.submit(body, start=False, trusted=True)
        except JobError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        with store.session() as s:
            n = len(s.get(Bisection, bisect_id).candidates)
        typer.echo(f"bisection {bisect_id}: {n} candidate commits")
        jobs.start(lock)
        bisector.run(bisect_id, on_step=show)
        with store.session() as s:
            b = s.get(Bisection, bisect_id)
            first_bad, used, error = b.first_bad, b.runs_used, b.error
    finally:
        jobs.stop()
        lock.release()  # jobs.stop() did, unless the runner never started
        store.close()
    _bisect_result(first_bad, used, error)


def _dispatcher(settings):
    """Where the settings send runs (EVALSVC_RAY_ADDRESS: a Ray cluster), or exit 2 saying why not."""
    from evalsvc.dispatch import DispatchError, make_dispatcher

    try:
        return make_dispatcher(settings)
    except DispatchError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _bisect_result(first_bad: str | None, runs_used: int, error: str | None) -> None:
    if first_bad is None:
        typer.echo(f"bisection failed: {error}", err=True)
        raise typer.Exit(1)
    typer.echo(f"first bad commit: {first_bad} ({runs_used} run(s))")


@app.command("engine-envs")
def engine_envs_command(
    as_json: Annotated[bool, typer.Option("--json", help="a JSON list")] = False,
) -> None:
    """The SGLang environments jobs may name (EVALSVC_ENGINE_PYTHON as `default`,
    EVALSVC_ENGINE_ENVS, and what `make sglang-cpu` and the SGLang env builder made)."""
    import json

    from evalsvc.builds.engine_envs import listed
    from evalsvc.settings import Settings

    envs = listed(Settings())
    if as_json:
        typer.echo(json.dumps(envs, indent=2))
        return
    if not envs:
        typer.echo("no SGLang environments (set EVALSVC_ENGINE_PYTHON or EVALSVC_ENGINE_ENVS, or "
                   "make sglang-cpu)")
    for e in envs:
        what = e["problem"] or ", ".join(
            f"{k} {e[k] or '-'}" for k in ("sglang", "torch", "kernel", "device")) + (
            f", cpu ops {'/'.join(e['cpu_ops'])}" if e["cpu_ops"] else "")
        typer.echo(f"{e['name']}{' (default)' if e['default'] else ''}: {what}")
        typer.echo(f"    {e['python']} ({e['origin']})")


@app.command("models")
def models_command(
    as_json: Annotated[bool, typer.Option("--json", help="a JSON list")] = False,
) -> None:
    """The models jobs may name: the shipped ones and those of EVALSVC_MODELS_DIR."""
    import json

    from evalsvc.model_catalog import listed
    from evalsvc.settings import Settings

    found = listed(Settings())
    if as_json:
        typer.echo(json.dumps(found, indent=2))
        return
    for m in found:
        typer.echo(f"{m['name']}: {m['engine']}, {m['architecture'] or '?'} ({m['origin']})")


db_app = typer.Typer(no_args_is_help=True, help="The results store's schema.")
app.add_typer(db_app, name="db")


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Apply migrations (to head by default)."""
    from evalsvc.settings import Settings
    from evalsvc.store import shown_url
    from evalsvc.store.db import current, upgrade

    url = Settings().resolved_database_url()
    upgrade(url, revision)
    typer.echo(f"{shown_url(url)}: at revision {current(url)}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()] = "base") -> None:
    """Revert migrations (to an empty schema by default)."""
    from evalsvc.settings import Settings
    from evalsvc.store import shown_url
    from evalsvc.store.db import current, downgrade

    url = Settings().resolved_database_url()
    downgrade(url, revision)
    typer.echo(f"{shown_url(url)}: at revision {current(url)}")


@db_app.command("current")
def db_current() -> None:
    """The revision the database is at."""
    from evalsvc.settings import Settings
    from evalsvc.store import shown_url
    from evalsvc.store.db import current

    url = Settings().resolved_database_url()
    typer.echo(f"{shown_url(url)}: at revision {current(url)}")


@app.command()
def export(
    out: Annotated[Path, typer.Argument(help="output file, .parquet or .csv")],
    job: Annotated[str | None, typer.Option(help="a job's results")] = None,
    repository: Annotated[str | None, typer.Option(help="only this repository's commits")] = None,
    since: Annotated[str | None, typer.Option(help="first commit ref of a range (inclusive)")] = None,
    until: Annotated[str | None, typer.Option(help="last commit ref of a range (inclusive)")] = None,
) -> None:
    """Write results from the store to Parquet or CSV: a row per run and scenario."""
    from evalsvc.settings import Settings
    from evalsvc.store.db import Store
    from evalsvc.store.export import results_frame, write_frame

    if out.suffix not in (".parquet", ".csv"):
        typer.echo(f"error: {out}: use a .parquet or .csv file name", err=True)
        raise typer.Exit(2)
    db = Store(Settings().resolved_database_url())
    try:
        with db.session() as s:
            df = results_frame(s, job_id=job, repository=repository, since=since, until=until)
    except KeyError as exc:
        typer.echo(f"error: {exc.args[0]}", err=True)
        raise typer.Exit(2) from None
    finally:
        db.close()
    if df.empty:
        typer.echo("error: no results match", err=True)
        raise typer.Exit(1)
    write_frame(df, out)
    typer.echo(f"{out}: {len(df)} rows")


if __name__ == "__main__":
    app()
