"""The ``evalsvc`` command line."""

from __future__ import annotations

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


if __name__ == "__main__":
    app()
