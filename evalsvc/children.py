"""Child processes that die with the thread that started them (Linux ``PR_SET_PDEATHSIG``).

Engines started on a Ray worker use it (a killed worker leaves no engine behind), and so does every
short-lived tool the service runs (git, pip, a build's python): a service stopped or killed mid-build
leaves no clone or install running after it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

PR_SET_PDEATHSIG = 1


def parent_death_signal() -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that forks it exits (the harness
    starts engines, and builds run their tools, from the thread that waits for them). libc is
    looked up here, before the fork; the child only makes the call."""
    prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the call: nobody will signal us
            os._exit(1)

    return arm


def run(argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose child is killed if this process dies before it ends."""
    return subprocess.run(list(argv), preexec_fn=parent_death_signal(), **kwargs)
