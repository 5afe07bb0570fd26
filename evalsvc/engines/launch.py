"""Start an engine server as a child process group, wait until it serves, and take it down.

Used for the embedded engine now, and for SGLang servers by the harness: the command is an argument
list (never a shell string), the process gets a process group of its own so teardown kills every
process it started, and the environment drops SGLang's simulated-acceptance switches, which make a
server produce wrong text on purpose, and the service's secrets (API tokens, database URL, webhook,
Ray's token). An engine in a group of its own outlives a killed parent
(a restarted service stops it from the pid on its run); with ``die_with_parent`` it is killed when
the process that started it dies (a Ray worker, whose engine nobody else would stop).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from evalsvc.children import is_secret_env, parent_death_signal
from evalsvc.paths import keep_earlier
from evalsvc.tls import tls_context

SCRUBBED_ENV_PREFIXES = ("SGLANG_SIMULATE_ACC",)
class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message carries its log tail."""


class PortInUseError(EngineStartError):
    """The engine could not bind its port."""


PORT_HEADROOM = 10000  # SGLang derives ports from its own (0.5.12's gRPC port: port + 10000)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 with ``PORT_HEADROOM`` above it (SGLang 0.5.12 refuses to
    start on a port whose derived gRPC port passes 65535)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + PORT_HEADROOM <= 65535:
            return port
    raise OSError("no free port below 55536 on 127.0.0.1")


def embedded_command(port: int, flags: Sequence[str] = (), python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "evalsvc.engines.embedded", "--port", str(port),
            *flags]


def clean_env(extra: dict[str, str] | None = None, unset: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment without the scrubbed switches, the service's secrets
    (``is_secret_env``) and the names in ``unset``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(SCRUBBED_ENV_PREFIXES) and not is_secret_env(k) and k not in unset}
    env.update(extra or {})
    return env


def group_states(pgid: int) -> dict[int, str]:
    """pid -> state letter (``/proc/PID/stat``: R, S, T for stopped, Z, ...) of each process in
    the process group ``pgid``."""
    states = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[2]) == pgid:
            states[int(entry.name)] = fields[0]
    return states


def listening_inodes(port: int) -> set[str]:
    """The inodes of the TCP sockets listening on ``port`` on any address (``/proc/net/tcp`` and
    ``tcp6``; empty where there is no ``/proc``)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... uid timeout inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def group_listens_on(pgid: int, port: int) -> bool | None:
    """Whether a process of the group ``pgid`` holds the socket listening on ``port``; None where
    that cannot be told (no listener visible, no ``/proc``)."""
    sockets = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    if not sockets:
        return None
    for pid in group_states(pgid):
        try:
            fds = os.scandir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile
            continue
        with fds:
            for fd in fds:
                with contextlib.suppress(OSError):
                    if os.readlink(fd.path) in sockets:
                        return True
    return False


class EngineProcess:
    """A running engine server. Use as a context manager; ``stop`` is idempotent."""

    def __init__(self, argv: Sequence[str], port: int, *, env: dict[str, str] | None = None,
                 log_path: Path | None = None, startup_timeout: float = 120.0,
                 host: str = "127.0.0.1", die_with_parent: bool = False,
                 unset_env: Sequence[str] = ()) -> None:
        self.argv = list(argv)
        self.die_with_parent = die_with_parent
        self.port = port
        self.env = clean_env(env, unset_env)
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.base_url = f"http://{host}:{port}"
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self._log = None

    def __enter__(self) -> EngineProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            keep_earlier(self.log_path)  # a run done again: the earlier attempt's log stays
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            out = self._log
        else:
            out = subprocess.DEVNULL
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            preexec_fn=parent_death_signal() if self.die_with_parent else None)

    def wait_ready(self) -> None:
        deadline = self._t0 + self.startup_timeout
        with httpx.Client(timeout=5.0, verify=tls_context()) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    tail = self._tail()
                    if "address already in use" in tail.lower():
                        raise PortInUseError(f"port {self.port} is already in use: the engine "
                                             f"could not bind it{tail}")
                    raise EngineStartError(f"engine exited with code {code} during start-up{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health_generate").status_code == 200:
                        self.check_port_is_ours()
                        self.startup_seconds = time.monotonic() - self._t0
                        return
                if time.monotonic() > deadline:
                    stopped = " (its process is stopped)" if self.stopped() else ""
                    raise EngineStartError(f"engine not healthy after {self.startup_timeout:.0f} s"
                                           f"{stopped}{self._tail()}")
                time.sleep(0.1)

    def check_port_is_ours(self) -> None:
        """A server that answers is ours only if our process group holds the listening socket:
        another server may have bound the port between ``free_port`` and our engine's own bind
        (SGLang binds only after its imports, many seconds in), and taking its answers would
        measure the wrong server."""
        if group_listens_on(self.proc.pid, self.port) is False:
            raise PortInUseError(f"port {self.port} is already in use: another process answers "
                                 f"on it while the engine starts{self._tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stopped(self) -> bool:
        """Whether a process of the engine's group is stopped (SIGSTOP, SIGTSTP, a debugger): it
        answers nothing, and acts on no signal but SIGKILL until it is continued."""
        return self.proc is not None and any(
            state in "Tt" for state in group_states(self.proc.pid).values())

    def kill(self) -> None:
        """SIGKILL the whole process group at once (works on stopped processes too); ``stop``
        reaps it."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL what is left after ``grace`` seconds. A group
        with a stopped process is SIGKILLed at once: SIGTERM stays pending on a stopped process."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            if self.stopped():
                self.kill()
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
        self.kill()  # stragglers in the group, if any
        proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode

    def _tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "; log tail:\n" + "\n".join(text)
