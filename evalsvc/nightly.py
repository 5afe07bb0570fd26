"""Nightly schedules (``nightly.yaml``: EVALSVC_CONFIGS_DIR's, else the shipped one in
``evalsvc/configs``): each firing evaluates the newest commit or release.

A schedule names a cron expression, a tracked source (a git remote and branch, PyPI releases of a
package, or this project's embedded engine), a matrix and up to two patch sets, and optionally the
matrix's configs to run and overrides of its workload. A git source serves an SGLang matrix (the
commit's SGLang package) and an embedded one alike (the commit's ``evalsvc-engine.yaml``, see
``evalsvc/builds/embedded.py``); the matrix's engine decides. Firing resolves the
newest commit or version, skips it if a nightly job already covers it, and otherwise submits a job
with trigger ``nightly``. The service runs the schedules with APScheduler; ``evalsvc nightly
--once`` fires them all once from the command line.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from sqlalchemy import select

from evalsvc import children
from evalsvc.jobs import BuildSpec, JobCreate, JobService
from evalsvc.jobs.spec import stored_spec
from evalsvc.paths import config_file
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Job
from evalsvc.types import JobStatus

log = logging.getLogger("evalsvc.nightly")


class NightlyError(ValueError):
    pass


class GitSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    repository: str
    branch: str = "main"


class PypiSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    package: str = "sglang"


class Source(BaseModel):
    model_config = ConfigDict(extra="forbid")
    git: GitSource | None = None
    pypi: PypiSource | None = None
    embedded: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one(self) -> Source:
        if sum(x is not None for x in (self.git, self.pypi, self.embedded)) != 1:
            raise ValueError("give exactly one of git, pypi, embedded")
        return self


class Schedule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    cron: str
    source: Source
    matrix: str
    enabled: bool = True
    patch_sets: list[list[str]] = Field(default_factory=lambda: [[]], min_length=1, max_length=2)
    priority: int = 0
    configs: list[str] | None = None  # only these configs of the matrix
    workload: dict[str, Any] | None = None  # overrides of the matrix workload
    engine_env: str | None = None  # engine sglang: the SGLang environment, by name (engine_envs)


class NightlyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schedules: list[Schedule]


def load_schedules(path: Path | None = None) -> list[Schedule]:
    path = path or config_file("nightly.yaml")
    if not path.is_file():
        return []
    try:
        data = NightlyFile.model_validate(yaml.safe_load(path.read_text()) or {"schedules": []})
    except (ValidationError, yaml.YAMLError) as exc:
        raise NightlyError(f"{path}: {exc}") from None
    from apscheduler.triggers.cron import CronTrigger

    for s in data.schedules:
        try:
            CronTrigger.from_crontab(s.cron)
        except ValueError as exc:
            raise NightlyError(f"{path}: schedules[{s.name}].cron: {exc}") from None
    return data.schedules


@dataclass
class Target:
    """What a firing evaluates: a key that says whether it was done, and the job's builds."""

    key: str
    builds: list[BuildSpec]


def resolve(schedule: Schedule, builds_dir: Path) -> Target:
    """The newest commit (git), release (PyPI) or engine version (embedded) of a schedule; a git
    repository through its mirror in the builds cache ``builds_dir``."""
    src = schedule.source
    if src.embedded is not None:
        from evalsvc import __version__

        return Target(f"{schedule.name}:embedded=={__version__}",
                      [BuildSpec(patches=[p for p in ps]) for ps in schedule.patch_sets])
    if src.git is not None:
        from evalsvc.builds.build import BuildError, git, git_mirror

        try:
            mirror = git_mirror(src.git.repository, builds_dir)
            sha = git(["rev-parse", "--verify", f"refs/heads/{src.git.branch}^{{commit}}"],
                      mirror).stdout.strip()
        except BuildError as exc:
            raise NightlyError(f"schedule {schedule.name}: {exc}") from None
        source = f"git:{src.git.repository}@{sha}"
        return Target(f"{schedule.name}:{source}",
                      [BuildSpec(source=source, patches=ps) for ps in schedule.patch_sets])
    version = newest_release(src.pypi.package)
    source = f"sglang=={version}"
    return Target(f"{schedule.name}:{source}",
                  [BuildSpec(source=source, patches=ps) for ps in schedule.patch_sets])


def releases(package: str) -> list[str]:
    """A package's releases on the index, newest first (pip's listing)."""
    out = children.run([sys.executable, "-m", "pip", "index", "versions", package,
                        "--disable-pip-version-check"], capture_output=True, text=True)
    m = re.search(r"^Available versions: (.+)$", out.stdout, flags=re.M)
    if out.returncode != 0 or m is None:
        raise NightlyError(f"PyPI: cannot list releases of {package} "
                           f"({(out.stderr or out.stdout).strip()[-200:]})")
    return [v.strip() for v in m.group(1).split(",") if v.strip()]


def newest_release(package: str) -> str:
    return releases(package)[0]


def evaluated(store: Store, key: str) -> bool:
    with store.session() as s:
        for spec, status in s.execute(select(Job.spec, Job.status).where(Job.trigger == "nightly")):
            typed = stored_spec(spec)
            if typed is not None and typed.nightly_key == key and status not in (
                    JobStatus.FAILED, JobStatus.CANCELLED):
                return True
    return False


def fire(schedule: Schedule, jobs: JobService, store: Store) -> str | None:
    """One firing: the job id submitted, or None when the newest target was evaluated already."""
    target = resolve(schedule, jobs.settings.resolved_builds_dir())
    if evaluated(store, target.key):
        log.info("nightly %s: %s already evaluated", schedule.name, target.key)
        return None
    body = JobCreate(matrix=schedule.matrix, builds=target.builds, priority=schedule.priority,
                     configs=schedule.configs, workload=schedule.workload,
                     engine_env=schedule.engine_env, track=True)
    job_id = jobs.submit(body, trigger="nightly", extra={"nightly_key": target.key}, trusted=True)
    log.info("nightly %s: submitted job %s for %s", schedule.name, job_id, target.key)
    return job_id


class NightlyScheduler:
    """The schedules inside the service (APScheduler, background thread)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    @classmethod
    def start(cls, settings: Settings, jobs: JobService, store: Store) -> NightlyScheduler | None:
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.cron import CronTrigger

        schedules = [s for s in load_schedules(settings.nightly_file) if s.enabled]
        if not schedules:
            return None
        scheduler = BackgroundScheduler(timezone="UTC")
        for s in schedules:
            scheduler.add_job(_safe_fire, CronTrigger.from_crontab(s.cron, timezone="UTC"),
                              args=(s, jobs, store), id=s.name, coalesce=True, max_instances=1)
        scheduler.start()
        log.info("nightly schedules: %s", ", ".join(f"{s.name} ({s.cron})" for s in schedules))
        return cls(scheduler)

    def stop(self) -> None:
        self.scheduler.shutdown(wait=False)


def _safe_fire(schedule: Schedule, jobs: JobService, store: Store) -> None:
    try:
        fire(schedule, jobs, store)
    except Exception:
        log.exception("nightly %s failed", schedule.name)
