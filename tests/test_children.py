"""The tools a build runs (git, pip, a python) die with the service: a service killed mid-build
leaves none of them running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie waits for a reaper; it runs no more
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # reaped meanwhile
        return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_build_tool_dies_with_the_service_that_ran_it(tmp_path, how):
    service = subprocess.Popen([sys.executable, "-c", SERVICE, str(tmp_path / "tool.pid")],
                               stdout=subprocess.PIPE, text=True)
    tool = None
    try:
        tool = int(service.stdout.readline())
        assert alive(tool)
        service.send_signal(how)
        service.wait(10)
        deadline = time.monotonic() + 5
        while alive(tool) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(tool), f"the build's tool (pid {tool}) outlived the service"
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
        service.stdout.close()
        if tool is not None and alive(tool):
            os.kill(tool, signal.SIGKILL)
