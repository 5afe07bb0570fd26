"""Jobs' specs in one shape: the ones ``evalsvc run`` wrote become ``JobSpec.stored()``'s

``evalsvc run`` wrote its jobs' specs in shapes of its own: ``{"matrix_name", "matrix", "engine",
"configs", "build", "patches"}`` (the matrix as run), and before that ``{"matrix": NAME, "engine",
"configs", "build", "patches"}`` (the matrix by its name only; the store's tests record such jobs
with ``{"matrix": NAME}`` alone). The service's jobs, and now ``evalsvc run``'s too, store
``jobs.spec.JobSpec.stored()``: ``{"matrix_name", "matrix", "engine", "builds": [{"source",
"patches"}], "configs", "model", "track", ...}``. Here each old CLI spec becomes one: its
patches are its one build's (its source is not known: none; the build itself is its runs' own,
``runs.build_id``, which ``"build"`` named), no model, not tracked, the engine the matrix's where
the spec names none. A spec that names its matrix only gets the matrix of that name as it reads
now (``evalsvc.matrix.load_matrix``); one whose matrix cannot be read so is left as it was (its
readers find no spec in it, as they found no matrix before). Specs of any other shape (the
service's) are not touched; no column changes.

Downgrade is a no-op: the old shapes are not written back (a JobSpec holds all they held but
``"build"``, the runs' build), and the code before this revision reads the new shape too (the
service's jobs always had it).

Revision ID: 0010
Revises: 0008
Create Date: 2026-12-06 21:30:00
"""

from __future__ import annotations

import json
import logging
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

log = logging.getLogger("alembic.runtime.migration")

# the keys the CLI's old shapes have (and the store's own record of a CLI job before them, which
# named the matrix alone)
CLI_KEYS = {"matrix_name", "matrix", "engine", "configs", "build", "patches"}


def converted(spec: Any) -> dict[str, Any] | None:
    """An old CLI spec in ``JobSpec.stored()``'s shape; None for any other (left as it is)."""
    if not isinstance(spec, dict) or not spec or "builds" in spec or set(spec) - CLI_KEYS:
        return None
    matrix, name = spec.get("matrix"), spec.get("matrix_name")
    if matrix is None or isinstance(matrix, str):  # the matrix by its name only
        name = name or matrix
        if not isinstance(name, str) or not name:
            return None
        try:
            from evalsvc.matrix import load_matrix

            matrix = load_matrix(name, allow_path=False).model_dump(mode="json")
        except (ValueError, OSError) as exc:  # no such matrix any more, or one that does not read
            log.warning("a job spec naming matrix %r: left as it is (%s)", name, exc)
            return None
    if not isinstance(matrix, dict):
        return None
    engine = spec.get("engine") or matrix.get("engine") or "embedded"
    if engine not in ("embedded", "sglang"):
        return None
    patches = spec.get("patches") or []
    return {"matrix_name": name or matrix.get("name", ""), "matrix": matrix, "engine": engine,
            "builds": [{"source": None, "patches": [str(p) for p in patches]}],
            "configs": spec.get("configs") or None, "model": None, "track": False}


def upgrade() -> None:
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("spec", sa.JSON))
    conn = op.get_bind()
    for job_id, spec in conn.execute(sa.select(jobs.c.id, jobs.c.spec)).all():
        if isinstance(spec, str):  # a driver that hands JSON back as text
            spec = json.loads(spec)
        new = converted(spec)
        if new is not None:
            conn.execute(jobs.update().where(jobs.c.id == job_id).values(spec=new))


def downgrade() -> None:
    """Nothing: the old shapes are not written back (see above)."""
