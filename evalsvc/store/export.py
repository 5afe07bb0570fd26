"""Results out of the store as a table (pandas): a job's, or a commit range's."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from sqlalchemy import select
from sqlalchemy.orm import Session

from evalsvc.store.models import Build, Commit, Metric, Run, ScenarioRow


def results_frame(session: Session, *, job_id: str | None = None, repository: str | None = None,
                  since: str | None = None, until: str | None = None) -> pd.DataFrame:
    """A row per run and scenario, metrics as columns. A commit range is given by commit refs
    (``repository@sha`` or ``repository==version``), inclusive, in commit-time order."""
    q = (select(Commit.ref, Commit.committed_at, Build.patch_set, Run.job_id, Run.id, Run.config,
                Run.fingerprint, ScenarioRow.scenario, ScenarioRow.verdict)
         .join(Build, Build.commit_id == Commit.id).join(Run, Run.build_id == Build.id)
         .join(ScenarioRow, ScenarioRow.run_id == Run.id))
    if job_id is not None:
        q = q.where(Run.job_id == job_id)
    if repository is not None:
        q = q.where(Commit.repository == repository)
    for ref, op in ((since, "ge"), (until, "le")):
        if ref is None:
            continue
        at = session.scalar(select(Commit.committed_at).where(Commit.ref == ref))
        if at is None:
            raise KeyError(f"no commit {ref!r} in the store")
        q = q.where(Commit.committed_at >= at if op == "ge" else Commit.committed_at <= at)
    cols = ["commit", "committed_at", "patch_set", "job_id", "run_id", "config", "fingerprint",
            "scenario", "verdict"]
    base = pd.DataFrame(session.execute(q).all(), columns=cols)
    if base.empty:
        return base
    metrics = pd.DataFrame(session.execute(
        select(Metric.run_id, Metric.scenario, Metric.name, Metric.value)
        .where(Metric.run_id.in_(base.run_id.unique().tolist()))).all(),
        columns=["run_id", "scenario", "name", "value"])
    wide = metrics.pivot_table(index=["run_id", "scenario"], columns="name", values="value",
                               aggfunc="first").reset_index()
    out = base.merge(wide, on=["run_id", "scenario"], how="left")
    return out.sort_values(["committed_at", "config", "scenario"]).reset_index(drop=True)


def write_frame(df: pd.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".csv":
        df.to_csv(path, index=False)
    elif path.suffix == ".parquet":
        df.to_parquet(path, index=False)
    else:
        raise ValueError(f"{path}: use a .parquet or .csv file name")
