"""The ``evalsvc`` command line: ``evalsvc engine`` passes its flags through to the embedded engine."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from evalsvc.engines.launch import EngineProcess, clean_env, free_port

CLI = [sys.executable, "-m", "evalsvc.cli"]


def _env() -> dict[str, str]:
    return {k: v for k, v in clean_env().items() if k != "EVALSVC_ENGINE_DEFECTS"}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=_env())


def test_engine_help_lists_the_engine_flags():
    res = run_cli("engine", "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: evalsvc engine")
    for flag in ("--mamba-radix-cache-strategy", "--disable-overlap-schedule", "--model-path",
                 "--speculative-algorithm", "--enable-hierarchical-cache", "--inject-defect"):
        assert flag in res.stdout


def test_engine_unknown_flag_exits_2_naming_it():
    res = run_cli("engine", "--bogus")
    assert res.returncode == 2
    assert "--bogus" in res.stderr
    assert "unrecognized arguments" in res.stderr


def test_engine_refused_combination_exits_2():
    res = run_cli("engine", "--mamba-radix-cache-strategy", "no_buffer")
    assert res.returncode == 2
    assert "--disable-overlap-schedule" in res.stderr


def test_top_level_help_lists_the_commands():
    res = run_cli("--help")
    assert res.returncode == 0, res.stderr
    assert "engine" in res.stdout
    assert "demo" in res.stdout


@pytest.mark.slow
def test_engine_command_serves_with_the_flags_given(tmp_path):
    port = free_port()
    argv = [*CLI, "engine", "--port", str(port), "--disable-overlap-schedule", "--random-seed", "7"]
    with EngineProcess(argv, port, env=_env(), log_path=tmp_path / "engine.log",
                       startup_timeout=60) as eng:
        with httpx.Client(base_url=eng.base_url, timeout=60) as c:
            info = c.get("/server_info").json()
            assert info["port"] == port
            assert info["disable_overlap_schedule"] is True
            assert info["mamba_radix_cache_strategy"] == "no_buffer"
            assert info["random_seed"] == 7
            out = c.post("/generate", json={"text": "def f():",
                                            "sampling_params": {"max_new_tokens": 3,
                                                                "ignore_eos": True}})
            assert out.status_code == 200
            assert out.json()["meta_info"]["completion_tokens"] == 3
        assert eng.stop() == 0  # SIGTERM through the CLI: a clean exit


def test_db_commands_show_the_database_url_without_its_password(request, tmp_path, engines):
    from sqlalchemy.engine import make_url

    from tests.conftest import database

    with database(request, "postgresql", tmp_path, engines) as db_url:
        _db_upgrade_hides_the_password(make_url(db_url))


def _db_upgrade_hides_the_password(url) -> None:
    with_password = url.set(password="s3cret-pw").render_as_string(hide_password=False)
    env = {**clean_env(), "EVALSVC_DATABASE_URL": with_password}
    done = subprocess.run([sys.executable, "-m", "evalsvc.cli", "db", "upgrade"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "at revision" in done.stdout and "***" in done.stdout
    assert "s3cret-pw" not in done.stdout + done.stderr


def _result(config: str, verdict: str):
    from evalsvc.types import RunResult

    return RunResult(config=config, fingerprint=config, model="m", settings={},
                     requested_args={}, verdict=verdict)


@pytest.mark.parametrize(("verdicts", "unrecorded", "status", "errored"), [
    (["pass", "pass"], set(), 0, set()),
    (["pass", "inconclusive"], set(), 0, set()),
    (["pass", "error"], set(), 4, {"c1"}),
    (["error", "error"], set(), 4, {"c0", "c1"}),
    (["pass", "pass"], {"c0"}, 4, {"c0"}),  # a run that could not be recorded errored
    (["fail", "error"], set(), 1, {"c1"}),  # a failed verdict is the finding: 1, errors counted
    (["invalid", "pass"], set(), 1, set()),
])
def test_evalsvc_run_exits_1_for_a_failed_verdict_4_for_errored_runs(verdicts, unrecorded,
                                                                      status, errored):
    from evalsvc.cli import run_outcome
    from evalsvc.evaluate import EXIT_ERRORED, EXIT_FAILED

    assert (EXIT_FAILED, EXIT_ERRORED) == (1, 4)
    results = [_result(f"c{i}", v) for i, v in enumerate(verdicts)]
    assert run_outcome(results, unrecorded) == (status, errored)


def test_evalsvc_run_refuses_a_release_that_is_no_version_number_before_any_build(tmp_path):
    res = subprocess.run([*CLI, "run", "sglang-cpu", "--engine", "sglang", "--no-store",
                          "--source", "sglang==tree-ebeb8633e652", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120,
                         env={**_env(), "COLUMNS": "250", "EVALSVC_DATA_DIR": str(tmp_path)})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert ("error: --source: 'sglang==tree-ebeb8633e652': 'tree-ebeb8633e652' is not a version "
            "number") in res.stdout
    assert not (tmp_path / "o").exists() and not (tmp_path / "builds").exists()


def test_evalsvc_run_refuses_to_track_what_it_does_not_store(tmp_path):
    res = subprocess.run([*CLI, "run", "smoke", "--track", "--no-store",
                          "--out", str(tmp_path / "o")], capture_output=True, text=True,
                         timeout=120, env={**_env(), "EVALSVC_DATA_DIR": str(tmp_path)})
    assert res.returncode == 2, res.stdout + res.stderr
    assert "error: --track needs the store (drop --no-store)" in res.stdout
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_sigterm_stops_a_run_and_its_engine(tmp_path):
    """``evalsvc run`` stopped by SIGTERM (a scheduler's or a supervisor's stop) stops the engine
    it started, which runs in a process group of its own, before it exits 143, as on Ctrl-C."""
    import os
    import signal
    import time
    import uuid

    from tests.processes import marked_processes, wait_no_processes

    mark, token = "EVALSVC_TEST_SIGTERM", uuid.uuid4().hex
    env = {**os.environ, "EVALSVC_DATA_DIR": str(tmp_path / "data"), mark: token}
    proc = subprocess.Popen([sys.executable, "-m", "evalsvc.cli", "run", "smoke", "--config",
                             "mamba2-eb-ov-c64", "--no-store", "--out", str(tmp_path / "out")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marked_processes(mark, token):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no engine started within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 143, out[-3000:]
        assert wait_no_processes(mark, token) == [], "the engine outlived its run"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
