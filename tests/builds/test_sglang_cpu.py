"""The checks of ``make sglang-cpu``: which CPUs can have real SGLang's CPU environment, which kernel
wheel it takes, and when a made environment is up to date. Nothing here installs anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalsvc.builds import sglang_cpu
from evalsvc.builds.sglang_cpu import MARKER, SGLangCPUError, check_host, fingerprint, read_host

# /proc/cpuinfo lines of two machines this project has run on (flags shortened to what matters)
AMD_EPYC_MILAN = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes vpclmulqdq
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse avx avx2
"""
AMD_EPYC_GENOA = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse avx avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni
"""
XEON_SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile
"""


def test_a_cpu_without_avx512_is_refused_naming_what_it_lacks():
    host = read_host(AMD_EPYC_MILAN)
    assert host.model == "AMD EPYC"
    assert host.missing() == ["avx512f", "avx512bw", "avx512vl", "avx512_bf16"]
    with pytest.raises(SGLangCPUError) as err:
        check_host(host)
    message = str(err.value)
    assert "AMD EPYC" in message and "avx512f" in message and "avx512_bf16" in message
    assert "SIGILL" in message


@pytest.mark.parametrize("cpuinfo", [XEON_SAPPHIRE_RAPIDS, AMD_EPYC_GENOA], ids=["amx", "no-amx"])
def test_a_cpu_with_avx512_bf16_passes_the_check_with_or_without_amx(cpuinfo):
    host = read_host(cpuinfo)
    assert host.missing() == []
    check_host(host)


@pytest.mark.parametrize("engine", ["1", None], ids=["engine", "other"])
def test_the_environment_reports_amx_to_sglang_in_its_engine_processes_only(tmp_path, engine):
    """The env's sitecustomize (run here by the project's own python, which has the same CPU
    torch) makes torch report AMX tiles in processes started with SGLANG_USE_CPU_ENGINE=1, and
    leaves every other process as it is."""
    (tmp_path / "sitecustomize.py").write_text(sglang_cpu.SITECUSTOMIZE)
    ask = [sys.executable, "-c", "import torch; print(torch.cpu._is_amx_tile_supported())"]
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    real = subprocess.run(ask, env=env, capture_output=True, text=True, check=True).stdout
    env["PYTHONPATH"] = str(tmp_path)
    if engine:
        env["SGLANG_USE_CPU_ENGINE"] = engine
    seen = subprocess.run(ask, env=env, capture_output=True, text=True, check=True).stdout
    assert seen.strip() == ("True" if engine else real.strip())


def test_a_missing_kernel_wheel_names_the_variable_to_set(tmp_path):
    with pytest.raises(SGLangCPUError, match=r"EVALSVC_SGLANG_CPU_KERNEL=.*nothing\.whl"):
        sglang_cpu.kernel_wheel({"EVALSVC_SGLANG_CPU_KERNEL": str(tmp_path / "nothing.whl")})
    wheel = tmp_path / "k.whl"
    wheel.write_bytes(b"kernel")
    assert sglang_cpu.kernel_wheel({"EVALSVC_SGLANG_CPU_KERNEL": str(wheel)}) == wheel


def test_the_host_is_checked_before_the_wheel_and_before_anything_is_installed(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setattr(sglang_cpu.children, "run", _must_not_run)
    with pytest.raises(SGLangCPUError, match="lacks avx512f"):
        sglang_cpu.ensure(tmp_path / "env", host=read_host(AMD_EPYC_MILAN),
                          environ={"EVALSVC_SGLANG_CPU_KERNEL": str(tmp_path / "nothing.whl")})
    assert not (tmp_path / "env").exists()


def test_an_environment_with_a_current_marker_is_returned_at_once(tmp_path, monkeypatch):
    wheel = tmp_path / "k.whl"
    wheel.write_bytes(b"kernel v1")
    dest = _made_env(tmp_path / "env", wheel)
    monkeypatch.setattr(sglang_cpu.children, "run", _must_not_run)
    t0 = time.monotonic()
    python = sglang_cpu.ensure(dest, host=read_host(XEON_SAPPHIRE_RAPIDS),
                               environ={"EVALSVC_SGLANG_CPU_KERNEL": str(wheel)})
    assert python == dest / "bin" / "python"
    assert time.monotonic() - t0 < 5


def test_another_kernel_wheel_makes_the_environment_out_of_date(tmp_path):
    wheel = tmp_path / "k.whl"
    wheel.write_bytes(b"kernel v1")
    dest = _made_env(tmp_path / "env", wheel)
    assert sglang_cpu.up_to_date(dest, wheel)
    wheel.write_bytes(b"kernel v2")
    assert not sglang_cpu.up_to_date(dest, wheel)


def test_the_command_exits_2_with_the_reason(monkeypatch, capsys):
    monkeypatch.setattr(sglang_cpu, "read_host", lambda: read_host(AMD_EPYC_MILAN))
    assert sglang_cpu.main(["--check"]) == 2
    assert "lacks avx512f" in capsys.readouterr().err


def _made_env(dest: Path, wheel: Path) -> Path:
    (dest / "bin").mkdir(parents=True)
    (dest / "bin" / "python").write_text("")
    (dest / MARKER).write_text(json.dumps({"fingerprint": fingerprint(wheel)}))
    return dest


def _must_not_run(*args, **kwargs):
    raise AssertionError(f"nothing should be run: {args}")
