"""The models a job may name: the shipped ones (the embedded engine's, ``evalsvc/assets/models``,
and the SGLang checkpoints, ``evalsvc/assets/sglang-models``) and each subdirectory with a
``config.json`` of ``EVALSVC_MODELS_DIR``. A shipped model's name wins over a directory of the
same name there.

A client's job names a model by its name (``GET /api/v1/models``); a model directory it names by
path must lie under one of those roots, else the job is refused at submission naming
``EVALSVC_MODELS_DIR``. The job stores the directory resolved here, so its runs, wherever they are
dispatched (a Ray worker mounts the models where the service does), load what was checked.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalsvc.engines.registry import engine_kind, serving_engine
from evalsvc.paths import MODELS_DIR, SGLANG_MODELS_DIR
from evalsvc.settings import Settings

# a model on the hub: NAME or NAMESPACE/NAME (SGLang downloads it)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


class ModelError(ValueError):
    """A model a job cannot name; the message names the field and the setting."""


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    origin: str  # shipped, or EVALSVC_MODELS_DIR


def roots(settings: Settings) -> list[tuple[Path, str]]:
    """The directories models lie in, with where each comes from."""
    out = [(MODELS_DIR, "shipped"), (SGLANG_MODELS_DIR, "shipped")]
    if settings.models_dir is not None:
        out.append((Path(settings.models_dir).expanduser(), "EVALSVC_MODELS_DIR"))
    return out


def models(settings: Settings) -> dict[str, Model]:
    """The models jobs may name, by name."""
    found: dict[str, Model] = {}
    for root, origin in roots(settings):
        try:
            entries = sorted(root.iterdir())
        except OSError:
            continue
        for d in entries:
            if not d.name.startswith(".") and (d / "config.json").is_file():
                found.setdefault(d.name, Model(d.name, d, origin))
    return found


def _config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def listed(settings: Settings) -> list[dict[str, Any]]:
    """The models with what their ``config.json`` says (``GET /api/v1/models``): the engine that
    serves them (the embedded engine its own architectures, SGLang the others), architecture."""
    out = []
    for m in models(settings).values():
        config = _config(m.path)
        archs = config.get("architectures")
        model_type = config.get("model_type")
        out.append({"name": m.name, "origin": m.origin, "path": str(m.path),
                    "engine": serving_engine(model_type),
                    "architecture": archs[0] if isinstance(archs, list) and archs else None,
                    "model_type": model_type if isinstance(model_type, str) else None})
    return out


def _lexical(path: str) -> Path:
    """An absolute path with ``..`` and ``.`` taken out (links kept: the operator's own)."""
    return Path(os.path.normpath(os.path.abspath(os.path.expanduser(path))))


def _as_named(m: Model, engine: str) -> str:
    """A model's name as the engine's command takes it: its directory, or the embedded engine's
    shipped name as is (the engine finds it)."""
    return (m.name if engine_kind(engine).shipped_models and m.path.parent == MODELS_DIR
            else str(m.path))


def named(value: str, engine: str, settings: Settings) -> str:
    """The operator's model (the CLI's ``--model``, a schedule's): a model's name is its
    directory; anything else as given."""
    m = models(settings).get(value)
    return value if m is None else _as_named(m, engine)


def resolve_model(value: str, engine: str, settings: Settings, where: str) -> str:
    """What a client's job may name as a model: a model's name (``_as_named``), a model directory
    under one of the roots (``roots``), or for SGLang a hub id. ModelError naming ``where`` and
    EVALSVC_MODELS_DIR if not."""
    known = models(settings)
    m = known.get(value)
    if m is not None:
        return _as_named(m, engine)
    setting = (f"EVALSVC_MODELS_DIR={settings.models_dir}" if settings.models_dir is not None
               else "EVALSVC_MODELS_DIR is unset")
    names = ", ".join(sorted(known))
    if value.startswith(("/", ".", "~")) or "\\" in value or Path(value).exists():
        path = _lexical(value)
        if not any(path.is_relative_to(_lexical(str(root))) for root, _ in roots(settings)):
            raise ModelError(f"{where}: {value[:200]!r} is outside the directories models are "
                             f"served from (the shipped models; {setting}); name a model "
                             f"(known: {names})")
        if not (path / "config.json").is_file():
            raise ModelError(f"{where}: no model directory {value[:200]} (no config.json)")
        return str(path)
    if engine_kind(engine).hub_models and HUB_ID.fullmatch(value) and ".." not in value:
        return value  # a hub id: SGLang downloads it
    raise ModelError(f"{where}: unknown model {value[:200]!r} (known: {names}; models of "
                     f"{setting} are named by their directory)")
