"""A job recorded as it runs outside the service, in the steps ``evalsvc run`` takes
(``tests.recorded.JobRecord``, on results made by hand): its runs planned first, each recorded and
judged as it ends through the service's own ``record_result``, and its end; and a run judged
against the limits of its job's engine (``judging.config_limits``), as they are stored when it is
planned."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from evalsvc import judging
from evalsvc.jobs.record import end_job
from evalsvc.matrix import Config, load_matrix
from evalsvc.store import queries
from evalsvc.store.db import Store
from evalsvc.store.models import Job, Run, VerdictRow
from evalsvc.store.record import BuildRef, ensure_job
from evalsvc.types import RunResult, ScenarioResult
from evalsvc.verdicts import triage_regression
from tests.recorded import JobRecord
from tests.store.factories import fingerprint_of, job_spec, run_result

pytestmark = pytest.mark.usefixtures("engines")


def config(name: str) -> Config:
    return Config(name=name, matrix="smoke", model="mamba2", settings={"strategy": "extra_buffer"},
                  args={"random_seed": 0}, fingerprint=fingerprint_of(name),
                  scenarios=("cold", "prefill_hit"))


def start(store: Store, tmp_path, job_id: str, names: list[str], track: bool = False) -> JobRecord:
    ref = BuildRef("sgl-project/sglang", sha="abc123", committed_at=datetime(2026, 3, 1, tzinfo=UTC))
    return JobRecord.start(store, tmp_path / "results", job_id, "cli", ref, "smoke",
                           [config(n) for n in names],
                           spec=job_spec(engine="sglang", track=track))


def runs(store: Store, job_id: str) -> dict[str, Run]:
    with store.session() as s:
        return {r.config: r for r in s.scalars(select(Run).where(Run.job_id == job_id))}


def test_runs_are_planned_first_then_recorded_and_judged_as_each_ends(db_url, engines, tmp_path):
    store = Store(db_url)
    engines.append(store.engine)
    record = start(store, tmp_path, "cli-a", ["m-eb", "m-nb"])
    planned = runs(store, "cli-a")
    assert {c: r.status for c, r in planned.items()} == {"m-eb": "pending", "m-nb": "pending"}
    assert record.run_ids == [planned["m-eb"].id, planned["m-nb"].id]
    with store.session() as s:
        assert s.get(Job, "cli-a").status == "running"

    # the harness passed it (its factory limit is 1e-2); the job's engine limits it to 5e-3
    result = run_result("m-eb", {"cold": [1e-4] * 4, "prefill_hit": [8e-3] * 4})
    assert result.verdict == "pass"
    record.record(config("m-eb"), result)
    done = runs(store, "cli-a")["m-eb"]
    assert done.status == "done"
    assert done.samples_path == str(tmp_path / "results" / "cli-a" / f"{done.id}.parquet")
    with store.session() as s:
        verdicts = {(v.scenario, v.metric): v.verdict
                    for v in s.scalars(select(VerdictRow).where(VerdictRow.run_id == done.id))}
        # judged in the same transaction, on the job's engine (sglang: KL max 5e-3)
        assert verdicts[("cold", "kl_k3_mean")] == "pass"
        assert verdicts[("prefill_hit", "kl_k3_mean")] == "regression"
        run = s.get(Run, done.id)
        assert [(x.scenario, x.verdict) for x in run.scenarios] == [("cold", "pass"),
                                                                   ("prefill_hit", "fail")]
        assert run.verdict == "fail"

    record.record(config("m-nb"), run_result("m-nb", {"cold": [1e-4] * 4}))
    record.finish()
    with store.session() as s:
        job = s.get(Job, "cli-a")
        assert (job.status, job.error) == ("done", None) and job.finished_at is not None
    store.close()


def test_a_known_failure_is_expected_in_what_evalsvc_run_prints(db_url, engines, tmp_path):
    """A scenario that fails as its series' known failure (an open regression triaged expected,
    with a link) is expected in the recorded result too: the table ``evalsvc run`` prints and
    its exit status follow the store."""
    from evalsvc.store.models import Regression

    store = Store(db_url)
    engines.append(store.engine)
    start(store, tmp_path, "cli-a", ["m-eb"], track=True).record(
        config("m-eb"), run_result("m-eb", {"cold": [1e-4] * 4, "prefill_hit": [0.05] * 4}))
    with store.session() as s:
        [reg] = s.scalars(select(Regression)).all()
        triage_regression(s, reg.id, "expected", "known",
                                  link="https://github.com/sgl-project/sglang/pull/29068")
    result = run_result("m-eb", {"cold": [1e-4] * 4, "prefill_hit": [0.05] * 4})
    assert result.verdict == "fail"
    ref = BuildRef("sgl-project/sglang", sha="def456", committed_at=datetime(2026, 3, 2, tzinfo=UTC))
    record = JobRecord.start(store, tmp_path / "results", "cli-b", "cli", ref, "smoke",
                             [config("m-eb")], spec=job_spec(engine="sglang"))
    record.record(config("m-eb"), result)
    assert [(x.scenario, x.verdict) for x in result.scenarios] == [("cold", "pass"),
                                                                  ("prefill_hit", "expected")]
    assert result.verdict == "expected"
    assert result.reason.startswith("prefill_hit: known failure (regression #")
    assert "pull/29068" in result.reason
    store.close()


def test_a_job_stopped_before_its_runs_ended_is_cancelled(db_url, engines, tmp_path):
    store = Store(db_url)
    engines.append(store.engine)
    record = start(store, tmp_path, "cli-b", ["m-eb", "m-nb"])
    record.record(config("m-eb"), run_result("m-eb", {"cold": [1e-4] * 4}))
    record.finish()  # Ctrl-C before the second run ended
    with store.session() as s:
        assert s.get(Job, "cli-b").status == "cancelled"
    assert {c: r.status for c, r in runs(store, "cli-b").items()} == {"m-eb": "done",
                                                                     "m-nb": "cancelled"}
    store.close()


def test_the_store_ends_a_job_whose_cancel_it_holds_cancelled(db_url, engines):
    """``end_job`` on a running job whose cancel was written (``cancel_requested_at``): it ends
    cancelled whatever the runner says (a cancel answered cancelling and the runner's end cannot
    disagree); a job no longer running is left alone."""
    store = Store(db_url)
    engines.append(store.engine)
    with store.session() as s:
        for job_id in ("api-asked", "api-not-asked"):
            ensure_job(s, job_id, "api", job_spec(), status="running")
        s.get(Job, "api-asked").cancel_requested_at = datetime.now(UTC)
    with store.session() as s:
        assert end_job(s, "api-asked", "failed", "run 1: broke") == ("cancelled", None)
        assert end_job(s, "api-not-asked", "failed", "run 2: broke") == ("failed", "run 2: broke")
    with store.session() as s:
        assert end_job(s, "api-asked", "done", None) == (None, None)
        asked, other = s.get(Job, "api-asked"), s.get(Job, "api-not-asked")
        assert (asked.status, asked.error) == ("cancelled", None) and asked.finished_at
        assert (other.status, other.error) == ("failed", "run 2: broke")
    store.close()


def test_a_run_that_cannot_be_recorded_fails_the_job_naming_it(db_url, engines, tmp_path):
    store = Store(db_url)
    engines.append(store.engine)
    record = start(store, tmp_path, "cli-c", ["m-eb"])
    (tmp_path / "results").write_text("a file where the results folder should be")
    record.record(config("m-eb"), run_result("m-eb", {"cold": [1e-4] * 4}))
    record.finish()
    [run] = runs(store, "cli-c").values()
    assert (run.status, run.verdict) == ("done", "error")
    assert "its samples could not be written" in run.reason
    with store.session() as s:
        job = s.get(Job, "cli-c")
        assert job.status == "failed" and f"run {run.id}: its samples" in job.error
    assert record.failures == [job.error]
    store.close()


def errored(name: str, reason: str) -> RunResult:
    """A run that reached no verdict (its engine did not start)."""
    return RunResult(config=name, fingerprint=fingerprint_of(name), model="hybrid-mamba2-tiny",
                     settings={}, requested_args={}, verdict="error", reason=reason)


def test_a_job_whose_only_run_errored_is_failed_naming_it(db_url, engines, tmp_path):
    store = Store(db_url)
    engines.append(store.engine)
    record = start(store, tmp_path, "cli-d", ["m-eb"])
    why = "engine did not start: engine exited with code 1 during start-up"
    record.record(config("m-eb"), errored("m-eb", why))
    assert record.finish() == "failed"
    [run] = runs(store, "cli-d").values()
    with store.session() as s:
        job = s.get(Job, "cli-d")
        assert job.status == "failed" and job.finished_at is not None
        assert job.error == f"every run errored (1 of 1): run {run.id} (m-eb): {why}"
        assert queries.errored_runs(s, ["cli-d"]) == {"cli-d": 1}
        assert queries.job_detail(s, "cli-d").runs_errored == 1
    store.close()


def test_a_job_with_some_errored_runs_is_done_counting_them(db_url, engines, tmp_path):
    store = Store(db_url)
    engines.append(store.engine)
    names = ["m-eb", "m-nb", "m-auto"]
    record = start(store, tmp_path, "cli-e", names)
    record.record(config("m-eb"), errored("m-eb", "engine did not start"))
    record.record(config("m-nb"), run_result("m-nb", {"cold": [1e-4] * 4}))
    record.record(config("m-auto"), errored("m-auto", "the engine died"))
    assert record.finish() == "done"
    with store.session() as s:
        job = s.get(Job, "cli-e")
        assert (job.status, job.error) == ("done", None)
        assert queries.errored_runs(s, ["cli-e", "no-such-job"]) == {"cli-e": 2}
        assert queries.job_detail(s, "cli-e").runs_errored == 2
        [summary] = queries.job_summaries(s)
        assert summary.runs_errored == 2 and summary.status == "done"
    store.close()


def test_an_errored_job_names_its_first_runs_and_counts_the_rest(db_url, engines, tmp_path):
    store = Store(db_url)
    engines.append(store.engine)
    names = [f"m-{i}" for i in range(5)]
    record = start(store, tmp_path, "cli-f", names)
    for n in names:
        record.record(config(n), errored(n, f"{n} refused"))
    assert record.finish() == "failed"
    with store.session() as s:
        error = s.get(Job, "cli-f").error
    assert error.startswith("every run errored (5 of 5): run ")
    assert "(m-0): m-0 refused; run " in error and "(m-2): m-2 refused; and 2 more" in error
    assert "m-3" not in error
    store.close()


def decide(name: str, metrics: dict, cfg: Config, matrix, engine: str | None = None
           ) -> tuple[str, str]:
    """A scenario's verdict and reason, measured with ``metrics``, as its run is judged
    (``judging.judge_run``, no history) against its limits on ``engine``."""
    result = RunResult(cfg.name, cfg.fingerprint, cfg.model, dict(cfg.settings), dict(cfg.args),
                       verdict="measured", scenarios=[ScenarioResult(name, "measured",
                                                                     metrics=metrics)])
    judging.judge_run(result, judging.config_limits(cfg, matrix, engine=engine))
    return result.scenarios[0].verdict, result.scenarios[0].reason


def test_the_harness_judges_on_the_runs_engine():
    """The same scenario metrics against the embedded engine's float32 limit (1e-8) and against
    the defaults on SGLang (5e-3): the harness takes the run's engine, not the matrix's."""
    matrix = load_matrix("smoke")  # engine: embedded
    cfg = config("mamba2-eb")
    metrics = {"kl_k3_mean": 1e-5, "hit_coverage": 1.0}
    assert decide("prefill_hit", metrics, cfg, matrix)[0] == "fail"  # the matrix's engine
    assert decide("prefill_hit", metrics, cfg, matrix, engine="embedded")[0] == "fail"
    assert decide("prefill_hit", metrics, cfg, matrix, engine="sglang") == ("pass", "")
