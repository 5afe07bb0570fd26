"""Parameters and bodies the REST API and the dashboard's forms both take: job, run and regression
ids in a path, text both SQLite and PostgreSQL store, a regression's triage."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from fastapi import Path
from pydantic import AfterValidator, BaseModel, Field

from evalsvc.web.middleware import unstorable

JobId = Annotated[str, Path(max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
# a store row's id in a path (an INTEGER key in both databases), named for what it identifies
RowId = Annotated[int, Path(ge=1, le=2**31 - 1)]
RunId = RowId
RegressionId = RowId


def _storable(value: str | None) -> str | None:
    """Text both SQLite and PostgreSQL store (query and path parameters are checked by the
    middleware before any route runs; body texts here)."""
    why = unstorable(value) if value is not None else None
    if why:
        raise ValueError(why)
    return value


StorableText = AfterValidator(_storable)


def _web_link(value: str | None) -> str | None:
    """An http(s) URL with a host, and no spaces or control characters (None and "" for no
    link)."""
    if not value:
        return None
    try:
        parts = urlsplit(value)
        port = parts.port  # raises for a port that is not a number
    except ValueError:
        parts, port = None, None
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or port == 0 or not value.isprintable() or any(c.isspace() for c in value)):
        raise ValueError("an http(s) URL, as https://github.com/sgl-project/sglang/pull/29068")
    return value


WebLink = AfterValidator(_web_link)


class TriageUpdate(BaseModel):
    model_config = {"extra": "forbid"}

    triage: Literal["acknowledged", "expected", "fixed"] | None = Field(
        ..., description="acknowledged: being looked at; expected: a known failure or an intended "
                         "change (later runs of its series no worse than its level are judged "
                         "expected, and its level is the new baseline); fixed: a fix is in; "
                         "null: untriaged")
    comment: Annotated[str | None, StorableText] = Field(None, max_length=4000)
    link: Annotated[str | None, WebLink] = Field(
        None, max_length=500, description="an http(s) URL: the issue or pull request about it")
