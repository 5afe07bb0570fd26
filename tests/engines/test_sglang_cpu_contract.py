"""The CPU matrix (``evalsvc/configs/sglang-cpu.yaml``) against SGLang 0.5.17's own rules for
``--device cpu``.

The checker runs here without its GPU-host patches, so SGLang resolves every command as it would on
this CPU: each config the matrix runs must be accepted and resolve to what it asked, and each
combination it leaves out for an argument-level reason must be refused by SGLang itself, with that
reason. (HiCache and NEXTN are left out because they crash at start on CPU, which no argument check
sees; the matrix says so in its comments.) Serving the configs needs SGLang's CPU kernel, which
needs AVX-512 with BF16 (``make sglang-cpu``; ``test_sglang_cpu_server.py`` serves one).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from evalsvc.engines.base import EngineSpec
from evalsvc.engines.sglang_server import build_command, resolved_mismatches
from evalsvc.matrix import expand, load_matrix
from tests.engines.test_sglang_contract import (
    MODEL_DIR,
    PORT,
    describe,
    excluded_configs,
    release_python,
    run_checker,
)

VERSION = "0.5.17"
# what SGLang says, in its own words, for each combination the matrix leaves out
REFUSALS = {"eb": "extra_buffer", "nb-ov": "overlap"}

pytestmark = [pytest.mark.sglang_contract, pytest.mark.timeout(3600),
              pytest.mark.xdist_group(f"sglang-{VERSION}")]


@pytest.fixture(scope="module")
def cpu_contract() -> dict[str, Any]:
    matrix = load_matrix("sglang-cpu")
    configs = {c.name: c for c in expand(matrix, sglang_version=VERSION)}
    excluded = {name: c for name, (c, _) in excluded_configs(matrix, VERSION).items()}
    job = {"model_path": str(MODEL_DIR), "device": "cpu", "timeout_s": 300, "host_patches": False,
           "vocab_size": json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"],
           "commands": [{"id": name, "argv": build_command(c.args, port=PORT, python="python",
                                                           version=VERSION)}
                        for name, c in {**configs, **excluded}.items()]}
    result = run_checker(release_python(VERSION), VERSION, job)
    result["configs"], result["excluded"] = configs, excluded
    result["by_command"] = {c["id"]: c for c in result["commands"]}
    return result


def test_the_checker_left_sglang_as_it_is(cpu_contract: dict[str, Any]) -> None:
    assert cpu_contract["sglang_version"] == VERSION
    assert cpu_contract["patches"] == []


def test_every_config_is_accepted_on_cpu_as_asked(cpu_contract: dict[str, Any]) -> None:
    assert len(cpu_contract["configs"]) == 6
    problems = []
    for name, cfg in cpu_contract["configs"].items():
        res = cpu_contract["by_command"][name]
        if not res["accepted"]:
            problems.append(f"{name}: refused: {describe(res['error'])}")
        elif mismatches := resolved_mismatches(cfg.args, res["resolved_all"]):
            problems.append(f"{name}: runs something else: {'; '.join(mismatches)}")
        elif res["resolved_all"].get("device") != "cpu":
            problems.append(f"{name}: device {res['resolved_all'].get('device')!r}")
    assert not problems, "\n".join(problems)


def test_what_the_matrix_leaves_out_sglang_refuses_on_cpu_for_the_reason_given(
        cpu_contract: dict[str, Any]) -> None:
    seen = set()
    for name in cpu_contract["excluded"]:
        res = cpu_contract["by_command"][name]
        assert not res["accepted"], f"sglang {VERSION} accepts {name} on cpu"
        kind = "eb" if "-eb-" in name else "nb-ov"
        assert REFUSALS[kind] in res["error"]["message"], (name, describe(res["error"]))
        seen.add(kind)
    assert seen == set(REFUSALS)


def test_the_engines_get_sglangs_cpu_switch_from_the_matrix() -> None:
    matrix = load_matrix("sglang-cpu")
    spec = EngineSpec(kind="sglang", env={"PYTHONPATH": "/builds/x/site"})
    assert spec.with_env(matrix.engine_env).env == {"SGLANG_USE_CPU_ENGINE": "1",
                                                    "EVALSVC_CPU_OPS": "reference",
                                                    "PYTHONPATH": "/builds/x/site"}
    assert all(c.args["device"] == "cpu" for c in expand(matrix))
    # the reference ops by default, with torch attention; the kernel path on request, with
    # SGLang's own default backend; the choice is part of every config's fingerprint
    assert all(c.args["attention_backend"] == "torch_native" for c in expand(matrix))
    kernel = matrix.with_cpu_ops("kernel")
    assert kernel.engine_env["EVALSVC_CPU_OPS"] == "kernel"
    assert all("attention_backend" not in c.args for c in expand(kernel))
    assert not {c.fingerprint for c in expand(matrix)} & {c.fingerprint for c in expand(kernel)}
