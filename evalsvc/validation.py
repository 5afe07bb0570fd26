"""Pydantic's validation errors in words: one line of ``LOC: message`` problems for an API answer,
a config file's refusal or a form's (no dependencies: every layer may use it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class HasErrors(Protocol):
    """A pydantic ``ValidationError``, or FastAPI's ``RequestValidationError``."""

    def errors(self) -> Sequence[Any]: ...


def describe_errors(exc: HasErrors, prefix: str = "", *, tidy: bool = False) -> str:
    """Each problem as ``PREFIX + LOC: message`` (LOC the field's dotted path), joined by ``; ``.
    ``tidy`` (the matrix's wording): an unknown key says so, pydantic's ``Value error, `` is
    dropped, and a whole-model check (no location: its message names the key) is its message."""
    out = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"]
        if tidy:
            msg = "unknown key" if e["type"] == "extra_forbidden" else msg
            msg = msg.removeprefix("Value error, ")
            if not loc:
                out.append(f"{prefix}{msg}" if prefix else msg)
                continue
        out.append(f"{prefix}{loc}: {msg}")
    return "; ".join(out)
