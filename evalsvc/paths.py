"""Paths: the shipped models and prompts (no heavy imports: the control plane and the embedded
engine both use this), and paths built from names a job carries (job ids, matrix, model and config
names), always inside their root directory."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
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
