"""Where the shipped models and prompts live (no heavy imports: the control plane uses this)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MODELS_DIR = ASSETS / "models"
DEFAULT_MODEL = "hybrid-mamba2-tiny"


def shipped_models() -> dict[str, Path]:
    return {p.name: p for p in sorted(MODELS_DIR.iterdir()) if (p / "config.json").is_file()}


def shipped_model_dir(name: str) -> Path | None:
    return shipped_models().get(name)
