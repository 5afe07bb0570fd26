"""Finding the engine processes a test started, and checking they are gone.

A test marks the processes it starts with an environment variable (``var=token``), which engines
inherit; ``marked_processes`` finds the engine processes (embedded or fake SGLang) carrying it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

ENGINE_PATTERNS = ("evalsvc.engines.embedded", "fake_sglang.py")


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def marked_processes(var: str, token: str, patterns: tuple[str, ...] = ENGINE_PATTERNS) -> list[str]:
    """Live processes matching one of ``patterns`` with ``var=token`` in their environment."""
    found = []
    for pattern in patterns:
        res = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, check=False)
        for pid in res.stdout.split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:  # gone meanwhile, or another user's
                continue
            if f"{var}={token}".encode() in environ and not _zombie(int(pid)):
                found.append(f"{pid}: {cmdline.decode(errors='replace').strip()}")
    return found


def wait_no_processes(var: str, token: str, timeout: float = 5.0) -> list[str]:
    """Waits up to ``timeout`` for the marked engine processes to be gone; returns those left."""
    deadline = time.monotonic() + timeout
    while (left := marked_processes(var, token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def exists(pid: int, group: bool = False) -> bool:
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    return group or not _zombie(pid)


def assert_gone(pids: list[int], timeout: float = 5.0) -> None:
    """Every pid has exited and no process group led by one of them remains. The harness reaps its
    own child; a straggler it SIGKILLed may take a moment to be reaped by init."""
    assert pids
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if exists(p) or exists(p, group=True)]) and (
            time.monotonic() < deadline):
        time.sleep(0.05)
    assert not left, f"still running: {left}"


def outlives_its_parent(argv: list[str], how: signal.Signals = signal.SIGKILL) -> bool:
    """Starts ``argv``, a parent that starts a child and prints the child's pid, sends the parent
    ``how`` and tells whether the child still runs 5 s after the parent is gone (then kills it)."""
    parent = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert exists(child), "the child was not running"
        parent.send_signal(how)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while exists(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        return exists(child)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
        if child is not None:
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(child, signal.SIGKILL)
