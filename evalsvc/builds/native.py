"""The native parts of an engine build and of its base environment, for the build's manifest.

A release wheel of SGLang ships compiled extensions inside its ``sglang`` package (from 0.5.11 the
gRPC core; from 0.5.18 the Rust extensions under ``sglang/srt/rust_extensions/``; from 0.5.19 the
Rust TreeCore of the unified radix cache, ``sglang/srt/mem_cache/rust_tree_core/mem_cache.*.so``,
which 0.5.21 and later select by default, ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust``). A
source tree declares them instead: crates under ``rust/`` whose ``Cargo.toml`` names the module in
``[package.metadata.sglang] python-module`` (the root workspace may list more crates in
``[workspace.metadata.sglang] extension-manifests``), or, in older trees, ``python/pyproject.toml``'s
``[[tool.setuptools-rust.ext-modules]]`` (or a maturin ``module-name``). evalsvc compiles none of
them: a ``git`` or ``path`` build carries what its tree holds, and every declared extension without
a compiled file is recorded as ``missing``, with what SGLang does without it. SGLang falls back to
its Python TreeCore silently (one log line) where the Rust one is missing, so the manifest and the
dashboard's build card say so.

The base environment's native parts (``base_env``): its torch, and where it is the CPU environment
(``evalsvc.builds.sglang_cpu``, with ``sglang-kernel-cpu``'s ``sgl_kernel``), the kernel wheel's
name and sha256, as the environment's marker or the kernel's ``direct_url.json`` records them.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

# a compiled module: NAME[.TAG].so / .pyd / .dylib (CPython's EXTENSION_SUFFIXES, on any platform)
_EXTENSION = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\.(?P<tag>[^/]+))?\.(?:so|pyd|dylib)$")
_CPYTHON_TAG = re.compile(r"^cpython-(?P<major>\d)(?P<minor>\d+)")
CPU_MARKER = "evalsvc-sglang-cpu.json"  # sglang_cpu.MARKER; not imported, to keep this module light
NOT_BUILT = "evalsvc compiles no Rust extension: the build carries what its tree holds"


class NativeError(ValueError):
    """A tree's declaration of its native parts that cannot be read; the message names the file."""


def label(module: str) -> str:
    """A short name for an extension module: ``rust_tree_core`` for the Rust TreeCore, ``grpc``
    for ``sglang.srt.rust_extensions._grpc``, else its last two components."""
    parts = module.split(".")
    if "rust_tree_core" in parts:
        return "rust_tree_core"
    if len(parts) > 1 and parts[-2] == "rust_extensions":
        return parts[-1].lstrip("_")
    return ".".join(parts[-2:])


def without(module: str) -> str:
    """What SGLang does when the extension ``module`` is not there."""
    if "rust_tree_core" in module.split("."):
        return "the Python TreeCore runs (SGLang falls back to it silently)"
    return f"SGLang runs without {module} (what needs it fails or takes a Python path)"


def compiled_files(site: Path) -> list[dict[str, Any]]:
    """The compiled extension modules in ``site/sglang``: path (relative to ``site``), module,
    ABI tag (``cpython-311-x86_64-linux-gnu``, or None), size in bytes and sha256, sorted by path."""
    found = []
    for path in sorted((site / "sglang").rglob("*")):
        m = _EXTENSION.match(path.name)
        if m is None or not path.is_file() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(site)
        module = ".".join((*rel.parts[:-1], m.group("name")))
        found.append({"path": rel.as_posix(), "module": module, "abi": m.group("tag"),
                      "size": path.stat().st_size,
                      "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    return found


def _read_toml(path: Path, tree: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise NativeError(f"{path.relative_to(tree)}: cannot be read as TOML ({exc})") from None


def _crate(manifest: Path, tree: Path) -> dict[str, Any] | None:
    doc = _read_toml(manifest, tree)
    package = doc.get("package") or {}
    meta = ((package.get("metadata") or {}).get("sglang") or {})
    module = meta.get("python-module")
    if module is None:
        return None
    if not isinstance(module, str) or not module.startswith("sglang."):
        raise NativeError(f"{manifest.relative_to(tree)}: [package.metadata.sglang] python-module "
                          f"must name a module of the sglang package, not {module!r}")
    return {"module": module, "crate": package.get("name"),
            "declared_in": manifest.relative_to(tree).as_posix()}


def declared_extensions(tree: Path) -> list[dict[str, Any]]:
    """The compiled extensions of the ``sglang`` package that a source tree (its root: the one with
    ``rust/`` and ``python/``, or a tree with ``sglang/`` at the top) declares: module, crate (or
    None) and the file that declares it, sorted by module. NativeError naming the file for a
    declaration that cannot be read."""
    found: dict[str, dict[str, Any]] = {}
    rust = tree / "rust"
    manifests = sorted(rust.glob("*/Cargo.toml")) if rust.is_dir() else []
    if (rust / "Cargo.toml").is_file():
        workspace = _read_toml(rust / "Cargo.toml", tree)
        extra = (((workspace.get("workspace") or {}).get("metadata") or {}).get("sglang") or {}
                 ).get("extension-manifests") or []
        for rel in extra:
            path = (rust / rel).resolve()
            if not path.is_file():
                raise NativeError(f"rust/Cargo.toml: [workspace.metadata.sglang] "
                                  f"extension-manifests names {rel!r}, which is not there")
            if path not in manifests:
                manifests.append(path)
    for manifest in manifests:
        crate = _crate(manifest, tree)
        if crate is not None:
            found.setdefault(crate["module"], crate)
    for pyproject in (tree / "python" / "pyproject.toml", tree / "pyproject.toml"):
        if not pyproject.is_file():
            continue
        tool = _read_toml(pyproject, tree).get("tool") or {}
        where = pyproject.relative_to(tree).as_posix()
        for ext in (tool.get("setuptools-rust") or {}).get("ext-modules") or []:
            target = ext.get("target") if isinstance(ext, dict) else None
            if not isinstance(target, str):
                raise NativeError(f"{where}: a [[tool.setuptools-rust.ext-modules]] entry has no "
                                  "target")
            if target.startswith("sglang."):
                crate_path = pyproject.parent / str(ext.get("path", "Cargo.toml"))
                name = None
                if crate_path.is_file():
                    name = (_read_toml(crate_path, tree).get("package") or {}).get("name")
                found.setdefault(target, {"module": target, "crate": name, "declared_in": where})
        module = (tool.get("maturin") or {}).get("module-name")
        if isinstance(module, str) and module.startswith("sglang."):
            found.setdefault(module, {"module": module, "crate": None, "declared_in": where})
    return [found[k] for k in sorted(found)]


def abi_mismatch(compiled: list[dict[str, Any]], python: str | None) -> list[str]:
    """The compiled files whose CPython tag is not the base python's (``3.11.7``): they cannot
    load there."""
    if not python:
        return []
    major, minor = python.split(".")[:2]
    out = []
    for f in compiled:
        m = _CPYTHON_TAG.match(f.get("abi") or "")
        if m and (m.group("major"), m.group("minor")) != (major, minor):
            out.append(f["path"])
    return out


def native_section(kind: str, site: Path, tree: Path | None = None,
                   base_python: str | None = None) -> dict[str, Any]:
    """The manifest's ``native`` section of a build whose package is ``site/sglang``: the compiled
    files in it; for a ``git`` or ``path`` build (``tree``: its source tree) the extensions the tree
    declares, each ``present`` (a compiled file for it is in the build) or ``missing``; the base
    python's version (``base_python``) checked against the files' CPython tags; and a one-line
    ``summary`` (the dashboard's "native parts")."""
    compiled = compiled_files(site)
    modules = {f["module"] for f in compiled}
    declared = []
    if tree is not None:
        for ext in declared_extensions(tree):
            status = "present" if ext["module"] in modules else "missing"
            declared.append({**ext, "status": status,
                             **({"without": without(ext["module"])} if status == "missing" else {})})
    missing = [d for d in declared if d["status"] == "missing"]
    unloadable = abi_mismatch(compiled, base_python)
    section: dict[str, Any] = {"compiled": compiled, "declared": declared,
                               "missing": [d["module"] for d in missing]}
    if missing:
        section["note"] = NOT_BUILT
    if unloadable:
        section["unloadable"] = unloadable
    section["summary"] = summarize(kind, section, base_python)
    return section


def summarize(kind: str, section: dict[str, Any], base_python: str | None = None) -> str:
    compiled, declared = section["compiled"], section["declared"]
    n = len(compiled)
    where = "from the wheel" if kind == "pypi" else "in the tree"
    parts = []
    if n:
        names = ", ".join(label(f["module"]) for f in compiled)
        parts.append(f"{n} compiled extension{'s' if n != 1 else ''} {where} ({names})")
    elif kind == "pypi":
        parts.append("no compiled extensions in the wheel")
    missing = [d for d in declared if d["status"] == "missing"]
    if missing:
        names = ", ".join(label(d["module"]) for d in missing)
        consequence = ("Python core will run" if any("rust_tree_core" in d["module"].split(".")
                                                      for d in missing)
                       else "SGLang runs without them")
        parts.append(f"declares {names}; not built: {consequence}")
    elif kind != "pypi" and not declared and not n:
        parts.append("no native parts declared")
    if section.get("unloadable"):
        parts.append(f"{len(section['unloadable'])} compiled for another CPython than the base "
                     f"python {base_python}: they cannot load")
    return "; ".join(parts)


def _site_dist_info(site_dirs: list[Path], project: str) -> Path | None:
    want = re.sub(r"[-_.]+", "_", project).lower()
    for site in site_dirs:
        if not site.is_dir():
            continue
        for path in sorted(site.glob("*.dist-info")):
            name = path.name.removesuffix(".dist-info").rsplit("-", 1)[0]
            if re.sub(r"[-_.]+", "_", name).lower() == want:
                return path
    return None


def _metadata_version(dist_info: Path) -> str | None:
    try:
        for line in (dist_info / "METADATA").read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
            if not line.strip():
                break
    except OSError:
        return None
    return None


def _sha256_of_direct_url(direct: dict[str, Any]) -> str | None:
    info = direct.get("archive_info") or {}
    hashes = info.get("hashes") or {}
    if isinstance(hashes.get("sha256"), str):
        return hashes["sha256"]
    legacy = info.get("hash")
    if isinstance(legacy, str) and legacy.startswith("sha256="):
        return legacy.removeprefix("sha256=")
    return None


def _marker_wheels(marker: dict[str, Any], installed: str | None) -> list[dict[str, Any]]:
    """The kernel wheels a ``make sglang-cpu`` marker records, as {wheel, sha256, role}: recipe 3
    names each build (``portable_kernel``: the environment's ``sgl_kernel``; ``kernel``: the
    AVX-512 build beside it); recipe 2 holds one ``kernel_sha256``, the installed wheel's."""
    recipe = marker.get("recipe") if isinstance(marker.get("recipe"), dict) else {}
    out = []
    for role in ("portable_kernel", "kernel"):
        entry = recipe.get(role)
        if isinstance(entry, dict) and isinstance(entry.get("wheel"), str):
            out.append({"wheel": entry["wheel"], "sha256": entry.get("sha256"), "role": role})
    if not out and isinstance(recipe.get("kernel_sha256"), str):
        out.append({"wheel": installed, "sha256": recipe["kernel_sha256"], "role": "kernel"})
    return out


def cpu_kernel(prefix: Path, site_dirs: list[Path]) -> dict[str, Any] | None:
    """The SGLang CPU kernel an environment (``prefix``, its ``site_dirs``) holds: the installed
    package's version, its wheel's name and sha256 and where they were read (the environment's
    ``evalsvc-sglang-cpu.json`` marker, else the kernel's ``direct_url.json``), and the other kernel
    builds the marker records (``other_builds``: the AVX-512 build of the CPU environment); None
    where it has no CPU kernel. A wheel whose sha256 no record holds has ``sha256`` None and a
    ``note`` saying so."""
    dist = _site_dist_info(site_dirs, "sglang-kernel-cpu")
    # a GPU environment has an ``sgl_kernel`` too (sgl-kernel): without the CPU kernel's metadata,
    # only the marker of ``make sglang-cpu`` makes it the CPU one
    if dist is None and not (prefix / CPU_MARKER).is_file():
        return None
    out: dict[str, Any] = {"package": "sglang-kernel-cpu",
                           "version": _metadata_version(dist) if dist else None,
                           "wheel": None, "sha256": None, "recorded_in": None}
    direct: dict[str, Any] = {}
    if dist is not None:
        try:
            direct = json.loads((dist / "direct_url.json").read_text())
        except (OSError, ValueError):
            direct = {}
    if isinstance(direct.get("url"), str):
        name = Path(unquote(urlsplit(direct["url"]).path)).name
        if name.endswith(".whl"):
            out["wheel"] = name
    try:
        marker = json.loads((prefix / CPU_MARKER).read_text())
    except (OSError, ValueError):
        marker = None
    recorded = _marker_wheels(marker, out["wheel"]) if isinstance(marker, dict) else []
    mine = next((w for w in recorded if w["wheel"] == out["wheel"]), None)
    if mine is None and out["wheel"] is None and len(recorded) == 1:
        mine = recorded[0]
    if mine is not None and mine["sha256"]:
        out.update(wheel=mine["wheel"], sha256=mine["sha256"], recorded_in=CPU_MARKER)
    if out["sha256"] is None and (sha := _sha256_of_direct_url(direct)):
        out["sha256"], out["recorded_in"] = sha, "direct_url.json"
    others = [w for w in recorded if w is not mine]
    if others:
        out["other_builds"] = others
    if out["sha256"] is None:
        out["note"] = ("no record of the kernel wheel's sha256 (neither the marker of make "
                       "sglang-cpu nor the installer's direct_url.json holds one)")
    return out
