"""The tools a build runs (git, pip, a python) die with the service: a service killed mid-build
leaves none of them running."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from evalsvc import children
from tests.processes import outlives_its_parent

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
