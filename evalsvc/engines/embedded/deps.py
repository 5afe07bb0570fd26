"""The embedded engine's optional dependencies (the ``engine`` extra), named when one is missing."""

from __future__ import annotations

ENGINE_EXTRA = ("torch", "safetensors")  # what pip install 'evalsvc[engine]' adds


def missing_dependency(exc: ImportError) -> str | None:
    """The message for an engine dependency that is not installed, naming the extra with it;
    None for another import error."""
    name = (exc.name or "").split(".")[0]
    if name not in ENGINE_EXTRA:
        return None
    return (f"{name} is not installed: the embedded engine needs the engine extra "
            "(pip install 'evalsvc[engine]')")
