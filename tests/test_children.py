"""The tools a build runs (git, pip, a python) die with the service: a service killed mid-build
leaves none of them running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalsvc import children
from tests.processes import marked_processes, outlives_its_parent

MARK = "EVALSVC_TEST_STOPPED_RUN"

# a "service" whose build thread runs a long tool, as a pip install would be, through the path
# builds take (sglang_env's step runner); it prints the tool's pid once the tool runs
SERVICE = """
import os, sys, threading, time
from pathlib import Path
from evalsvc.builds.sglang_env import _run
marker = Path(sys.argv[1])
argv = [sys.executable, "-c", "import os, time; open(%r, 'w').write(str(os.getpid())); "
        "time.sleep(300)" % str(marker)]
threading.Thread(target=_run, args=("0.0.0", "install", argv, 600), daemon=True).start()
while not marker.exists() or not marker.read_text():
    time.sleep(0.02)
print(marker.read_text(), flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_build_tool_dies_with_the_service_that_ran_it(tmp_path, how):
    assert not outlives_its_parent([sys.executable, "-c", SERVICE, str(tmp_path / "tool.pid")], how)


def test_build_tools_inherit_none_of_the_services_secrets(monkeypatch):
    monkeypatch.setenv("EVALSVC_API_TOKEN", "write-secret")
    monkeypatch.setenv("EVALSVC_DATABASE_URL", "postgresql+psycopg://u:pw@db/evalsvc")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "ray-secret")
    monkeypatch.setenv("EVALSVC_DATA_DIR", "/srv/evalsvc")
    show = [sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"]
    seen = json.loads(children.run(show, capture_output=True, text=True, check=True).stdout)
    assert "EVALSVC_API_TOKEN" not in seen and "EVALSVC_DATABASE_URL" not in seen
    assert "RAY_AUTH_TOKEN" not in seen
    assert seen["EVALSVC_DATA_DIR"] == "/srv/evalsvc"  # settings that are no secret pass
    given = {"PATH": os.environ["PATH"], "EVALSVC_READ_TOKEN": "read-secret", "KEEP": "1"}
    seen = json.loads(children.run(show, env=given, capture_output=True, text=True,
                                   check=True).stdout)
    assert "EVALSVC_READ_TOKEN" not in seen and seen["KEEP"] == "1"


# a test that starts an engine (the fake SGLang server, in a session of its own as the launcher
# starts every engine) and waits inside it, as a long test does when the run is stopped
STOPPED_TEST = """
import sys, time
from pathlib import Path
from evalsvc.engines.launch import EngineProcess, free_port

FAKE = str(Path({root!r}) / "tests" / "data" / "fake_sglang.py")


def test_waits_with_an_engine(tmp_path):
    port = free_port()
    argv = [sys.executable, FAKE, "--model-path", "m", "--host", "127.0.0.1", "--port", str(port)]
    with EngineProcess(argv, port, log_path=tmp_path / "engine.log") as engine:
        engine.wait_ready()
        print("READY", flush=True)
        time.sleep(300)
"""


def test_a_terminated_test_run_stops_the_engines_its_tests_started(tmp_path):
    """SIGTERM (a CI runner's time limit, ``timeout``, ``kill``) stops a test run as Ctrl-C does:
    the running test unwinds, and the engine it started is stopped, not left running."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "test_stopped.py").write_text(STOPPED_TEST.format(root=str(root)))
    token = tmp_path.name
    env = {**os.environ, MARK: token, "PYTHONPATH": str(root)}
    # a basetemp of its own: by default the inner run would take the next numbered directory
    # beside this run's and, at its end, delete the older ones: earlier suites' trees, which can
    # take minutes to delete
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "basetemp"),
         str(tmp_path / "test_stopped.py")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = ""
        while "READY" not in out:
            line = run.stdout.readline()
            assert line, out
            out += line
        assert marked_processes(MARK, token), "the engine did not start"
        run.send_signal(signal.SIGTERM)
        out += run.communicate(timeout=60)[0]
        assert "KeyboardInterrupt" in out, out
        deadline = time.monotonic() + 10
        while marked_processes(MARK, token) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not marked_processes(MARK, token), "the engine outlived the stopped test run"
    finally:
        run.kill()
        run.wait()
        run.stdout.close()
        for line in marked_processes(MARK, token):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
