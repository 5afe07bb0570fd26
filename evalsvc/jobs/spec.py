"""A job's contract: the body a client submits (``JobCreate``), its checks, and the job as the
service stores and runs it (``JobSpec``).

``validate_job`` checks a body against matrices, models, patches, allowed sources and the limits on
what one job may expand to, and answers the ``JobSpec`` (JobError naming the field if not). Job ids
are made here too (``mint_id``), for jobs and bisections alike.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from evalsvc import validation
from evalsvc.builds.engine_envs import EngineEnvError, engine_envs
from evalsvc.builds.engine_envs import default_name as default_env
from evalsvc.builds.engine_envs import resolve as resolve_env
from evalsvc.engines.base import EngineSpec
from evalsvc.engines.embedded.defects import Defect
from evalsvc.engines.registry import EngineName, engine_kind
from evalsvc.jobs.plan import UnknownConfigs, plan_runs
from evalsvc.matrix import MatrixError, MatrixFile, WorkloadSpec, describe_errors, load_matrix
from evalsvc.model_catalog import ModelError, resolve_model
from evalsvc.model_catalog import named as named_model
from evalsvc.paths import shipped_model_dir
from evalsvc.settings import Settings


def mint_id(prefix: str, digits: int = 8) -> str:
    """A new id for a job or a bisection: ``PREFIX-YYYYmmdd-HHMMSS-`` and ``digits`` random hex
    digits (the prefix: the job's trigger, or ``bisect``)."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:digits]}"


class JobError(ValueError):
    """A job that cannot be accepted; the message names the problem. Nothing is stored."""


MAX_TEXT = 5000  # characters of any one string in a job body
MAX_DEPTH = 32  # nesting of a job body
INT64 = 2**63
# a model on the hub: NAME or NAMESPACE/NAME
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def check_storable(value: Any, where: str = "", depth: int = 0) -> None:
    """What both SQLite and PostgreSQL store and read back: strings (keys too) without NUL or lone
    surrogates and at most MAX_TEXT long, finite floats, integers within int64, bounded nesting.
    ValueError naming where in the body."""
    here = where or "(body)"
    if depth > MAX_DEPTH:
        raise ValueError(f"{here}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise ValueError(f"{here}: a string of {len(value)} characters (at most {MAX_TEXT})")
        if "\0" in value:
            raise ValueError(f"{here}: contains a NUL character")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{here}: contains a lone surrogate (not valid Unicode text)") from None
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not -INT64 <= value < INT64:
            raise ValueError(f"{here}: {value} is outside the 64-bit integer range")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{here}: {value} is not a finite number")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_storable(key, f"{where}.(key {ascii(key)[:80]})".lstrip("."), depth + 1)
            check_storable(item, f"{where}.{key}".lstrip("."), depth + 1)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_storable(item, f"{where}[{i}]", depth + 1)


class BuildSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str | None = Field(None, min_length=1, max_length=250,
                               description="sglang==VERSION, git:REPO@COMMIT or path:DIR "
                                           "(SGLang engine); none: the engine as installed")
    patches: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(
        default_factory=list, max_length=16,
        description="known fixes (SGLang) or defect:NAME (embedded engine)")

    @field_validator("source")
    @classmethod
    def _release_version(cls, source: str | None) -> str | None:
        """A release (``sglang==VERSION``, ``pypi:[sglang==]VERSION``) names a version number
        (PEP 440), as its wheel is downloaded by: else it is refused here, for every client
        (REST, the dashboard's form, the CLI), not failed when the job builds it."""
        version = release_version(source)
        if version is not None:
            try:
                Version(version)
            except InvalidVersion:
                raise ValueError(
                    f"{source.strip()[:200]!r}: {version[:100]!r} is not a version number "
                    "(PEP 440, e.g. sglang==0.5.23); a local tree is path:DIR, a commit "
                    "git:REPOSITORY@COMMIT") from None
        return source


def release_version(source: str | None) -> str | None:
    """The version a release source names (``sglang==VERSION``, ``pypi:sglang==VERSION``,
    ``pypi:VERSION``, as ``builds.build.parse_source`` reads them), None for any other source."""
    m = re.fullmatch(r"(?:pypi:)?sglang==(.*)|pypi:(.*)", (source or "").strip(), flags=re.S)
    return None if m is None else (m.group(1) if m.group(1) is not None else m.group(2))


class JobCreate(BaseModel):
    """A job: a matrix (a name in EVALSVC_CONFIGS_DIR or evalsvc/configs/, or inline) on one or two builds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    matrix: str | dict[str, Any] = Field(..., description="matrix name or an inline matrix")
    engine: EngineName | None = Field(None, description="default: the matrix's")
    builds: list[BuildSpec] | None = Field(None, min_length=1, max_length=2,
                                           description="two builds yield their comparison")
    engine_env: str | None = Field(None, min_length=1, max_length=64,
                                   description="engine sglang: the SGLang environment, by its "
                                               "name (GET /api/v1/engine-envs); default: the "
                                               "matrix's default_engine_env, else the service's "
                                               "default")
    model: str | None = Field(None, min_length=1, max_length=500,
                              description="a model replacing the matrix's models, by its name "
                                          "(GET /api/v1/models), or for SGLang a hub id")
    workload: dict[str, Any] | None = Field(None, description="overrides of the matrix workload")
    reference: dict[str, Any] | None = Field(None, description="reference override")
    configs: list[str] | None = Field(None, min_length=1, max_length=1000,
                                      description="only these configs of the matrix (leave it "
                                                  "out for all)")
    priority: int = Field(0, ge=-1000, le=1000, description="higher runs first")
    track: bool = Field(False, description="open and close regressions (and alert) from this "
                                           "job's verdicts, as nightly jobs do")

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        check_storable(data)
        return data

    @field_validator("matrix")
    @classmethod
    def _matrix_name(cls, matrix: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(matrix, str) and len(matrix) > 100:
            raise ValueError("a matrix name is at most 100 characters")
        return matrix

    @field_validator("configs")
    @classmethod
    def _config_names(cls, configs: list[str] | None) -> list[str] | None:
        for name in configs or []:
            if not CONFIG_NAME.fullmatch(name) or ".." in name:
                raise ValueError(f"{name[:200]!r} is not a config name (letters, digits, '.', "
                                 "'_', '-', at most 200)")
        return configs


CONFIG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


class JobSpec(BaseModel):
    """A validated job as stored with it (``stored()``) and read back by its runner: the matrix
    with the job's overrides applied, the engine, its builds and the configs it runs."""

    model_config = ConfigDict(extra="forbid")

    matrix_name: str
    matrix: MatrixFile
    engine: EngineName
    builds: list[BuildSpec]
    configs: list[str] | None = None
    model: str | None = None
    # engine sglang: the SGLang environment's name (engine_envs); None: EVALSVC_ENGINE_PYTHON (or
    # on Ray, each node's own)
    engine_env: str | None = None
    track: bool = False
    # what submitted it, when not a client: a nightly schedule's target, a bisection's step
    nightly_key: str | None = None
    bisection: str | None = None
    bisection_sha: str | None = None

    def stored(self) -> dict[str, Any]:
        """The job's JSON in the store (the submitters' keys only when given)."""
        return self.model_dump(mode="json", exclude={
            k for k in ("engine_env", "nightly_key", "bisection", "bisection_sha")
            if getattr(self, k) is None})


def stored_spec(spec: dict[str, Any] | None, *, strict: bool = False) -> JobSpec | None:
    """A job's spec as the store holds it (``Job.spec``), typed: the one place a stored job's
    matrix is parsed (``tests/test_run_job.py`` holds it so). None for one that is no ``JobSpec``
    (a row of a shape the store's migration 0010 could not convert: its matrix named only, and no
    longer there); ``strict``: a ValidationError instead (the job that runs it fails with it)."""
    if not spec and not strict:
        return None
    try:
        return JobSpec.model_validate(spec)
    except ValidationError:
        if strict:
            raise
        return None


def job_spec(job: Any) -> JobSpec | None:
    """``stored_spec`` of a ``store.models.Job``, read once per the spec it holds (its readers
    may look at it for each run and scenario of the job)."""
    spec = job.spec
    cached = job.__dict__.get("_job_spec")
    if cached is not None and cached[0] is spec:
        return cached[1]
    typed = stored_spec(spec)
    job.__dict__["_job_spec"] = (spec, typed)
    return typed


def validate_job(body: JobCreate, settings: Settings, trusted: bool = False) -> JobSpec:
    """Validate a job against matrices, models, patches, allowed sources and the limits on
    what one job may expand to; JobError if not."""
    limits = settings
    try:
        if isinstance(body.matrix, str):  # a name (evalsvc.matrix.resolve_matrix_path), never a path
            matrix = load_matrix(body.matrix, allow_path=False)
        else:
            size = len(json.dumps(body.matrix))
            if size > limits.max_matrix_bytes:
                raise JobError(f"matrix: the inline matrix is {size} bytes as JSON, over the "
                               f"limit of {limits.max_matrix_bytes} "
                               "(EVALSVC_MAX_MATRIX_BYTES)")
            matrix = MatrixFile.model_validate(body.matrix)
    except MatrixError as exc:
        raise JobError(str(exc)) from None
    except ValidationError as exc:
        raise JobError(describe_errors(exc, "matrix.")) from None
    _check_matrix_size(matrix, settings)
    engine = body.engine or matrix.engine
    try:
        matrix.check_engine_flags(engine)
    except ValueError as exc:
        raise JobError(f"matrix.{exc}") from None
    # a client names models by name, or directories under the model roots (model_catalog); the
    # named matrices (evalsvc/configs/, EVALSVC_CONFIGS_DIR; and the operator's schedules,
    # bisections and CLI) may name their own
    from_client = not trusted
    if body.model is not None:
        path = (_client_model(body.model, engine, settings, "model") if from_client
                else named_model(body.model, engine, settings))
        for entry in matrix.models.values():
            entry.path = path
    elif from_client and not isinstance(body.matrix, str):
        for key, entry in matrix.models.items():
            entry.path = _client_model(entry.path, engine, settings, f"matrix.models.{key}.path")
    for key, entry in matrix.models.items():
        _check_model(engine, key, entry.path)
    if body.workload:
        try:
            matrix.workload = WorkloadSpec.model_validate(
                {**matrix.workload.model_dump(), **body.workload})
        except ValidationError as exc:
            raise JobError(validation.describe_errors(exc, "workload.")) from None
    from evalsvc.workloads import WorkloadError, check_dataset

    # a client names builtin or hub datasets, and local files only under EVALSVC_DATASETS_DIR;
    # named matrices (evalsvc/configs/, EVALSVC_CONFIGS_DIR; and the operator's schedules) may use
    # their own files
    from_client = not isinstance(body.matrix, str) or "dataset" in (body.workload or {})
    local_ok = trusted or not from_client
    try:
        matrix.workload.dataset = check_dataset(
            matrix.workload, allow_local=local_ok,
            root=None if local_ok else settings.datasets_dir)
    except WorkloadError as exc:
        raise JobError(str(exc)) from None
    if body.reference is not None:
        raise JobError("reference: the service uses SGLang's same-server reference; a "
                       "reference config is available from the CLI (evalsvc run)")
    if matrix.reference.kind != "same_server":  # else it would be stored but not run
        raise JobError("matrix.reference: the service uses SGLang's same-server reference; a "
                       "reference config is available from the CLI (evalsvc run)")
    try:
        configs = plan_runs(matrix, EngineSpec(kind=engine), configs=body.configs)
    except UnknownConfigs as exc:  # a matrix without configs is named as such, below
        configs = []
        if exc.known:
            listed = sorted(exc.known)
            raise JobError(f"configs: {', '.join(n[:200] for n in exc.unknown[:20])} not in "
                           f"matrix {matrix.name} (configs: {', '.join(listed[:100])}"
                           f"{', ...' if len(listed) > 100 else ''})") from None
    if not configs:
        raise JobError(f"matrix {matrix.name}: no configs (every combination of its axes is "
                       "excluded)")
    builds = body.builds or [BuildSpec()]
    _check_job_size(matrix, settings, len(configs), len(builds))
    for i, b in enumerate(builds):
        _check_build(engine, i, b, trusted, settings)
    engine_env = _engine_env(body, matrix, engine, settings)
    return JobSpec(matrix_name=matrix.name, matrix=matrix, engine=engine, builds=builds,
                   configs=body.configs, model=body.model, engine_env=engine_env,
                   track=body.track)


def _engine_env(body: JobCreate, matrix: MatrixFile, engine: str, settings: Settings) -> str | None:
    """The name of the SGLang environment a job runs in: the job's, else its matrix's default,
    else the service's default; None on Ray without one (each node's own). JobError naming the
    field and the known names."""
    if not engine_kind(engine).uses_engine_envs:
        if body.engine_env is not None:
            raise JobError("engine_env: only for engine sglang (the embedded engine runs in the "
                           "service's own environment)")
        return None
    envs = engine_envs(settings)
    if body.engine_env is not None or matrix.default_engine_env is not None:
        field = "engine_env" if body.engine_env is not None else "matrix.default_engine_env"
        try:
            return resolve_env(settings, body.engine_env or matrix.default_engine_env, field).name
        except EngineEnvError as exc:
            raise JobError(str(exc)) from None
    name = default_env(settings, envs)
    if name is None and not settings.ray_address:  # on Ray the workers bring their own
        known = ", ".join(sorted(envs))
        raise JobError("engine sglang: this service has no default SGLang environment "
                       "(EVALSVC_ENGINE_PYTHON)" + (f"; name one in engine_env (known: {known})"
                                                    if known else ""))
    return name


def _client_model(value: str, engine: str, settings: Settings, where: str) -> str:
    try:
        return resolve_model(value, engine, settings, where)
    except ModelError as exc:
        raise JobError(str(exc)) from None
    except OSError as exc:
        raise JobError(f"{where}: {value[:200]!r} cannot be used ({exc.strerror})") from None


def _check_matrix_size(matrix: MatrixFile, settings: Settings) -> None:
    """Axis values, include and exclude entries and the axes' cross product, before the
    matrix is expanded (JobError naming the limit)."""
    limit = settings.max_matrix_entries
    over = f"over the limit of {limit} (EVALSVC_MAX_MATRIX_ENTRIES)"
    for key, values in matrix.axes.items():
        if len(values) > limit:
            raise JobError(f"matrix.axes.{key}: {len(values)} values, {over}")
    for section in ("include", "exclude"):
        n = len(getattr(matrix, section))
        if n > limit:
            raise JobError(f"matrix.{section}: {n} entries, {over}")
        points = matrix.listed_points(section)
        if points > limit:
            raise JobError(f"matrix.{section}: its entries' listed values make {points} "
                           f"combinations, {over}")
    product = matrix.cross_product()
    if product > limit:
        raise JobError(f"matrix.axes: the axes make {product} combinations, {over}")

def _check_job_size(matrix: MatrixFile, settings: Settings, configs: int, builds: int) -> None:
    """Configs, prompts and generated tokens of the whole job (JobError naming the limit)."""
    s = settings
    runs = configs * builds
    if runs > s.max_configs_per_job:
        raise JobError(f"configs: the job runs {runs} configs ({configs} x {builds} "
                       f"build(s)), over the limit of {s.max_configs_per_job} "
                       "(EVALSVC_MAX_CONFIGS_PER_JOB)")
    prompts = matrix.workload.num_prompts * runs
    if prompts > s.max_job_prompts:
        raise JobError(f"workload.num_prompts: {matrix.workload.num_prompts} prompts x {runs} "
                       f"configs = {prompts}, over the limit of {s.max_job_prompts} "
                       "(EVALSVC_MAX_JOB_PROMPTS)")
    tokens = matrix.workload.max_new_tokens * prompts
    if tokens > s.max_job_tokens:
        raise JobError(f"workload.max_new_tokens: {matrix.workload.max_new_tokens} tokens x "
                       f"{prompts} prompts = {tokens}, over the limit of {s.max_job_tokens} "
                       "(EVALSVC_MAX_JOB_TOKENS)")

def _check_build(engine: str, i: int, b: BuildSpec, trusted: bool, settings: Settings) -> None:
    from evalsvc.builds.build import BuildError, parse_source

    where = f"builds[{i}]"
    if engine_kind(engine).local_builds:  # source: git:REPO@COMMIT or path:DIR, evalsvc-engine.yaml
        from evalsvc.builds.embedded import embedded_build, parse_embedded_source

        known = {f"defect:{d.value}" for d in Defect}
        for p in b.patches:
            if p not in known:
                raise JobError(f"{where}.patches: unknown {p!r} for the embedded engine "
                               f"(known: {', '.join(sorted(known))})")
        parse = parse_embedded_source
    else:
        from evalsvc.builds.patches import PATCHES

        for p in b.patches:
            if p not in PATCHES:
                raise JobError(f"{where}.patches: unknown patch {p!r} "
                               f"(known: {', '.join(sorted(PATCHES))})")
        if b.source is None and b.patches:
            raise JobError(f"{where}: patches need a source")
        parse = parse_source
    if b.source is None:
        return
    version = re.fullmatch(r"(?:pypi:)?(?:sglang==)?(.*)", b.source.strip()).group(1)
    if b.source.strip().startswith(("sglang==", "pypi:")) and len(version) > 100:
        raise JobError(f"{where}.source: a version of {len(version)} characters (at most 100)")
    try:
        parse(b.source)
    except BuildError as exc:
        raise JobError(f"{where}.source: {exc}") from None
    if not trusted and not any(fnmatch.fnmatchcase(b.source, pat)
                               for pat in settings.allowed_sources):
        raise JobError(f"{where}.source: {b.source!r} is not an allowed build source "
                       f"(EVALSVC_ALLOWED_SOURCES: {', '.join(settings.allowed_sources)})")
    if engine_kind(engine).local_builds:
        try:  # the repository and commit exist, and the settings file there reads
            embedded_build(b.source, b.patches, settings.resolved_builds_dir())
        except BuildError as exc:
            raise JobError(f"{where}.source: {exc}") from None


def _check_model(engine: str, key: str, path: str) -> None:
    where = f"models.{key}.path"
    if path.startswith("-"):
        raise JobError(f"{where}: {path!r} is not a model (it starts with '-')")
    try:
        if engine_kind(engine).shipped_models:
            if shipped_model_dir(path) is None and not (Path(path) / "config.json").is_file():
                raise JobError(f"{where}: {path!r} is neither a shipped model nor a model "
                               "directory")
        elif path.startswith(("/", ".", "~")) or Path(path).exists():
            if not Path(path).expanduser().is_dir():
                raise JobError(f"{where}: no such directory {path}")
        elif not HUB_ID.fullmatch(path) or ".." in path:
            raise JobError(f"{where}: {path!r} is neither a model directory nor a hub model id "
                           "(NAME or NAMESPACE/NAME)")
    except OSError as exc:
        raise JobError(f"{where}: {path[:200]!r} cannot be used ({exc.strerror})") from None
