"""Engine environments and models by name, through the API (the app in process, the runner off;
one test runs a job with the runner): ``GET /api/v1/engine-envs`` and ``/models``, a job naming its
environment and model, and the 422s naming the field (and the setting) for what a job may not
name. Clients never send a path to a python."""

from __future__ import annotations

import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from evalsvc.app import create_app
from evalsvc.builds import engine_envs, sglang_env
from evalsvc.paths import MODELS_DIR
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Job, Run
from tests import fake_envs
from tests.api.conftest import FAKE_MATRIX

FAKE_PYTHON = str(Path(__file__).parents[1] / "data" / "fake-python")


@pytest.fixture(autouse=True)
def no_discovery(monkeypatch, tmp_path):
    """The builders' locations, empty (this machine's own environments stay out of the tests)."""
    monkeypatch.setattr(engine_envs, "SGLANG_CPU_ENV", tmp_path / "no-sglang-cpu")
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(tmp_path / "no-sglang-envs"))


def other_python(tmp_path: Path) -> Path:
    """A second SGLang environment: the fake one behind a script that notes each time it runs."""
    script = tmp_path / "other-env" / "bin" / "python"
    script.parent.mkdir(parents=True)
    script.write_text(f'#!/usr/bin/env bash\necho "$@" >> {tmp_path / "other-env" / "calls"}\n'
                      f'exec {FAKE_PYTHON} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def models_dir(tmp_path: Path) -> Path:
    """A models directory with one model (a copy of a shipped model's config and tokenizer)."""
    root = tmp_path / "models"
    mine = root / "mamba2-mine"
    mine.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (mine / name).write_bytes((MODELS_DIR / "hybrid-mamba2-tiny" / name).read_bytes())
    return root


def make_client(tmp_path: Path, start_runner: bool = False, **overrides) -> TestClient:
    s = Settings(**{"data_dir": tmp_path / "data", "database_url": f"sqlite:///{tmp_path / 'e.db'}",
                    "nightly": False, **overrides})
    return TestClient(create_app(s, start_runner=start_runner))


@pytest.fixture
def client(tmp_path) -> Iterator[TestClient]:
    with make_client(tmp_path, engine_python=FAKE_PYTHON, models_dir=models_dir(tmp_path),
                     engine_envs={"other": str(other_python(tmp_path))}) as c:
        yield c


def jobs_stored(tmp_path: Path) -> int:
    store = Store(f"sqlite:///{tmp_path / 'e.db'}")
    try:
        with store.session() as s:
            return s.scalar(select(func.count()).select_from(Job))
    finally:
        store.close()


def refused(client: TestClient, tmp_path: Path, body: dict, *words: str) -> str:
    resp = client.post("/api/v1/jobs", json=body)
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    for word in words:
        assert word in str(detail), detail
    assert jobs_stored(tmp_path) == 0
    return str(detail)


def submitted(client: TestClient, body: dict) -> dict:
    resp = client.post("/api/v1/jobs", json=body)
    assert resp.status_code == 201, resp.text
    return client.get(f"/api/v1/jobs/{resp.json()['id']}").json()["spec"]


def test_the_environments_are_listed_with_what_they_hold(client, tmp_path):
    envs = client.get("/api/v1/engine-envs").json()
    assert [(e["name"], e["default"], e["origin"]) for e in envs] == [
        ("default", True, "EVALSVC_ENGINE_PYTHON"), ("other", False, "EVALSVC_ENGINE_ENVS")]
    assert envs[0]["python"] == FAKE_PYTHON
    for e in envs:  # the fake environment holds sglang 0.5.23's metadata (tests/data/fake-site)
        assert e["sglang"] == "0.5.23" and e["problem"] is None, e
        assert set(e) >= {"torch", "kernel", "cpu_ops", "device"}


def test_a_job_names_its_environment_by_name(client, tmp_path):
    assert submitted(client, {"matrix": FAKE_MATRIX, "engine_env": "other"})["engine_env"] == \
        "other"
    assert submitted(client, {"matrix": FAKE_MATRIX})["engine_env"] == "default"
    # a matrix may name its jobs' default, and a job its own
    named = {**FAKE_MATRIX, "default_engine_env": "other"}
    assert submitted(client, {"matrix": named})["engine_env"] == "other"
    assert submitted(client, {"matrix": named, "engine_env": "default"})["engine_env"] == \
        "default"
    # the embedded engine's jobs have none
    assert "engine_env" not in submitted(client, {"matrix": "smoke"})


def test_unknown_environments_and_paths_are_refused_naming_the_field(client, tmp_path):
    detail = refused(client, tmp_path, {"matrix": FAKE_MATRIX, "engine_env": "sglang-0.5.99"},
                     "engine_env", "sglang-0.5.99")
    assert detail.endswith("(known: default, other)")
    refused(client, tmp_path, {"matrix": {**FAKE_MATRIX, "default_engine_env": "nope"}},
            "matrix.default_engine_env", "'nope'", "known: default, other")
    refused(client, tmp_path, {"matrix": {**FAKE_MATRIX, "default_engine_env": "../bin"}},
            "default_engine_env")
    refused(client, tmp_path, {"matrix": FAKE_MATRIX, "engine_python": FAKE_PYTHON},
            "engine_python", "Extra inputs are not permitted")
    refused(client, tmp_path, {"matrix": FAKE_MATRIX, "engine_env": FAKE_PYTHON}, "engine_env")
    refused(client, tmp_path, {"matrix": "smoke", "engine_env": "other"}, "engine_env",
            "engine sglang")
    refused(client, tmp_path, {"matrix": {**FAKE_MATRIX, "engine": "embedded",
                                          "default_engine_env": "other"}},
            "default_engine_env", "engine: sglang")


def test_without_a_default_a_job_names_one(tmp_path):
    with make_client(tmp_path, engine_envs={"other": str(other_python(tmp_path))}) as c:
        refused(c, tmp_path, {"matrix": FAKE_MATRIX}, "EVALSVC_ENGINE_PYTHON", "engine_env",
                "known: other")
        assert submitted(c, {"matrix": FAKE_MATRIX, "engine_env": "other"})["engine_env"] == \
            "other"
        assert [e["default"] for e in c.get("/api/v1/engine-envs").json()] == [False]


def test_models_are_listed_and_named(client, tmp_path):
    models = {m["name"]: m for m in client.get("/api/v1/models").json()}
    assert set(models) == {"hybrid-gdn-tiny", "hybrid-mamba2-tiny", "qwen3-next-tiny",
                           "inkling-tiny", "mamba2-mine"}
    assert models["mamba2-mine"]["origin"] == "EVALSVC_MODELS_DIR"
    assert models["mamba2-mine"]["engine"] == "embedded"
    mine = str(tmp_path / "models" / "mamba2-mine")
    spec = submitted(client, {"matrix": "smoke", "model": "mamba2-mine"})
    assert spec["model"] == "mamba2-mine"
    # what the runs load (and what a Ray worker is sent): the directory checked here
    assert {m["path"] for m in spec["matrix"]["models"].values()} == {mine}
    spec = submitted(client, {"matrix": FAKE_MATRIX, "model": "qwen3-next-tiny"})
    assert spec["matrix"]["models"]["m"]["path"].endswith("assets/sglang-models/qwen3-next-tiny")
    spec = submitted(client, {"matrix": {**FAKE_MATRIX, "models": {"m": {"path": mine}}}})
    assert spec["matrix"]["models"]["m"]["path"] == mine


def test_a_model_outside_the_roots_is_refused_naming_the_setting(client, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    setting = f"EVALSVC_MODELS_DIR={tmp_path / 'models'}"
    refused(client, tmp_path, {"matrix": "smoke", "model": str(outside)}, "model: ", setting)
    refused(client, tmp_path, {"matrix": "smoke", "model": f"{tmp_path}/models/../elsewhere"},
            "model: ", setting)
    refused(client, tmp_path, {"matrix": {**FAKE_MATRIX, "models": {"m": {"path": str(outside)}}}},
            "matrix.models.m.path", setting)
    refused(client, tmp_path, {"matrix": "smoke", "model": "no-such-model"}, "model: ",
            "unknown model 'no-such-model'", "mamba2-mine")
    with make_client(tmp_path / "unset", engine_python=FAKE_PYTHON) as c:
        resp = c.post("/api/v1/jobs", json={"matrix": "smoke", "model": str(outside)})
        assert resp.status_code == 422 and "EVALSVC_MODELS_DIR is unset" in resp.json()["detail"]


def test_the_runs_of_a_job_use_its_named_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_PYTHON", sys.executable)
    other = other_python(tmp_path)
    with make_client(tmp_path, start_runner=True, engine_python=FAKE_PYTHON,
                     engine_envs={"other": str(other)}) as c:
        resp = c.post("/api/v1/jobs", json={"matrix": FAKE_MATRIX, "engine_env": "other"})
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["id"]
        deadline = time.monotonic() + 300
        while (job := c.get(f"/api/v1/jobs/{job_id}").json())["status"] not in (
                "done", "failed", "cancelled"):
            assert time.monotonic() < deadline, job
            time.sleep(0.5)
    assert job["status"] == "done", job
    calls = (tmp_path / "other-env" / "calls").read_text()
    assert "sglang.launch_server" in calls  # its engine started with the named python
    store = Store(f"sqlite:///{tmp_path / 'e.db'}")
    try:
        with store.session() as s:
            commands = [r.command for r in s.scalars(select(Run).where(Run.job_id == job_id))]
    finally:
        store.close()
    assert commands and all(cmd[0] == str(other) for cmd in commands), commands


def test_two_environments_of_two_releases_each_run_the_job_that_names_it(tmp_path, monkeypatch):
    """One service, the sglang-cpu environment and one built for another release (both found
    where their builders make them), a job naming each over REST: both run, each on its own."""
    monkeypatch.setenv("FAKE_SGLANG_PYTHON", sys.executable)
    pythons = fake_envs.build_envs(tmp_path / "envs", monkeypatch)
    with make_client(tmp_path, start_runner=True) as c:
        listed = {e["name"]: e for e in c.get("/api/v1/engine-envs").json()}
        assert {n: (e["python"], e["sglang"], e["default"]) for n, e in listed.items()} == {
            fake_envs.CPU_ENV: (str(pythons[fake_envs.CPU_ENV]), fake_envs.CPU_RELEASE, False),
            fake_envs.OTHER_ENV: (str(pythons[fake_envs.OTHER_ENV]), fake_envs.OTHER_RELEASE,
                                  False)}
        job_ids = {}
        for name in pythons:
            resp = c.post("/api/v1/jobs", json={"matrix": FAKE_MATRIX, "engine_env": name,
                                                "workload": {"num_prompts": 1}})
            assert resp.status_code == 201, resp.text
            job_ids[name] = resp.json()["id"]
        deadline = time.monotonic() + 300
        jobs = {}
        for name, job_id in job_ids.items():
            while (job := c.get(f"/api/v1/jobs/{job_id}").json())["status"] not in (
                    "done", "failed", "cancelled"):
                assert time.monotonic() < deadline, job
                time.sleep(0.5)
            jobs[name] = job
    releases = {fake_envs.CPU_ENV: fake_envs.CPU_RELEASE, fake_envs.OTHER_ENV: fake_envs.OTHER_RELEASE}
    for name, job in jobs.items():
        assert job["status"] == "done", job
        assert job["spec"]["engine_env"] == name
        # each run's build: the release its engine reported, the one its environment holds
        assert job["runs"] and {r["build"] for r in job["runs"]} == {
            f"sgl-project/sglang=={releases[name]}"}, job["runs"]
        # each environment's python started its own job's engines and no other's
        assert fake_envs.calls(pythons[name]).count("sglang.launch_server") == len(job["runs"])
    store = Store(f"sqlite:///{tmp_path / 'e.db'}")
    try:
        with store.session() as s:
            for name, job_id in job_ids.items():
                commands = [r.command for r in s.scalars(select(Run).where(Run.job_id == job_id))]
                assert commands and all(cmd[0] == str(pythons[name]) for cmd in commands), commands
    finally:
        store.close()


def test_a_reader_without_the_write_role_sees_no_server_path_in_the_lists(tmp_path):
    """The environments' interpreters and the models' directories are the server's paths: a read
    token sees them by their last part, the write token as they are."""
    other, models = other_python(tmp_path), models_dir(tmp_path)
    read, write = ({"Authorization": f"Bearer {t}"} for t in ("read-secret", "write-secret"))
    with make_client(tmp_path, engine_python=FAKE_PYTHON, models_dir=models,
                     engine_envs={"other": str(other)}, api_token="write-secret",
                     read_token="read-secret") as c:
        envs = {e["name"]: e for e in c.get("/api/v1/engine-envs", headers=read).json()}
        listed = {m["name"]: m for m in c.get("/api/v1/models", headers=read).json()}
        assert envs["other"]["python"] == ".../python" and envs["other"]["default"] is False
        assert listed["mamba2-mine"]["path"] == ".../mamba2-mine"
        assert listed["mamba2-mine"]["engine"] == "embedded"
        for seen in (envs, listed):
            assert str(tmp_path) not in str(seen) and str(Path(FAKE_PYTHON).parent) not in str(seen)
        assert {e["name"]: e["python"] for e in c.get("/api/v1/engine-envs", headers=write)
                .json()} == {"default": FAKE_PYTHON, "other": str(other)}
        assert {m["name"]: m["path"] for m in c.get("/api/v1/models", headers=write).json()}[
            "mamba2-mine"] == str(models / "mamba2-mine")
