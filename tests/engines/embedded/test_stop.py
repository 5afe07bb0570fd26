"""Taking an engine down whatever state it is in: a stopped (SIGSTOP) process group acts on no
SIGTERM, so it is SIGKILLed at once instead of after the grace period."""

from __future__ import annotations

import os
import signal
import time

import pytest

from evalsvc.engines.launch import EngineProcess, clean_env, embedded_command, free_port
from tests.processes import assert_gone


@pytest.mark.slow
def test_stopped_engine_group_is_killed_at_once(tmp_path):
    port = free_port()
    proc = EngineProcess(embedded_command(port), port, env=clean_env(),
                         log_path=tmp_path / "engine.log")
    proc.start()
    try:
        os.killpg(proc.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # the kernel stops the group soon, not at once
        while not proc.stopped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.stopped()
        t0 = time.monotonic()
        code = proc.stop(grace=120)
        assert time.monotonic() - t0 < 30  # not the grace period: SIGTERM does nothing to it
        assert code == -signal.SIGKILL
    finally:
        proc.stop()
    assert_gone([proc.proc.pid])
