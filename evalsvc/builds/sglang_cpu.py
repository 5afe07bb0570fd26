"""The environment in which real SGLang serves on this machine's CPU: ``make sglang-cpu``.

SGLang's CPU backend (``--device cpu``) runs its ops in the CPU kernel package ``sgl_kernel``
(``sglang-kernel-cpu``), which SGLang does not publish; the project's shared folder carries a wheel
of it (``../shared/sglang-cpu/``), or ``EVALSVC_SGLANG_CPU_KERNEL`` names one. That wheel is
compiled for Intel Xeons with AVX-512 and AMX: its library registers its first op with AVX-512F
instructions as it is imported, so on a CPU without AVX-512 ``import sgl_kernel`` dies with SIGILL
(exit 132) before SGLang can say anything. The host check here therefore runs before anything is
installed and names the missing CPU features.

AMX is not needed by the kernel: its matrix products go through oneDNN's brgemm (``at::native::
cpublas``), which runs on AVX-512-BF16 where the CPU has no AMX tiles, and its own micro-kernels
are AVX-512-BF16. SGLang, though, asks for AMX (``cpu_has_amx_support``, from
``torch.cpu._is_amx_tile_supported``) before it uses the kernel at all; without it Qwen3-Next's
gated-deltanet layers fall back to Triton kernels, which need a GPU ("0 active drivers"). On a CPU
with AVX-512-BF16 and no AMX (AMD Zen 4 and later, for one), the environment's ``sitecustomize.py``
therefore answers that check with yes in SGLang's engine processes (``SGLANG_USE_CPU_ENGINE=1``,
which the CPU matrix sets), and SGLang serves through its real CPU path (measured: a cold
teacher-forced prefill and decode agree to a mean k3 of 2e-6 on a random-weight model, as on a
Xeon with AMX).

The environment (``.venv-sglang-cpu/`` in the checkout by default): Python 3.11, CPU torch
(``torch==2.13.0``, the build the kernel was compiled against), ``sglang==0.5.17`` (the newest
release whose Python calls this kernel's op signatures) and the kernel, both ``--no-deps``, then
SGLang's pure-Python dependencies pinned as they were in a working environment
(``requirements-sglang-cpu-0.5.17.txt`` beside this file), and the ``sitecustomize.py`` that lets
PyPI's CUDA torchvision import beside CPU torch. A marker records the recipe's fingerprint, so a
second call with nothing changed returns at once; a changed recipe, kernel or requirements file
installs again over the same directory (pip and uv keep what already satisfies the pins).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalsvc import children
from evalsvc.builds.sglang_env import SITECUSTOMIZE as ENV_SITECUSTOMIZE
from evalsvc.builds.sglang_env import find_uv

KERNEL_VARIABLE = "EVALSVC_SGLANG_CPU_KERNEL"
SGLANG = "sglang==0.5.17"
TORCH = "torch==2.13.0"
TORCHVISION = "torchvision==0.28.0"
REQUIREMENTS = Path(__file__).with_name("requirements-sglang-cpu-0.5.17.txt")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_KERNEL = (REPO.parent / "shared" / "sglang-cpu"
                  / "sglang_kernel_cpu-0.4.5-cp311-cp311-linux_x86_64.whl")
DEFAULT_DEST = REPO / ".venv-sglang-cpu"
MARKER = "evalsvc-sglang-cpu.json"
RECIPE_VERSION = 2
# What the kernel's code executes (AVX-512 F/BW/VL and BF16 instructions, found in its library):
# /proc/cpuinfo's names. AMX (amx_tile, amx_bf16) is used where present, not needed.
CPU_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
SITECUSTOMIZE = ENV_SITECUSTOMIZE + '''
# Written by evalsvc.builds.sglang_cpu. SGLang uses its CPU kernel only where torch reports AMX
# tiles; the kernel runs on AVX-512-BF16 without them (oneDNN's brgemm picks the ISA). In SGLang's
# engine processes on a CPU without AMX, that check answers yes.
import os

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import torch

    if not torch.cpu._is_amx_tile_supported():
        torch.cpu._is_amx_tile_supported = lambda: True
'''


class SGLangCPUError(RuntimeError):
    """This machine cannot have the environment; the message says what is missing and what to do."""


@dataclass(frozen=True)
class Host:
    model: str
    flags: frozenset[str]

    def missing(self) -> list[str]:
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
    missing = host.missing()
    if missing:
        raise SGLangCPUError(
            f"this CPU ({host.model}) lacks {', '.join(missing)}: SGLang's CPU kernel "
            "(sgl_kernel) runs AVX-512 (F, BW, VL and BF16) instructions (an Intel Xeon of the "
            "4th generation, Sapphire Rapids, or later; an AMD EPYC of Zen 4 or later) and dies "
            "with SIGILL on import elsewhere. Run the SGLang CPU tier on such a machine; here the "
            "embedded engine and the checks against SGLang's code still run.")


def kernel_wheel(environ: dict[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    given = environ.get(KERNEL_VARIABLE)
    path = Path(given).expanduser() if given else DEFAULT_KERNEL
    if not path.is_file():
        where = f"{KERNEL_VARIABLE}={given}" if given else f"the default {path}"
        raise SGLangCPUError(
            f"no SGLang CPU kernel wheel at {where}: SGLang publishes none. Set {KERNEL_VARIABLE} "
            "to a sglang_kernel_cpu-*.whl built from sgl-kernel/ (pyproject_cpu.toml) against "
            f"{TORCH}, or put the project's shared/sglang-cpu/ folder beside the checkout.")
    return path


def recipe(kernel: Path) -> dict[str, Any]:
    """Everything that decides what the environment holds; its hash is the marker's fingerprint."""
    return {"recipe_version": RECIPE_VERSION, "sglang": SGLANG, "torch": TORCH,
            "torchvision": TORCHVISION,
            "kernel_sha256": hashlib.sha256(kernel.read_bytes()).hexdigest(),
            "requirements_sha256": hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest(),
            "sitecustomize": hashlib.sha256(SITECUSTOMIZE.encode()).hexdigest(),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def fingerprint(kernel: Path) -> str:
    return hashlib.sha256(json.dumps(recipe(kernel), sort_keys=True).encode()).hexdigest()[:16]


def up_to_date(dest: Path, kernel: Path) -> bool:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(marker, dict) and marker.get("fingerprint") == fingerprint(kernel)
            and (dest / "bin" / "python").exists())


def ensure(dest: Path = DEFAULT_DEST, *, host: Host | None = None,
           environ: dict[str, str] | None = None) -> Path:
    """The python of the environment at ``dest``, installed when missing or out of date."""
    check_host(host or read_host())
    kernel = kernel_wheel(environ)
    if up_to_date(dest, kernel):
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
        ("sglang and kernel", [*uv, "--no-deps", SGLANG, str(kernel), TORCHVISION]),
        ("dependencies", [*uv, "-c", str(constraints), "-r", str(REQUIREMENTS)]),
    ]
    for step, argv in steps:
        if step == "dependencies":
            constraints.write_text(f"{TORCH}\n")
        result = children.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-40:])
            raise SGLangCPUError(f"{dest}: step '{step}' failed (exit {result.returncode}):\n{tail}")
    site = children.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                         "['purelib'])"], capture_output=True, text=True, check=True)
    (Path(site.stdout.strip()) / "sitecustomize.py").write_text(SITECUSTOMIZE)
    smoke = children.run([str(python), "-c", "import sgl_kernel, sglang; print(sglang.__version__)"],
                         capture_output=True, text=True)
    if smoke.returncode != 0:
        raise SGLangCPUError(f"{dest}: sglang or sgl_kernel does not import (exit "
                             f"{smoke.returncode}):\n{smoke.stderr[-3000:]}")
    (dest / MARKER).write_text(json.dumps({"fingerprint": fingerprint(kernel),
                                           "recipe": recipe(kernel),
                                           "sglang_version": smoke.stdout.strip()}, indent=2) + "\n")
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evalsvc.builds.sglang_cpu",
                                     description="Make the environment real SGLang serves in on "
                                                 "this CPU (make sglang-cpu).")
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--check", action="store_true",
                        help="only say whether this machine can have it (CPU and kernel wheel)")
    args = parser.parse_args(argv)
    try:
        if args.check:
            check_host(read_host())
            print(f"ok: {read_host().model}, kernel {kernel_wheel()}")
        else:
            print(ensure(args.dest))
    except SGLangCPUError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
