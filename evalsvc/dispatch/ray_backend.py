"""Runs on a Ray cluster: each run is a Ray task that requests the engine slots its config needs.

The task executes the same plain function as the local dispatcher (``execute``: build, launch,
scenarios, metrics) on a worker node and returns the ``RunResult``, its per-sample rows included,
with the engine's log; the service writes both (the Parquet file, the log under ``task.log_dir``)
and stays the only writer of the store. Only this module imports ``ray`` (``pip install
'evalsvc[ray]'``), and only when a ``RayDispatcher`` is made.

* Builds: the workers make the SGLang builds, over their own SGLang environment
  (``EVALSVC_ENGINE_PYTHON`` of the worker node, which wins over the service's; for a job that
  names an environment, the node's own of that name, ``evalsvc.builds.engine_envs``), in their own
  builds cache (``EVALSVC_DATA_DIR/builds`` of the node): nothing is shared with the service but
  what travels through Ray. Before a job's runs, ``prepare_build`` makes each build on a node that
  offers slots and brings its manifest (or the installed SGLang release) back for the store; each
  run then finds the build in its node's cache, or makes it there, and checks it is the same code.

* Address: ``EVALSVC_RAY_ADDRESS`` is what ``ray.init(address=...)`` takes: ``HOST:6379`` (the
  head's GCS, for a service on the cluster's network), ``ray://HOST:10001`` (a Ray Client) or
  ``auto``. Connecting is tried three times (a Ray Client's server on the head sometimes dies as it
  starts).
* Placement: a run requests ``tp_size * pp_size`` of ``EVALSVC_RAY_SLOT_RESOURCE`` (default
  ``GPU``; Ray gives each task GPUs of its own, so two runs never share one). The engine sees only
  the slots Ray assigned: ``CUDA_VISIBLE_DEVICES`` is set to their ids in the engine's
  environment, and the engine's base GPU id (SGLang's ``--base-gpu-id``, default 0) counts within
  that list (``slots_needed``: a config that moves it asks for the slots below it too). A custom
  resource (``engine_slot``) has ids only when every node is started with
  ``RAY_custom_unit_instance_resources=engine_slot`` (Ray then tracks it by unit, like GPUs);
  otherwise the engine's devices are left as the worker has them. The engine does not inherit what
  Ray adds to a worker's environment (``RAY_*``, the auth token among them; ``OMP_NUM_THREADS``
  when Ray set it), so it runs as it would under the local dispatcher. Ray starts workers, and so
  their engines, at nice 15: start the nodes with ``RAY_worker_niceness=0`` to run them at normal
  priority.
* Progress: the tasks report to a small actor (``Board``, on the head node) when they start and
  when their engine is up; a monitor thread here drains it and puts the job's ``RunEvent``s on its
  queue (``started``; ``engine`` only for engines on this machine, same boot and PID namespace, the
  only ones a restarted service can stop itself; an engine elsewhere dies with its Ray worker).
* Cancel: ``cancel_job`` marks the job on the board; a watcher thread in each task stops its
  engine (the harness returns a ``cancelled`` result), and a task that had not started returns
  ``cancelled`` at once, as with the local dispatcher.
* Failures: a task whose worker process or node dies is started again by Ray
  (``EVALSVC_RAY_RETRIES`` times, default 1), then the run is an ``error`` naming what died. The
  engine is started with ``PR_SET_PDEATHSIG``, so a killed worker never leaves its engine behind;
  when the service dies, Ray kills its tasks' workers, and with them their engines (a Ray Client's
  session first waits ``RAY_CLIENT_RECONNECT_GRACE_PERIOD``, 30 s by default). A run that no
  alive node can place (no node offers the slots it needs) is an ``error`` at once.
* Shutdown: runs in flight are cancelled and come back ``cancelled`` (the job service leaves them
  pending, to run again after the restart); runs that had not started are dropped.

Token authentication (Ray 2.60, on by default for ``ray start`` clusters when a token exists): Ray
reads it from the environment of every process, the service included: ``RAY_AUTH_MODE=token`` and
the token in ``RAY_AUTH_TOKEN``, or in a file named by ``RAY_AUTH_TOKEN_PATH`` (default
``~/.ray/auth_token``; ``ray get-auth-token --generate`` writes one). Nodes and the service must
share the same token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from evalsvc.builds.build import BuildError
from evalsvc.builds.engine_envs import DEFAULT as DEFAULT_ENV
from evalsvc.builds.engine_envs import engine_envs
from evalsvc.dispatch.base import RunTask, execute, prepare_build
from evalsvc.dispatch.errors import DispatchError
from evalsvc.engines.registry import engine_kind
from evalsvc.harness import RunControl
from evalsvc.paths import keep_earlier
from evalsvc.settings import Settings
from evalsvc.types import EventQueue, RunEvent, RunResult, Verdict

log = logging.getLogger("evalsvc.dispatch.ray")
POLL_SECONDS = 0.5  # how often the monitor and the tasks' cancel watchers look at the board
FEASIBILITY_SECONDS = 10.0  # how often runs waiting for a slot are checked against the alive nodes
CAPACITY_SECONDS = 5.0  # how long the most slots a node offers is taken as known
LOG_LIMIT = 16 << 20  # bytes of an engine log brought back (its tail)
CONNECT_ATTEMPTS = 3  # ray.init tries
SHUTDOWN_SECONDS = 60.0  # how long shutdown waits for cancelled runs to come back
BUILD_SECONDS = 3600.0  # how long a build on a worker may take (a first clone of SGLang included)
AUTH_HINT = ("with token authentication the service needs RAY_AUTH_MODE=token and the cluster's "
             "token in RAY_AUTH_TOKEN or in a file named by RAY_AUTH_TOKEN_PATH")


class RayDispatchError(DispatchError):
    """The Ray cluster cannot be used (not installed, unreachable, refused the token)."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise RayDispatchError("EVALSVC_RAY_ADDRESS is set but ray is not installed: "
                               "pip install 'evalsvc[ray]'") from None
    return ray


def slots_needed(config: dict[str, Any]) -> int:
    """Engine slots (GPUs) one run of a config occupies: data- times tensor- times
    pipeline-parallel size with SGLang's defaults. The engine's GPU ids count within the slots Ray
    assigns, and SGLang puts rank (dp, pp, tp) on ``base_gpu_id + dp * tp_size * pp_size *
    gpu_id_step + pp * tp_size + tp * gpu_id_step``, so a config that moves the base or the step
    occupies up to its highest id. Data-parallel attention (``enable_dp_attention``, later
    ``attn_dp_size``) splits the tensor-parallel ranks instead of adding replicas."""
    args = config.get("args") or {}
    tp, pp = int(args.get("tp_size") or 1), int(args.get("pp_size") or 1)
    dp = 1 if args.get("enable_dp_attention") else int(args.get("dp_size") or 1)
    base, step = int(args.get("base_gpu_id") or 0), int(args.get("gpu_id_step") or 1)
    return max(1, base + (dp - 1) * tp * pp * step + (pp - 1) * tp + (tp - 1) * step + 1)


def machine_key() -> str:
    """Identifies where a pid means the same process: the boot and the PID namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"unknown-{os.uname().nodename}"
    return f"{boot}/{pidns}"


# ---- on the cluster ----------------------------------------------------------------------------
class Board:
    """A Ray actor between the dispatcher and its tasks: the events the tasks report (started,
    engine up) until the dispatcher drains them, and the jobs cancelled."""

    def __init__(self) -> None:
        self._events: list[tuple[int, str, dict[str, Any]]] = []
        self._cancelled: set[str] = set()
        self._all = False

    def report(self, run_id: int, kind: str, info: dict[str, Any]) -> None:
        self._events.append((run_id, kind, info))

    def drain(self) -> list[tuple[int, str, dict[str, Any]]]:
        events, self._events = self._events, []
        return events

    def cancel(self, job_id: str) -> None:
        self._cancelled.add(job_id)

    def cancel_all(self) -> None:
        self._all = True

    def cancelled(self, job_id: str) -> bool:
        return self._all or job_id in self._cancelled


def assigned_slot_ids(resource: str) -> list[str]:
    """The ids of the slots Ray assigned to this task: GPUs (or another accelerator), or a custom
    resource Ray tracks by unit (``RAY_custom_unit_instance_resources``); [] when it has none."""
    import ray

    ctx = ray.get_runtime_context()
    accelerators = ctx.get_accelerator_ids()
    if resource in accelerators:
        return [str(i) for i in accelerators[resource]]
    units = os.environ.get("RAY_custom_unit_instance_resources", "")  # noqa: SIM112 - Ray's name
    if resource not in [u.strip() for u in units.split(",")]:
        return []
    with contextlib.suppress(Exception):  # Ray's own bookkeeping; ids exist only for unit resources
        worker = ray._private.worker.global_worker
        return [str(i) for i, _ in worker.core_worker.resource_ids().get(resource, [])]
    return []


_logging_set_up = False


def worker_python(python: str | None, node: Settings, env_name: str | None = None) -> str | None:
    """The SGLang python on this node: the environment the job named (``env_name``) as this node
    knows it (its ``EVALSVC_ENGINE_ENVS``, or what its builders made), else the service's
    ``python``; for a job on the default environment, the node's ``EVALSVC_ENGINE_PYTHON``, else
    the service's."""
    if env_name is None or env_name == DEFAULT_ENV:
        return node.engine_python or python
    own = engine_envs(node).get(env_name)
    return own.python if own is not None else python


def prepare_on_worker(source: str | None, patches: list[str], python: str | None,
                      env_name: str | None = None) -> dict:
    """The Ray task of ``RayDispatcher.prepare_build``: the build made on this node (the node's
    own settings are read here, where its task starts)."""
    node = Settings()
    return prepare_build(source, patches, worker_python(python, node, env_name),
                         node.resolved_builds_dir())


def ray_added_env() -> list[str]:
    """What Ray put in this worker's environment that an engine must not inherit, so that it runs
    as it would under the local dispatcher: Ray's own variables (the auth token among them), and
    ``OMP_NUM_THREADS`` when Ray set it (to the task's CPUs, at least 1) rather than the node."""
    names = [k for k in os.environ if k.startswith("RAY_")]
    if "OMP_NUM_THREADS" in os.environ:
        try:
            raylet = Path(f"/proc/{os.environ['RAY_RAYLET_PID']}/environ").read_bytes()
        except (KeyError, OSError):
            return names
        if not raylet:  # a process not yet past its exec (or exiting): it cannot tell
            return names
        if not any(e.startswith(b"OMP_NUM_THREADS=") for e in raylet.split(b"\0")):
            names.append("OMP_NUM_THREADS")
    return names


def run_dir(run_id: int) -> Path:
    """A folder of this worker's own for a run's engine log, under ``$TMPDIR/evalsvc-ray-runs``;
    the folders of workers that died (killed mid-run: nobody removed them) are removed first."""
    parent = Path(tempfile.gettempdir()) / "evalsvc-ray-runs"
    parent.mkdir(exist_ok=True)
    for old in parent.iterdir():
        pid = old.name.split("-")[1] if old.name.count("-") >= 2 else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{run_id}-{os.getpid()}-", dir=parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_on_worker(wire: dict[str, Any], board, slot_resource: str) -> dict[str, Any]:
    """The Ray task: one run (``RunTask.to_wire``'s data) on this node, reported to ``board``;
    returns the result and logs."""
    import ray

    task = RunTask.from_wire(wire)

    global _logging_set_up
    if not _logging_set_up:
        from evalsvc.logs import setup_logging

        setup_logging(logging.INFO)
        _logging_set_up = True

    unreachable = threading.Event()

    def is_cancelled() -> bool:
        try:
            return ray.get(board.cancelled.remote(task.job_id), timeout=30)
        except (ray.exceptions.RayError, ConnectionError, TimeoutError):
            # the board is gone (its node died): go on, the driver decides
            if not unreachable.is_set():
                unreachable.set()
                log.warning("run %s: the dispatcher's board is unreachable", task.run_id,
                            exc_info=True)
            return False

    def report(kind: str, **info: Any) -> None:
        try:
            ray.get(board.report.remote(task.run_id, kind, info), timeout=30)
        except (ray.exceptions.RayError, ConnectionError, TimeoutError):
            log.warning("run %s: could not report %s to the dispatcher", task.run_id, kind,
                        exc_info=True)

    if is_cancelled():  # cancelled while it waited for a slot
        return {"result": task.outcome(Verdict.CANCELLED, "the job was cancelled"), "logs": {}}
    ctx = ray.get_runtime_context()
    slots = assigned_slot_ids(slot_resource)
    report("started", node=ctx.get_node_id(), host=os.uname().nodename, worker_pid=os.getpid(),
           slots=slots)
    env = dict(task.engine.env)
    if slots:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slots)
    engine = dataclasses.replace(task.engine, env=env, die_with_parent=True,
                                 unset_env=ray_added_env())
    node = Settings()  # this node's own, read where its task starts
    if engine_kind(engine.kind).uses_engine_envs:
        engine = dataclasses.replace(engine, python=worker_python(engine.python, node,
                                                                  engine.env_name))
    log_dir = run_dir(task.run_id)
    local = task.model_copy(update={"engine": engine, "log_dir": str(log_dir)})
    key = machine_key()
    engine_up: queue.Queue[RunEvent] = queue.Queue()
    control = RunControl(task.run_id, engine_up)
    done = threading.Event()

    def watch() -> None:
        """The engine's pid reported as it comes; the job's cancel looked at every POLL_SECONDS."""
        while not done.is_set():
            try:
                event = engine_up.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if is_cancelled():
                    control.cancel()
                    return
            else:
                report("engine", pid=event.pid, machine=key)

    watcher = threading.Thread(target=watch, name=f"cancel-watch-{task.run_id}", daemon=True)
    watcher.start()
    try:
        try:
            result = execute(local, control, builds_dir=node.resolved_builds_dir())
        finally:
            done.set()
            watcher.join()
        logs = {}
        for path in sorted(log_dir.iterdir()):
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - LOG_LIMIT))
                logs[path.name] = f.read()
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return {"result": result, "logs": logs}


# ---- in the service ----------------------------------------------------------------------------
@dataclasses.dataclass
class _Flight:
    task: RunTask
    future: Future
    ref: Any
    need: int
    events: EventQueue | None
    attempts: int = 0
    where: str = ""
    error: str | None = None  # why the dispatcher itself cancelled it


class RayDispatcher:
    """Runs as Ray tasks on the cluster at ``address`` (what ``ray.init(address=...)`` takes)."""

    def __init__(self, address: str, slot_resource: str = "GPU", retries: int = 1) -> None:
        ray = self._ray = _import_ray()
        self.address = address
        self.slot_resource = slot_resource
        self.retries = retries
        self._connect(ray, address)
        self._machine = machine_key()
        self._board = ray.remote(Board).options(
            num_cpus=0, max_restarts=-1, resources={"node:__internal_head__": 0.001}).remote()
        self._remote = ray.remote(run_on_worker)
        self._prepare = ray.remote(prepare_on_worker)
        self.slots = int(ray.cluster_resources().get(slot_resource, 0))
        if self.slots == 0:
            log.warning("the Ray cluster at %s offers no %s yet: runs fail until a node does",
                        address, slot_resource)
        self._flights: dict[int, _Flight] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._checked = 0.0
        self._capacity, self._capacity_at = 0, -CAPACITY_SECONDS - 1
        self._thread = threading.Thread(target=self._monitor, name="ray-dispatch", daemon=True)
        self._thread.start()
        log.info("Ray dispatcher on %s: %d %s slot(s)", address, self.slots, slot_resource)

    @staticmethod
    def _connect(ray, address: str) -> None:
        """``ray.init``, tried ``CONNECT_ATTEMPTS`` times: a Ray Client's server process on the
        head sometimes dies as it starts (a crash inside grpc, seen with Ray 2.60 and grpcio
        1.85), and the next attempt gets a new one."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main else None
        try:
            for attempt in range(1, CONNECT_ATTEMPTS + 1):
                try:
                    ray.init(address=address, namespace="evalsvc", log_to_driver=True)
                    return
                except (ConnectionError, RuntimeError, ValueError, TimeoutError,
                        ray.exceptions.RayError) as exc:
                    with contextlib.suppress(Exception):
                        ray.shutdown()
                    if attempt == CONNECT_ATTEMPTS:
                        raise RayDispatchError(
                            f"cannot connect to the Ray cluster at {address} ({attempt} "
                            f"attempts): {type(exc).__name__}: {exc} ({AUTH_HINT})") from None
                    log.warning("connecting to the Ray cluster at %s failed (attempt %d of %d), "
                                "trying again: %s: %s", address, attempt, CONNECT_ATTEMPTS,
                                type(exc).__name__, str(exc).strip().splitlines()[-1:])
                    time.sleep(2.0 * attempt)
        finally:
            if main:  # ray.init replaces SIGTERM's handler; the service's own (uvicorn's) stays
                signal.signal(signal.SIGTERM, previous)

    # ---- the Dispatcher interface --------------------------------------------------------
    def submit(self, task: RunTask, events: EventQueue | None = None) -> Future:
        future: Future = Future()
        need = slots_needed({"args": task.config.args})
        problem = self._infeasible(need)
        if problem:
            log.error("run %s: %s", task.run_id, problem)
            future.set_result(task.outcome(Verdict.ERROR, problem))
            return future
        placement: dict[str, Any] = {"num_cpus": 0}
        if self.slot_resource == "GPU":
            placement["num_gpus"] = need
        else:
            placement["resources"] = {self.slot_resource: need}
        ref = self._remote.options(**placement, max_retries=self.retries, retry_exceptions=False,
                                   name=f"evalsvc-run-{task.run_id}").remote(
            task.to_wire(), self._board, self.slot_resource)
        with self._lock:
            self._flights[task.run_id] = _Flight(task, future, ref, need, events)
        self._wake.set()
        return future

    def prepare_build(self, source: str | None, patches: list[str], python: str | None,
                      env_name: str | None = None) -> dict[str, Any]:
        """``prepare_build`` on an alive node that offers slots (one that takes runs), placed there
        alone (no slot taken): its answer, or a BuildError naming the node."""
        ray = self._ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted((n for n in ray.nodes() if n.get("Alive")
                        and n.get("Resources", {}).get(self.slot_resource, 0) > 0),
                       key=lambda n: n["NodeID"])
        label = source or "the installed SGLang"
        if not nodes:
            raise BuildError(f"{label}: no alive node of the Ray cluster at {self.address} offers "
                             f"{self.slot_resource} to make the build on")
        node = nodes[0]
        where = f"node {node['NodeID'][:12]} ({node.get('NodeManagerHostname', '?')})"
        ref = self._prepare.options(
            num_cpus=0, max_retries=self.retries, name="evalsvc-build",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote(source, list(patches), python, env_name)
        t0 = time.monotonic()
        try:
            info = ray.get(ref, timeout=BUILD_SECONDS)
        except ray.exceptions.GetTimeoutError:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
            raise BuildError(f"{label}: the build on {where} did not finish within "
                             f"{BUILD_SECONDS:.0f} s") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, BuildError):
                raise BuildError(f"{cause} (on {where})") from None
            raise BuildError(f"{label}: the build failed on {where}: {type(cause).__name__}: "
                             f"{cause}") from None
        except ray.exceptions.RayError as exc:
            detail = str(exc).strip().splitlines()
            raise BuildError(f"{label}: the build task on {where} failed: {type(exc).__name__}: "
                             f"{detail[0] if detail else ''}") from None
        log.info("build %s ready on %s in %.1f s", label, where, time.monotonic() - t0)
        return info

    def cancel_job(self, job_id: str) -> None:
        try:
            self._ray.get(self._board.cancel.remote(job_id), timeout=60)
        except self._ray.exceptions.RayError:
            log.exception("job %s: the cancel did not reach the Ray tasks", job_id)

    def shutdown(self) -> None:
        ray = self._ray
        with contextlib.suppress(Exception):
            ray.get(self._board.cancel_all.remote(), timeout=30)
        with self._lock:
            waiting = [f for f in self._flights.values() if f.attempts == 0]
        for flight in waiting:  # not started: dropped (their runs stay pending)
            if flight.future.cancel():
                with contextlib.suppress(Exception):
                    ray.cancel(flight.ref)
                with self._lock:
                    self._flights.pop(flight.task.run_id, None)
        deadline = time.monotonic() + SHUTDOWN_SECONDS
        while time.monotonic() < deadline:
            with self._lock:
                if not self._flights:
                    break
            time.sleep(0.2)
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout=30)
        with self._lock:
            left, self._flights = list(self._flights.values()), {}
        for flight in left:
            if not flight.future.done():
                flight.future.set_result(flight.task.outcome(Verdict.CANCELLED,
                                                 "the service stopped"))
        with contextlib.suppress(Exception):
            ray.shutdown()

    # ---- the monitor ---------------------------------------------------------------------
    def _monitor(self) -> None:
        while not self._closing.is_set():
            try:
                self._step()
            except Exception:  # the cluster hiccuped: try again, never lose the thread
                log.exception("Ray dispatcher")
                time.sleep(POLL_SECONDS)

    def _step(self) -> None:
        ray = self._ray
        with self._lock:
            refs = [f.ref for f in self._flights.values()]
        if not refs:
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()
            return
        # the first result as soon as it is there (the rest at the next turns), else a poll
        ready, _ = ray.wait(refs, num_returns=1, timeout=POLL_SECONDS, fetch_local=False)
        # after the wait: a task reports synchronously, so a finished task's events are here
        try:
            events = ray.get(self._board.drain.remote(), timeout=60)
        except ray.exceptions.RayError:  # the board restarts; results still come in below
            log.warning("Ray dispatcher: the board did not answer", exc_info=True)
            events = []
        for run_id, kind, info in events:
            self._event(run_id, kind, info)
        done = set(ready)
        with self._lock:
            finished = [f for f in self._flights.values() if f.ref in done]
        for flight in finished:
            self._finish(flight)
        if time.monotonic() - self._checked > FEASIBILITY_SECONDS:
            self._recheck()

    def _event(self, run_id: int, kind: str, info: dict[str, Any]) -> None:
        with self._lock:
            flight = self._flights.get(run_id)
        if flight is None:
            return
        if kind == "started":
            flight.attempts += 1
            flight.where = (f"node {info['node'][:12]} ({info['host']}), worker pid "
                            f"{info['worker_pid']}, {self.slot_resource} "
                            f"{','.join(info['slots']) or '-'}")
            with _run_log(flight.task):
                log.info("run %s started (attempt %d) on %s", run_id, flight.attempts,
                         flight.where)
            if flight.attempts == 1 and flight.events is not None:
                flight.events.put(RunEvent(run_id, "started"))
        elif kind == "engine":
            local = info["machine"] == self._machine
            with _run_log(flight.task):
                log.info("run %s: engine pid %d up on %s%s", run_id, info["pid"], flight.where,
                         "" if local else " (another machine)")
            if local and flight.events is not None:
                flight.events.put(RunEvent(run_id, "engine", info["pid"]))

    def _finish(self, flight: _Flight) -> None:
        ray = self._ray
        task = flight.task
        try:
            out = ray.get(flight.ref, timeout=120)
            result: RunResult = out["result"]
            self._write_logs(task, result, out["logs"])
        except ray.exceptions.TaskCancelledError:
            result = task.outcome(Verdict.ERROR if flight.error else Verdict.CANCELLED,
                             flight.error or "the job was cancelled")
        except ray.exceptions.RayError as exc:
            detail = str(exc).strip().splitlines()
            result = task.outcome(Verdict.ERROR, (
                f"the Ray task of this run failed after {max(flight.attempts, 1)} attempt(s) "
                f"(last on {flight.where or 'no node'}): {type(exc).__name__}: "
                f"{detail[0] if detail else ''}"))
            with _run_log(task):
                log.error("run %s: %s", task.run_id, result.reason)
        with self._lock:
            self._flights.pop(task.run_id, None)
        flight.future.set_result(result)

    def _write_logs(self, task: RunTask, result: RunResult, logs: dict[str, bytes]) -> None:
        if not logs:
            result.log_path = None
            return
        log_dir = Path(task.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        for name, data in logs.items():
            target = log_dir / Path(name).name
            keep_earlier(target)  # a run done again: the earlier attempt's log stays
            target.write_bytes(data)
        if result.log_path:
            result.log_path = str(log_dir / Path(result.log_path).name)

    def _capacity_now(self) -> int:
        """The most slots one alive node offers."""
        nodes = [n for n in self._ray.nodes() if n.get("Alive")]
        return int(max((n.get("Resources", {}).get(self.slot_resource, 0) for n in nodes),
                       default=0))

    def _infeasible(self, need: int) -> str | None:
        if time.monotonic() - self._capacity_at > CAPACITY_SECONDS:
            self._capacity, self._capacity_at = self._capacity_now(), time.monotonic()
        if need <= self._capacity:
            return None
        return (f"no alive node of the Ray cluster at {self.address} offers {need} "
                f"{self.slot_resource} (the most one node offers: {self._capacity}); the run "
                f"needs {need} (dp_size x tp_size x pp_size, from base_gpu_id on)")

    def _recheck(self) -> None:
        self._checked = time.monotonic()
        with self._lock:
            waiting = [f for f in self._flights.values() if f.attempts == 0 and not f.error]
        for flight in waiting:
            problem = self._infeasible(flight.need)
            if problem:
                flight.error = problem
                self._ray.cancel(flight.ref)


@contextlib.contextmanager
def _run_log(task: RunTask):
    from evalsvc.logs import log_context

    with log_context(job=task.job_id, run=task.run_id):
        yield
