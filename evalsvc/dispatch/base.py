"""A run as typed data, the functions that execute it, and the dispatcher interface.

``execute`` is a plain function of a ``RunTask``: everything it needs travels in the task (the
matrix, the config, the engine spec, token ids of the prompts, the SGLang build), so a dispatcher
can run it in a thread here or hand it to another machine as plain data (``RunTask.to_wire``, read
back there with ``RunTask.from_wire``). The machine that runs it
makes the run's SGLang build itself (``engine_for``: from its own builds cache, or made there), so
nothing but the task has to be shared; ``prepare_build`` makes it first where the runs will go, for
the service to record what the build is before it plans the runs.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from evalsvc.builds.build import BuildError, installed_version, make_build
from evalsvc.engines.base import EngineSpec
from evalsvc.harness import RunControl, run_config, run_timeout
from evalsvc.logs import log_context
from evalsvc.matrix import Config, MatrixFile
from evalsvc.types import EventQueue, RunResult, Verdict

log = logging.getLogger("evalsvc.dispatch")


class RunTask(BaseModel):
    """One run to execute: its matrix, config and engine spec as the harness takes them, the
    prompts' token ids, where its logs go, its build and its deadline."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    run_id: int
    matrix: MatrixFile
    config: Config
    engine: EngineSpec
    prompts: list[tuple[str, list[int]]]
    log_dir: str
    # the SGLang build the run executes (a build request, see below); None: the engine spec as is
    build: dict[str, Any] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)
    # the run's deadline in seconds, engine start-up included (``harness.run_timeout``): decided
    # where the run is planned, so a worker's own settings do not change it; None: decided there
    run_timeout_s: float | None = None

    @classmethod
    def make(cls, job_id: str, run_id: int, matrix: MatrixFile, config: Config, spec: EngineSpec,
             prompts: list[tuple[str, list[int]]], log_dir: Path,
             build: dict[str, Any] | None = None,
             run_timeout_s: float | None = None) -> RunTask:
        """``run_timeout_s``: the service's default deadline (the matrix's own wins). The task
        holds the matrix itself; ``to_wire`` writes it where a task leaves this process."""
        return cls(job_id=job_id, run_id=run_id, matrix=matrix, config=config, engine=spec,
                   prompts=[(pid, list(ids)) for pid, ids in prompts], log_dir=str(log_dir),
                   build=build, run_timeout_s=run_timeout(matrix, run_timeout_s))

    def to_wire(self) -> dict[str, Any]:
        """The task as plain JSON data, as it travels to another machine (``from_wire``)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> RunTask:
        """A task from ``to_wire``'s data (the matrix validated again where it arrives)."""
        return cls.model_validate(data)

    def outcome(self, verdict: str, reason: str) -> RunResult:
        """The result of a run that did not get to its engine (cancelled, or an error)."""
        return self.config.unrun(verdict, reason)

    def as_config(self) -> Config:
        """The task's config as the harness takes it."""
        return self.config


def execute(task: RunTask, control: RunControl | None = None, *,
            builds_dir: Path | None = None) -> RunResult:
    """Run one config (the whole harness: build, engine, scenarios, metrics) from a task;
    ``builds_dir``: this machine's builds cache, where an SGLang build is made or found."""
    matrix, config, spec = task.matrix, task.config, task.engine
    with log_context(job=task.job_id, run=task.run_id):
        if task.build is not None:
            try:
                spec = engine_for(spec, task.build, builds_dir)
            except BuildError as exc:
                log.error("run %s: %s", task.run_id, exc)
                return task.outcome(Verdict.ERROR, f"engine build: {exc}")
        return run_config(config, matrix, spec, [(p, list(ids)) for p, ids in task.prompts],
                          log_dir=Path(task.log_dir), control=control,
                          run_timeout_s=task.run_timeout_s)


# A build request, as the service sends it with each run: ``{"source": SOURCE, "patches": [...],
# "package_hash": HASH}`` (a git source names its full sha), or ``{"source": None, "version": V}``
# for the SGLang installed in the engine's python.


def prepare_build(source: str | None, patches: list[str], python: str | None,
                  builds_dir: Path | None) -> dict[str, Any]:
    """Make (or find) an SGLang build in this machine's builds cache ``builds_dir``, before its
    runs: ``{"manifest": ...}`` for a source (see ``builds.build``), ``{"version": V}`` for the
    SGLang installed in ``python``. BuildError, naming the problem, when it cannot be made."""
    python = _need_python(python)
    if source is None:
        version = installed_version(python)
        if version is None:
            raise BuildError(f"the SGLang environment {python} has no sglang installed (a job "
                             "without a build source runs the installed SGLang)")
        return {"version": version}
    return {"manifest": make_build(source, patches, base_python=python,
                                   root=_need_dir(builds_dir)).manifest}


class InstalledBuild(BaseModel):
    """``prepare_build``'s answer without a source: the SGLang installed in the engine's python."""

    model_config = ConfigDict(extra="forbid")

    version: str

    def request(self) -> dict[str, Any]:
        return {"source": None, "version": self.version}


class MadeBuild(BaseModel):
    """``prepare_build``'s answer for a source: the build made (its manifest, ``builds.build``)."""

    model_config = ConfigDict(extra="forbid")

    manifest: dict[str, Any]

    def request(self) -> dict[str, Any]:
        m = self.manifest
        source = f"git:{m['location']}@{m['commit']}" if m["kind"] == "git" else m["source"]
        return {"source": source, "patches": list(m["patches"]),
                "package_hash": m["package_hash"]}


BUILD_INFO: TypeAdapter[InstalledBuild | MadeBuild] = TypeAdapter(InstalledBuild | MadeBuild)


def build_info(info: dict[str, Any]) -> InstalledBuild | MadeBuild:
    """``prepare_build``'s answer (plain data, as it travels from another machine), typed."""
    return BUILD_INFO.validate_python(info)


def build_request(info: dict[str, Any]) -> dict[str, Any]:
    """What each run of a prepared build carries (``prepare_build``'s answer -> a build request):
    the same code wherever the run goes, a git source pinned to its commit."""
    return build_info(info).request()


def engine_for(spec: EngineSpec, build: dict[str, Any], builds_dir: Path | None) -> EngineSpec:
    """The engine spec of a run on this machine: its build made here (or found in this machine's
    builds cache, ``builds_dir``) and checked to be the code the service recorded."""
    python = _need_python(spec.python)
    if build["source"] is None:
        found = installed_version(python)
        if found != build["version"]:
            raise BuildError(f"the SGLang environment {python} on this machine has "
                             f"{'sglang ' + found if found else 'no sglang'}; the job's build is "
                             f"the installed sglang {build['version']}")
        return spec
    made = make_build(build["source"], build["patches"], base_python=python,
                      root=_need_dir(builds_dir))
    if made.manifest["package_hash"] != build["package_hash"]:
        raise BuildError(f"{build['source']} built on this machine is other code (package hash "
                         f"{made.manifest['package_hash'][:12]}) than the job recorded "
                         f"({build['package_hash'][:12]})")
    return replace(spec, env={**spec.env, **made.env()})


def _need_dir(builds_dir: Path | None) -> Path:
    if builds_dir is None:
        raise BuildError("this machine has no builds directory (EVALSVC_BUILDS_DIR or "
                         "EVALSVC_DATA_DIR)")
    return builds_dir


def _need_python(python: str | None) -> str:
    if not python:
        raise BuildError("this machine has no SGLang environment (EVALSVC_ENGINE_PYTHON)")
    if not Path(python).exists():
        raise BuildError(f"the SGLang python {python} is not on this machine "
                         "(EVALSVC_ENGINE_PYTHON)")
    return python


class Dispatcher(Protocol):
    slots: int

    def prepare_build(self, source: str | None, patches: list[str], python: str | None,
                      env_name: str | None = None) -> dict[str, Any]:
        """``prepare_build`` on a machine where the runs will go, over the SGLang environment
        ``python`` (there: the one named ``env_name``); BuildError if it fails there."""

    def submit(self, task: RunTask, events: EventQueue | None = None) -> Future:
        """Queue a run; the future yields its RunResult. On ``events``, as they happen (values,
        not calls into the job): ``RunEvent(run_id, "started")`` when a slot starts it, and
        ``RunEvent(run_id, "engine", pid)`` when its engine process is up on this machine."""

    def cancel_job(self, job_id: str) -> None:
        """Stop every run of a job: engines stopped, no further scenario."""

    def shutdown(self) -> None:
        """Stop everything running and wait for it."""
