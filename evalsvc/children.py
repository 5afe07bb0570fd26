"""Child processes that die with the thread that started them (Linux ``PR_SET_PDEATHSIG``).

Engines started on a Ray worker use it (a killed worker leaves no engine behind), and so does every
short-lived tool the service runs (git, pip, a build's python): a service stopped or killed mid-build
leaves no clone or install running after it. None of them inherits the service's secrets.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

PR_SET_PDEATHSIG = 1
# the service's secrets, which no child (an engine running code of any build a job names, pip
# running a package's build, git) needs: the API tokens, the users (their tokens), the session
# secret, the database URL (it may hold a password), the alert webhook (its URL is its key), Ray's
# cluster token and database passwords. HF_TOKEN stays: SGLang downloads gated models.
SECRET_ENV_NAMES = frozenset({"EVALSVC_DATABASE_URL", "EVALSVC_ALERT_WEBHOOK", "EVALSVC_USERS",
                              "EVALSVC_TEST_POSTGRES_URL", "RAY_AUTH_TOKEN", "PGPASSWORD",
                              "POSTGRES_PASSWORD"})
SECRET_ENV_PATTERNS = ("EVALSVC_*TOKEN*", "EVALSVC_*SECRET*", "EVALSVC_*WEBHOOK*",
                       "EVALSVC_*DATABASE_URL*", "RAY_*TOKEN*", "*PASSWORD*")


def is_secret_env(name: str) -> bool:
    """Whether the environment variable ``name`` holds one of the service's secrets."""
    return name in SECRET_ENV_NAMES or any(fnmatchcase(name, p) for p in SECRET_ENV_PATTERNS)


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not is_secret_env(k)}


def exit_on_sigterm() -> None:
    """SIGTERM ends this command as Ctrl-C does: a ``SystemExit`` (status 143) in the main thread,
    so its ``finally`` blocks and context managers stop the engines it started, which run in
    process groups of their own and would otherwise outlive it."""
    signal.signal(signal.SIGTERM, _exit_on_signal)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


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
    """``subprocess.run`` whose child is killed if this process dies before it ends, and whose
    environment (this process's, or ``env``) holds none of the service's secrets."""
    kwargs["env"] = without_secrets(os.environ if kwargs.get("env") is None else kwargs["env"])
    return subprocess.run(list(argv), preexec_fn=parent_death_signal(), **kwargs)
