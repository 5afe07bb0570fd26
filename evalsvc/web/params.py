"""Parameters and bodies the REST API and the dashboard's forms both take: job, run and regression
ids in a path, text both SQLite and PostgreSQL store, a regression's triage."""

from __future__ import annotations

from typing import Annotated, Literal

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


class TriageUpdate(BaseModel):
    model_config = {"extra": "forbid"}

    triage: Literal["acknowledged", "expected", "fixed"] | None = Field(
        ..., description="acknowledged: being looked at; expected: an intended change (its level "
                         "becomes the new baseline); fixed: a fix is in; null: untriaged")
    comment: Annotated[str | None, StorableText] = Field(None, max_length=4000)
