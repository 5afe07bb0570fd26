"""Matrix files (``evalsvc/configs/*.yaml``) -> configs: named sets of engine settings with fingerprints.

A matrix crosses its ``axes`` (asv-style), drops every combination that matches an ``exclude``
entry, and adds its ``include`` entries. Each resulting config is one point: a model and a value per
axis, turned into SGLang server arguments (``ServerArgs`` field names) that the engine adapters
spell as a command line for their engine and release. Unknown keys anywhere are refused with the
file and key named.

A config's fingerprint hashes everything that makes two results comparable (model identity,
server arguments, dtype, tensor-parallel size, hardware class, workload version) and nothing that
does not (commit, time, port).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from evalsvc import validation
from evalsvc.engines.registry import (
    DEFAULT_ENGINE,
    EMBEDDED_FLAGS,  # noqa: F401 - the allowlists' home moved to engines.registry
    ENGINES,
    SGLANG_ENV_VALUES,
    SGLANG_FLAGS,  # noqa: F401
    EngineName,
    engine_kind,
    kinds_with,
)
from evalsvc.engines.sglang_server import TREE_CORE_ENV
from evalsvc.paths import (
    SHIPPED_CONFIGS_DIR,
    configs_dirs,
    inside,
    shipped_model_dir,
    shipped_sglang_model_dir,
)
from evalsvc.types import RunResult

# the shipped matrices (package data); EVALSVC_CONFIGS_DIR's come first (evalsvc.paths.configs_dirs)
CONFIGS_DIR = SHIPPED_CONFIGS_DIR
SCENARIOS = ("cold", "prefill_hit", "decode_hit", "branching", "host_tier", "speculative",
             "mixed_hit", "chunked_hit")
# chunked_hit needs one and a half chunks of new tokens after each cached prefix: larger chunks
# would need prompts longer than the workloads have
CHUNKED_HIT_MAX_CHUNK = 512


# names that become parts of paths and database rows: matrix names, model keys (and through them
# config names), matrix files under evalsvc/configs/
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "letters, digits, '.', '_', '-', at most 64, not starting with '.' or '-', no '..'"
# a string an engine flag may take: a plain word (no path, no address, no leading dash)
FLAG_VALUE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
INT64 = 2**63
INT32 = 2**31

# ServerArgs fields a matrix may set in ``extra_args``, per engine (``engines.registry``)
ENGINE_FLAGS = {name: e.flags for name, e in ENGINES.items()}
# The numeric flags' ranges (ServerArgs' own: sizes, counts and intervals are positive, fractions
# lie in (0, 1]); a value outside is refused at submission, naming the flag
_COUNT = Annotated[int, Field(ge=1, lt=INT32)]
_FRACTION = Annotated[float, Field(gt=0, le=1)]
_PROBABILITY = Annotated[float, Field(ge=0, le=1)]
_POSITIVE = Annotated[float, Field(gt=0, lt=INT32)]
FLAG_RANGES = {
    **dict.fromkeys(("mamba_track_interval", "max_mamba_cache_size", "max_running_requests",
                     "max_total_tokens", "page_size", "context_length", "cuda_graph_max_bs",
                     "torch_compile_max_bs", "max_prefill_tokens", "stream_interval",
                     "max_queued_requests", "num_continuous_decode_steps",
                     "triton_attention_num_kv_splits", "mamba_max_states_per_path",
                     "int8_mamba_ckpt_size"), _COUNT),
    "hicache_size": Annotated[int, Field(ge=0, lt=INT32)],  # GB; 0: HiCache's ratio decides
    "random_seed": Annotated[int, Field(ge=0, lt=INT64)],
    "mem_fraction_static": _FRACTION,
    "mamba_full_memory_ratio": _FRACTION,
    "swa_full_tokens_ratio": _FRACTION,
    "speculative_accept_threshold_single": _PROBABILITY,
    "speculative_accept_threshold_acc": _PROBABILITY,
    "schedule_conservativeness": _POSITIVE,
    "watchdog_timeout": _POSITIVE,
}
# SGLang's radix-tree core (0.5.19 and later: ``python`` or ``rust``; the ``radix_tree_core`` axis
# sets it per config). The embedded engine takes it too, and runs Python, as SGLang falls back.
TREE_CORES = ("python", "rust")
# Environment variables a matrix may give its engines (``engine_env``), per engine
# (``engines.registry``): SGLang's CPU engine switch (``--device cpu`` serves through it); the
# embedded engine's torch threads; the radix-tree core. ``ENV_VALUES``: the only values some of
# them take.
ENGINE_ENV = {name: e.env for name, e in ENGINES.items()}
ENV_VALUES = {TREE_CORE_ENV: TREE_CORES, **SGLANG_ENV_VALUES}
# Real SGLang on a CPU (``device: cpu``): which ops serve its gated-deltanet layers (``cpu_ops``),
# given to the engine as this variable (the SGLang CPU environment's sitecustomize reads it:
# evalsvc.builds.sglang_cpu). ``reference``, the default, runs on any x86-64 CPU with SGLang's
# native torch paths and torch attention; ``kernel`` is SGLang's CPU kernel (AVX-512-BF16).
CPU_OPS_VARIABLE = "EVALSVC_CPU_OPS"
CPU_OPS_ATTENTION = {"reference": "torch_native"}
FLAG_VALUES = {"load_format": {"auto", "safetensors", "pt", "dummy"}}


class MatrixError(ValueError):
    """A matrix file that cannot be used; the message names the file and the key."""


def shown(value: Any) -> str:
    """A value as an error message shows it: its repr, cut at 100 characters."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def name_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a name that becomes part of a path; None if it can."""
    if not isinstance(value, str):
        return f"{shown(value)} is not a string"
    if not NAME_RE.fullmatch(value) or ".." in value:
        return f"{shown(value)} is not a valid name ({NAME_RULE})"
    return None


def check_extra_args(extra_args: dict[str, Any], engine: str) -> None:
    """``extra_args`` against the engine's allowlist, scalar values only (ValueError naming
    ``extra_args.FLAG``)."""
    allowed = ENGINE_FLAGS[engine]
    for flag, value in extra_args.items():
        where = f"extra_args.{flag[:100]}"
        if flag not in allowed:
            raise ValueError(f"{where}: not an engine flag a matrix may set for the {engine} "
                             f"engine (allowed: {', '.join(sorted(allowed))})")
        if flag in FLAG_RANGES and value is not None:
            if isinstance(value, bool):
                raise ValueError(f"{where}: {value} is not a number")
            try:
                _flag_adapter(flag).validate_python(value)
            except ValidationError as exc:
                raise ValueError(f"{where}: {shown(value)}: {exc.errors()[0]['msg']}") from None
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not -INT64 < value < INT64:
                raise ValueError(f"{where}: {value} is out of range (|value| < 2^63)")
        elif isinstance(value, float):
            if not math.isfinite(value) or abs(value) >= INT64:
                raise ValueError(f"{where}: {value} is not a finite number below 2^63")
        elif isinstance(value, str):
            if not FLAG_VALUE_RE.fullmatch(value):
                raise ValueError(f"{where}: {shown(value)} is not a plain value (letters, digits, "
                                 "'.', '_', '+', '-', at most 64, not starting with '-')")
            if flag in FLAG_VALUES and value not in FLAG_VALUES[flag]:
                raise ValueError(f"{where}: {shown(value)} not in {sorted(FLAG_VALUES[flag])}")
        else:
            raise ValueError(f"{where}: a {type(value).__name__} is not a scalar (a number, a "
                             "boolean or a word)")


@cache
def _flag_adapter(flag: str) -> TypeAdapter:
    return TypeAdapter(FLAG_RANGES[flag], config=ConfigDict(allow_inf_nan=False))


def value_problem(axis: str, value: Any, models: dict[str, Any]) -> str | None:
    """Why ``value`` cannot be a value of ``axis``; None if it can."""
    if axis == "model":
        if not isinstance(value, str) or value not in models:
            return f"{shown(value)} is not a key of models"
        return None
    if axis == "chunked_prefill":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{shown(value)} is not an integer"
        if not -INT32 <= value < INT32:
            return f"{value} is out of range (-1 disables; at most 2^31 - 1)"
        return None
    if axis in POSITIVE_AXES:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{shown(value)} is not an integer"
        if not 0 < value < INT32:
            return f"{value} is out of range (1 to 2^31 - 1; null: the release's default)"
        return None
    allowed = AXES[axis]
    if axis in ("radix_tree_core", "prefill_cuda_graph"):
        if value is not None and (not isinstance(value, str) or value not in allowed):
            return f"{shown(value)} not in {sorted(allowed)} (null: the release's default)"
        return None
    if axis == "strategy":
        if not isinstance(value, str) or value not in allowed:
            return f"{shown(value)} not in {sorted(allowed)}"
        return None
    if not isinstance(value, bool):
        return f"{shown(value)} is not true or false"
    return None


class Strict(BaseModel):
    """The base of every experiment input read from YAML (matrices, thresholds): an unknown key
    is refused, and so is an infinite or NaN number."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


FlagWord = Annotated[str, Field(pattern=f"^{FLAG_VALUE_RE.pattern}$")]


class ModelEntry(Strict):
    # shipped model name or directory (embedded), model id or directory (sglang)
    path: str = Field(min_length=1, max_length=500)
    tp_size: int = Field(1, ge=1, le=64)
    dtype: FlagWord = "auto"
    accept_floor: dict[int, float] = Field(default_factory=dict,
                                           description="min accept length per MTP draft steps")


class HiCacheSettings(Strict):
    ratio: float = Field(4.0, gt=0, le=1000)
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    io_backend: FlagWord | None = None
    mem_layout: FlagWord | None = None
    max_total_tokens: int | None = Field(None, ge=1, lt=INT32)
    max_mamba_cache_size: int | None = Field(None, ge=1, lt=INT32)
    max_running_requests: int | None = Field(None, ge=1, lt=INT32)


class MTPSettings(Strict):
    algorithm: Literal["NEXTN", "EAGLE"] = "NEXTN"
    num_steps: int = Field(3, ge=1, le=64)
    eagle_topk: int = Field(1, ge=1, le=64)
    num_draft_tokens: int | None = Field(None, ge=1, le=1024)
    # SGLang's multi-layer EAGLE worker (``--enable-multi-layer-eagle``): a draft model per step,
    # each with pools of its own, as chain MTP heads with Mamba state (Inkling's) are served
    multi_layer: bool = False


DEFAULT_CONCURRENCY = 16  # requests of a scenario's batch in flight at once


class WorkloadSpec(Strict):
    # builtin:NAME, a local .jsonl/.json/.parquet/.csv file, or a hub dataset
    dataset: str = Field("builtin:demo", min_length=1, max_length=1000)
    split: str = Field("train", min_length=1, max_length=200)
    text_field: str = Field("text", min_length=1, max_length=200)
    num_prompts: int = Field(8, ge=1, le=100_000)
    max_new_tokens: int = Field(32, ge=1, le=65_536)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    # which prompts, and the sampling seed unless sampling_seed is set (the engines take int64)
    seed: int = Field(0, ge=0, lt=INT64)
    # the sampling seed alone: runs that differ only in it are samples of the same thing, so it is
    # left out of the workload version (and the fingerprint)
    sampling_seed: int | None = Field(None, ge=0, lt=INT64)
    # shared system prefix for branching (0: derived from the prompts)
    prefix_tokens: int = Field(0, ge=0, le=1 << 20)
    # requests of a scenario's batch in flight at once (the default leaves the workload version
    # as it was: see workloads.workload_version)
    concurrency: int = Field(DEFAULT_CONCURRENCY, ge=1, le=4096)


# ---- thresholds: one definition for evalsvc/configs/thresholds.yaml and a matrix's own -------------------
# (evalsvc.thresholds applies them; here because a matrix carries them)

Coverage = Annotated[float, Field(ge=0, le=1)]  # a fraction of the prompt tokens the cache served
_COVERAGE = TypeAdapter(Coverage, config=ConfigDict(allow_inf_nan=False))
METRIC_NAMES = ("kl_k3_mean", "extend_kl_k3_mean", "accept_length")


class MetricLimits(Strict):
    """The limits of one metric: a KL divergence or an accept length, neither ever negative."""

    max: float | None = Field(None, ge=0)
    min: float | None = Field(None, ge=0)
    min_effect: float | None = Field(None, ge=0)
    relative_effect: float | None = Field(None, ge=0)
    tail: bool | None = None
    tail_factor: float | None = Field(None, ge=1)
    noise: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> MetricLimits:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self

    @model_serializer(mode="wrap")
    def _given(self, handler) -> dict[str, Any]:
        """The limits given, none of the others: read back, it sets the same fields alone (a rule
        overrides only what it sets)."""
        return {k: v for k, v in handler(self).items() if v is not None}


class RuleBody(Strict):
    """What a rule of ``evalsvc/configs/thresholds.yaml`` sets (its ``defaults`` too)."""

    kl_k3_mean: MetricLimits | None = None
    extend_kl_k3_mean: MetricLimits | None = None
    accept_length: MetricLimits | None = None
    min_hit_coverage: Coverage | None = None
    bit_exact: bool | None = None

    @field_validator(*METRIC_NAMES, mode="before")
    @classmethod
    def _number_is_limit(cls, value: Any, info) -> Any:
        """``kl_k3_mean: 1e-8`` is short for ``{max: 1e-8}`` (``{min: ...}`` for acceptance)."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            return {"min" if info.field_name == "accept_length" else "max": value}
        return value


class Thresholds(RuleBody):
    """A matrix's own thresholds, applied after ``evalsvc/configs/thresholds.yaml`` to each of its
    configs (the fields and ranges of a rule there; see ``evalsvc.thresholds``), with
    ``min_hit_coverage`` also per scenario (``{prefill_hit: 0.5, ...}``)."""

    min_hit_coverage: Coverage | dict[str, Coverage] | None = None

    @field_validator("min_hit_coverage", mode="before")
    @classmethod
    def _per_scenario(cls, value: Any) -> Any:
        """One fraction, or one per scenario: each checked alone, so the message names it."""
        if value is None:
            return None
        given = value.items() if isinstance(value, dict) else [(None, value)]
        for key, fraction in given:
            if key is not None and key not in SCENARIOS:
                raise ValueError(f"{shown(key)} is not a scenario (known: {', '.join(SCENARIOS)}; "
                                 "the limits apply to every config)")
            try:
                _COVERAGE.validate_python(fraction)
            except ValidationError as exc:
                where = f"{key}: " if key is not None else ""
                raise ValueError(f"{where}{shown(fraction)}: {exc.errors()[0]['msg']} (a fraction "
                                 "of the prompt tokens)") from None
        return value

    def for_scenario(self, scenario: str) -> RuleBody:
        """The rule these thresholds make for one scenario."""
        cov = self.min_hit_coverage
        if isinstance(cov, dict):
            cov = cov.get(scenario)
        return RuleBody(**{k: getattr(self, k) for k in RuleBody.model_fields
                           if k != "min_hit_coverage"}, min_hit_coverage=cov)


class ReferenceSpec(Strict):
    """``same_server``: SGLang's method on the evaluated server itself; ``config``: the same
    teacher-forced prefill on a server of its own, started with the axis values in ``config``
    (for example radix cache off, overlap off, MTP off)."""

    kind: Literal["same_server", "config"] = "same_server"
    config: dict[str, Any] | None = None

    @field_validator("config")
    @classmethod
    def _axes_only(cls, config: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (config or {}).items():
            if key not in AXES or key == "model":
                raise ValueError(f"unknown axis {key!r} (the reference uses each config's model)")
            problem = value_problem(key, value, {})
            if problem:
                raise ValueError(f"{key}: {problem}")
        return config


AXES = {
    "model": None,  # keys of ``models``
    "strategy": {"no_buffer", "extra_buffer", "extra_buffer_lazy", "auto"},
    "radix_cache": {True, False},
    "overlap": {True, False},
    "chunked_prefill": None,  # int; -1 disables
    "hicache": {True, False},
    "mtp": {True, False},
    "deterministic": {True, False},
    "radix_tree_core": set(TREE_CORES),  # SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND; null: default
    # the axes of 2026's bug classes (each null or false: the release's default, no flag)
    "mixed_chunk": {True, False},  # --enable-mixed-chunk
    "page_size": None,  # --page-size N
    "track_interval": None,  # --mamba-track-interval N
    "prefill_cuda_graph": {"full", "breakable", "disabled"},  # --cuda-graph-backend-prefill
    "mamba_max_states_per_path": None,  # --mamba-max-states-per-path N
    "int8_mamba_checkpoint": {True, False},  # --enable-int8-mamba-checkpoint
}
POSITIVE_AXES = ("page_size", "track_interval", "mamba_max_states_per_path")
DEFAULTS = {"strategy": "auto", "radix_cache": True, "overlap": True, "chunked_prefill": None,
            "hicache": False, "mtp": False, "deterministic": False, "radix_tree_core": None,
            "mixed_chunk": False, "page_size": None, "track_interval": None,
            "prefill_cuda_graph": None, "mamba_max_states_per_path": None,
            "int8_mamba_checkpoint": False}


class MatrixFile(Strict):
    name: str
    description: str = Field("", max_length=2000)
    engine: EngineName = DEFAULT_ENGINE
    models: dict[str, ModelEntry] = Field(min_length=1)
    axes: dict[str, list[Any]] = Field(default_factory=dict)
    exclude: list[dict[str, Any]] = Field(default_factory=list)
    include: list[dict[str, Any]] = Field(default_factory=list)
    hicache: HiCacheSettings = Field(default_factory=HiCacheSettings)
    mtp: MTPSettings = Field(default_factory=MTPSettings)
    extra_args: dict[str, Any] = Field(default_factory=dict, description="ServerArgs fields for all")
    engine_env: dict[str, str] = Field(default_factory=dict,
                                       description="environment variables of every engine")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    scenarios: list[Literal[SCENARIOS]] = Field(default_factory=lambda: list(SCENARIOS),
                                               max_length=len(SCENARIOS))
    reference: ReferenceSpec = Field(default_factory=ReferenceSpec)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    # each run's deadline in seconds, engine start-up included (default: EVALSVC_RUN_TIMEOUT_S)
    run_timeout_s: float | None = Field(None, gt=0, le=7 * 86400)
    # real SGLang on a CPU: the ops of its gated-deltanet layers (CPU_OPS_VARIABLE); only there
    cpu_ops: Literal["reference", "kernel"] | None = None
    # engine sglang: the SGLang environment (a name of GET /api/v1/engine-envs) of jobs that name
    # none; unset: the service's default (EVALSVC_ENGINE_PYTHON)
    default_engine_env: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem:
            raise ValueError(problem)
        return name

    @field_validator("models")
    @classmethod
    def _model_keys(cls, models: dict[str, ModelEntry]) -> dict[str, ModelEntry]:
        for key in models:
            problem = name_problem(key)
            if problem:
                raise ValueError(f"model key {problem}")
        return models

    @model_validator(mode="after")
    def _points(self) -> MatrixFile:
        """Axes, include and exclude entries: known axes, allowed values of the right type, known
        models; and at least one config."""
        for key, values in self.axes.items():
            if key not in AXES:
                raise ValueError(f"axes: unknown axis {shown(key)} (known: {', '.join(AXES)})")
            if not values:
                raise ValueError(f"axes: axis {shown(key)} has no values")
            for v in values:
                problem = value_problem(key, v, self.models)
                if problem:
                    raise ValueError(f"axes: axis {key!r}: value {problem}")
        for section in ("exclude", "include"):
            for i, entry in enumerate(getattr(self, section)):
                for key, value in entry.items():
                    where = f"{section}[{i}].{key[:100]}"
                    if key == "sglang_version" and section == "exclude":
                        try:
                            SpecifierSet(str(value) if isinstance(value, str | int | float)
                                         else "?")
                        except InvalidSpecifier:
                            raise ValueError(f"{where}: {shown(value)} is not a version range such "
                                             "as '<0.5.14'") from None
                        continue
                    if key == "reason" and section == "exclude":
                        if not isinstance(value, str) or not 0 < len(value) <= 1000:
                            raise ValueError(f"{where}: a reason is a text of 1 to 1000 "
                                             "characters (SGLang's own refusal)")
                        continue
                    if key not in AXES:
                        raise ValueError(f"{where}: unknown axis (known: {', '.join(AXES)})")
                    # a list: each of its values (an include entry stands for their product)
                    values = value if isinstance(value, list) and key != "model" else [value]
                    if not values:
                        raise ValueError(f"{where}: an empty list")
                    for v in values:
                        problem = value_problem(key, v, self.models)
                        if problem:
                            raise ValueError(f"{where}: {problem}")
        if not self.axes and not self.include:
            raise ValueError("include: the matrix has no configs (give axes or include entries)")
        asked = [*self.axes.get("radix_tree_core", []),
                 *(entry.get("radix_tree_core") for entry in self.include)]
        if TREE_CORE_ENV in self.engine_env and any(v is not None for v in asked):
            raise ValueError(f"engine_env.{TREE_CORE_ENV}: the radix_tree_core axis sets it per "
                             "config; give one of them")
        if "page_size" in self.extra_args and ("page_size" in self.axes or any(
                "page_size" in entry for entry in self.include)):
            raise ValueError("extra_args.page_size: the page_size axis sets it; give it there")
        return self

    @model_validator(mode="after")
    def _engine_env_name(self) -> MatrixFile:
        if self.default_engine_env is not None and not engine_kind(self.engine).uses_engine_envs:
            raise ValueError(f"default_engine_env: only for engine: "
                             f"{' or '.join(kinds_with('uses_engine_envs'))} (the {self.engine} engine "
                             "runs in the service's own environment)")
        return self

    @model_validator(mode="after")
    def _shipped_sglang_models(self) -> MatrixFile:
        """A model of a real-SGLang matrix named like a shipped SGLang checkpoint
        (``evalsvc/assets/sglang-models/NAME``) is that directory, wherever the command runs."""
        if engine_kind(self.engine).shipped_checkpoints:
            for entry in self.models.values():
                directory = shipped_sglang_model_dir(entry.path)
                if directory is not None:
                    entry.path = str(directory)
        return self

    @model_validator(mode="after")
    def _multi_layer_mtp(self) -> MatrixFile:
        if self.mtp.multi_layer and not engine_kind(self.engine).multi_layer_mtp:
            raise ValueError(f"mtp.multi_layer: SGLang's multi-layer EAGLE worker (engine: "
                             f"{' or '.join(kinds_with('multi_layer_mtp'))}), not the "
                             f"{self.engine} engine's")
        return self

    @model_validator(mode="after")
    def _cpu_ops(self) -> MatrixFile:
        """Real SGLang on a CPU gets its ops choice (``reference`` unless the matrix says
        ``kernel``) as an engine variable, which puts it in every config's fingerprint, and the
        reference ops get torch attention (unless the matrix names a backend)."""
        on_cpu = engine_kind(self.engine).cpu_ops and self.extra_args.get("device") == "cpu"
        given = self.engine_env.get(CPU_OPS_VARIABLE)
        if not on_cpu:
            if self.cpu_ops is not None:
                raise ValueError("cpu_ops: only for real SGLang on a CPU (engine: sglang with "
                                 "extra_args.device: cpu)")
            if given is not None:
                raise ValueError(f"engine_env.{CPU_OPS_VARIABLE}: only for real SGLang on a CPU")
            return self
        ops = self.cpu_ops or given or "reference"
        if given is not None and given != ops:
            raise ValueError(f"engine_env.{CPU_OPS_VARIABLE}: {shown(given)} contradicts "
                             f"cpu_ops: {ops} (set cpu_ops alone)")
        if ops not in ("reference", "kernel"):
            raise ValueError(f"engine_env.{CPU_OPS_VARIABLE}: {shown(ops)} is not reference or "
                             "kernel")
        self.cpu_ops = ops
        self.engine_env[CPU_OPS_VARIABLE] = ops
        return self

    def with_cpu_ops(self, ops: str) -> MatrixFile:
        """This matrix with its CPU ops replaced (``evalsvc run --cpu-ops``)."""
        data = self.model_dump()
        data["engine_env"].pop(CPU_OPS_VARIABLE, None)
        try:
            return MatrixFile.model_validate({**data, "cpu_ops": ops})
        except ValidationError as exc:
            raise MatrixError(f"--cpu-ops {shown(ops)}: " + describe_errors(exc)) from None

    def check_engine_flags(self, engine: str | None = None) -> None:
        """``extra_args`` and ``engine_env`` against the allowlists of ``engine`` (default: the
        matrix's own)."""
        engine = engine or self.engine
        check_extra_args(self.extra_args, engine)
        allowed = ENGINE_ENV[engine] | ({CPU_OPS_VARIABLE} if self.cpu_ops else set())
        for name, value in self.engine_env.items():
            where = f"engine_env.{name[:100]}"
            if name not in allowed:
                raise ValueError(f"{where}: not a variable a matrix may set for the {engine} "
                                 f"engine (allowed: {', '.join(sorted(allowed))})")
            if not FLAG_VALUE_RE.fullmatch(value):
                raise ValueError(f"{where}: {shown(value)} is not a plain value (letters, digits, "
                                 "'.', '_', '+', '-', at most 64, not starting with '-')")
            if name in ENV_VALUES and value not in ENV_VALUES[name]:
                raise ValueError(f"{where}: {shown(value)} not in {sorted(ENV_VALUES[name])}")

    def accept_floor(self, model: str, settings: dict[str, Any]) -> float | None:
        """The minimum accept length of a config of ``model`` with axis values ``settings``: the
        model's floor for the matrix's MTP draft steps, for an MTP config; None otherwise."""
        entry = self.models.get(model)
        if entry is None or not settings.get("mtp"):
            return None
        return entry.accept_floor.get(self.mtp.num_steps)

    def listed_points(self, section: str) -> int:
        """How many points the ``include`` (or ``exclude``) entries stand for: each the product of
        its listed values."""
        return sum(math.prod(len(v) if isinstance(v, list) and k != "model" else 1
                             for k, v in entry.items()) for entry in getattr(self, section))

    def cross_product(self) -> int:
        """How many combinations the axes make before any is excluded (0 without axes)."""
        if not self.axes:
            return 0
        n = len(self.models) if "model" not in self.axes else 1
        for values in self.axes.values():
            n *= len(values)
        return n


@dataclass(frozen=True)
class Config:
    """One matrix point. ``args`` are SGLang ServerArgs fields (plus model_path)."""

    name: str
    matrix: str
    model: str  # key in the matrix's models
    settings: dict[str, Any]
    args: dict[str, Any]
    fingerprint: str
    scenarios: tuple[str, ...]
    accept_floor: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # the engine's environment: the matrix's ``engine_env`` plus what the axes set
    # (``radix_tree_core``)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def tree_core(self) -> str | None:
        """The radix-tree core this config asks for (None: the release's default)."""
        return self.env.get(TREE_CORE_ENV)

    @property
    def uses_mtp(self) -> bool:
        return bool(self.settings.get("mtp"))

    def unrun(self, verdict: str, reason: str = "") -> RunResult:
        """This config's result when it got no further than its engine (an error, a cancel): what
        was asked, the verdict and why."""
        return RunResult(self.name, self.fingerprint, self.model, dict(self.settings),
                         dict(self.args), verdict=verdict, reason=reason)


def load_matrix(name_or_path: str | Path, *, allow_path: bool | None = None) -> MatrixFile:
    """A matrix by name (``NAME.yaml`` in EVALSVC_CONFIGS_DIR, else in the shipped
    ``evalsvc/configs``), or from a file when ``allow_path`` (the default for a ``Path``: the
    operator's own code; a string is a name unless the caller allows paths, as the CLI does).
    Matrices from those directories go through the engine flag allowlist."""
    if allow_path is None:
        allow_path = isinstance(name_or_path, Path)
    path = resolve_matrix_path(name_or_path, allow_path=allow_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise MatrixError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise MatrixError(f"{path}: a matrix file is a mapping at the top level")
    if "models" not in raw:  # some other file: its keys are not shown
        raise MatrixError(f"{path}: not a matrix file (a matrix has name and models; matrices: "
                          f"{', '.join(matrix_names())})")
    try:
        matrix = MatrixFile.model_validate(raw)
    except ValidationError as exc:
        raise MatrixError(f"{path}: " + describe_errors(exc)) from None
    if path.parent.resolve() in {d.resolve() for d in configs_dirs()}:
        try:
            matrix.check_engine_flags()
        except ValueError as exc:
            raise MatrixError(f"{path}: {exc}") from None
    return matrix


def describe_errors(exc: ValidationError, prefix: str = "") -> str:
    """A matrix's validation errors, each as ``PREFIX.LOC: message`` (a whole-matrix check: its
    message, which starts with the key)."""
    return validation.describe_errors(exc, prefix, tidy=True)


def matrix_files() -> dict[str, Path]:
    """The matrices by name (files with models), EVALSVC_CONFIGS_DIR's before the shipped ones: a
    file of the operator's overrides the shipped one of the same name. Files whose name is not a
    matrix name, or that resolve outside their directory (a link elsewhere), are left out."""
    found: dict[str, Path] = {}
    for directory in configs_dirs():
        for path in sorted(directory.glob("*.yaml")):
            if path.stem in found or name_problem(path.stem):
                continue
            try:
                inside(directory, path.name)
                is_matrix = "\nmodels:" in "\n" + path.read_text()
            except (ValueError, OSError, UnicodeDecodeError):
                continue
            if is_matrix:
                found[path.stem] = path
    return dict(sorted(found.items()))


def matrix_names() -> list[str]:
    """The names of ``matrix_files()``."""
    return list(matrix_files())


def resolve_matrix_path(name_or_path: str | Path, *, allow_path: bool = True) -> Path:
    text = str(name_or_path)
    if allow_path:
        path = Path(name_or_path)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            return path
    if name_problem(text) is None:
        for directory in configs_dirs():
            try:  # a name never leaves its directory (a link out of it included)
                candidate = inside(directory, f"{text}.yaml")
            except ValueError:
                continue
            if candidate.is_file():
                return candidate
    known = ", ".join(matrix_names())
    shown = repr(text[:100])
    if allow_path:
        raise MatrixError(f"matrix {shown}: no such file and no matrix of that name "
                          f"(known: {known})")
    if name_problem(text):
        raise MatrixError(f"matrix {shown}: a job names a matrix by name, not by "
                          f"path ({NAME_RULE}; known: {known})")
    raise MatrixError(f"matrix {shown}: no such matrix (known: {known})")


def expand(matrix: MatrixFile, hardware: str = "cpu", workload_version: str = "",
           sglang_version: str | None = None) -> list[Config]:
    """All configs of a matrix, in a stable order (for a given SGLang release, if any). Linear in
    the points (the cross product and the include entries, less the excluded ones)."""
    configs = []
    seen: set[str] = set()
    for point, excluded_by in iter_points(matrix, sglang_version):
        if excluded_by:
            continue
        cfg = make_config(matrix, point, hardware, workload_version)
        if cfg.name in seen:
            continue
        seen.add(cfg.name)
        configs.append(cfg)
    return configs


def iter_points(matrix: MatrixFile, sglang_version: str | None = None
                ) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Every point of a matrix once (the axes' cross product, then each include entry's
    product), with the exclude entries that apply to it for ``sglang_version`` (none: it is
    kept)."""
    seen_points: set[tuple] = set()
    # the exclude entries, grouped by the axes they name: one dict lookup per group and point
    excluded: dict[tuple[str, ...], dict[tuple, list[dict[str, Any]]]] = {}
    for ex in matrix.exclude:
        if _version_applies(ex, sglang_version):
            named = tuple(sorted(k for k in ex if k not in ("sglang_version", "reason")))
            for values in itertools.product(*(_listed(ex[k]) for k in named)):
                excluded.setdefault(named, {}).setdefault(
                    tuple(_hashable(v) for v in values), []).append(ex)

    def verdict(point: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        key = tuple(sorted((k, _hashable(v)) for k, v in point.items()))
        if key in seen_points:
            return None
        seen_points.add(key)
        applied = []
        for named, entries in excluded.items():
            applied += entries.get(tuple(_hashable(point.get(k, DEFAULTS.get(k))) for k in named),
                                   [])
        return point, applied

    products = []
    if matrix.axes:
        axes = dict(matrix.axes)
        if "model" not in axes:
            axes["model"] = list(matrix.models)
        products.append(axes)
    for inc in matrix.include:
        products.append({"model": [next(iter(matrix.models))],
                         **{k: _listed(v) if k != "model" else [v] for k, v in inc.items()}})
    for axes in products:
        keys = list(axes)
        for values in itertools.product(*(axes[k] for k in keys)):
            found = verdict(dict(zip(keys, values, strict=True)))
            if found is not None:
                yield found


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _hashable(value: Any) -> Any:
    """Axis values are scalars once validated; anything else compares by its JSON text."""
    try:
        hash(value)
    except TypeError:
        return json.dumps(value, sort_keys=True, default=str)
    return (type(value).__name__, value) if isinstance(value, bool) else value


def _version_applies(pattern: dict[str, Any], version: str | None) -> bool:
    spec = pattern.get("sglang_version")
    return spec is None or (version is not None
                            and Version(version.split("+")[0]) in SpecifierSet(spec))


def make_config(matrix: MatrixFile, point: dict[str, Any], hardware: str = "cpu",
                workload_version: str = "") -> Config:
    settings = {**DEFAULTS, **point}
    model = matrix.models[settings["model"]]
    args = server_args(matrix, settings, model)
    scenarios = tuple(s for s in matrix.scenarios if applies(s, settings))
    identity = {
        "model": model_identity(model.path, matrix.engine),
        "args": {k: v for k, v in sorted(args.items()) if k not in ("model_path", "port", "host")},
        "dtype": model.dtype, "tp_size": model.tp_size, "hardware": hardware,
        "workload": workload_version,
    }
    env = config_env(matrix, settings)
    if env:  # what the engine's environment switches on is part of what it is
        identity["engine_env"] = dict(sorted(env.items()))
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    return Config(name=config_name(settings), matrix=matrix.name, model=settings["model"],
                  settings=settings, args=args, fingerprint=fingerprint.hexdigest()[:16],
                  scenarios=scenarios, accept_floor=matrix.accept_floor(settings["model"], settings),
                  env=env)


def config_env(matrix: MatrixFile, s: dict[str, Any]) -> dict[str, str]:
    """The environment of a config's engine: the matrix's ``engine_env`` and the radix-tree core
    the config asks for."""
    env = dict(matrix.engine_env)
    if s.get("radix_tree_core") is not None:
        env[TREE_CORE_ENV] = s["radix_tree_core"]
    return env


def applies(scenario: str, settings: dict[str, Any]) -> bool:
    if scenario == "host_tier":
        return bool(settings["hicache"])
    if scenario == "speculative":
        return bool(settings["mtp"])
    if scenario in ("prefill_hit", "decode_hit", "branching"):
        return bool(settings["radix_cache"])
    if scenario == "mixed_hit":
        return bool(settings["radix_cache"] and settings["mixed_chunk"])
    if scenario == "chunked_hit":
        chunk = settings["chunked_prefill"]
        return bool(settings["radix_cache"] and chunk is not None
                    and 0 < chunk <= CHUNKED_HIT_MAX_CHUNK)
    return True


def config_name(s: dict[str, Any]) -> str:
    parts = [s["model"], "noradix" if not s["radix_cache"] else
             {"no_buffer": "nb", "extra_buffer": "eb", "extra_buffer_lazy": "ebl",
              "auto": "auto"}[s["strategy"]],
             "ov" if s["overlap"] else "sync"]
    if s["chunked_prefill"] is not None:
        parts.append("nochunk" if s["chunked_prefill"] <= 0 else f"c{s['chunked_prefill']}")
    if s["hicache"]:
        parts.append("hicache")
    if s["mtp"]:
        parts.append("mtp")
    if s["deterministic"]:
        parts.append("det")
    if s.get("mixed_chunk"):
        parts.append("mixed")
    if s.get("page_size") is not None:
        parts.append(f"p{s['page_size']}")
    if s.get("track_interval") is not None:
        parts.append(f"t{s['track_interval']}")
    if s.get("prefill_cuda_graph") is not None:
        parts.append(f"pcg{s['prefill_cuda_graph']}")
    if s.get("mamba_max_states_per_path") is not None:
        parts.append(f"ms{s['mamba_max_states_per_path']}")
    if s.get("int8_mamba_checkpoint"):
        parts.append("int8ckpt")
    if s.get("radix_tree_core") is not None:
        parts.append({"python": "pycore", "rust": "rustcore"}[s["radix_tree_core"]])
    return "-".join(parts)


def server_args(matrix: MatrixFile, s: dict[str, Any], model: ModelEntry) -> dict[str, Any]:
    """The SGLang ServerArgs fields a config asks for (names of the newest release)."""
    args: dict[str, Any] = {"model_path": model.path, **matrix.extra_args}
    if model.tp_size != 1:
        args["tp_size"] = model.tp_size
    if model.dtype != "auto":
        args["dtype"] = model.dtype
    if not s["radix_cache"]:
        args["disable_radix_cache"] = True
    else:
        args["mamba_radix_cache_strategy"] = s["strategy"]
    if not s["overlap"]:
        args["disable_overlap_schedule"] = True
    if s["chunked_prefill"] is not None:
        args["chunked_prefill_size"] = s["chunked_prefill"]
    if s["hicache"]:
        h = matrix.hicache
        args.update({"enable_hierarchical_cache": True, "hicache_ratio": h.ratio,
                     "hicache_write_policy": h.write_policy})
        for key in ("io_backend", "mem_layout"):
            if getattr(h, key) is not None:
                args[f"hicache_{key}"] = getattr(h, key)
        for key in ("max_total_tokens", "max_mamba_cache_size", "max_running_requests"):
            if getattr(h, key) is not None:
                args[key] = getattr(h, key)
    if s["mtp"]:
        m = matrix.mtp
        args.update({"speculative_algorithm": m.algorithm, "speculative_num_steps": m.num_steps,
                     "speculative_eagle_topk": m.eagle_topk,
                     "speculative_num_draft_tokens": m.num_draft_tokens or m.num_steps + 1})
        if m.multi_layer:
            args["enable_multi_layer_eagle"] = True
    if s["deterministic"]:
        args["enable_deterministic_inference"] = True
    for axis, arg in AXIS_ARGS.items():
        if s.get(axis) is not None and s.get(axis) is not False:
            args[arg] = s[axis]
    if matrix.cpu_ops in CPU_OPS_ATTENTION:  # unless the matrix names a backend itself
        args.setdefault("attention_backend", CPU_OPS_ATTENTION[matrix.cpu_ops])
    return args


# axes that are one ServerArgs field each (set when not null or false)
AXIS_ARGS = {"mixed_chunk": "enable_mixed_chunk", "page_size": "page_size",
             "track_interval": "mamba_track_interval",
             "prefill_cuda_graph": "cuda_graph_backend_prefill",
             "mamba_max_states_per_path": "mamba_max_states_per_path",
             "int8_mamba_checkpoint": "enable_int8_mamba_checkpoint"}


@lru_cache(maxsize=64)
def model_identity(path: str, engine: str) -> str:
    """Shipped or local model directories: name plus a hash of config and weights; other ids as is."""
    local = shipped_model_dir(path) if engine_kind(engine).shipped_models else None
    directory = local or (Path(path) if Path(path).is_dir() else None)
    if directory is None:
        return path
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        f = directory / name
        if f.is_file():
            h.update(f.read_bytes())
    return f"{directory.name}@{h.hexdigest()[:12]}"
