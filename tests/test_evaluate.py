"""Matrix evaluation: the CLI's dry run, a separate reference server, the engine environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from evalsvc.engines.base import EngineSpec
from evalsvc.engines.launch import clean_env
from evalsvc.evaluate import evaluate, prepare, summary_rows
from evalsvc.matrix import load_matrix
from evalsvc.paths import SGLANG_MODELS_DIR


def evalsvc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evalsvc.cli", *args], capture_output=True,
                          text=True, timeout=120)


TREE_CORE = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


def without_env(argv: list[str]) -> list[str]:
    """A dry run's line less its ``env VAR=VALUE`` prefix."""
    if argv[0] != "env":
        return argv
    return argv[1 + next(i for i, a in enumerate(argv[1:]) if "=" not in a):]


def test_dry_run_prints_each_sglang_command_for_the_release():
    new = evalsvc("run", "mamba-full", "--dry-run", "--engine-python", "/opt/sglang/bin/python")
    old = evalsvc("run", "mamba-full", "--dry-run", "--sglang-version", "0.5.13")
    assert new.returncode == 0 and old.returncode == 0, new.stderr + old.stderr
    new_env = [json.loads(x) for x in new.stdout.splitlines()]
    old_env = [json.loads(x) for x in old.stdout.splitlines()]
    assert len(new_env) == 57 and len(old_env) == 23
    # each radix-tree core on the newest release; the Python one only before 0.5.19; the include
    # entries on the release's default core
    assert {argv[1] for argv in new_env if argv[0] == "env"} == {f"{TREE_CORE}=python",
                                                                 f"{TREE_CORE}=rust"}
    assert {argv[1] for argv in old_env if argv[0] == "env"} == {f"{TREE_CORE}=python"}
    assert sum(argv[0] != "env" for argv in new_env) == 9
    new_lines, old_lines = map(without_env, new_env), map(without_env, old_env)
    new_lines, old_lines = list(new_lines), list(old_lines)
    assert all(argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
               for argv in new_lines)
    assert all("--mamba-radix-cache-strategy" in argv for argv in new_lines)
    assert all("--mamba-scheduler-strategy" in argv and "--mamba-radix-cache-strategy" not in argv
               for argv in old_lines)
    assert all(argv[argv.index("--tp-size") + 1] == "4" for argv in new_lines)


def python_with_release(tmp_path: Path, version: str) -> Path:
    """A python whose site holds SGLang ``version``'s metadata (and no SGLang): what the dry run
    reads to spell that release's flags."""
    site = tmp_path / "site" / f"sglang-{version}.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site.parent} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def test_dry_run_spells_the_release_installed_in_the_engine_python(tmp_path):
    python = python_with_release(tmp_path, "0.5.13")
    out = evalsvc("run", "mamba-full", "--dry-run", "--engine-python", str(python))
    assert out.returncode == 0, out.stderr
    lines = [without_env(json.loads(x)) for x in out.stdout.splitlines()]
    assert len(lines) == 23 and all(argv[0] == str(python) for argv in lines)
    assert all("--mamba-scheduler-strategy" in argv and "--mamba-radix-cache-strategy" not in argv
               for argv in lines)


def test_engine_env_names_the_sglang_environment_and_model_names_a_model(tmp_path):
    """``--engine-env NAME`` beside ``--engine-python``: the environment of that name
    (EVALSVC_ENGINE_ENVS), the release installed there spelled; ``--model NAME`` a shipped model's
    directory; an unknown name exits 2 listing the known ones."""
    python = python_with_release(tmp_path, "0.5.13")
    env = {**os.environ, "EVALSVC_ENGINE_ENVS": json.dumps({"old": str(python)}),
           "EVALSVC_DISCOVER_ENGINE_ENVS": "false", "EVALSVC_DATA_DIR": str(tmp_path / "data")}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "evalsvc.cli", "run", *args],
                              capture_output=True, text=True, timeout=120, env=env)

    out = run("mamba-full", "--dry-run", "--engine-env", "old", "--model", "qwen3-next-tiny")
    assert out.returncode == 0, out.stderr
    lines = [without_env(json.loads(x)) for x in out.stdout.splitlines()]
    assert len(lines) == 23 and all(argv[0] == str(python) for argv in lines)
    assert all(argv[argv.index("--model-path") + 1] == str(SGLANG_MODELS_DIR / "qwen3-next-tiny")
               for argv in lines)
    out = run("mamba-full", "--dry-run", "--engine-env", "new")
    assert out.returncode == 2 and "--engine-env: unknown engine environment 'new' (known: old)" \
        in " ".join(out.stdout.split()), out.stdout + out.stderr
    out = run("smoke", "--dry-run", "--engine-env", "old")
    assert out.returncode == 2 and "--engine-env needs --engine sglang" in out.stdout


def test_dry_run_shows_the_engine_environment_of_each_config(tmp_path):
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump({
        "name": "core", "engine": "sglang", "models": {"m": {"path": "Qwen/Qwen3-Next"}},
        "axes": {"strategy": ["extra_buffer"], "radix_tree_core": [None, "python", "rust"]},
        "engine_env": {"SGLANG_USE_CPU_ENGINE": "1"}}))
    out = evalsvc("run", str(path), "--dry-run", "--engine-python", "/opt/sglang/bin/python",
                  "--sglang-version", "0.5.23")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [argv[:3] for argv in lines] == [
        ["env", "SGLANG_USE_CPU_ENGINE=1", "/opt/sglang/bin/python"],
        ["env", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python", "SGLANG_USE_CPU_ENGINE=1"],
        ["env", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust", "SGLANG_USE_CPU_ENGINE=1"]]
    assert all(argv[argv.index("/opt/sglang/bin/python") + 1:][:2] == ["-m", "sglang.launch_server"]
               for argv in lines)


def test_engine_environment_drops_simulated_acceptance(monkeypatch):
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "3")
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_METHOD", "match-expected")
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "1")
    env = clean_env({"EXTRA": "1"})
    assert "SGLANG_SIMULATE_ACC_LEN" not in env and "SGLANG_SIMULATE_ACC_METHOD" not in env
    assert env["SGLANG_ENABLE_SPEC_V2"] == "1" and env["EXTRA"] == "1"


@pytest.mark.slow
def test_reference_config_on_its_own_server(tmp_path):
    path = tmp_path / "ref.yaml"
    path.write_text(yaml.safe_dump({
        "name": "ref", "engine": "embedded",
        "models": {"mamba2": {"path": "hybrid-mamba2-tiny"}},
        "include": [{"model": "mamba2", "strategy": "extra_buffer", "overlap": True,
                     "chunked_prefill": 64}],
        "scenarios": ["cold", "prefill_hit"],
        "reference": {"kind": "config", "config": {"radix_cache": False, "overlap": False}},
        "extra_args": {"random_seed": 0},
        "workload": {"num_prompts": 3, "max_new_tokens": 8},
        "thresholds": {"kl_k3_mean": 1e-8}}))
    matrix = load_matrix(path)
    spec = EngineSpec()
    configs, prompts = prepare(matrix, spec)
    results = evaluate(matrix, configs, prompts, spec, tmp_path / "out")
    rows = summary_rows(results)
    assert [r["verdict"] for r in rows] == ["pass", "pass"], rows
    ref = results[0].reference
    assert ref["kind"] == "config" and ref["config"] == "mamba2-noradix-sync"
    assert "--disable-radix-cache" in ref["command"]
    assert (tmp_path / "out" / "logs" / "reference-mamba2.log").is_file()
    runs = json.loads((tmp_path / "out" / "runs.json").read_text())
    assert runs[0]["reference"]["config"] == "mamba2-noradix-sync"
    samples = pd.read_parquet(tmp_path / "out" / "samples.parquet")
    assert len(samples) == 6 and (samples.kl_k3_mean < 1e-8).all()
    assert samples[samples.scenario == "prefill_hit"].cached_tokens.gt(0).all()


@pytest.mark.slow
def test_a_server_that_resolves_differently_is_invalid(tmp_path):
    # MTP on the embedded (CPU) engine turns the overlap scheduler off, as SGLang does on CPU
    path = tmp_path / "inv.yaml"
    path.write_text(yaml.safe_dump({
        "name": "inv", "models": {"mamba2": {"path": "hybrid-mamba2-tiny"}},
        "include": [{"model": "mamba2", "strategy": "extra_buffer", "overlap": True, "mtp": True}],
        "scenarios": ["cold"], "workload": {"num_prompts": 2, "max_new_tokens": 4}}))
    matrix = load_matrix(path)
    configs, prompts = prepare(matrix, EngineSpec())
    [result] = evaluate(matrix, configs, prompts, EngineSpec(), tmp_path / "out")
    assert result.verdict == "invalid"
    assert "overlap" in result.reason and not result.scenarios
    assert result.resolved_args["disable_overlap_schedule"] is True
