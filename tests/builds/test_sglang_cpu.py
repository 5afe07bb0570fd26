"""The checks of ``make sglang-cpu``: which CPUs can take the kernel path (every one takes the
reference ops), which kernel wheels the environment takes, and when a made environment is up to
date. Nothing here installs anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evalsvc.builds import sglang_cpu
from evalsvc.builds.sglang_cpu import MARKER, SGLangCPUError, Wheels, check_host, fingerprint, read_host
from evalsvc.engines import sglang_cpu_ops

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


def test_a_cpu_without_avx512_is_refused_the_kernel_path_naming_what_it_lacks():
    host = read_host(AMD_EPYC_MILAN)
    assert host.model == "AMD EPYC"
    assert host.missing() == ["avx512f", "avx512bw", "avx512vl", "avx512_bf16"]
    with pytest.raises(SGLangCPUError) as err:
        check_host(host)
    message = str(err.value)
    assert "AMD EPYC" in message and "avx512f" in message and "avx512_bf16" in message
    assert "SIGILL" in message and "cpu_ops: reference" in message


@pytest.mark.parametrize("cpuinfo", [XEON_SAPPHIRE_RAPIDS, AMD_EPYC_GENOA], ids=["amx", "no-amx"])
def test_a_cpu_with_avx512_bf16_passes_the_check_with_or_without_amx(cpuinfo):
    host = read_host(cpuinfo)
    assert host.missing() == []
    check_host(host)


def test_an_engine_asking_for_the_kernel_on_a_cpu_without_avx512_exits_naming_it(tmp_path):
    """The engine-side check (in the environment's copy of the reference-ops module) refuses the
    kernel path before ``import sgl_kernel`` could die with SIGILL; the same names as the build's."""
    assert sglang_cpu_ops.KERNEL_FEATURES == sglang_cpu.CPU_FEATURES
    (tmp_path / "sgl_kernel").mkdir()
    with pytest.raises(SystemExit, match=r"lacks avx512f, avx512bw, avx512vl, avx512_bf16.*"
                                         r"EVALSVC_CPU_OPS=reference"):
        sglang_cpu_ops.use_kernel(str(tmp_path), cpuinfo=AMD_EPYC_MILAN)
    with pytest.raises(SystemExit, match="no AVX-512 kernel build"):
        sglang_cpu_ops.use_kernel(str(tmp_path / "nothing"), cpuinfo=AMD_EPYC_GENOA)
    with pytest.raises(SystemExit, match="'bogus': expected reference or kernel"):
        sglang_cpu_ops.activate({"EVALSVC_CPU_OPS": "bogus"})


def test_the_environment_leaves_processes_other_than_sglang_engines_alone(tmp_path):
    """The env's sitecustomize (run here by the project's own python, which has the same CPU
    torch) acts only in processes started with SGLANG_USE_CPU_ENGINE=1: elsewhere neither torch's
    AMX answer nor the import of sgl_kernel is touched (the env's own engine-process behaviour is
    tested in that env, tests/engines/test_sglang_cpu_ops.py)."""
    (tmp_path / "sitecustomize.py").write_text(sglang_cpu.SITECUSTOMIZE)
    (tmp_path / f"{sglang_cpu.OPS_MODULE}.py").write_text("raise SystemExit('imported')\n")
    ask = [sys.executable, "-c", "import torch; print(torch.cpu._is_amx_tile_supported())"]
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    real = subprocess.run(ask, env=env, capture_output=True, text=True, check=True).stdout
    env["PYTHONPATH"] = str(tmp_path)
    seen = subprocess.run(ask, env=env, capture_output=True, text=True, check=True).stdout
    assert seen == real
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    engine = subprocess.run(ask, env=env, capture_output=True, text=True)
    assert engine.returncode != 0 and "imported" in engine.stderr


def test_missing_kernel_wheels_name_the_variables_to_set(tmp_path):
    with pytest.raises(SGLangCPUError, match=r"EVALSVC_SGLANG_CPU_KERNEL_PORTABLE=.*nothing\.whl"):
        sglang_cpu.kernel_wheels({"EVALSVC_SGLANG_CPU_KERNEL_PORTABLE": str(tmp_path / "nothing.whl")})
    portable = tmp_path / "p.whl"
    portable.write_bytes(b"portable")
    with pytest.raises(SGLangCPUError, match=r"EVALSVC_SGLANG_CPU_KERNEL=.*nothing\.whl"):
        sglang_cpu.kernel_wheels({"EVALSVC_SGLANG_CPU_KERNEL_PORTABLE": str(portable),
                                  "EVALSVC_SGLANG_CPU_KERNEL": str(tmp_path / "nothing.whl")})
    wheel = tmp_path / "k.whl"
    wheel.write_bytes(b"kernel")
    both = {"EVALSVC_SGLANG_CPU_KERNEL_PORTABLE": str(portable),
            "EVALSVC_SGLANG_CPU_KERNEL": str(wheel)}
    assert sglang_cpu.kernel_wheels(both) == Wheels(portable, wheel)
    assert sglang_cpu.kernel_wheel(both) == wheel


def test_an_environment_with_a_current_marker_is_returned_at_once(tmp_path, monkeypatch):
    wheels = _wheels(tmp_path)
    dest = _made_env(tmp_path / "env", wheels)
    monkeypatch.setattr(sglang_cpu.children, "run", _must_not_run)
    t0 = time.monotonic()
    python = sglang_cpu.ensure(dest, environ=_environ(wheels))
    assert python == dest / "bin" / "python"
    assert time.monotonic() - t0 < 5


def test_another_kernel_wheel_or_reference_ops_make_the_environment_out_of_date(tmp_path,
                                                                               monkeypatch):
    wheels = _wheels(tmp_path)
    dest = _made_env(tmp_path / "env", wheels)
    assert sglang_cpu.up_to_date(dest, wheels)
    wheels.kernel.write_bytes(b"kernel v2")
    assert not sglang_cpu.up_to_date(dest, wheels)
    dest = _made_env(tmp_path / "env", wheels)
    ops = tmp_path / "ops.py"
    ops.write_text(sglang_cpu.OPS_SOURCE.read_text() + "\n# changed\n")
    monkeypatch.setattr(sglang_cpu, "OPS_SOURCE", ops)
    assert not sglang_cpu.up_to_date(dest, wheels)


def test_the_check_says_which_cpu_ops_this_machine_can_serve_with(monkeypatch, capsys, tmp_path):
    wheels = _wheels(tmp_path)
    for name, value in _environ(wheels).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sglang_cpu, "read_host", lambda: read_host(AMD_EPYC_MILAN))
    assert sglang_cpu.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "reference ops: ok on AMD EPYC" in out and "kernel ops: unavailable" in out
    assert "lacks avx512f" in out
    monkeypatch.setattr(sglang_cpu, "read_host", lambda: read_host(XEON_SAPPHIRE_RAPIDS))
    assert sglang_cpu.main(["--check"]) == 0
    assert "kernel ops: ok" in capsys.readouterr().out


def _wheels(tmp_path: Path) -> Wheels:
    portable, kernel = tmp_path / "p.whl", tmp_path / "k.whl"
    portable.write_bytes(b"portable v1")
    kernel.write_bytes(b"kernel v1")
    return Wheels(portable, kernel)


def _environ(wheels: Wheels) -> dict[str, str]:
    return {"EVALSVC_SGLANG_CPU_KERNEL_PORTABLE": str(wheels.portable),
            "EVALSVC_SGLANG_CPU_KERNEL": str(wheels.kernel)}


def _made_env(dest: Path, wheels: Wheels) -> Path:
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    (dest / "bin" / "python").write_text("")
    (dest / MARKER).write_text(json.dumps({"fingerprint": fingerprint(wheels)}))
    return dest


def _must_not_run(*args, **kwargs):
    raise AssertionError(f"nothing should be run: {args}")
