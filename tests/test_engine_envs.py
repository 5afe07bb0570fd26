"""Named engine environments and models, without the service: ``EVALSVC_ENGINE_ENVS`` and
``EVALSVC_MODELS_DIR`` as the settings read them, the environments the builders made found by
their markers, what an environment holds asked of its python (and kept), which python a Ray node
takes for a job's environment, and the models a client may name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from evalsvc import model_catalog
from evalsvc.builds import engine_envs, sglang_cpu, sglang_env
from evalsvc.dispatch.ray_backend import worker_python
from evalsvc.paths import MODELS_DIR, SGLANG_MODELS_DIR
from evalsvc.settings import Settings

BASE_PYTHON = Path(sys.executable).resolve()
SITE = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"


def fake_env(root: Path, packages: dict[str, str], reference_ops: bool = False,
             kernel_avx512: bool = False) -> Path:
    """A virtualenv of this interpreter holding only the metadata of ``packages`` (name ->
    version); its python."""
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text(f"home = {BASE_PYTHON.parent}\n"
                                     "include-system-site-packages = false\n")
    python = root / "bin" / "python"
    python.symlink_to(BASE_PYTHON)
    site = root / SITE
    site.mkdir(parents=True)
    for name, version in packages.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if reference_ops:
        (site / "evalsvc_sglang_cpu_ops.py").write_text("")
    if kernel_avx512:
        (root / "kernel-avx512" / "sgl_kernel").mkdir(parents=True)
    return python


@pytest.fixture
def no_discovery(monkeypatch, tmp_path):
    """The builders' locations, empty (this machine's own environments stay out of the tests)."""
    monkeypatch.setattr(engine_envs, "SGLANG_CPU_ENV", tmp_path / "no-sglang-cpu")
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(tmp_path / "no-sglang-envs"))


# ---- settings ----------------------------------------------------------------------------------

def test_engine_envs_and_models_dir_are_read_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EVALSVC_ENGINE_ENVS", json.dumps({"gpu-0.5.23": "/opt/sglang/bin/python",
                                                          "cpu": "/opt/cpu/bin/python"}))
    monkeypatch.setenv("EVALSVC_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("EVALSVC_ENGINE_PYTHON", "")
    s = Settings()
    assert s.engine_envs == {"gpu-0.5.23": "/opt/sglang/bin/python", "cpu": "/opt/cpu/bin/python"}
    assert s.models_dir == tmp_path and s.engine_python is None
    monkeypatch.setenv("EVALSVC_ENGINE_ENVS", "")
    monkeypatch.setenv("EVALSVC_MODELS_DIR", "")
    assert Settings().engine_envs == {} and Settings().models_dir is None


@pytest.mark.parametrize(("value", "words"), [
    ("{not json", ["engine_envs", "not valid JSON"]),
    ('["/opt/x/bin/python"]', ["engine_envs"]),
    ('{"../x": "/opt/x/bin/python"}', ["engine_envs", "'../x' is not an environment name"]),
    ('{"x": ""}', ["engine_envs", "x: an empty python path"]),
])
def test_malformed_engine_envs_are_refused_naming_the_setting(monkeypatch, value, words):
    monkeypatch.setenv("EVALSVC_ENGINE_ENVS", value)
    with pytest.raises(ValidationError) as exc:
        Settings()
    for word in words:
        assert word in str(exc.value)


def test_default_is_engine_python_s_name():
    with pytest.raises(ValidationError, match="'default' is EVALSVC_ENGINE_PYTHON's name"):
        Settings(engine_python="/a/bin/python", engine_envs={"default": "/b/bin/python"})


# ---- the registry ----------------------------------------------------------------------------

def test_names_come_from_the_settings_and_what_the_builders_made(monkeypatch, tmp_path):
    cpu = tmp_path / "venv-sglang-cpu"
    fake_env(cpu, {"sglang": "0.5.17"})
    (cpu / sglang_cpu.MARKER).write_text(json.dumps({"sglang_version": "0.5.17"}))
    envs_root = tmp_path / "sglang-envs"
    fake_env(envs_root / "0.5.23", {"sglang": "0.5.23"})
    (envs_root / "0.5.23" / sglang_env.MARKER).write_text(json.dumps({"sglang_version": "0.5.23"}))
    fake_env(envs_root / "0.5.24", {"sglang": "0.5.24"})  # no marker: a build that did not finish
    (envs_root / ".build-0.5.25-x").mkdir()
    monkeypatch.setattr(engine_envs, "SGLANG_CPU_ENV", cpu)
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(envs_root))
    s = Settings(engine_python="/srv/sglang/bin/python",
                 engine_envs={"gpu": "/opt/gpu/bin/python",
                              "sglang-0.5.23": "/opt/mine/bin/python"})
    envs = engine_envs.engine_envs(s)
    assert {n: (e.python, e.origin) for n, e in envs.items()} == {
        "default": ("/srv/sglang/bin/python", "EVALSVC_ENGINE_PYTHON"),
        "gpu": ("/opt/gpu/bin/python", "EVALSVC_ENGINE_ENVS"),
        "sglang-0.5.23": ("/opt/mine/bin/python", "EVALSVC_ENGINE_ENVS"),  # the setting wins
        "sglang-cpu-0.5.17": (str(cpu / "bin" / "python"), "make sglang-cpu"),
    }
    assert engine_envs.default_name(s) == "default"
    assert engine_envs.python_of(s, None) == "/srv/sglang/bin/python"  # a job stored before names
    assert engine_envs.python_of(s, "gpu") == "/opt/gpu/bin/python"
    with pytest.raises(engine_envs.EngineEnvError) as exc:
        engine_envs.resolve(s, "sglang-0.5.99", "engine_env")
    assert str(exc.value) == ("engine_env: unknown engine environment 'sglang-0.5.99' (known: "
                              "default, gpu, sglang-0.5.23, sglang-cpu-0.5.17)")
    found = {e.name for e in engine_envs.discovered()}
    assert found == {"sglang-cpu-0.5.17", "sglang-0.5.23"}
    off = Settings(engine_envs={"gpu": "/opt/gpu/bin/python"}, discover_engine_envs=False)
    assert set(engine_envs.engine_envs(off)) == {"gpu"} and engine_envs.default_name(off) is None


def test_what_an_environment_holds_is_read_from_its_metadata_and_kept(tmp_path, no_discovery):
    cpu = fake_env(tmp_path / "cpu", {"sglang": "0.5.17", "torch": "2.13.0+cpu",
                                      "sglang-kernel-cpu": "0.4.5+avx2"},
                   reference_ops=True, kernel_avx512=True)
    gpu = fake_env(tmp_path / "gpu", {"sglang": "0.5.23", "torch": "2.9.1",
                                      "sgl-kernel": "0.3.21", "nvidia-cublas-cu12": "12.8.4.1"})
    bare = fake_env(tmp_path / "bare", {"torch": "2.13.0+cpu"})
    s = Settings(engine_envs={"cpu": str(cpu), "gpu": str(gpu), "bare": str(bare),
                              "gone": str(tmp_path / "gone" / "bin" / "python")})
    by_name = {e["name"]: e for e in engine_envs.listed(s)}
    assert {k: by_name["cpu"][k] for k in ("sglang", "torch", "kernel", "cpu_ops", "device",
                                           "problem", "default")} == {
        "sglang": "0.5.17", "torch": "2.13.0+cpu", "kernel": "sglang-kernel-cpu 0.4.5+avx2",
        "cpu_ops": ["reference", "kernel"], "device": "cpu", "problem": None, "default": False}
    assert {k: by_name["gpu"][k] for k in ("sglang", "torch", "kernel", "cpu_ops", "device")} == {
        "sglang": "0.5.23", "torch": "2.9.1", "kernel": "sgl-kernel 0.3.21", "cpu_ops": [],
        "device": "gpu"}
    assert (by_name["bare"]["sglang"], by_name["bare"]["kernel"], by_name["bare"]["device"]) == (
        None, None, "cpu")
    assert "no such file" in by_name["gone"]["problem"]
    # asked once; asked again when a package is installed
    calls = []
    ask = engine_envs._ask
    engine_envs._cache.clear()

    def counted(python):
        calls.append(python)
        return ask(python)

    engine_envs._ask = counted
    try:
        assert engine_envs.describe(str(cpu))["sglang"] == "0.5.17"
        assert engine_envs.describe(str(cpu))["sglang"] == "0.5.17"
        assert calls == [str(cpu)]
        site = tmp_path / "cpu" / SITE
        for old in site.glob("sglang-*.dist-info"):
            (old / "METADATA").unlink()
            old.rmdir()
        (site / "sglang-0.5.18.dist-info").mkdir()
        (site / "sglang-0.5.18.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.18\n")
        assert engine_envs.describe(str(cpu))["sglang"] == "0.5.18"
        assert len(calls) == 2
    finally:
        engine_envs._ask = ask


def test_a_ray_node_runs_a_named_environment_as_it_knows_it(no_discovery):
    node = Settings(engine_python="/node/default/bin/python",
                    engine_envs={"gpu-0.5.23": "/node/gpu/bin/python"})
    # the default: the node's own EVALSVC_ENGINE_PYTHON, else the service's
    assert worker_python("/svc/bin/python", node) == "/node/default/bin/python"
    assert worker_python("/svc/bin/python", node, "default") == "/node/default/bin/python"
    assert worker_python("/svc/bin/python", Settings(), "default") == "/svc/bin/python"
    # a name: the node's environment of that name, else the service's python for it
    assert worker_python("/svc/gpu/bin/python", node, "gpu-0.5.23") == "/node/gpu/bin/python"
    assert worker_python("/svc/other/bin/python", node, "other") == "/svc/other/bin/python"


# ---- models ------------------------------------------------------------------------------------

def model_dir(root: Path, name: str, model_type: str = "qwen3_next") -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"],
                                               "model_type": model_type}))
    return d


def test_models_are_the_shipped_ones_and_those_of_the_models_dir(tmp_path):
    models = tmp_path / "models"
    mine = model_dir(models, "qwen3-next-mine")
    model_dir(models, "hybrid-mamba2-tiny")  # a shipped model's name: the shipped one wins
    (models / "not-a-model").mkdir()
    s = Settings(models_dir=models)
    listed = {m["name"]: m for m in model_catalog.listed(s)}
    assert set(listed) == {"hybrid-gdn-tiny", "hybrid-mamba2-tiny", "qwen3-next-tiny",
                           "inkling-tiny", "qwen3-next-mine"}
    assert listed["inkling-tiny"]["engine"] == "sglang"
    assert listed["hybrid-mamba2-tiny"]["origin"] == "shipped"
    assert listed["hybrid-mamba2-tiny"]["engine"] == "embedded"
    assert listed["qwen3-next-mine"] == {
        "name": "qwen3-next-mine", "origin": "EVALSVC_MODELS_DIR", "path": str(mine),
        "engine": "sglang", "architecture": "Qwen3NextForCausalLM", "model_type": "qwen3_next"}
    resolve = model_catalog.resolve_model
    assert resolve("qwen3-next-mine", "sglang", s, "model") == str(mine)
    assert resolve(str(mine) + "/", "sglang", s, "model") == str(mine)
    assert resolve("qwen3-next-tiny", "sglang", s, "model") == str(
        SGLANG_MODELS_DIR / "qwen3-next-tiny")
    assert resolve("hybrid-mamba2-tiny", "embedded", s, "model") == "hybrid-mamba2-tiny"
    assert resolve("hybrid-mamba2-tiny", "sglang", s, "model") == str(
        MODELS_DIR / "hybrid-mamba2-tiny")
    assert resolve("Qwen/Qwen3-Next-80B-A3B-Instruct", "sglang", s, "model") == \
        "Qwen/Qwen3-Next-80B-A3B-Instruct"  # a hub id: SGLang downloads it


def test_a_model_directory_outside_the_roots_is_refused_naming_the_setting(tmp_path):
    models = tmp_path / "models"
    model_dir(models, "ok")
    elsewhere = model_dir(tmp_path / "elsewhere", "secret")
    s = Settings(models_dir=models)
    for value in (str(elsewhere), f"{models}/../elsewhere/secret", "~/../../etc"):
        with pytest.raises(model_catalog.ModelError) as exc:
            model_catalog.resolve_model(value, "sglang", s, "model")
        assert str(exc.value).startswith("model: ") and f"EVALSVC_MODELS_DIR={models}" in str(
            exc.value)
    with pytest.raises(model_catalog.ModelError, match="EVALSVC_MODELS_DIR is unset"):
        model_catalog.resolve_model(str(elsewhere), "sglang", Settings(), "model")
    with pytest.raises(model_catalog.ModelError, match=r"no config\.json"):
        model_catalog.resolve_model(str(models / "nope"), "sglang", s, "model")
    with pytest.raises(model_catalog.ModelError, match=r"unknown model 'nope'.*known: "):
        model_catalog.resolve_model("nope", "embedded", s, "model")
