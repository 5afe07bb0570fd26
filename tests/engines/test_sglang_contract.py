"""What evalsvc sends to SGLang is what SGLang accepts: checked against SGLang's own code.

For each release (the newest, and 0.5.13 from before ``--mamba-radix-cache-strategy``), a cached
env (``evalsvc.builds.sglang_env``) holds that release from PyPI on CPU torch, and one run of
``tests/engines/sglang_check.py`` under its python parses and resolves every command line the
``mamba-full`` matrix builds (on a tiny local Qwen3-Next config) and validates the request payloads
evalsvc sends. The control plane never imports sglang.

The first run builds the envs (under a minute each, about 2.3 GB, see ``sglang_env``); later runs reuse
them, and the checker's result while nothing it follows from changed (``check_key``). With ``CI``
set an env that cannot be built fails the tests; elsewhere, when the package index cannot be
reached, they are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from evalsvc.builds import sglang_env
from evalsvc.engines.sglang_server import (
    build_command,
    build_generate_payload,
    build_reference_payload,
    parse_tree_core,
    resolved_mismatches,
)
from evalsvc.matrix import AXES, Config, MatrixFile, expand, iter_points, load_matrix, make_config

VERSIONS = ["0.5.23", "0.5.13"]
MATRIX = "mamba-full"
CHECKER = Path(__file__).resolve().parent / "sglang_check.py"
MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "sglang" / "models" / "qwen3-next-tiny"
PORT = 30000

pytestmark = [pytest.mark.sglang_contract, pytest.mark.timeout(3600)]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def excluded_configs(matrix: MatrixFile, version: str) -> dict[str, tuple[Config, list[dict]]]:
    """The points of the axes and the include entries that this release's exclude entries drop:
    name -> (config, the exclude entries that drop it)."""
    kept = {cfg.name for cfg in expand(matrix, sglang_version=version)}
    out: dict[str, tuple[Config, list[dict]]] = {}
    for point, entries in iter_points(matrix, sglang_version=version):
        assert set(point) <= set(AXES), f"unknown axes {set(point) - set(AXES)}"
        cfg = make_config(matrix, point)
        if entries and cfg.name not in kept:
            out.setdefault(cfg.name, (cfg, entries))
    return out


def by_environment(entries: list[dict]) -> bool:
    """Exclude entries about the engine's environment (the radix-tree core), which no command
    line shows: checked against the release's tree-core registry instead."""
    return any("radix_tree_core" in e for e in entries)


def payloads() -> dict[str, dict[str, Any]]:
    generate = {"max_new_tokens": 8, "temperature": 1.0, "seed": 1}
    return {
        "generate": build_generate_payload([1, 2, 3], **generate),
        "generate-top5": build_generate_payload([1, 2, 3], **generate, top_logprobs_num=5),
        "generate-logprob-start0": build_generate_payload([1, 2, 3], **generate,
                                                          logprob_start_len=0),
        "reference": build_reference_payload([1, 2, 3], [4, 5]),
        "reference-top5": build_reference_payload([1, 2, 3], [4, 5], top_logprobs_num=5),
    }


BAD_PAYLOADS = {"bad-no-input": {"sampling_params": {"max_new_tokens": 8}, "return_logprob": True}}
CONTROL = "control-other-release-spelling"


def other_release(version: str) -> str:
    return next(v for v in VERSIONS if v != version)


# One pytest-xdist worker per release: the one that builds its env runs its tests, and the
# other worker goes on with other tests instead of waiting on the env's lock.
def release_python(version: str) -> Path:
    """The python of the cached env of one SGLang release (skipped here when the package index
    cannot be reached and CI is not set; failed otherwise)."""
    try:
        return sglang_env.ensure_sglang_env(version)
    except sglang_env.SGLangEnvError as exc:
        if exc.offline and not in_ci():
            pytest.skip(f"sglang {version} env cannot be built here (package index unreachable or "
                        f"without the release; CI is not set): {str(exc).splitlines()[0]}")
        pytest.fail(str(exc), pytrace=False)


def check_key(python: Path, job: dict[str, Any]) -> str:
    """Everything a checker run's result follows from: the checker's source, the job, the
    release's env (its marker: recipe fingerprint, installed packages, build time), the model
    files the job names, and the machine (SGLang derives defaults from its memory and CPUs)."""
    h = hashlib.sha256(CHECKER.read_bytes())
    h.update(json.dumps(job, sort_keys=True).encode())
    h.update((python.parent.parent / sglang_env.MARKER).read_bytes())
    for path in sorted(Path(job["model_path"]).rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(job["model_path"])).encode() + path.read_bytes())
    h.update(json.dumps([platform.machine(), platform.processor(), os.cpu_count(),
                         os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]).encode())
    return h.hexdigest()[:32]


def run_checker(python: Path, version: str, job: dict[str, Any]) -> dict[str, Any]:
    """``tests/engines/sglang_check.py`` under the release's python, on one job; its result is
    kept beside the envs under the hash of everything it follows from (``check_key``), and read
    back while that is unchanged (``EVALSVC_SGLANG_CHECK_CACHE=0``: run it every time)."""
    cache = sglang_env.env_root() / ".checks" / f"{version}-{check_key(python, job)}.json"
    use_cache = os.environ.get("EVALSVC_SGLANG_CHECK_CACHE", "1") != "0"
    if use_cache and cache.is_file():
        with contextlib.suppress(ValueError):
            return json.loads(cache.read_text())
    result = _run_checker(python, version, job)
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(cache)  # whole or not at all
    return result


def _run_checker(python: Path, version: str, job: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        done = subprocess.run([str(python), str(CHECKER)], input=json.dumps(job),
                              capture_output=True, text=True, timeout=1800, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"sglang {version} checker timed out: {str(exc.stderr)[-4000:]}", pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"sglang {version} checker exited {done.returncode}:\n{done.stderr[-6000:]}",
                    pytrace=False)
    try:
        return json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"sglang {version} checker printed no JSON:\n{done.stdout[-2000:]}\n"
                    f"{done.stderr[-4000:]}", pytrace=False)


@pytest.fixture(scope="session", params=[pytest.param(v, marks=pytest.mark.xdist_group(f"sglang-{v}"))
                                         for v in VERSIONS])
def version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def matrix() -> MatrixFile:
    return load_matrix(MATRIX)


@pytest.fixture(scope="session")
def contract(version: str) -> dict[str, Any]:
    return release_contract(version)


@functools.cache
def release_contract(version: str) -> dict[str, Any]:
    """One checker run for this release: every matrix and excluded command, every payload."""
    matrix = load_matrix(MATRIX)
    python = release_python(version)
    configs = {cfg.name: cfg for cfg in expand(matrix, sglang_version=version)}
    excluded = excluded_configs(matrix, version)
    # A control: the first config spelled for the other release must not get through the parser.
    control = build_command(next(iter(configs.values())).args, port=PORT, python="python",
                            version=other_release(version))
    job = {
        "model_path": str(MODEL_DIR), "device": "cpu", "timeout_s": 300,
        "vocab_size": json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"],
        "commands": [{"id": name, "argv": build_command(cfg.args, port=PORT, python="python",
                                                        version=version)}
                     for name, cfg in {**configs, **{n: c for n, (c, _) in excluded.items()}}.items()]
                    + [{"id": CONTROL, "argv": control}],
        "tree_core": True,
        "payloads": [{"id": k, "payload": v} for k, v in {**payloads(), **BAD_PAYLOADS}.items()],
    }
    result = run_checker(python, version, job)
    result["configs"] = configs
    result["excluded"] = excluded
    result["by_command"] = {c["id"]: c for c in result["commands"]}
    result["by_payload"] = {p["id"]: p for p in result["payloads"]}
    return result


def describe(error: dict[str, Any] | None) -> str:
    if not error:
        return ""
    where = f" at {error['where']}" if error.get("where") else ""
    return f"{error['type']} ({error['stage']}{where}): {error['message']}"


def test_checker_ran_the_release(version: str, contract: dict[str, Any]) -> None:
    assert contract["sglang_version"] == version
    applied = {p["target"] for p in contract["patches"] if p["applied"]}
    assert applied, "none of the CPU-host patches found its target in this release"
    assert len(contract["commands"]) == len(contract["configs"]) + len(contract["excluded"]) + 1


def test_other_release_spelling_refused_by_the_parser(version: str, contract: dict[str, Any]) -> None:
    """The strategy flag was renamed between the two releases: the parser really is the release's."""
    res = contract["by_command"][CONTROL]
    other_flag = {"0.5.23": "--mamba-scheduler-strategy", "0.5.13": "--mamba-radix-cache-strategy"}
    assert not res["accepted"], f"sglang {version} accepts {other_release(version)}'s spelling"
    assert res["error"]["stage"] == "parse" and res["error"]["exit_code"] == 2, describe(res["error"])
    assert other_flag[version] in res["error"]["message"]


def test_matrix_commands_accepted_as_asked(version: str, contract: dict[str, Any]) -> None:
    """Every config the matrix runs on this release is accepted, and resolves to what it asked."""
    assert contract["configs"], f"the {MATRIX} matrix has no configs for {version}"
    problems = []
    for name, cfg in contract["configs"].items():
        res = contract["by_command"][name]
        if not res["accepted"]:
            problems.append(f"{name}: refused by sglang {version}: {describe(res['error'])}\n"
                            f"    argv: {' '.join(res['argv'])}")
            continue
        mismatches = resolved_mismatches(cfg.args, res["resolved_all"])
        if mismatches:
            problems.append(f"{name}: sglang {version} runs something else: {'; '.join(mismatches)}"
                            f"\n    warnings: {res['warnings']}")
    assert not problems, "\n".join(problems)


def test_excluded_configs_refused_or_changed(version: str, contract: dict[str, Any],
                                             record_property: Any) -> None:
    """What the matrix leaves out for this release, the release refuses (with the exclude entry's
    reason in its message) or would run differently."""
    report = {}
    wrongly_excluded = []
    wrong_reason = []
    registered = contract["tree_core"]["registered"]
    for name, (cfg, entries) in contract["excluded"].items():
        if by_environment(entries):
            asked = cfg.settings["radix_tree_core"]
            report[name] = (f"{asked!r} not among the registered tree cores {registered}"
                            if asked not in registered else "registered")
            if asked in registered:
                wrongly_excluded.append(name)
            continue
        res = contract["by_command"][name]
        if not res["accepted"]:
            report[name] = f"refused: {describe(res['error'])}"
            if not any(e.get("reason") and e["reason"] in res["error"]["message"]
                       for e in entries):
                wrong_reason.append(f"{name}: refused with {res['error']['message']!r}, not "
                                    f"{[e.get('reason') for e in entries]}")
            continue
        mismatches = resolved_mismatches(cfg.args, res["resolved_all"])
        if mismatches:
            report[name] = f"resolves to something else: {'; '.join(mismatches)}"
        else:
            wrongly_excluded.append(name)
            report[name] = "accepted as asked"
    record_property(f"excluded-{version}", report)
    print(f"\nsglang {version}, configs the {MATRIX} matrix excludes:")
    for name, what in report.items():
        print(f"  {name}: {what}")
    assert not wrongly_excluded, (f"sglang {version} accepts and runs as asked these excluded "
                                  f"configs: {wrongly_excluded}")
    assert not wrong_reason, "exclude reasons that are not SGLang's refusal:\n" + "\n".join(
        wrong_reason)


def test_every_exclude_names_sglangs_refusal(matrix: MatrixFile) -> None:
    """Each exclude entry's reason is SGLang's own words where some release drops one of its
    configs: the message of a refusal, or the warning of a release that changes what was asked
    (a newer one may refuse it); entries about the radix-tree core are the registry's."""
    missing = [e for e in matrix.exclude if not e.get("reason")]
    assert not missing, f"exclude entries of {MATRIX} without a reason: {missing}"
    said: dict[str, list[str]] = {}
    for version in VERSIONS:
        contract = release_contract(version)
        for name, (_, entries) in contract["excluded"].items():
            res = contract["by_command"][name]
            words = [res["error"]["message"]] if res["error"] else res["warnings"]
            for e in entries:
                if by_environment([e]) or any(e["reason"] in w for w in words):
                    said.setdefault(json.dumps(e, sort_keys=True), []).append(f"{version}: {name}")
    unsaid = [e for e in matrix.exclude if json.dumps(e, sort_keys=True) not in said]
    assert not unsaid, f"exclude entries whose reason no release says: {unsaid}"


def test_tree_cores_of_the_release(version: str, contract: dict[str, Any]) -> None:
    """0.5.23 registers both cores, defaults to Rust, imports its Rust core on this CPU, and falls
    back with the line ``parse_tree_core`` reads; 0.5.13 has no tree-core registry."""
    tree = contract["tree_core"]
    if version == "0.5.13":
        assert tree["registered"] == [] and tree["fallback_line"] is None
        return
    assert tree["registered"] == ["python", "rust"] and tree["default"] == "rust"
    assert tree["rust_imports"], tree["rust_error"]
    assert tree["fallback_core"] == "python"
    assert parse_tree_core(tree["fallback_line"], asked="rust", version=version) == {
        "radix_tree_core": "python",
        "radix_tree_core_fallback": "session-aware caching requires the Python TreeCore"}


@pytest.mark.parametrize("payload_id", sorted(payloads()))
def test_payload_accepted(version: str, contract: dict[str, Any], payload_id: str) -> None:
    res = contract["by_payload"][payload_id]
    assert res["accepted"], f"sglang {version} refuses {payload_id}: {describe(res['error'])}"


@pytest.mark.parametrize("payload_id", sorted(BAD_PAYLOADS))
def test_bad_payload_refused(version: str, contract: dict[str, Any], payload_id: str) -> None:
    res = contract["by_payload"][payload_id]
    assert not res["accepted"], f"sglang {version} accepts {payload_id}: {res['normalized']}"
    assert "input_ids" in res["error"]["message"] or "text" in res["error"]["message"]


# ---- the env builder, without network ----------------------------------------------------------

def test_sglang_pins_read_from_the_wheel(tmp_path: Path) -> None:
    dist = tmp_path / "sglang-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("\n".join([
        "Metadata-Version: 2.1", "Name: sglang", "Version: 9.9.9",
        "Requires-Dist: transformers==5.19.0", "Requires-Dist: numpy",
        "Requires-Dist: torch==2.14.1", "Requires-Dist: torchvision",
        "Requires-Dist: flashinfer_python[cu13]==0.7.2", "Requires-Dist: python-dateutil<3",
        'Requires-Dist: av==16.1.0; platform_machine == "armv7l"',
        'Requires-Dist: pytest==1.0; extra == "test"', ""]))
    assert sglang_env.sglang_pins(tmp_path, "9.9.9") == [
        "flashinfer-python==0.7.2", "python-dateutil<3", "transformers==5.19.0"]


def test_env_reused_without_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(tmp_path))
    env = tmp_path / "9.9.9"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    (env / sglang_env.MARKER).write_text(json.dumps(
        {"sglang_version": "9.9.9", "fingerprint": sglang_env.fingerprint("9.9.9")}))

    def no_build(*_args: Any) -> None:
        raise AssertionError("rebuilt a usable env")

    monkeypatch.setattr(sglang_env, "_build", no_build)
    assert sglang_env.ensure_sglang_env("9.9.9") == env / "bin" / "python"


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(tmp_path))

    def failing_install(version: str, tmp: Path) -> list[dict[str, Any]]:
        (tmp / "half-installed").write_text("x")
        raise sglang_env.SGLangEnvError(version, "install dependencies", "exit code 1",
                                        "ERROR: Could not find a version that satisfies the "
                                        "requirement torch==2.13.0 (from versions: none)")

    monkeypatch.setattr(sglang_env, "_install", failing_install)
    expected = re.escape("sglang 9.9.9 env: step 'install dependencies' failed")
    with pytest.raises(sglang_env.SGLangEnvError, match=expected) as caught:
        sglang_env.ensure_sglang_env("9.9.9")
    assert caught.value.offline
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_version_must_be_a_release() -> None:
    with pytest.raises(sglang_env.SGLangEnvError, match="check version"):
        sglang_env.ensure_sglang_env("latest")


def test_checker_result_read_back_while_nothing_changed(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(tmp_path / "envs"))
    env = tmp_path / "envs" / "9.9.9"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    runs = tmp_path / "runs"
    python.write_text(f'#!/bin/sh\necho run >> {runs}\necho \'{{"sglang_version": "9.9.9"}}\'\n')
    python.chmod(0o755)
    (env / sglang_env.MARKER).write_text('{"fingerprint": "a"}')
    job = {"model_path": str(MODEL_DIR), "commands": [{"id": "x", "argv": ["--port", "1"]}]}
    assert run_checker(python, "9.9.9", job) == {"sglang_version": "9.9.9"}
    assert run_checker(python, "9.9.9", job) == {"sglang_version": "9.9.9"}
    assert runs.read_text().count("run") == 1
    run_checker(python, "9.9.9", {**job, "commands": []})  # another job
    (env / sglang_env.MARKER).write_text('{"fingerprint": "b"}')  # the env rebuilt
    run_checker(python, "9.9.9", job)
    monkeypatch.setenv("EVALSVC_SGLANG_CHECK_CACHE", "0")
    run_checker(python, "9.9.9", job)
    assert runs.read_text().count("run") == 4
