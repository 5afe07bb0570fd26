"""Matrix files (``configs/*.yaml``) -> configs: named sets of engine settings with fingerprints.

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
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
SCENARIOS = ("cold", "prefill_hit", "decode_hit", "branching", "host_tier", "speculative")


class MatrixError(ValueError):
    """A matrix file that cannot be used; the message names the file and the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelEntry(Strict):
    path: str  # shipped model name or directory (embedded), model id or directory (sglang)
    tp_size: int = 1
    dtype: str = "auto"
    accept_floor: dict[int, float] = Field(default_factory=dict,
                                           description="min accept length per MTP draft steps")


class HiCacheSettings(Strict):
    ratio: float = 4.0
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    io_backend: str | None = None
    mem_layout: str | None = None
    max_total_tokens: int | None = None
    max_mamba_cache_size: int | None = None
    max_running_requests: int | None = None


class MTPSettings(Strict):
    algorithm: Literal["NEXTN", "EAGLE"] = "NEXTN"
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int | None = None


class WorkloadSpec(Strict):
    dataset: str = "builtin:demo"  # builtin:NAME, a local .jsonl/.json/.parquet, or a hub dataset
    split: str = "train"
    text_field: str = "text"
    num_prompts: int = Field(8, ge=1, le=100_000)
    max_new_tokens: int = Field(32, ge=1, le=65_536)
    temperature: float = Field(1.0, ge=0.0)
    seed: int = Field(0, ge=0)  # which prompts, and the sampling seed unless sampling_seed is set
    # the sampling seed alone: runs that differ only in it are samples of the same thing, so it is
    # left out of the workload version (and the fingerprint)
    sampling_seed: int | None = Field(None, ge=0)
    # shared system prefix for branching (0: derived from the prompts)
    prefix_tokens: int = Field(0, ge=0)


class Thresholds(Strict):
    """A matrix's own thresholds, applied after ``configs/thresholds.yaml`` (for inline matrices);
    see ``evalsvc.thresholds`` for the fields."""

    kl_k3_mean: float | dict[str, float | None] | None = None
    accept_length: float | dict[str, float | None] | None = None
    min_hit_coverage: float | dict[str, float] | None = None
    bit_exact: bool | None = None


class ReferenceSpec(Strict):
    """``same_server``: SGLang's method on the evaluated server itself; ``config``: the same
    teacher-forced prefill on a server of its own, started with the axis values in ``config``
    (for example radix cache off, overlap off, MTP off)."""

    kind: Literal["same_server", "config"] = "same_server"
    config: dict[str, Any] | None = None

    @field_validator("config")
    @classmethod
    def _axes_only(cls, config: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in config or {}:
            if key not in AXES or key == "model":
                raise ValueError(f"unknown axis {key!r} (the reference uses each config's model)")
        return config


AXES = {
    "model": None,  # keys of ``models``
    "strategy": {"no_buffer", "extra_buffer", "auto"},
    "radix_cache": {True, False},
    "overlap": {True, False},
    "chunked_prefill": None,  # int; -1 disables
    "hicache": {True, False},
    "mtp": {True, False},
    "deterministic": {True, False},
}
DEFAULTS = {"strategy": "auto", "radix_cache": True, "overlap": True, "chunked_prefill": None,
            "hicache": False, "mtp": False, "deterministic": False}


class MatrixFile(Strict):
    name: str
    description: str = ""
    engine: Literal["embedded", "sglang"] = "embedded"
    models: dict[str, ModelEntry]
    axes: dict[str, list[Any]] = Field(default_factory=dict)
    exclude: list[dict[str, Any]] = Field(default_factory=list)
    include: list[dict[str, Any]] = Field(default_factory=list)
    hicache: HiCacheSettings = Field(default_factory=HiCacheSettings)
    mtp: MTPSettings = Field(default_factory=MTPSettings)
    extra_args: dict[str, Any] = Field(default_factory=dict, description="ServerArgs fields for all")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    scenarios: list[Literal[SCENARIOS]] = Field(default_factory=lambda: list(SCENARIOS))
    reference: ReferenceSpec = Field(default_factory=ReferenceSpec)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    # each run's deadline in seconds, engine start-up included (default: EVALSVC_RUN_TIMEOUT_S)
    run_timeout_s: float | None = Field(None, gt=0, le=7 * 86400)

    @field_validator("axes")
    @classmethod
    def _axes(cls, axes: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """Known axes and values only; an empty mapping means the configs are the ``include`` list."""
        for key, values in axes.items():
            if key not in AXES:
                raise ValueError(f"unknown axis {key!r} (known: {', '.join(AXES)})")
            if not values:
                raise ValueError(f"axis {key!r} has no values")
            allowed = AXES[key]
            for v in values:
                if allowed is not None and v not in allowed:
                    raise ValueError(f"axis {key!r}: value {v!r} not in {sorted(map(str, allowed))}")
                if key == "chunked_prefill" and not isinstance(v, int):
                    raise ValueError(f"axis 'chunked_prefill': value {v!r} is not an integer")
        return axes


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

    @property
    def uses_mtp(self) -> bool:
        return bool(self.settings.get("mtp"))


def load_matrix(name_or_path: str | Path) -> MatrixFile:
    path = resolve_matrix_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise MatrixError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise MatrixError(f"{path}: a matrix file is a mapping at the top level")
    try:
        matrix = MatrixFile.model_validate(raw)
    except ValidationError as exc:
        raise MatrixError(f"{path}: " + "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(top)'}: "
            f"{'unknown key' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in exc.errors())) from None
    _check_entries(path, matrix)
    return matrix


def resolve_matrix_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = CONFIGS_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml") if "\nmodels:" in p.read_text())
    raise MatrixError(f"matrix {name_or_path!r}: no such file and no configs/{name_or_path}.yaml "
                      f"(known: {', '.join(known)})")


def _check_entries(path: Path, matrix: MatrixFile) -> None:
    if "model" in matrix.axes:
        for m in matrix.axes["model"]:
            if m not in matrix.models:
                raise MatrixError(f"{path}: axes.model: {m!r} is not a key of models")
    for section in ("exclude", "include"):
        for i, entry in enumerate(getattr(matrix, section)):
            for key, value in entry.items():
                if key == "sglang_version" and section == "exclude":
                    try:
                        SpecifierSet(str(value))
                    except InvalidSpecifier:
                        raise MatrixError(f"{path}: exclude[{i}].sglang_version: {value!r} is not "
                                          "a version range such as '<0.5.14'") from None
                    continue
                if key not in AXES:
                    raise MatrixError(f"{path}: {section}[{i}].{key}: unknown axis")
                if key == "model" and value not in matrix.models:
                    raise MatrixError(f"{path}: {section}[{i}].model: {value!r} is not a key of "
                                      "models")


def expand(matrix: MatrixFile, hardware: str = "cpu", workload_version: str = "",
           sglang_version: str | None = None) -> list[Config]:
    """All configs of a matrix, in a stable order (for a given SGLang release, if any)."""
    points = []
    if matrix.axes:
        axes = dict(matrix.axes)
        if "model" not in axes:
            axes["model"] = list(matrix.models)
        keys = list(axes)
        for values in itertools.product(*(axes[k] for k in keys)):
            point = dict(zip(keys, values, strict=True))
            if any(_matches(point, ex, sglang_version) for ex in matrix.exclude):
                continue
            points.append(point)
    for inc in matrix.include:
        point = {"model": next(iter(matrix.models)), **inc}
        if point not in points:
            points.append(point)
    configs = []
    seen: set[str] = set()
    for point in points:
        cfg = make_config(matrix, point, hardware, workload_version)
        if cfg.name in seen:
            continue
        seen.add(cfg.name)
        configs.append(cfg)
    return configs


def _matches(point: dict[str, Any], pattern: dict[str, Any], version: str | None) -> bool:
    """Whether an exclude entry matches; ``sglang_version`` limits it to releases in a range."""
    spec = pattern.get("sglang_version")
    if spec is not None and (version is None or Version(version.split("+")[0])
                             not in SpecifierSet(spec)):
        return False
    return all(point.get(k, DEFAULTS.get(k)) == v for k, v in pattern.items()
               if k != "sglang_version")


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
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode())
    floor = model.accept_floor.get(matrix.mtp.num_steps) if settings["mtp"] else None
    return Config(name=config_name(settings), matrix=matrix.name, model=settings["model"],
                  settings=settings, args=args, fingerprint=fingerprint.hexdigest()[:16],
                  scenarios=scenarios, accept_floor=floor)


def applies(scenario: str, settings: dict[str, Any]) -> bool:
    if scenario == "host_tier":
        return bool(settings["hicache"])
    if scenario == "speculative":
        return bool(settings["mtp"])
    if scenario in ("prefill_hit", "decode_hit", "branching"):
        return bool(settings["radix_cache"])
    return True


def config_name(s: dict[str, Any]) -> str:
    parts = [s["model"], "noradix" if not s["radix_cache"] else
             {"no_buffer": "nb", "extra_buffer": "eb", "auto": "auto"}[s["strategy"]],
             "ov" if s["overlap"] else "sync"]
    if s["chunked_prefill"] is not None:
        parts.append("nochunk" if s["chunked_prefill"] <= 0 else f"c{s['chunked_prefill']}")
    if s["hicache"]:
        parts.append("hicache")
    if s["mtp"]:
        parts.append("mtp")
    if s["deterministic"]:
        parts.append("det")
    return "-".join(parts)


def server_args(matrix: MatrixFile, s: dict[str, Any], model: ModelEntry) -> dict[str, Any]:
    """The SGLang ServerArgs fields a config asks for (names of the newest release)."""
    args: dict[str, Any] = {"model_path": model.path, **matrix.extra_args}
    if model.tp_size != 1:
        args["tp_size"] = model.tp_size
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
    if s["deterministic"]:
        args["enable_deterministic_inference"] = True
    return args


@lru_cache(maxsize=64)
def model_identity(path: str, engine: str) -> str:
    """Shipped or local model directories: name plus a hash of config and weights; other ids as is."""
    from evalsvc.engines.embedded.paths import shipped_model_dir

    local = shipped_model_dir(path) if engine == "embedded" else None
    directory = local or (Path(path) if Path(path).is_dir() else None)
    if directory is None:
        return path
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        f = directory / name
        if f.is_file():
            h.update(f.read_bytes())
    return f"{directory.name}@{h.hexdigest()[:12]}"
