"""A run of the harness judged as ``evalsvc run --no-store`` judges it: the harness measures
(``harness.run_config``, its scenarios ``measured``), ``judging.judge_run`` decides on the config's
fixed limits with no history (``jobs.run.run_job`` does the same where nothing is stored)."""

from __future__ import annotations

from typing import Any

from evalsvc import judging
from evalsvc.engines.base import EngineSpec
from evalsvc.harness import run_config
from evalsvc.matrix import Config, MatrixFile
from evalsvc.types import RunResult


def run_judged(config: Config, matrix: MatrixFile, spec: EngineSpec, *args: Any,
               **kwargs: Any) -> RunResult:
    """``run_config``'s result, judged (an error, invalid or cancelled run keeps its verdict)."""
    result = run_config(config, matrix, spec, *args, **kwargs)
    judging.judge_run(result, judging.config_limits(config, matrix, engine=spec.kind))
    return result
