"""The SGLang environments a job may name (``engine_env``), each by a name and never by a path.

Where the names come from, first found first:

* ``default``: ``EVALSVC_ENGINE_PYTHON``, the environment of jobs that name none (a job or its
  matrix's ``default_engine_env`` may name another);
* ``EVALSVC_ENGINE_ENVS``: a JSON object of names and the paths of their pythons;
* what the environment builders made where they make them (unless
  ``EVALSVC_DISCOVER_ENGINE_ENVS=false``): ``make sglang-cpu``'s environment (the checkout's
  ``.venv-sglang-cpu``) as ``sglang-cpu-VERSION``, and the SGLang envs of
  ``evalsvc.builds.sglang_env`` (``EVALSVC_SGLANG_ENV_DIR``, default
  ``~/.cache/evalsvc/sglang-envs``) as ``sglang-VERSION``, read from their markers.

What an environment holds (``describe``: its SGLang and torch releases, its kernel package, the CPU
ops it can serve with, CPU or GPU) is asked of its python once, with ``importlib.metadata`` (nothing
is imported), and kept until a directory its packages lie in changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalsvc import children
from evalsvc.builds import sglang_cpu, sglang_env
from evalsvc.settings import Settings

DEFAULT = "default"
# where the builders make environments (tests point these elsewhere)
SGLANG_CPU_ENV = sglang_cpu.DEFAULT_DEST
KERNEL_PACKAGES = ("sglang-kernel-cpu", "sgl-kernel", "sglang-kernel")
# asked of an environment's python: versions from the packages' metadata, nothing imported
DESCRIBE = """\
import importlib.metadata as m, importlib.util as u, json, os, site, sys, sysconfig
out = {"python_version": sys.version.split()[0], "prefix": sys.prefix}
for p in ("sglang", "torch", "sglang-kernel-cpu", "sgl-kernel", "sglang-kernel"):
    try:
        out[p] = m.version(p)
    except m.PackageNotFoundError:
        pass
out["cuda_packages"] = any((d.metadata["Name"] or "").lower().startswith("nvidia-")
                           for d in m.distributions())
out["reference_ops"] = u.find_spec("evalsvc_sglang_cpu_ops") is not None
out["kernel_avx512"] = os.path.isdir(os.path.join(sys.prefix, "kernel-avx512", "sgl_kernel"))
paths = sysconfig.get_paths()
dirs = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
out["site_dirs"] = [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]
print(json.dumps(out))
"""


class EngineEnvError(ValueError):
    """A name no environment has; the message names the field and lists the names known."""


@dataclass(frozen=True)
class EngineEnv:
    name: str
    python: str
    origin: str  # where the name comes from: the setting, or the builder that made it


def engine_envs(settings: Settings) -> dict[str, EngineEnv]:
    """The environments this service (or Ray node) knows, by name."""
    envs: dict[str, EngineEnv] = {}
    if settings.engine_python:
        envs[DEFAULT] = EngineEnv(DEFAULT, settings.engine_python, "EVALSVC_ENGINE_PYTHON")
    for name, python in settings.engine_envs.items():
        envs.setdefault(name, EngineEnv(name, python, "EVALSVC_ENGINE_ENVS"))
    if settings.discover_engine_envs:
        for env in discovered():
            envs.setdefault(env.name, env)
    return envs


def discovered() -> list[EngineEnv]:
    """The environments the builders made where they make them, named by their markers."""
    found = []
    marker = sglang_cpu.read_marker(SGLANG_CPU_ENV)
    python = SGLANG_CPU_ENV / "bin" / "python"
    if marker and marker.get("sglang_version") and python.exists():
        found.append(EngineEnv(f"sglang-cpu-{marker['sglang_version']}", str(python),
                               "make sglang-cpu"))
    root = sglang_env.env_root()
    try:
        candidates = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    except OSError:
        candidates = []
    for env in candidates:
        marker = sglang_env.read_marker(env)
        python = sglang_env.env_python(env)
        if marker and marker.get("sglang_version") == env.name and python.exists():
            found.append(EngineEnv(f"sglang-{env.name}", str(python),
                                   f"evalsvc.builds.sglang_env ({root})"))
    return found


def default_name(settings: Settings, envs: dict[str, EngineEnv] | None = None) -> str | None:
    """The environment of a job that names none (and whose matrix names none)."""
    envs = engine_envs(settings) if envs is None else envs
    return DEFAULT if DEFAULT in envs else None


def resolve(settings: Settings, name: str, field: str = "engine_env") -> EngineEnv:
    """The environment named ``name``; EngineEnvError naming ``field`` and the known names."""
    envs = engine_envs(settings)
    env = envs.get(name)
    if env is None:
        known = ", ".join(sorted(envs)) or "none: set EVALSVC_ENGINE_PYTHON or EVALSVC_ENGINE_ENVS"
        raise EngineEnvError(f"{field}: unknown engine environment {name[:64]!r} (known: {known})")
    return env


def python_of(settings: Settings, name: str | None) -> str | None:
    """The python a job's runs use: its named environment's, else EVALSVC_ENGINE_PYTHON (a job
    stored before jobs named environments); EngineEnvError when the name is no longer known."""
    if name is None:
        return settings.engine_python
    return resolve(settings, name).python


# ---- what an environment holds ---------------------------------------------------------------
_cache: dict[str, tuple[tuple[tuple[str, int], ...], dict[str, Any]]] = {}
_cache_lock = threading.Lock()


def _stamp(dirs: list[str]) -> tuple[tuple[str, int], ...]:
    out = []
    for d in dirs:
        try:
            out.append((d, os.stat(d).st_mtime_ns))
        except OSError:
            out.append((d, -1))
    return tuple(out)


def describe(python: str) -> dict[str, Any]:
    """What the environment of ``python`` holds: ``sglang`` and ``torch`` (their versions),
    ``kernel`` (its SGLang kernel package and version), ``cpu_ops`` (``reference``: the project's
    pure-torch ops are installed; ``kernel``: the AVX-512 kernel build is unpacked beside them),
    ``device`` (``cpu`` or ``gpu``, from torch's build and CUDA packages), or ``problem`` when its
    python cannot be asked. Kept until a directory its packages lie in changes."""
    with _cache_lock:
        cached = _cache.get(python)
    if cached is not None and cached[0] and _stamp([d for d, _ in cached[0]]) == cached[0]:
        return cached[1]
    info = _ask(python)
    with _cache_lock:
        _cache[python] = (_stamp(info.pop("site_dirs", [])), info)
    return info


def _ask(python: str) -> dict[str, Any]:
    if not Path(python).exists():
        return {"problem": f"{python}: no such file"}
    try:
        proc = children.run([python, "-c", DESCRIBE], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
        raw = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"problem": f"{python}: cannot be asked what it holds ({exc})"}
    if not isinstance(raw, dict):
        return {"problem": f"{python}: cannot be asked what it holds (exit {proc.returncode}: "
                           f"{proc.stderr.strip()[-200:]})"}
    torch = raw.get("torch")
    kernel = next((f"{p} {raw[p]}" for p in KERNEL_PACKAGES if raw.get(p)), None)
    local = torch.partition("+")[2] if torch else ""
    gpu = (local.startswith(("cu", "rocm")) or bool(raw.get("cuda_packages"))
           or any(raw.get(p) for p in ("sgl-kernel", "sglang-kernel")))
    cpu_ops = [ops for ops, present in (("reference", raw.get("reference_ops")),
                                        ("kernel", raw.get("kernel_avx512"))) if present]
    return {"sglang": raw.get("sglang"), "torch": torch, "kernel": kernel, "cpu_ops": cpu_ops,
            "device": "gpu" if gpu else ("cpu" if torch else None),
            "python_version": raw.get("python_version"), "problem": None,
            "site_dirs": raw.get("site_dirs", [])}


def listed(settings: Settings) -> list[dict[str, Any]]:
    """The known environments with what each holds (``GET /api/v1/engine-envs``)."""
    envs = engine_envs(settings)
    default = default_name(settings, envs)
    return [{"name": e.name, "default": e.name == default, "origin": e.origin, "python": e.python,
             **describe(e.python)} for e in sorted(envs.values(), key=lambda e: e.name)]
