"""The overview's KL limit line is the limit a run was judged against: its config on its job's
engine and matrix, stored when it was planned (``verdicts.stored_limits``), not the matrix file
of the same name today."""

from __future__ import annotations

from datetime import UTC, datetime

from evalsvc.dashboard.views import kl_threshold
from evalsvc.matrix import MatrixFile, load_matrix
from evalsvc.store.db import Store
from evalsvc.store.record import BuildRef
from tests.recorded import JobRecord
from tests.store.factories import job_spec, run_result
from tests.test_job_record import config


def test_the_limit_line_follows_the_jobs_engine_and_matrix(db_url, engines, tmp_path):
    store = Store(db_url)
    engines.append(store.engine)
    smoke = load_matrix("smoke").model_dump(mode="json")
    ref = BuildRef("evalsvc/embedded", version="1", committed_at=datetime(2026, 3, 1, tzinfo=UTC))
    limits = {}
    for job_id, spec in {
        "on-embedded": {"matrix": smoke, "engine": "embedded"},
        "on-sglang": {"matrix": smoke, "engine": "sglang"},  # the same matrix on SGLang
        "own-limit": {"matrix": {**smoke, "thresholds": {"kl_k3_mean": 2e-3}}, "engine": "sglang"},
    }.items():
        record = JobRecord.start(store, tmp_path / "results", job_id, "cli", ref,
                                 MatrixFile.model_validate(spec["matrix"]), [config("m-eb")],
                                 spec=job_spec(**spec))
        record.record(config("m-eb"), run_result("m-eb", {"cold": [1e-9] * 2}))
        record.finish()
        with store.session() as s:
            limits[job_id] = kl_threshold(s, record.run_ids[0])
    assert limits == {"on-embedded": 1e-8, "on-sglang": 5e-3, "own-limit": 2e-3}
    store.close()
