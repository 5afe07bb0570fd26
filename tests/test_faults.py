"""The fault suite: a real ``evalsvc serve`` (``tests/api/conftest.py: Service``) on the embedded
engine, and a fault injected mid-job. Whatever the fault, no planned run is lost or recorded twice
(one row per job, config and build in the runs table) and no engine process is left behind.

Faults: the service SIGKILLed and restarted; an engine SIGKILLed; an engine SIGSTOPped (its run's
deadline); the port taken, and a second service on a store in use; the data directory's disk
full; the PostgreSQL server restarted (a private server, never the shared one)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.pool import NullPool

from evalsvc.engines.launch import group_listens_on
from evalsvc.store.lock import StoreLock, StoreLocked
from evalsvc.store.models import Run
from evalsvc.tls import tls_context
from tests.api import conftest as api_conftest
from tests.api.conftest import Service, free_port
from tests.conftest import in_ci
from tests.engines.embedded.test_server import metric as metric_in
from tests.processes import exists

pytestmark = pytest.mark.slow

SMALL = {"num_prompts": 2, "max_new_tokens": 8}
CONFIGS = ["mamba2-noradix-sync-nochunk", "gdn-eb-ov-c64"]
# the run a fault hits while it serves: four scenarios, seconds of work once its engine is healthy
# (the other config's one cold scenario of 2 prompts can end between the test seeing its engine
# serve and the fault landing, and did on a fast machine)
LONG = CONFIGS[1]
PG_BIN = Path("/usr/lib/postgresql/15/bin")
service_factory = api_conftest.service_factory  # services stopped afterwards, no engine left


def job_body(configs: list[str] = CONFIGS, **extra) -> dict:
    return {"matrix": "smoke", "configs": configs, "workload": dict(SMALL), **extra}


def run_rows(db_url: str, job_id: str | None = None) -> list[Run]:
    """The runs table as it is (a connection of the test's own, not the service's)."""
    engine = create_engine(db_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            query = select(Run.id, Run.job_id, Run.config, Run.build_id, Run.status, Run.verdict,
                           Run.reason, Run.engine_pid, Run.finished_at)
            if job_id is not None:
                query = query.where(Run.job_id == job_id)
            return list(conn.execute(query.order_by(Run.id)))
    finally:
        engine.dispose()


def assert_once_each(db_url: str, job_id: str, configs: list[str], builds: int = 1) -> list:
    """Every planned run (config x build) has exactly one row; returns the rows."""
    rows = run_rows(db_url, job_id)
    per_key = Counter((r.job_id, r.config, r.build_id) for r in rows)
    assert all(n == 1 for n in per_key.values()), f"duplicated runs: {per_key}"
    assert sorted(r.config for r in rows) == sorted(configs * builds), f"lost runs: {rows}"
    return rows


def engine_pids(service: Service) -> list[int]:
    return [int(line.split(":")[0]) for line in service.engines()]


def engine_port(service: Service, pid: int) -> int | None:
    line = next((x for x in service.engines() if x.startswith(f"{pid}:")), "")
    m = re.search(r"--port (\d+)", line)
    return int(m.group(1)) if m else None


def serving_engine(service: Service, db_url: str, timeout: float = 120,
                   config: str | None = None) -> tuple[int, int]:
    """Waits for a running run (of ``config``, when given) whose engine (the pid on its row, one
    of the service's marked processes) is up: it answers ``/ping`` (which generates nothing, so
    it answers at once however busy the engine is) on a port its own process group listens on
    (not another test's engine that took the port first). Returns (run id, engine pid)."""
    deadline = time.monotonic() + timeout
    while True:
        running = [r for r in run_rows(db_url) if r.status == "running" and r.engine_pid
                   and config in (None, r.config)]
        for run in running:
            port = engine_port(service, run.engine_pid)
            if port is not None and group_listens_on(run.engine_pid, port):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=5,
                                 verify=tls_context()).status_code == 200:
                        return run.id, run.engine_pid
                except httpx.HTTPError:
                    pass
        assert time.monotonic() < deadline, (running, service.engines(), service.log())
        time.sleep(0.2)


def working_engine(service: Service, db_url: str, config: str, timeout: float = 120) -> tuple[int, int]:
    """A run's engine while it serves the workload: a request in flight and prompt tokens beyond
    the health checks' one each (``serving_engine``, then its metrics). A fault sent now lands
    mid-scenario, not after the last one (when nothing the run still asks of it would notice)."""
    run_id, pid = serving_engine(service, db_url, timeout, config)
    port = engine_port(service, pid)

    def metric(name: str) -> float:
        return metric_in(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5,
                                   verify=tls_context()).text, name)

    deadline = time.monotonic() + timeout
    while not (metric("sglang:num_running_reqs") > 0
               and metric("sglang:prompt_tokens_total") > 64):
        assert time.monotonic() < deadline, service.log()
        time.sleep(0.02)
    return run_id, pid


def stopped_ok(service: Service) -> None:
    """The service stops on SIGTERM and leaves no engine."""
    assert service.stop() in (0, -signal.SIGTERM), service.log()
    deadline = time.monotonic() + 10
    while service.engines() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not service.engines(), "engines left behind"


def need(what: str, ok: bool) -> None:
    """Skip (fail under CI) a test whose fault needs something this machine lacks."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"CI is set and this fault test needs {what}", pytrace=False)
    pytest.skip(f"needs {what}")


# ---- 1. the service SIGKILLed mid-job ---------------------------------------------------------
def test_killed_service_resumes_and_records_each_run_once(service_factory, tmp_path):
    db = f"sqlite:///{tmp_path / 'kill.db'}"
    configs = CONFIGS
    service = service_factory(db).start()
    job_id = service.submit(job_body(configs))
    service.wait(job_id, timeout=300, until=lambda j: j["progress"].get("done", 0) >= 1)
    _run, pid = serving_engine(service, db)
    done_before = {r.id: r.finished_at for r in run_rows(db, job_id) if r.status == "done"}
    assert done_before

    service.kill()
    orphans = engine_pids(service)
    assert pid in orphans, "the engine should outlive the killed service"

    service.start()
    assert not any(exists(p) for p in orphans), "the restart left the orphaned engine running"
    job = service.wait(job_id, timeout=300)
    assert job["status"] == "done", job
    rows = assert_once_each(db, job_id, configs)
    assert all(r.status == "done" and r.verdict == "pass" for r in rows), rows
    assert {r.id: r.finished_at for r in rows if r.id in done_before} == done_before, \
        "a run recorded before the kill was run again"
    stopped_ok(service)


# ---- 2. an engine SIGKILLed mid-run -----------------------------------------------------------
def test_killed_engine_fails_its_run_only(service_factory, tmp_path):
    db = f"sqlite:///{tmp_path / 'engine.db'}"
    service = service_factory(db).start()
    # a workload that keeps the engine busy for seconds, and the kill sent while a request of it
    # runs: twice in CI the kill landed after the run's last scenario, and the run passed
    job_id = service.submit(job_body(workload={"num_prompts": 8, "max_new_tokens": 32}))
    run_id, pid = working_engine(service, db, config=LONG)
    os.kill(pid, signal.SIGKILL)

    job = service.wait(job_id, timeout=300)
    assert job["status"] == "done", job
    rows = {r.id: r for r in assert_once_each(db, job_id, CONFIGS)}
    killed = rows.pop(run_id)
    assert killed.status == "done" and killed.verdict == "error", killed
    assert "exited with code -9" in killed.reason, killed.reason
    assert all(r.status == "done" and r.verdict == "pass" for r in rows.values()), rows
    assert not exists(pid) and not exists(pid, group=True)
    stopped_ok(service)


# ---- 3. an engine SIGSTOPped mid-run ----------------------------------------------------------
RUN_DEADLINE = 90  # seconds (EVALSVC_RUN_TIMEOUT_S): a run here takes well under it


def wait_run_finished(db_url: str, run_id: int, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        run = next(r for r in run_rows(db_url) if r.id == run_id)
        if run.status not in ("pending", "running"):
            return run
        assert time.monotonic() < deadline, f"run {run_id} still {run.status}"
        time.sleep(0.5)


def test_stopped_engine_fails_its_run_by_the_deadline(service_factory, tmp_path):
    db = f"sqlite:///{tmp_path / 'stop.db'}"
    service = service_factory(db, EVALSVC_RUN_TIMEOUT_S=str(RUN_DEADLINE)).start()
    job_id = service.submit(job_body())
    run_id, pid = serving_engine(service, db, config=LONG)
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        run = wait_run_finished(db, run_id, timeout=RUN_DEADLINE + 120)
        waited = time.monotonic() - stopped
    finally:  # whatever happened, no stopped engine stays
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)
    assert run.verdict == "error" and ("deadline" in run.reason or "did not answer" in run.reason), run
    assert waited < RUN_DEADLINE + 60, f"the run ended {waited:.0f} s after its engine stopped"
    assert not exists(pid) and not exists(pid, group=True), "the stopped engine was left"

    job = service.wait(job_id, timeout=300)
    assert job["status"] == "done", job
    rows = {r.id: r for r in assert_once_each(db, job_id, CONFIGS)}
    rows.pop(run_id)
    assert all(r.status == "done" and r.verdict == "pass" for r in rows.values()), rows
    stopped_ok(service)


# ---- 4. the port taken; a second service on a store in use -------------------------------------
def serve_once(service: Service, port: int, timeout: float = 120) -> subprocess.CompletedProcess:
    """``evalsvc serve --port PORT`` with ``service``'s settings (its store, data directory and
    marker): it should refuse to start, so it runs to its exit."""
    return subprocess.run([sys.executable, "-m", "evalsvc.cli", "serve", "--port", str(port)],
                          env=service.env, capture_output=True, text=True, timeout=timeout)


def test_taken_port_and_store_in_use_refuse_to_start(service_factory, tmp_path):
    db = f"sqlite:///{tmp_path / 'port.db'}"
    live = service_factory(db).start()
    job_id = live.submit(job_body([LONG]))
    _run, pid = serving_engine(live, db)
    os.kill(pid, signal.SIGSTOP)  # the live run holds still (its engine up) while they try
    try:
        before = run_rows(db)

        # (a) a port another process holds (the store is the live service's)
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            taken = serve_once(live, port)
        out = taken.stdout + taken.stderr
        assert taken.returncode != 0, out
        assert f"--port {port}" in out, out
        assert exists(pid), "the refused service stopped the live service's engine"
        assert run_rows(db) == before, "the refused service changed the live service's runs"

        # (b) a free port, but the store is in use by the live service
        second = serve_once(live, free_port())
        out = second.stdout + second.stderr
        assert second.returncode != 0, out
        assert "in use by another evalsvc service" in out, out
        assert exists(pid), "the second service stopped the live service's engine"
        assert run_rows(db) == before, "the second service changed the live service's runs"
    finally:
        os.kill(pid, signal.SIGCONT)

    job = live.wait(job_id, timeout=300)
    assert job["status"] == "done", job
    rows = assert_once_each(db, job_id, [LONG])
    assert rows[0].verdict == "pass", rows
    stopped_ok(live)


# ---- 6. PostgreSQL restarted mid-job -----------------------------------------------------------
class PrivatePostgres:
    """A PostgreSQL server of the test's own (initdb in tmp, a free port, a socket dir in tmp)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "pgdata"
        self.sockets = root / "sock"
        self.port = free_port()
        self.log = root / "postgres.log"
        self.started = False

    def _as_postgres(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True,
                             text=True, timeout=120)
        if check:
            assert res.returncode == 0, f"{argv}: {res.stdout}{res.stderr}{self.tail()}"
        return res

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def init(self) -> PrivatePostgres:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(exist_ok=True)
        shutil.chown(self.root, "postgres")
        shutil.chown(self.sockets, "postgres")
        self._as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "--auth=trust",
                          "-U", "postgres")
        return self

    def ctl(self, action: str, *args: str) -> None:
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                          "-o", f"-p {self.port} -k {self.sockets} -h 127.0.0.1", "-w", *args,
                          action)
        self.started = action in ("start", "restart")

    def stop(self) -> None:
        if self.started:
            self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w",
                              "stop", check=False)
            self.started = False

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    need("root, runuser and PostgreSQL 15's server binaries (apt-get install postgresql-15)",
         os.geteuid() == 0 and shutil.which("runuser") is not None
         and (PG_BIN / "initdb").exists() and (PG_BIN / "pg_ctl").exists())
    # not under pytest's tmp (private to root); a short path keeps the socket's under 107 bytes
    server = PrivatePostgres(Path(tempfile.mkdtemp(prefix="evalsvc-pg-")))
    try:
        server.init().ctl("start")
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


def test_a_postgres_restart_never_hands_the_store_to_a_second_service(private_postgres):
    """The advisory lock dies with its session: ``keep`` takes it again after a restart, and says
    so when another service got in first (the runner then takes no job)."""
    url = private_postgres.url
    first = StoreLock(url)
    first.acquire()
    try:
        private_postgres.ctl("restart", "-m", "fast")
        first.keep()
        with pytest.raises(StoreLocked, match="in use by another evalsvc service"):
            StoreLock(url).acquire()
        private_postgres.ctl("restart", "-m", "fast")
        second = StoreLock(url)
        second.acquire()  # in the gap before the first one looks again
        try:
            with pytest.raises(StoreLocked, match="in use by another evalsvc service"):
                first.keep()
        finally:
            second.release()
        first.keep()  # free again: the first service's once more
        with pytest.raises(StoreLocked):
            StoreLock(url).acquire()
    finally:
        first.release()


def wait_for_log(service: Service, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in service.log():
        assert service.proc.poll() is None, f"the service exited:\n{service.log()}"
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{service.log()}"
        time.sleep(0.2)


def test_postgres_restart_mid_job_loses_no_run(service_factory, private_postgres):
    pg = private_postgres
    configs = CONFIGS
    service = service_factory(pg.url).start()
    job_id = service.submit(job_body(configs))
    # a restart while the first run's engine works: the service's pooled connections are dead
    serving_engine(service, pg.url)
    pg.ctl("restart", "-m", "fast")
    service.wait(job_id, timeout=300, until=lambda j: j["progress"].get("done", 0) >= 1)
    # down while the second run ends: its record waits for the server to come back
    serving_engine(service, pg.url)
    pg.ctl("stop", "-m", "fast")
    try:
        wait_for_log(service, "the database is unreachable", timeout=120)
        time.sleep(2)  # a second retry, still down
    finally:
        pg.ctl("start")
    job = service.wait(job_id, timeout=300)
    assert job["status"] == "done", job
    rows = assert_once_each(pg.url, job_id, configs)
    assert all(r.status == "done" and r.verdict == "pass" for r in rows), rows
    stopped_ok(service)


# ---- 5. the data directory's disk full ---------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs on the service's data directory (tmp_path/data), unmounted afterwards."""
    data = tmp_path / "data"
    data.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(data)],
                         capture_output=True, text=True, check=False)
    need(f"root and mount -t tmpfs ({(res.stderr or res.stdout).strip()})", res.returncode == 0)
    try:
        yield data
    finally:
        if subprocess.run(["umount", str(data)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(data)], check=False)


def fill(path: Path) -> int:
    """Writes ``path`` until its file system is full; returns the bytes written."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError:
                break
        while True:  # what is left, byte by byte in smaller steps
            try:
                written += f.write(b"\0" * 4096)
            except OSError:
                return written


def test_full_disk_fails_the_run_and_the_runner_goes_on(small_disk, service_factory, tmp_path):
    # the store outside the full disk, so the failure can be recorded
    db = f"sqlite:///{tmp_path / 'store.db'}"
    service = service_factory(db).start()
    job_id = service.submit(job_body([LONG]))
    serving_engine(service, db)
    filler = small_disk / "filler"
    assert fill(filler) > 0
    job = service.wait(job_id, timeout=300)
    rows = assert_once_each(db, job_id, [LONG])
    run = rows[0]
    assert run.status == "done" and run.verdict == "error", (run, job)
    assert "No space left on device" in run.reason, run.reason
    assert job["status"] == "failed" and "No space left on device" in job["error"], job
    health = service.client.get("/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text

    filler.unlink()
    again = service.submit(job_body(CONFIGS[:1]))
    job = service.wait(again, timeout=300)
    assert job["status"] == "done", job
    assert assert_once_each(db, again, CONFIGS[:1])[0].verdict == "pass"
    stopped_ok(service)
