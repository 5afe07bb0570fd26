"""``make run`` (``evalsvc demo``) ends where a new user can see the job: its dashboard's address,
served until Ctrl-C. Here on one config and 2 prompts of the smoke matrix, as a process of its
own: the printed page shows the job done, and SIGINT (Ctrl-C) stops the service and its engines."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from evalsvc.engines.launch import free_port
from tests.processes import ENGINE_PATTERNS, marked_processes, wait_no_processes

pytestmark = pytest.mark.slow

MARK = "EVALSVC_TEST_DEMO"


def as_from_a_terminal() -> None:
    """The demo's SIGINT as a shell's foreground program has it (default, unblocked), whatever
    the test process's threads have blocked or ignored: Ctrl-C is what the test checks."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def signal_state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "(gone)"
    return " ".join(line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def test_the_demo_keeps_the_dashboard_of_its_job_up_until_ctrl_c(tmp_path):
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALSVC_")}
    env.update({"EVALSVC_DATA_DIR": str(tmp_path / "data"), "EVALSVC_PORT": str(free_port()),
                MARK: token, "COLUMNS": "200"})
    proc = subprocess.Popen([sys.executable, "-u", "-m", "evalsvc.cli", "demo", "--config",
                             "mamba2-eb-ov-c64", "--num-prompts", "2", "--keep"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, preexec_fn=as_from_a_terminal)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(line)
            found = re.search(r"Dashboard of this job: (http://127\.0\.0\.1:\d+/jobs/(\S+))", line)
            if found:
                url, job_id = found.groups()
        assert f":{env['EVALSVC_PORT']}/" in url  # the port asked for, as `evalsvc serve` has
        text = "".join(lines)
        assert "until Ctrl-C" in text and f"{env['EVALSVC_DATA_DIR']}" in text
        time.sleep(1)
        page = httpx.get(url, timeout=30)
        assert page.status_code == 200 and job_id in page.text
        assert re.search(r'<td class="status"><span class="badge v-done">done</span>', page.text)
        assert proc.poll() is None  # still serving
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the demo's process group
        try:
            rest, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the demo did not stop within 90 s of Ctrl-C ({signal_state(proc.pid)})")
        assert proc.returncode == 0, text + rest
        assert "stopping the service" in rest
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, timeout=5)
        assert not wait_no_processes(MARK, token, timeout=10)
        assert not marked_processes(MARK, token, ("evalsvc.cli", *ENGINE_PATTERNS))  # nor the service
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        # after a failure: what it left (the service in a session of its own)
        for line in marked_processes(MARK, token, ("evalsvc.cli", *ENGINE_PATTERNS)):
            with contextlib.suppress(OSError):
                os.killpg(int(line.split(":")[0]), signal.SIGKILL)
