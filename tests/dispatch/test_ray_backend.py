"""The Ray dispatcher's parts that need no cluster: which dispatcher the settings choose, that ray
is imported by the Ray backend alone, the slots a run needs, the board, and engines that die with
the process that started them (what keeps a killed Ray worker from leaving its engine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from evalsvc.dispatch import make_dispatcher
from evalsvc.dispatch.local import LocalDispatcher
from evalsvc.dispatch.ray_backend import (
    Board,
    RayDispatchError,
    machine_key,
    ray_added_env,
    slots_needed,
)
from evalsvc.engines.launch import clean_env
from evalsvc.settings import Settings
from tests.processes import outlives_its_parent

PACKAGE = Path(__file__).parents[2] / "evalsvc"


def test_settings_choose_the_dispatcher(monkeypatch):
    dispatcher = make_dispatcher(Settings(engine_slots=3))
    try:
        assert isinstance(dispatcher, LocalDispatcher) and dispatcher.slots == 3
    finally:
        dispatcher.shutdown()
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(RayDispatchError, match=r"pip install 'evalsvc\[ray\]'"):
        make_dispatcher(Settings(ray_address="127.0.0.1:6379"))


def test_ray_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("EVALSVC_RAY_ADDRESS", "auto")
    monkeypatch.setenv("EVALSVC_RAY_SLOT_RESOURCE", "engine_slot")
    monkeypatch.setenv("EVALSVC_RAY_RETRIES", "0")
    s = Settings()
    assert (s.ray_address, s.ray_slot_resource, s.ray_retries) == ("auto", "engine_slot", 0)
    for name in ("EVALSVC_RAY_ADDRESS", "EVALSVC_RAY_SLOT_RESOURCE", "EVALSVC_RAY_RETRIES"):
        monkeypatch.delenv(name)
    s = Settings()
    assert (s.ray_address, s.ray_slot_resource, s.ray_retries) == (None, "GPU", 1)


def test_only_the_ray_backend_imports_ray():
    importers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if re.search(r"^\s*(import ray\b|from ray\b)", p.read_text(), re.M)]
    assert importers == ["dispatch/ray_backend.py"]
    # and only lazily: the service's modules import without it
    code = ("import sys; sys.modules['ray'] = None; import evalsvc.dispatch.ray_backend, "
            "evalsvc.app, evalsvc.jobs")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_slots_needed():
    assert slots_needed({"args": {}}) == 1
    assert slots_needed({"args": {"tp_size": 4}}) == 4
    assert slots_needed({"args": {"tp_size": 2, "pp_size": 2}}) == 4
    # GPU ids count within the assigned slots: a moved base or step occupies up to the highest
    assert slots_needed({"args": {"tp_size": 2, "base_gpu_id": 1}}) == 3
    assert slots_needed({"args": {"tp_size": 2, "gpu_id_step": 2}}) == 3
    assert slots_needed({"args": {"tp_size": 2, "pp_size": 2, "gpu_id_step": 1,
                                  "base_gpu_id": 0}}) == 4
    # data-parallel replicas each take tp * pp GPUs; data-parallel attention splits the tp ranks
    assert slots_needed({"args": {"tp_size": 2, "dp_size": 2}}) == 4
    assert slots_needed({"args": {"tp_size": 2, "pp_size": 2, "dp_size": 2}}) == 8
    assert slots_needed({"args": {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True}}) == 4
    assert slots_needed({"args": {"tp_size": 4, "attn_dp_size": 4}}) == 4


def test_board_reports_and_cancels():
    board = Board()
    board.report(1, "started", {"node": "n"})
    board.report(1, "engine", {"pid": 5})
    assert board.drain() == [(1, "started", {"node": "n"}), (1, "engine", {"pid": 5})]
    assert board.drain() == []
    board.cancel("job-a")
    assert board.cancelled("job-a") and not board.cancelled("job-b")
    board.cancel_all()
    assert board.cancelled("job-b")


def test_machine_key_is_stable():
    assert machine_key() == machine_key()
    out = subprocess.run([sys.executable, "-c", "from evalsvc.dispatch.ray_backend import "
                          "machine_key; print(machine_key())"], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == machine_key()


@pytest.mark.parametrize("node_sets_omp", [False, True])
def test_ray_added_env(monkeypatch, node_sets_omp):
    """Ray's variables are not the engine's, nor OMP_NUM_THREADS unless the node (the raylet's
    environment) set it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.pop("OMP_NUM_THREADS", None)
    if node_sets_omp:
        env["OMP_NUM_THREADS"] = "4"
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        # just started, its environment can read empty for a moment (about 1 in 10 here)
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{raylet.pid}/environ").read_bytes():
            assert time.monotonic() < deadline, "the raylet's environment never became readable"
            time.sleep(0.01)
        monkeypatch.setenv("RAY_RAYLET_PID", str(raylet.pid))
        monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        names = ray_added_env()
        assert {"RAY_RAYLET_PID", "RAY_AUTH_TOKEN"} <= set(names)
        assert ("OMP_NUM_THREADS" in names) is not node_sets_omp
        engine_env = clean_env({"X": "1"}, names)
        assert "RAY_AUTH_TOKEN" not in engine_env and engine_env["X"] == "1"
    finally:
        raylet.kill()
        raylet.wait()


def test_ray_added_env_cannot_tell_from_an_empty_environment(monkeypatch):
    """A raylet whose environment reads empty (a process not yet past its exec, as
    ``test_ray_added_env``'s own reads about 1 in 10 times right after its start) says nothing of
    OMP_NUM_THREADS: the worker's is kept, not taken for Ray's."""
    from evalsvc.dispatch import ray_backend

    class Empty:
        def __init__(self, path: str) -> None:
            assert path == "/proc/4242/environ"

        def read_bytes(self) -> bytes:
            return b""

    monkeypatch.setattr(ray_backend, "Path", Empty)
    monkeypatch.setenv("RAY_RAYLET_PID", "4242")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "OMP_NUM_THREADS" not in ray_added_env()


PARENT = textwrap.dedent("""
    import sys, time
    from evalsvc.engines.launch import EngineProcess
    proc = EngineProcess([sys.executable, "-c", "import time; time.sleep(300)"], 1,
                         die_with_parent=sys.argv[1] == "1")
    proc.start()
    print(proc.proc.pid, flush=True)
    time.sleep(300)
""")


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_engine_dies_with_its_launcher_when_asked(die_with_parent):
    """SIGKILL of the process that started an engine: with ``die_with_parent`` the engine goes
    too (PR_SET_PDEATHSIG); without it the engine outlives it, as a restarted service expects."""
    outlived = outlives_its_parent([sys.executable, "-c", PARENT, "1" if die_with_parent else "0"])
    assert outlived is not die_with_parent
