"""Migrations: empty to head and back to base, through the API and the ``evalsvc db`` commands; the
migrations and the models describe the same schema."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Column, Integer, MetaData, Table, inspect, text
from typer.testing import CliRunner

from evalsvc.cli import app
from evalsvc.store.db import alembic_config, current, downgrade, make_engine, upgrade
from evalsvc.store.models import Base

MODEL_TABLES = set(Base.metadata.tables)


def head(url: str) -> str:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def tables(url: str, engines: list) -> set[str]:
    engine = make_engine(url)
    engines.append(engine)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_model_tables():
    assert sorted(MODEL_TABLES) == ["alerts", "audit_events", "bisections", "builds", "commits",
                                    "golden_runs", "jobs", "metrics", "regressions",
                                    "revoked_sessions", "runs", "samples", "scenarios",
                                    "verdicts"]


def test_upgrade_to_head_and_downgrade_to_base(db_url, engines):
    assert current(db_url) is None
    assert tables(db_url, engines) == set()
    upgrade(db_url)
    assert current(db_url) == head(db_url) == "0010"
    assert tables(db_url, engines) == MODEL_TABLES
    upgrade(db_url)  # at head already: nothing to do
    assert current(db_url) == head(db_url)
    downgrade(db_url)
    assert current(db_url) is None
    assert tables(db_url, engines) == set()
    upgrade(db_url)  # and up again
    assert tables(db_url, engines) == MODEL_TABLES


def test_db_commands(db_url, engines, monkeypatch, tmp_path):
    monkeypatch.setenv("EVALSVC_DATABASE_URL", db_url)
    monkeypatch.setenv("EVALSVC_DATA_DIR", str(tmp_path / "unused"))
    runner = CliRunner()

    res = runner.invoke(app, ["db", "current"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith("at revision None")

    res = runner.invoke(app, ["db", "upgrade"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith(f"at revision {head(db_url)}")
    assert tables(db_url, engines) == MODEL_TABLES

    res = runner.invoke(app, ["db", "current"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith(f"at revision {head(db_url)}")

    res = runner.invoke(app, ["db", "downgrade"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith("at revision None")
    assert tables(db_url, engines) == set()
    assert not (tmp_path / "unused").exists()  # EVALSVC_DATABASE_URL wins over the data dir


def test_db_commands_default_to_sqlite_in_the_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("EVALSVC_DATABASE_URL", raising=False)
    monkeypatch.setenv("EVALSVC_DATA_DIR", str(tmp_path / "data"))
    res = CliRunner().invoke(app, ["db", "upgrade"])
    assert res.exit_code == 0, res.output
    path = tmp_path / "data" / "evalsvc.db"
    assert path.is_file()
    assert current(f"sqlite:///{path}") == head(f"sqlite:///{path}")


def test_models_and_migrations_agree(store, engines):
    engine = make_engine(store.url)
    engines.append(engine)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True,
                                                     "compare_server_default": True})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == []


def test_the_comparison_sees_a_difference(store, engines):
    """The check above is not vacuous: a table the migrations lack shows up."""
    extra = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(extra)
    Table("annotations", extra, Column("id", Integer, primary_key=True))
    engine = make_engine(store.url)
    engines.append(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), extra)
    assert [d[0] for d in diff] == ["add_table"]
    assert diff[0][1].name == "annotations"


def test_upgrade_to_a_named_revision(db_url):
    upgrade(db_url, "0001")
    assert current(db_url) == "0001"
    downgrade(db_url, "base")
    assert current(db_url) is None


def test_0004_counts_attempts_from_zero_on_existing_jobs(db_url, engines):
    """Jobs stored before 0004 get attempts 0 and no cancel asked; down again, they stay."""
    upgrade(db_url, "0003")
    engine = make_engine(db_url)
    engines.append(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (id, trigger, status, priority, spec, created_at) "
                          "VALUES ('old', 'api', 'running', 0, '{}', CURRENT_TIMESTAMP)"))
    upgrade(db_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id, attempts, cancel_requested_at FROM jobs")).all() == [
            ("old", 0, None)]
    downgrade(db_url, "0003")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id, status FROM jobs")).all() == [("old", "running")]
    engine.dispose()


def test_0006_adds_the_audit_events_and_keeps_what_was_stored(db_url, engines):
    """A store at 0005 with a triaged regression's job: 0006 adds an empty audit_events table
    that takes an event; down again, the table goes and the rest stays."""
    upgrade(db_url, "0005")
    engine = make_engine(db_url)
    engines.append(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (id, trigger, status, priority, spec, created_at, "
                          "attempts) VALUES ('old', 'api', 'done', 0, '{}', CURRENT_TIMESTAMP, 0)"))
    upgrade(db_url)
    assert "audit_events" in tables(db_url, engines)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM audit_events")).scalar() == 0
        conn.execute(text("INSERT INTO audit_events (at, user_name, via, action, target_type, "
                          "target_id, comment, details) VALUES (CURRENT_TIMESTAMP, 'alice', "
                          "'dashboard', 'cancel', 'job', 'old', NULL, '{}')"))
    downgrade(db_url, "0005")
    assert "audit_events" not in tables(db_url, engines)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM jobs")).scalars().all() == ["old"]
    engine.dispose()


def test_0007_gives_regressions_a_link_and_a_level_and_keeps_their_triage(db_url, engines):
    """A regression triaged expected at 0006 has no link after 0007, and the level of its
    opening verdict; down again, its triage and comment stay."""
    upgrade(db_url, "0006")
    engine = make_engine(db_url)
    engines.append(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO commits (id, ref, repository, sha) "
                          "VALUES (1, 'r@c1', 'r', 'c1')"))
        conn.execute(text("INSERT INTO builds (id, commit_id, patch_set, created_at) "
                          "VALUES (1, 1, '', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO jobs (id, trigger, status, priority, spec, created_at, "
                          "attempts) VALUES ('j', 'nightly', 'done', 0, '{}', CURRENT_TIMESTAMP, 0)"))
        conn.execute(text("INSERT INTO runs (id, job_id, build_id, config, matrix, model, "
                          "fingerprint, settings, requested_args, status, created_at) VALUES "
                          "(1, 'j', 1, 'c', 'smoke', 'm', 'f', '{}', '{}', 'done', "
                          "CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO regressions (id, fingerprint, patch_set, scenario, metric, "
                          "config, matrix, state, first_run_id, last_run_id, runs_seen, triage, "
                          "comment, opened_at) VALUES (1, 'f', '', 'prefill_hit', 'kl_k3_mean', "
                          "'c', 'smoke', 'open', 1, 1, 1, 'expected', 'known', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO verdicts (run_id, scenario, metric, verdict, method, value) "
                          "VALUES (1, 'prefill_hit', 'kl_k3_mean', 'regression', 'threshold', 0.25), "
                          "(1, 'prefill_hit', 'extend_kl_k3_mean', 'regression', 'threshold', 9)"))
    upgrade(db_url, "0007")
    with engine.begin() as conn:
        assert conn.execute(text("SELECT triage, comment, link, expected_level "
                                 "FROM regressions")).all() == [("expected", "known", None, 0.25)]
        conn.execute(text("UPDATE regressions SET link = 'https://example.com/pull/1', "
                          "expected_level = 0.5"))
    downgrade(db_url, "0006")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT triage, comment FROM regressions")).all() == [
            ("expected", "known")]
    engine.dispose()


def test_0008_adds_the_revoked_sessions_and_keeps_what_was_stored(db_url, engines):
    """A store at 0007 with a job: 0008 adds an empty revoked_sessions table that takes a
    session's end; down again, the table goes and the rest stays."""
    upgrade(db_url, "0007")
    engine = make_engine(db_url)
    engines.append(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (id, trigger, status, priority, spec, created_at, "
                          "attempts) VALUES ('old', 'api', 'done', 0, '{}', CURRENT_TIMESTAMP, 0)"))
    upgrade(db_url)
    assert "revoked_sessions" in tables(db_url, engines)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM revoked_sessions")).scalar() == 0
        conn.execute(text("INSERT INTO revoked_sessions (id, user_name, revoked_at, expires_at) "
                          "VALUES ('s1', 'alice', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"))
    downgrade(db_url, "0007")
    assert "revoked_sessions" not in tables(db_url, engines)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM jobs")).scalars().all() == ["old"]


def test_0009_adds_the_stored_limits_and_comparison_and_keeps_what_was_stored(db_url, engines):
    """A store at 0008 with a job and its run: 0009 adds runs.limits and jobs.comparison, NULL on
    what was stored (read with their fallbacks), and takes them for new rows; down again, the
    columns go and the rows stay."""
    upgrade(db_url, "0008")
    engine = make_engine(db_url)
    engines.append(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (id, trigger, status, priority, spec, created_at, "
                          "attempts) VALUES ('old', 'api', 'done', 0, '{}', CURRENT_TIMESTAMP, 0)"))
        conn.execute(text("INSERT INTO commits (id, ref, repository) VALUES (1, 'r@a', 'r')"))
        conn.execute(text("INSERT INTO builds (id, commit_id, patch_set, created_at) "
                          "VALUES (1, 1, '', CURRENT_TIMESTAMP)"))
        conn.execute(text("INSERT INTO runs (id, job_id, build_id, config, matrix, model, "
                          "fingerprint, settings, requested_args, status, verdict, created_at) "
                          "VALUES (7, 'old', 1, 'c', 'smoke', 'm', 'fp', '{}', '{}', 'done', "
                          "'pass', CURRENT_TIMESTAMP)"))
    upgrade(db_url)
    columns = {t: {c["name"] for c in inspect(engine).get_columns(t)} for t in ("runs", "jobs")}
    assert "limits" in columns["runs"] and "comparison" in columns["jobs"]
    with engine.begin() as conn:
        assert conn.execute(text("SELECT limits FROM runs WHERE id = 7")).scalar() is None
        assert conn.execute(text("SELECT comparison FROM jobs WHERE id = 'old'")).scalar() is None
        conn.execute(text("UPDATE runs SET limits = '{\"cold\": {}}' WHERE id = 7"))
        conn.execute(text("UPDATE jobs SET comparison = '[]' WHERE id = 'old'"))
    downgrade(db_url, "0008")
    columns = {t: {c["name"] for c in inspect(engine).get_columns(t)} for t in ("runs", "jobs")}
    assert "limits" not in columns["runs"] and "comparison" not in columns["jobs"]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM jobs")).scalars().all() == ["old"]
        assert conn.execute(text("SELECT id, verdict FROM runs")).all() == [(7, "pass")]


def test_0010_gives_the_jobs_of_evalsvc_run_the_job_spec_shape(db_url, engines):
    """A store at 0008 with jobs of ``evalsvc run`` in its old shapes (the matrix as run, and by
    its name only) and a job of the service: after 0010 every spec validates as a JobSpec, the
    CLI's hold what they held (their patches their build's), the service's is as it was, and
    nothing else of the jobs changed; down again, they stay."""
    import json

    from evalsvc.jobs.spec import JobSpec
    from evalsvc.matrix import load_matrix

    smoke = load_matrix("smoke").model_dump(mode="json")
    old_cli = {"matrix_name": "smoke", "matrix": smoke, "engine": "embedded",
               "configs": ["mamba2-eb-ov-c64"], "build": "evalsvc/embedded@0.1",
               "patches": ["defect:host-load-race"]}
    oldest_cli = {"matrix": "smoke", "engine": "embedded", "configs": None,
                  "build": "evalsvc/embedded@0.1", "patches": []}
    service = JobSpec.model_validate({"matrix_name": "smoke", "matrix": smoke,
                                      "engine": "embedded", "builds": [{}]}).stored()
    upgrade(db_url, "0008")
    engine = make_engine(db_url)
    engines.append(engine)
    columns = "id, trigger, status, priority, created_at, started_at, finished_at, error, attempts"
    with engine.begin() as conn:
        for job_id, trigger, spec in (("cli-old", "cli", old_cli), ("cli-oldest", "cli", oldest_cli),
                                      ("api-1", "api", service)):
            conn.execute(text("INSERT INTO jobs (id, trigger, status, priority, spec, created_at, "
                              "started_at, finished_at, error, attempts) VALUES (:id, :trigger, "
                              "'done', 3, :spec, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, "
                              "CURRENT_TIMESTAMP, 'an error', 1)"),
                         {"id": job_id, "trigger": trigger, "spec": json.dumps(spec)})
        before = conn.execute(text(f"SELECT {columns} FROM jobs ORDER BY id")).all()
    upgrade(db_url)
    assert current(db_url) == "0010"

    def specs() -> dict[str, dict]:
        with engine.connect() as conn:
            return {job_id: json.loads(spec) if isinstance(spec, str) else spec for job_id, spec
                    in conn.execute(text("SELECT id, spec FROM jobs"))}

    after = specs()
    jobs = {job_id: JobSpec.model_validate(spec) for job_id, spec in after.items()}
    assert after["api-1"] == service
    old = jobs["cli-old"]
    assert (old.matrix_name, old.engine, old.configs) == ("smoke", "embedded", ["mamba2-eb-ov-c64"])
    assert old.matrix.model_dump(mode="json") == smoke
    assert [b.model_dump() for b in old.builds] == [{"source": None,
                                                    "patches": ["defect:host-load-race"]}]
    assert (old.model, old.track) == (None, False)
    assert after["cli-old"] == old.stored()
    oldest = jobs["cli-oldest"]
    assert (oldest.matrix_name, oldest.matrix.name, oldest.configs) == ("smoke", "smoke", None)
    assert [b.model_dump() for b in oldest.builds] == [{"source": None, "patches": []}]
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT {columns} FROM jobs ORDER BY id")).all() == before
    downgrade(db_url, "0008")  # a no-op: the specs keep the new shape
    assert specs() == after
    engine.dispose()
