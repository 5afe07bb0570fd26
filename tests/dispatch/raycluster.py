"""A Ray cluster of a test's own on this machine: ``ray start --head`` and CPU-only workers that
advertise a custom resource standing in for GPU slots, with token authentication on.

Ray binds to the machine's network address even when asked for loopback, so the cluster runs only
inside a network namespace whose one interface is loopback (``unshare --net``, then
``loopback_only()``): nothing of it can be reached from outside. Every process of the cluster
(raylets, GCS, workers, the engines they start) carries ``MARK=token`` in its environment; ``stop``
ends the ``ray start --block`` processes, then kills by pid whatever marked process is left and
checks that none is (never ``ray stop``, which kills every Ray process of the machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "EVALSVC_TEST_RAY"
RAY = str(Path(sys.executable).with_name("ray"))


def loopback_only() -> None:
    """Brings loopback up in this (new) network namespace, and refuses to go on if the namespace
    has any other interface."""
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        raise RuntimeError(f"not in a loopback-only network namespace (interfaces: {names}): "
                           "run under `unshare --net`")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def marked_pids(token: str) -> list[int]:
    """Live (non-zombie) processes with ``MARK=token`` in their environment."""
    found = []
    needle = f"{MARK}={token}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def listening() -> list[str]:
    """The TCP addresses listened on in this network namespace (``/proc/net/tcp{,6}``)."""
    found = []
    for name, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = bytes.fromhex(addr)
            # /proc writes each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
            ip = socket.inet_ntop(socket.AF_INET if name == "tcp" else socket.AF_INET6, raw)
            found.append(f"{ip}:{int(port, 16)}")
    return found


def is_loopback(address: str) -> bool:
    ip = address.rsplit(":", 1)[0]
    return ip.startswith("127.") or ip in ("::1",) or ip.startswith("::ffff:127.")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


class RayCluster:
    """``start()`` a head (no slots) and ``add_worker(slots)``; ``driver_env`` is what a process
    that connects to it needs (token authentication), at ``address`` or ``client_address``."""

    def __init__(self, logs: Path, resource: str = "engine_slot", port: int = 6379,
                 client_port: int = 10001) -> None:
        self.token = secrets.token_hex(32)  # the Ray auth token, and the processes' mark
        self.resource = resource
        self.address = f"127.0.0.1:{port}"  # the GCS: drivers on a node of the cluster
        self.client_address = f"ray://127.0.0.1:{client_port}"  # Ray Client: drivers elsewhere
        self.port = port
        self.client_port = client_port
        self.logs = logs
        # short: Ray's unix socket paths live under it
        self.temp_dir = tempfile.mkdtemp(prefix="evr", dir="/tmp")
        self.tmp = Path(self.temp_dir) / "tmp"  # the TMPDIR of its processes
        self.tmp.mkdir()
        self.procs: list[subprocess.Popen] = []
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "EVALSVC_")) or k.startswith("EVALSVC_TEST_")}
        self.env = {**env, **self.driver_env, MARK: self.token, "RAY_USAGE_STATS_ENABLED": "0",
                    "TMPDIR": str(self.tmp),
                    # the slot resource is tracked by unit, like GPUs: each task gets slot ids
                    "RAY_custom_unit_instance_resources": resource,
                    # workers (and so their engines) at the service's priority, not Ray's nice 15
                    "RAY_worker_niceness": "0"}

    @property
    def driver_env(self) -> dict[str, str]:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"ray-{name}.log", "ab") as out:
            self.procs.append(subprocess.Popen(
                [RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
                 "--num-gpus=0", *args], stdout=out, stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})}, start_new_session=True))

    def start(self, timeout: float = 180) -> RayCluster:
        self._start("head", ["--head", f"--port={self.port}", "--num-cpus=1",
                             f"--ray-client-server-port={self.client_port}",
                             "--include-dashboard=false", f"--temp-dir={self.temp_dir}"])
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port),
                                                                        timeout=1):
                return self
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not come up:\n{self.log('head')}")
            time.sleep(0.3)

    def add_worker(self, slots: int, name: str = "worker",
                   env: dict[str, str] | None = None) -> None:
        """A node with ``slots`` of the slot resource; ``env``: what its processes (the Ray
        workers, so the runs) have beside the cluster's environment."""
        self._start(name, [f"--address={self.address}", "--num-cpus=2",
                           f"--resources={json.dumps({self.resource: slots})}"], env)

    def wait_resources(self, amount: float, timeout: float = 180) -> dict[str, float]:
        """Waits until the cluster offers ``amount`` of the slot resource; returns its resources."""
        code = ("import json, sys, time, ray\n"
                f"ray.init(address={self.address!r}, log_to_driver=False)\n"
                f"deadline = time.monotonic() + {timeout}\n"
                f"while ray.cluster_resources().get({self.resource!r}, 0) < {amount}:\n"
                "    if time.monotonic() > deadline: sys.exit(3)\n"
                "    time.sleep(0.3)\n"
                "print(json.dumps(ray.cluster_resources()))\n")
        res = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True,
                             text=True, timeout=timeout + 60)
        if res.returncode != 0:
            raise RuntimeError(f"the cluster does not offer {amount} {self.resource}:\n"
                               f"{res.stderr[-3000:]}\n{self.log('head')}\n{self.log('worker')}")
        return json.loads(res.stdout.strip().splitlines()[-1])

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {proc.returncode}:\n"
                                   f"{self.log('head')}\n{self.log('worker')}")

    def log(self, name: str) -> str:
        path = self.logs / f"ray-{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def pids(self) -> list[int]:
        return marked_pids(self.token)

    def stop(self, timeout: float = 60, keep_logs: bool = False) -> list[str]:
        """Stops the cluster; returns the processes that were left and had to be killed.
        ``keep_logs``: Ray's session logs are copied next to the ``ray start`` logs first."""
        for proc in reversed(self.procs):  # workers first, then the head
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        # `ray start --block` stops its node's processes on SIGTERM; give them a moment
        while (left := self.pids()) and time.monotonic() < deadline:
            time.sleep(0.2)
        killed = [f"{pid}: {cmdline(pid)[:200]}" for pid in left]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        if keep_logs:  # Ray's own logs, for a failed test
            with contextlib.suppress(OSError):
                shutil.copytree(Path(self.temp_dir) / "session_latest" / "logs",
                                self.logs / "ray-session", dirs_exist_ok=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return killed
