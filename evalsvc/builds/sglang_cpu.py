"""The environment in which real SGLang serves on this machine's CPU: ``make sglang-cpu``.

SGLang's CPU backend (``--device cpu``) runs its ops in the CPU kernel package ``sgl_kernel``
(``sglang-kernel-cpu``), which SGLang does not publish; the project's shared folder carries two
builds of it (``../shared/sglang-cpu/``): one for AVX-512-BF16 (its library runs AVX-512 code as it
is imported: SIGILL on any other CPU) and one for x86-64-v3 (AVX2), which imports everywhere but
raises "scalar path not implemented" in the ops that have only an AVX-512 implementation.

The environment serves SGLang's real Python (scheduler, radix and Mamba caches, pools, model code)
on any x86-64 CPU, in one of two ways, chosen per engine by ``EVALSVC_CPU_OPS`` (the matrix field
``cpu_ops``):

* ``reference`` (the default, every CPU): the x86-64-v3 kernel build is the environment's
  ``sgl_kernel``; SGLang's AMX check answers no, so SGLang takes its native torch paths for linear
  layers, MoE, norms and rope (with ``--attention-backend torch_native``), and the gated-deltanet
  ops are replaced by the pure-torch reference ops of ``evalsvc.engines.sglang_cpu_ops``, copied
  into the environment as ``evalsvc_sglang_cpu_ops``;
* ``kernel`` (CPUs with AVX-512-BF16): the AVX-512 build, unpacked into ``kernel-avx512/`` of the
  environment, goes first on ``sys.path``, and SGLang's AMX check answers yes where the CPU has no
  AMX tiles (the kernel's matrix products go through oneDNN's brgemm, which runs on AVX-512-BF16;
  without that answer SGLang's gated-deltanet layers would fall back to Triton). A CPU without
  AVX-512-BF16 is refused at the engine's start, naming what it lacks, not with SIGILL.

Either way the package ``evalsvc_sglang_models`` holds model classes of this project's, which
SGLang's registry takes where an engine sets ``SGLANG_EXTERNAL_MODEL_PACKAGE`` to it: a tiny model
under Inkling's architecture names (``evalsvc.engines.sglang_inkling_tiny``).

The environment's ``sitecustomize.py`` applies the choice in SGLang's engine processes
(``SGLANG_USE_CPU_ENGINE=1``, which the CPU matrix sets) and nowhere else.

The environment (``.venv-sglang-cpu/`` in the checkout by default): Python 3.11, CPU torch
(``torch==2.13.0``, the build the kernel was compiled against), ``sglang==0.5.17`` (the newest
release whose Python calls this kernel's op signatures) and the kernel, both ``--no-deps``, then
SGLang's pure-Python dependencies pinned as they were in a working environment
(``requirements-sglang-cpu-0.5.17.txt`` beside this file), and the ``sitecustomize.py`` that also
lets PyPI's CUDA torchvision import beside CPU torch. A marker records the recipe's fingerprint, so
a second call with nothing changed returns at once; a changed recipe, kernel, reference-ops module,
model module or requirements file installs again over the same directory (pip and uv keep what already
satisfies the pins).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalsvc import children
from evalsvc.builds.sglang_env import SITECUSTOMIZE as ENV_SITECUSTOMIZE
from evalsvc.builds.sglang_env import find_uv

KERNEL_VARIABLE = "EVALSVC_SGLANG_CPU_KERNEL"  # the AVX-512-BF16 build (cpu_ops: kernel)
PORTABLE_VARIABLE = "EVALSVC_SGLANG_CPU_KERNEL_PORTABLE"  # the x86-64-v3 build (imports anywhere)
SGLANG = "sglang==0.5.17"
TORCH = "torch==2.13.0"
TORCHVISION = "torchvision==0.28.0"
REQUIREMENTS = Path(__file__).with_name("requirements-sglang-cpu-0.5.17.txt")
REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "sglang-cpu"
DEFAULT_KERNEL = SHARED / "sglang_kernel_cpu-0.4.5-cp311-cp311-linux_x86_64.whl"
DEFAULT_PORTABLE = SHARED / "sglang_kernel_cpu-0.4.5+avx2-cp311-cp311-linux_x86_64.whl"
# inside the package (a wheel install has no checkout around it)
OPS_SOURCE = Path(__file__).resolve().parents[1] / "engines" / "sglang_cpu_ops.py"
OPS_MODULE = "evalsvc_sglang_cpu_ops"
# Model classes of this project's that SGLang's registry takes where an engine sets
# SGLANG_EXTERNAL_MODEL_PACKAGE to this package (evalsvc.engines.sglang_inkling_tiny)
MODELS_SOURCES = {"inkling_tiny.py": OPS_SOURCE.with_name("sglang_inkling_tiny.py")}
MODELS_PACKAGE = "evalsvc_sglang_models"
KERNEL_DIR = "kernel-avx512"  # in the environment: the AVX-512 build's sgl_kernel
DEFAULT_DEST = REPO / ".venv-sglang-cpu"
MARKER = "evalsvc-sglang-cpu.json"
RECIPE_VERSION = 3
# What the AVX-512 kernel build executes (AVX-512 F/BW/VL and BF16 instructions, found in its
# library): /proc/cpuinfo's names. AMX (amx_tile, amx_bf16) is used where present, not needed.
# The reference-ops module checks the same names before an engine takes the kernel path.
CPU_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
SITECUSTOMIZE = ENV_SITECUSTOMIZE + f"""
# Written by evalsvc.builds.sglang_cpu. In SGLang's engine processes, the CPU ops the engine asked
# for (EVALSVC_CPU_OPS: reference, the default, or kernel); {OPS_MODULE}.activate says how.
import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import {OPS_MODULE}

    {OPS_MODULE}.activate()
"""


class SGLangCPUError(RuntimeError):
    """This machine cannot have the environment; the message says what is missing and what to do."""


@dataclass(frozen=True)
class Host:
    model: str
    flags: frozenset[str]

    def missing(self) -> list[str]:
        """What this CPU lacks for the kernel path (``cpu_ops: kernel``)."""
        return [f for f in CPU_FEATURES if f not in self.flags]


def read_host(cpuinfo: str | None = None) -> Host:
    """The CPU model and flags of the first processor in ``/proc/cpuinfo`` (or the text given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "unknown CPU", frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return Host(model, flags)


def check_host(host: Host) -> None:
    """Refuse the kernel path on a CPU that cannot run the AVX-512 build, naming what it lacks."""
    missing = host.missing()
    if missing:
        raise SGLangCPUError(
            f"this CPU ({host.model}) lacks {', '.join(missing)}: the AVX-512 build of SGLang's "
            "CPU kernel (sgl_kernel) runs AVX-512 (F, BW, VL and BF16) instructions (an Intel "
            "Xeon of the 4th generation, Sapphire Rapids, or later; an AMD EPYC of Zen 4 or later) "
            "and dies with SIGILL on import elsewhere. Use cpu_ops: reference (the default), "
            "which serves the same SGLang code on any x86-64 CPU.")


@dataclass(frozen=True)
class Wheels:
    portable: Path  # the x86-64-v3 build: the environment's sgl_kernel
    kernel: Path | None  # the AVX-512-BF16 build for cpu_ops: kernel; None where there is none


def _wheel(environ: Mapping[str, str], variable: str, default: Path) -> Path | None:
    given = environ.get(variable)
    path = Path(given).expanduser() if given else default
    if not path.is_file():
        if given:  # a wheel named and missing is a mistake, never a quiet fallback
            raise SGLangCPUError(f"{variable}={given}: no such file")
        return None
    return path


def kernel_wheels(environ: Mapping[str, str] | None = None) -> Wheels:
    """The two kernel builds: the portable one, which the environment needs, and the AVX-512 one,
    which only the kernel path needs."""
    environ = os.environ if environ is None else environ
    portable = _wheel(environ, PORTABLE_VARIABLE, DEFAULT_PORTABLE)
    if portable is None:
        raise SGLangCPUError(
            f"no SGLang CPU kernel wheel at the default {DEFAULT_PORTABLE}: SGLang publishes none. "
            f"Set {PORTABLE_VARIABLE} to a sglang_kernel_cpu-*.whl built from sgl-kernel/ "
            f"(pyproject_cpu.toml) for x86-64-v3 against {TORCH}, or put the project's "
            "shared/sglang-cpu/ folder beside the checkout.")
    return Wheels(portable, _wheel(environ, KERNEL_VARIABLE, DEFAULT_KERNEL))


def kernel_wheel(environ: Mapping[str, str] | None = None) -> Path:
    """The AVX-512 build, for the kernel path; a clear error where there is none."""
    wheel = kernel_wheels(environ).kernel
    if wheel is None:
        raise SGLangCPUError(
            f"no AVX-512 SGLang CPU kernel wheel at the default {DEFAULT_KERNEL}: the kernel path "
            f"(cpu_ops: kernel) needs one. Set {KERNEL_VARIABLE} to a sglang_kernel_cpu-*.whl "
            f"built from sgl-kernel/ (pyproject_cpu.toml) against {TORCH}, or put the project's "
            "shared/sglang-cpu/ folder beside the checkout.")
    return wheel


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def recipe(wheels: Wheels) -> dict[str, Any]:
    """Everything that decides what the environment holds; its hash is the marker's fingerprint."""
    return {"recipe_version": RECIPE_VERSION, "sglang": SGLANG, "torch": TORCH,
            "torchvision": TORCHVISION,
            "portable_kernel": {"wheel": wheels.portable.name,
                                "sha256": _sha256(wheels.portable)},
            "kernel": None if wheels.kernel is None else {
                "wheel": wheels.kernel.name, "sha256": _sha256(wheels.kernel)},
            "reference_ops_sha256": _sha256(OPS_SOURCE),
            "models_sha256": {name: _sha256(path) for name, path in MODELS_SOURCES.items()},
            "requirements_sha256": _sha256(REQUIREMENTS),
            "sitecustomize": hashlib.sha256(SITECUSTOMIZE.encode()).hexdigest(),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def fingerprint(wheels: Wheels) -> str:
    return hashlib.sha256(json.dumps(recipe(wheels), sort_keys=True).encode()).hexdigest()[:16]


def read_marker(dest: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def up_to_date(dest: Path, wheels: Wheels) -> bool:
    marker = read_marker(dest)
    return (marker is not None and marker.get("fingerprint") == fingerprint(wheels)
            and (dest / "bin" / "python").exists())


def ensure(dest: Path = DEFAULT_DEST, *, environ: Mapping[str, str] | None = None) -> Path:
    """The python of the environment at ``dest``, installed when missing or out of date."""
    wheels = kernel_wheels(environ)
    if up_to_date(dest, wheels):
        return dest / "bin" / "python"
    python = dest / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # SGLang, the kernel and the rest through uv, compiled (an engine imports them at every start),
    # torch through the env's pip, as the SGLang envs do (sglang_env._install)
    try:
        uv = [find_uv(), "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python)]
    except FileNotFoundError as exc:
        raise SGLangCPUError(f"{dest}: {exc}") from None
    constraints = dest / "constraints.txt"
    steps = [
        ("venv", [uv[0], "venv", "--quiet", "--seed", "--allow-existing", "--python",
                  sys.executable, str(dest)]),
        ("torch", [*pip, TORCH]),
        ("sglang and kernel", [*uv, "--reinstall-package", "sglang-kernel-cpu", "--no-deps",
                               SGLANG, str(wheels.portable), TORCHVISION]),
        ("dependencies", [*uv, "-c", str(constraints), "-r", str(REQUIREMENTS)]),
    ]
    for step, argv in steps:
        if step == "dependencies":
            constraints.write_text(f"{TORCH}\n")
        result = children.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-40:])
            raise SGLangCPUError(f"{dest}: step '{step}' failed (exit {result.returncode}):\n{tail}")
    site = Path(children.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True,
                             check=True).stdout.strip())
    _unpack_kernel(wheels.kernel, dest / KERNEL_DIR)
    shutil.copyfile(OPS_SOURCE, site / f"{OPS_MODULE}.py")
    models = site / MODELS_PACKAGE
    shutil.rmtree(models, ignore_errors=True)
    models.mkdir()
    (models / "__init__.py").write_text('"""Written by evalsvc.builds.sglang_cpu: model classes '
                                        'for SGLANG_EXTERNAL_MODEL_PACKAGE."""\n')
    for name, path in MODELS_SOURCES.items():
        shutil.copyfile(path, models / name)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    smoke = children.run([str(python), "-c", "import sgl_kernel, sglang; print(sglang.__version__)"],
                         capture_output=True, text=True)
    if smoke.returncode != 0:
        raise SGLangCPUError(f"{dest}: sglang or sgl_kernel does not import (exit "
                             f"{smoke.returncode}):\n{smoke.stderr[-3000:]}")
    (dest / MARKER).write_text(json.dumps({"fingerprint": fingerprint(wheels),
                                           "recipe": recipe(wheels),
                                           "sglang_version": smoke.stdout.strip()}, indent=2) + "\n")
    return python


def _unpack_kernel(wheel: Path | None, target: Path) -> None:
    """The AVX-512 build's ``sgl_kernel`` package into ``target`` (nothing where there is none).
    Only unpacked, never imported here: this CPU may not run it."""
    shutil.rmtree(target, ignore_errors=True)
    if wheel is None:
        return
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if m.filename.startswith("sgl_kernel/")]
        if not members:
            raise SGLangCPUError(f"{wheel}: no sgl_kernel/ package in the wheel")
        for member in members:
            archive.extract(member, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evalsvc.builds.sglang_cpu",
                                     description="Make the environment real SGLang serves in on "
                                                 "this CPU (make sglang-cpu).")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--check", action="store_true",
                        help="only say which CPU ops this machine can serve with (CPU and kernel wheels)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            host, wheels = read_host(), kernel_wheels()
            print(f"reference ops: ok on {host.model}, portable kernel {wheels.portable}")
            try:
                check_host(host)
                print(f"kernel ops: ok, kernel {kernel_wheel()}")
            except SGLangCPUError as exc:
                print(f"kernel ops: unavailable: {exc}")
        else:
            print(ensure(args.dest))
    except SGLangCPUError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
