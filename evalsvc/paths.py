"""Paths: the shipped models and prompts (no heavy imports: the control plane and the embedded
engine both use this), and paths built from names a job carries (job ids, matrix, model and config
names), always inside their root directory."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def package_dir(*parts: str) -> Path:
    """A directory shipped inside the evalsvc package (package data: ``configs``,
    ``dashboard/templates``, ...), found through importlib.resources, so that an installed wheel
    and an editable checkout read the same files."""
    found = resources.files("evalsvc").joinpath(*parts)
    if not isinstance(found, Path) or not found.is_dir():
        raise FileNotFoundError(f"evalsvc package data {'/'.join(parts)!r} is not a directory on "
                                f"disk ({found}): install evalsvc unpacked (a wheel or a checkout)")
    return found


ASSETS = package_dir("assets")
MODELS_DIR = ASSETS / "models"
DEFAULT_MODEL = "hybrid-mamba2-tiny"


def shipped_models() -> dict[str, Path]:
    return {p.name: p for p in sorted(MODELS_DIR.iterdir()) if (p / "config.json").is_file()}


def shipped_model_dir(name: str) -> Path | None:
    return shipped_models().get(name)


# checkpoints real SGLang loads (training/qwen3_next.py), apart from the embedded engine's models
SGLANG_MODELS_DIR = ASSETS / "sglang-models"


def shipped_sglang_model_dir(name: str) -> Path | None:
    """A shipped SGLang checkpoint by its name (a directory under ``SGLANG_MODELS_DIR``)."""
    directory = SGLANG_MODELS_DIR / name
    return directory if "/" not in name and (directory / "config.json").is_file() else None


# the shipped matrices, thresholds.yaml and nightly.yaml
SHIPPED_CONFIGS_DIR = package_dir("configs")
CONFIGS_DIR_VARIABLE = "EVALSVC_CONFIGS_DIR"


def check_configs_dir(value: str | Path) -> Path:
    """EVALSVC_CONFIGS_DIR's value as a resolved directory; ValueError naming the setting when it
    is empty, missing or not a directory."""
    text = str(value)
    if not text.strip() or "\0" in text:
        raise ValueError(f"{CONFIGS_DIR_VARIABLE}={text!r}: not a directory path")
    path = Path(text).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"{CONFIGS_DIR_VARIABLE}={text!r}: "
                         f"{'not a directory' if path.exists() else 'no such directory'} ({path})")
    return path


def user_configs_dir() -> Path | None:
    """The operator's own configuration directory (EVALSVC_CONFIGS_DIR), None when unset."""
    value = os.environ.get(CONFIGS_DIR_VARIABLE)
    return None if value is None or not value.strip() else check_configs_dir(value)


def configs_dirs() -> list[Path]:
    """The directories matrices, thresholds.yaml and nightly.yaml are looked up in, first match
    wins: EVALSVC_CONFIGS_DIR (when set), then the shipped ``evalsvc/configs``. A file of the
    operator's overrides the shipped file of the same name; the others stay visible."""
    user = user_configs_dir()
    return [user, SHIPPED_CONFIGS_DIR] if user is not None else [SHIPPED_CONFIGS_DIR]


def config_file(filename: str) -> Path:
    """``filename`` (a plain file name, e.g. ``thresholds.yaml``) from the first of
    ``configs_dirs()`` that has it, inside that directory (see ``inside``); the shipped path when
    none has it."""
    dirs = configs_dirs()
    for directory in dirs:
        path = inside(directory, filename)
        if path.is_file():
            return path
    return inside(dirs[-1], filename)


def inside(root: str | Path, *parts: str | Path) -> Path:
    """``root / parts...``, resolved (symbolic links too); ValueError if it is not inside ``root``
    (an absolute part, ``..`` out of it, a link elsewhere, a NUL character)."""
    base = Path(root).resolve()
    for part in parts:
        if "\0" in str(part):
            raise ValueError(f"path part {str(part)!r} contains a NUL character")
    path = base.joinpath(*parts).resolve()
    if not path.is_relative_to(base):
        raise ValueError(f"{'/'.join(map(str, parts))!r} is not inside {base}")
    return path


def keep_earlier(path: Path) -> Path | None:
    """A file of an earlier attempt at ``path`` (the engine log of a run done again after a
    restart) moved aside to ``NAME.attempt-N``, N the first number free from 1, so that the new
    attempt's file takes its place and none is lost; returns where it went (None: none there)."""
    if not path.exists():
        return None
    n = 1
    while (path.with_name(f"{path.name}.attempt-{n}")).exists():
        n += 1
    target = path.with_name(f"{path.name}.attempt-{n}")
    path.rename(target)
    return target
