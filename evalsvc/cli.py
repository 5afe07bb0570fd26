"""The ``evalsvc`` command line."""

from __future__ import annotations

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


@app.command()
def demo(
    model: str = typer.Option(None, "--model-path", help="model directory or shipped name"),
    flags: str = typer.Option("", help="extra engine flags, space-separated"),
) -> None:
    """Start the embedded engine, send requests that hit the prefix cache, print what came back."""
    from evalsvc.demo import run_demo

    extra = flags.split()
    if model:
        extra = ["--model-path", model, *extra]
    raise typer.Exit(run_demo(extra))


@app.command()
def run(
    matrix: Annotated[str, typer.Argument(help="matrix name (configs/NAME.yaml) or a YAML file")],
    engine: Annotated[str | None, typer.Option(
        help="embedded or sglang (default: the matrix's engine)")] = None,
    engine_python: Annotated[str | None, typer.Option(
        help="python of the SGLang engine build")] = None,
    sglang_version: Annotated[str | None, typer.Option(
        help="SGLang release to spell flags for (default: newest)")] = None,
    model: Annotated[str | None, typer.Option(
        help="model path replacing every model of the matrix")] = None,
    out: Annotated[Path | None, typer.Option(
        help="output directory (default: out/<matrix>-<time>)")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="print engine command lines, one JSON list per line; launch nothing")] = False,
    inject_defect: Annotated[list[str] | None, typer.Option(
        "--inject-defect", help="embedded engine: switch a known defect on")] = None,
    configs: Annotated[list[str] | None, typer.Option(
        "--config", help="run only these config names")] = None,
) -> None:
    """Evaluate a configuration matrix: KL against the reference and acceptance, per scenario."""
    import json
    import logging
    import time

    from rich.console import Console

    from evalsvc.engines.base import EngineSpec
    from evalsvc.evaluate import dry_run_commands, evaluate, prepare, results_table
    from evalsvc.matrix import MatrixError, load_matrix
    from evalsvc.workloads import WorkloadError

    console = Console(width=max(Console().width, 150))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        mat = load_matrix(matrix)
    except MatrixError as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    kind = engine or mat.engine
    if kind not in ("embedded", "sglang"):
        console.print(f"[red]error:[/] --engine {kind}: use embedded or sglang")
        raise typer.Exit(2)
    env = {}
    if inject_defect:
        if kind != "embedded":
            console.print("[red]error:[/] --inject-defect needs the embedded engine")
            raise typer.Exit(2)
        env["EVALSVC_ENGINE_DEFECTS"] = ",".join(inject_defect)
    spec = EngineSpec(kind=kind, python=engine_python, version=sglang_version, env=env)
    try:
        cfgs, prompts = prepare(mat, spec, model)
    except (WorkloadError, ValueError) as exc:
        console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    if configs:
        unknown = sorted(set(configs) - {c.name for c in cfgs})
        if unknown:
            console.print(f"[red]error:[/] --config {', '.join(unknown)}: not in matrix "
                          f"{mat.name} ({', '.join(c.name for c in cfgs)})")
            raise typer.Exit(2)
        cfgs = [c for c in cfgs if c.name in configs]
    if dry_run:
        for argv in dry_run_commands(cfgs, spec):
            print(json.dumps(argv))
        return
    out = out or Path("out") / f"{mat.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    t0 = time.monotonic()
    results = evaluate(mat, cfgs, prompts, spec, out, console)
    console.print(results_table(results, f"{mat.name}: {len(cfgs)} configs, "
                                         f"{time.monotonic() - t0:.0f} s"))
    console.print(f"results: {out}/summary.json, {out}/samples.parquet, logs in {out}/logs")
    bad = [r for r in results if r.verdict in ("fail", "error", "invalid")]
    raise typer.Exit(1 if bad else 0)


if __name__ == "__main__":
    app()
