"""``evalsvc run`` records its job in the store (SQLite in EVALSVC_DATA_DIR): end to end, on the
embedded engine."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import yaml
from sqlalchemy import select

from evalsvc.engines.launch import clean_env
from evalsvc.jobs.spec import JobSpec
from evalsvc.store.db import Store
from evalsvc.store.models import Build, Commit, Job, Run, SampleRow
from evalsvc.store.queries import job_detail

pytestmark = pytest.mark.slow

MATRIX = {
    "name": "store-tiny", "engine": "embedded",
    "models": {"mamba2": {"path": "hybrid-mamba2-tiny"}},
    "include": [{"model": "mamba2", "strategy": "extra_buffer", "overlap": False, "chunked_prefill": -1}],
    "scenarios": ["cold"],
    "extra_args": {"random_seed": 0},
    "workload": {"num_prompts": 2, "max_new_tokens": 4},
}


def evalsvc_run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    matrix = tmp_path / "store-tiny.yaml"
    matrix.write_text(yaml.safe_dump(MATRIX))
    env = {k: v for k, v in clean_env().items()
           if k not in ("EVALSVC_ENGINE_DEFECTS", "EVALSVC_DATABASE_URL")}
    env["EVALSVC_DATA_DIR"] = str(tmp_path / "data")
    return subprocess.run([sys.executable, "-m", "evalsvc.cli", "run", str(matrix), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def test_run_records_its_job_and_the_defects_as_patch_set(tmp_path):
    res = evalsvc_run(tmp_path, "--out", str(tmp_path / "out-clean"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "recorded as job cli-" in res.stdout
    res = evalsvc_run(tmp_path, "--out", str(tmp_path / "out-defect"), "--inject-defect", "host-load-race")
    assert res.returncode in (0, 1), res.stdout + res.stderr  # a cold-only run may not trip it
    assert "+defect:host-load-race" in res.stdout

    db = tmp_path / "data" / "evalsvc.db"
    assert db.is_file()
    store = Store(f"sqlite:///{db}")
    try:
        with store.session() as s:
            jobs = s.scalars(select(Job).order_by(Job.created_at)).all()
            assert len(jobs) == 2
            assert all(j.trigger == "cli" and j.status == "done" and j.id.startswith("cli-") for j in jobs)
            assert jobs[0].spec["matrix_name"] == "store-tiny" and jobs[0].spec["engine"] == "embedded"
            # the job's spec is a JobSpec (jobs.spec), as the service stores its jobs'
            spec = JobSpec.model_validate(jobs[1].spec)
            assert [b.patches for b in spec.builds] == [["defect:host-load-race"]]

            commit = s.scalars(select(Commit)).one()  # both runs evaluated the same embedded engine
            assert commit.repository == "evalsvc/embedded" and commit.version and commit.sha is None
            builds = {b.id: b.patch_set for b in s.scalars(select(Build))}
            assert sorted(builds.values()) == ["", "defect:host-load-race"]

            runs = s.scalars(select(Run).order_by(Run.id)).all()
            assert [r.job_id for r in runs] == [j.id for j in jobs]
            assert [builds[r.build_id] for r in runs] == ["", "defect:host-load-race"]
            assert runs[0].fingerprint == runs[1].fingerprint  # the same config
            clean = runs[0]
            assert (clean.matrix, clean.status, clean.verdict) == ("store-tiny", "done", "pass")
            assert clean.model == "mamba2"  # the matrix's model name
            assert [x.scenario for x in clean.scenarios] == ["cold"]
            names = {m.name: m for m in clean.metrics}
            assert names["kl_k3_mean"].count == 2 and names["kl_k3_mean"].value < 1e-8
            assert len(s.scalars(select(SampleRow).where(SampleRow.run_id == clean.id)).all()) == 2

            detail = job_detail(s, jobs[0].id)
            assert [r.scenarios for r in detail.runs] == [{"cold": "pass"}]
            path = clean.samples_path
        assert path.startswith(str(tmp_path / "data" / "results" / jobs[0].id))
        tokens = pd.read_parquet(path)
        assert len(tokens) == 2 and tokens.output_ids.map(len).tolist() == [4, 4]
    finally:
        store.close()
