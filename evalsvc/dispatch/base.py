"""A run as plain data, the function that executes it, and the dispatcher interface.

``execute`` is a plain function of a ``RunTask``: everything it needs travels in the task (the
matrix and config as dicts, the engine spec, token ids of the prompts), so a dispatcher can run it in
a thread here or hand it to another machine.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from evalsvc.engines.base import EngineSpec
from evalsvc.harness import RunControl, run_config
from evalsvc.logs import log_context
from evalsvc.matrix import Config, MatrixFile
from evalsvc.types import RunResult


@dataclass
class RunTask:
    job_id: str
    run_id: int
    matrix: dict[str, Any]  # MatrixFile as a dict
    config: dict[str, Any]  # Config as a dict
    engine: dict[str, Any]  # EngineSpec as a dict
    prompts: list[tuple[str, list[int]]]
    log_dir: str
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def make(cls, job_id: str, run_id: int, matrix: MatrixFile, config: Config, spec: EngineSpec,
             prompts: list[tuple[str, list[int]]], log_dir: Path) -> RunTask:
        return cls(job_id, run_id, matrix.model_dump(mode="json"), asdict(config), asdict(spec),
                   [(pid, list(ids)) for pid, ids in prompts], str(log_dir))


def execute(task: RunTask, control: RunControl | None = None) -> RunResult:
    """Run one config (the whole harness: engine, scenarios, metrics) from a task."""
    matrix = MatrixFile.model_validate(task.matrix)
    cfg = dict(task.config)
    cfg["scenarios"] = tuple(cfg["scenarios"])
    config = Config(**cfg)
    spec = EngineSpec(**task.engine)
    with log_context(job=task.job_id, run=task.run_id):
        return run_config(config, matrix, spec, [(p, list(ids)) for p, ids in task.prompts],
                          log_dir=Path(task.log_dir), control=control)


class Dispatcher(Protocol):
    slots: int

    def submit(self, task: RunTask, on_start: Callable[[], None] | None = None,
               on_engine: Callable[[int], None] | None = None) -> Future:
        """Queue a run; the future yields its RunResult. ``on_start()`` when a slot starts it,
        ``on_engine(pid)`` when its engine process is up."""

    def cancel_job(self, job_id: str) -> None:
        """Stop every run of a job: engines stopped, no further scenario."""

    def shutdown(self) -> None:
        """Stop everything running and wait for it."""
