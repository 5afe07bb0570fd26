"""Cached virtualenvs with one SGLang release each, for checking evalsvc against SGLang's own code.

The control plane never imports sglang. ``ensure_sglang_env("0.5.23")`` returns the python of a
virtualenv that holds ``sglang==0.5.23`` (installed ``--no-deps``: the wheel's own requirements pull
CUDA kernels, flashinfer and a CUDA torch) plus the pure-Python packages that SGLang's argument
parser, its server-argument resolution and ``io_struct.GenerateReqInput`` import, on the CPU build
of torch. ``tests/engines/sglang_check.py`` then runs under that python.

What gets installed, and why (found by importing those modules in a bare env, for 0.5.13 and 0.5.23):

* ``sglang.srt.utils.common`` imports numpy, orjson, psutil, pybase64, requests, triton, packaging,
  PIL, starlette (from fastapi), msgspec, pydantic and zmq at module level; ``sglang.utils`` imports
  IPython, tqdm and aiohttp; ``sglang.srt.configs`` imports transformers and, through the
  InternVL helpers, torchvision; the quantization registry imports compressed_tensors, gguf and
  tvm_ffi; server_args imports the function-call and reasoning parsers (openai,
  partial_json_parser, sentencepiece, dill); 0.5.13's FLA layers import einops; SGLang's
  ``bench_serving`` (``sglang.benchmark.datasets``) imports datasets, which SGLang requires.
* triton is imported unconditionally (``import triton`` in ``sglang/srt/utils/common.py``), so it
  stays although nothing here compiles a kernel: about 1 GB installed, the largest package. It is
  not an SGLang requirement (CUDA torch brings it), so it is pinned here, to the series that the
  newest release's torch (2.14.1) asks for.
* Versions: every package SGLang's own metadata pins (``transformers==5.19.0`` for 0.5.23,
  ``transformers==5.8.1`` for 0.5.13, ``sentencepiece``, ``apache-tvm-ffi``, ...) is installed at that
  pin: the pins are read from the installed wheel and written to the constraints file, next to
  ``torch==2.13.0`` (the CPU build pip finds locally; the torch family SGLang pins is left out).
* PyPI's torchvision is a CUDA build; beside CPU torch its ``_meta_registrations`` fails to register
  fake kernels for ops whose library did not load. The env's ``sitecustomize.py`` registers an
  empty module under that name first (sitecustomize runs in every interpreter of the env, so
  subprocesses get it too).

How: torch through the env's own pip, which finds the CPU build where the machine's pip
configuration says; SGLang and the rest through uv (``_install``), with nothing compiled at install:
the build's smoke import compiles what it imports, and later runs whatever else they import.

Layout: ``$EVALSVC_SGLANG_ENV_DIR`` (default ``~/.cache/evalsvc/sglang-envs``) / ``<version>``, a
virtualenv whose ``evalsvc-sglang-env.json`` marker records the recipe fingerprint and what was
installed. A build runs in a temporary folder beside it and is renamed into place only when it is
complete, so a failed build leaves nothing cached; a file lock keeps two processes from building the
same version at once. An env whose marker has another recipe fingerprint is rebuilt.
"""

from __future__ import annotations

import contextlib
import email.parser
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from evalsvc import children

ENV_DIR_VARIABLE = "EVALSVC_SGLANG_ENV_DIR"
MARKER = "evalsvc-sglang-env.json"
RECIPE_VERSION = 1

TORCH = "torch==2.13.0"
# Packages SGLang does not require itself but imports; pinned so builds do not drift.
EXTRA_PINS = ("triton==3.8.0",)
# What the parser, the resolution and io_struct import (see the module docstring), by pip name.
DEPENDENCIES = (
    "numpy", "orjson", "psutil", "pybase64", "requests", "packaging", "pillow", "fastapi",
    "msgspec", "pydantic", "pyzmq", "tqdm", "ipython", "aiohttp", "transformers", "torchvision",
    "dill", "apache-tvm-ffi", "sentencepiece", "compressed-tensors", "gguf", "openai",
    "partial-json-parser", "einops", "triton", "datasets",
)
# Imported by some releases only: 0.5.16 and 0.5.17's function-call parsers (which server_args
# imports) import xgrammar at module level. Kept out of the other releases' recipes, so their
# fingerprints (and the envs already made) stay as they are.
RELEASE_DEPENDENCIES = {"0.5.16": ("xgrammar",), "0.5.17": ("xgrammar",)}
# Pinned by SGLang to the torch it was built for; torch==2.13.0 (CPU) replaces that torch here.
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchao", "torchcodec", "triton"}
SMOKE_IMPORTS = ("sglang.srt.server_args", "sglang.srt.managers.io_struct")

SITECUSTOMIZE = '''\
"""Written by evalsvc.builds.sglang_env.

PyPI's torchvision is a CUDA build: beside the CPU torch of this env, importing
torchvision._meta_registrations fails ("operator torchvision::nms does not exist"). Registering an
empty module under that name first lets torchvision (which SGLang's model configs import) load.
"""
import sys
import types

sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))
'''

OUTPUT_TAIL_LINES = 60
OFFLINE_HINTS = (  # pip's and uv's words for an index it cannot reach
    "Temporary failure in name resolution", "error sending request", "dns error",
    "Name or service not known", "Network is unreachable",
    "Failed to establish a new connection", "NewConnectionError", "ConnectTimeoutError",
    "Max retries exceeded", "(from versions: none)", "Connection refused",
)


class SGLangEnvError(RuntimeError):
    """Building an SGLang env failed: the message names the version, the step and pip's output tail.

    ``offline`` is True when the output looks like the package index could not be reached (pip's
    connection errors, or no versions at all), which a caller without network may treat as
    "cannot check here"; a release the index does not have is not that.
    """

    def __init__(self, version: str, step: str, detail: str, output: str = "") -> None:
        tail = "\n".join(output.strip().splitlines()[-OUTPUT_TAIL_LINES:])
        message = f"sglang {version} env: step '{step}' failed: {detail}"
        if tail:
            message += f"\n--- output tail ---\n{tail}"
        super().__init__(message)
        self.version = version
        self.step = step
        self.output = output
        self.offline = any(hint in output for hint in OFFLINE_HINTS)


def env_root() -> Path:
    configured = os.environ.get(ENV_DIR_VARIABLE)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "evalsvc" / "sglang-envs"


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def recipe(version: str) -> dict[str, Any]:
    """Everything that decides what an env holds; its hash is the env's fingerprint."""
    return {"recipe_version": RECIPE_VERSION, "sglang": f"sglang=={version}", "torch": TORCH,
            "extra_pins": list(EXTRA_PINS), "dependencies": list(_dependencies(version)),
            "sitecustomize": hashlib.sha256(SITECUSTOMIZE.encode()).hexdigest(),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def _dependencies(version: str) -> tuple[str, ...]:
    return DEPENDENCIES + RELEASE_DEPENDENCIES.get(version, ())


def fingerprint(version: str) -> str:
    return hashlib.sha256(json.dumps(recipe(version), sort_keys=True).encode()).hexdigest()[:16]


def read_marker(env: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((env / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def ensure_sglang_env(version: str) -> Path:
    """The python of a cached env with ``sglang==version``; built (a minute) when missing."""
    version = _check_version(version)
    root = env_root()
    env = root / version
    if _usable(env, version):
        return env_python(env)
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root / f".{version}.lock"):
        if _usable(env, version):  # built by another process while this one waited
            return env_python(env)
        _build(version, root, env)
    return env_python(env)


def _check_version(version: str) -> str:
    try:
        parsed = Version(version)
    except InvalidVersion:
        raise SGLangEnvError(str(version), "check version", "not a release version") from None
    if parsed.local is not None or str(parsed) != version.strip():
        raise SGLangEnvError(version, "check version",
                             f"use the release's canonical spelling ({parsed.public!s})")
    return version


def _usable(env: Path, version: str) -> bool:
    marker = read_marker(env)
    return (marker is not None and marker.get("fingerprint") == fingerprint(version)
            and marker.get("sglang_version") == version and env_python(env).exists())


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(version: str, root: Path, env: Path) -> None:
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{version}-", dir=root))
    try:
        tmp.chmod(0o755)
        steps = _install(version, tmp)
        python = env_python(tmp)
        _run(version, "smoke import", [str(python), "-c", "; ".join(
            f"import {m}" for m in SMOKE_IMPORTS)], timeout=600)
        packages = json.loads(_run(version, "list packages", [
            str(python), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
            timeout=300))
        marker = {
            "sglang_version": version, "fingerprint": fingerprint(version), "recipe": recipe(version),
            "packages": {p["name"]: p["version"] for p in packages},
            "steps": steps, "build_seconds": round(time.monotonic() - started, 1),
            "size_bytes": _size(tmp), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        if env.exists() or env.is_symlink():  # a stale env (other recipe): replace it
            stale = Path(tempfile.mkdtemp(prefix=f".stale-{version}-", dir=root))
            env.rename(stale / "env")
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(env)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _install(version: str, tmp: Path) -> list[dict[str, Any]]:
    """torch through the env's pip, which finds the CPU build where the machine's pip configuration
    says (as ``make setup`` does); SGLang and the rest through uv, which keeps that torch and
    installs the same versions as pip resolves in seconds rather than minutes (the installs of a
    release's env: 127 to 129 s with pip, 19 to 20 s this way; benchmarks/sglang_env.py)."""
    steps = []

    def step(name: str, argv: Sequence[str], timeout: float) -> None:
        t = time.monotonic()
        _run(version, name, argv, timeout=timeout)
        steps.append({"step": name, "seconds": round(time.monotonic() - t, 1)})

    try:
        uv = find_uv()
    except FileNotFoundError as exc:
        raise SGLangEnvError(version, "find uv", str(exc)) from None
    step("create virtualenv", [uv, "venv", "--quiet", "--seed", "--python", sys.executable,
                               str(tmp)], timeout=300)
    python = str(env_python(tmp))
    constraints = tmp / "evalsvc-constraints.txt"
    constraints.write_text("\n".join([TORCH, *EXTRA_PINS]) + "\n")
    # not compiled here: the smoke import compiles what the checks import (see _build)
    step("install torch", [python, "-m", "pip", "install", "--disable-pip-version-check",
                           "--no-input", "--progress-bar", "off", "--no-compile", TORCH],
         timeout=1800)
    uv_pip = [uv, "pip", "install", "--quiet", "--python", python, "-c", str(constraints)]
    step(f"install sglang=={version} --no-deps", [*uv_pip, "--no-deps", f"sglang=={version}"],
         timeout=1800)
    pins = sglang_pins(_site_packages(tmp, version), version)
    constraints.write_text("\n".join([TORCH, *EXTRA_PINS, *pins]) + "\n")
    step("install dependencies", [*uv_pip, TORCH, *_dependencies(version)], timeout=3600)
    (_site_packages(tmp, version) / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return steps


def find_uv() -> str:
    """The uv binary: the ``uv`` package's (a dependency of evalsvc), else one on PATH."""
    try:
        from uv import find_uv_bin
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
    if found is None:
        raise FileNotFoundError("uv is not installed (pip install uv)")
    return found


def _site_packages(env: Path, version: str) -> Path:
    found = sorted(env.glob("lib/python3*/site-packages"))
    if not found:
        raise SGLangEnvError(version, "find site-packages", f"no lib/python3*/site-packages in {env}")
    return found[0]


def sglang_pins(site_packages: Path, version: str) -> list[str]:
    """The installed wheel's own requirements that carry a version, as constraint lines (no
    extras; the torch family left out, torch==2.13.0 CPU replaces it)."""
    metadata = sorted(site_packages.glob("sglang-*.dist-info/METADATA"))
    if not metadata:
        raise SGLangEnvError(version, "read sglang metadata", f"no sglang-*.dist-info in {site_packages}")
    message = email.parser.Parser().parsestr(metadata[0].read_text())
    pins = []
    for line in message.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in TORCH_FAMILY or req.url or not str(req.specifier):
            continue
        pins.append(f"{name}{req.specifier}")
    return sorted(set(pins))


def _run(version: str, step: str, argv: Sequence[str], timeout: float) -> str:
    # without PYTHONDONTWRITEBYTECODE: the smoke import compiles what it imports, once (pip and
    # uv install without compiling; compiling all 2 GB would cost more than it saves)
    env = {k: v for k, v in os.environ.items() if k not in (
        "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    try:
        done = children.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        output = (_text(exc.stdout) + _text(exc.stderr))
        raise SGLangEnvError(version, step, f"timed out after {timeout:.0f} s", output) from None
    except OSError as exc:
        raise SGLangEnvError(version, step, f"could not run {argv[0]}: {exc}") from None
    if done.returncode != 0:
        raise SGLangEnvError(version, step, f"exit code {done.returncode}",
                             done.stdout + done.stderr)
    return done.stdout


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
