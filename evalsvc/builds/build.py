"""Engine builds: SGLang at a release, a git commit or a local tree, with known fixes patched in.

A build is a directory holding one ``sglang`` package (every file of a release wheel's
``sglang/``: Python, data, headers and compiled extensions, with their modes; or a git commit's or
a local tree's package as it is) that is put first on ``PYTHONPATH`` of a base environment holding
the other native parts (torch, kernels). Each build is probed for the known fixes before and after
its patches, and keeps a manifest of what it is, its native parts included (``builds.native``: a
source tree's Rust extensions are not compiled, and the manifest says so). Builds are cached by
(build format, source, commit or version, patch set): a second request reuses the directory; a
failed build leaves nothing behind.

Sources:

* ``sglang==0.5.23`` (or ``pypi:0.5.23``): a release from the package index.
* ``git:REPO@COMMIT``: a commit of a git repository (a local path or a URL this machine reaches);
  the package is taken from ``python/sglang`` (SGLang's layout) or ``sglang`` at the top.
* ``path:DIR`` (or a directory): a local source tree with ``sglang/`` or ``python/sglang/``.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from base64 import urlsafe_b64encode
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from evalsvc import children
from evalsvc.builds.native import NativeError, cpu_kernel, native_section
from evalsvc.builds.patches import PATCHES, PatchError, apply_patch
from evalsvc.builds.probes import SourceTreeError, probe_all

MANIFEST = "manifest.json"
# what a build holds and how its manifest reads; part of the build key, so a build made by an older
# evalsvc (format 1: a release's .py files alone) is never reused
BUILD_FORMAT = 2
# a build or mirror clone in the making older than this was left by a process that was killed
LEFTOVER_SECONDS = 24 * 3600


class BuildError(RuntimeError):
    """A build that cannot be made; the message names the source, commit, patch or file."""


@dataclass(frozen=True)
class Source:
    kind: str  # pypi | git | path
    location: str  # package name, repository, or directory
    ref: str | None  # version or commit (None for a local tree)

    @property
    def label(self) -> str:
        if self.kind == "pypi":
            return f"sglang=={self.ref}"
        if self.kind == "git":
            return f"git:{self.location}@{self.ref}"
        return f"path:{self.location}"


def parse_source(text: str) -> Source:
    """``sglang==X`` / ``pypi:X`` / ``git:REPO@COMMIT`` / ``path:DIR`` / an existing directory."""
    text = text.strip()
    m = re.fullmatch(r"(?:pypi:)?sglang==([\w.+-]+)", text) or re.fullmatch(r"pypi:([\w.+-]+)", text)
    if m:
        return Source("pypi", "sglang", m.group(1))
    if text.startswith("git:"):
        repo, sep, commit = text[4:].rpartition("@")
        if not sep or not repo or not commit:
            raise BuildError(f"source {text!r}: write git:REPOSITORY@COMMIT")
        return Source("git", repo, commit)
    if text.startswith("path:") or Path(text).is_dir():
        path = Path(text.removeprefix("path:")).expanduser().resolve()
        if not path.is_dir():
            raise BuildError(f"source {text!r}: no such directory {path}")
        return Source("path", str(path), None)
    raise BuildError(f"source {text!r}: use sglang==VERSION, git:REPOSITORY@COMMIT or path:DIR")


@dataclass
class Build:
    """A ready build: put ``site`` first on PYTHONPATH of the base environment."""

    key: str
    directory: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    reused: bool = False

    @property
    def site(self) -> Path:
        return self.directory / "site"

    def env(self) -> dict[str, str]:
        extra = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": str(self.site) + (os.pathsep + extra if extra else "")}


def build_key(source: Source, resolved_ref: str | None, patches: list[str]) -> str:
    ident = json.dumps({"format": BUILD_FORMAT, "kind": source.kind, "location": source.location,
                        "ref": resolved_ref, "patches": sorted(set(patches))}, sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def make_build(source_text: str, patches: list[str] | tuple[str, ...] = (),
               base_python: str | None = None, *, root: Path) -> Build:
    """Make (or reuse) the build of a source with patches in the builds cache ``root`` (and its
    git mirrors, ``root/git``); see the module docstring."""
    source = parse_source(source_text)
    unknown = [p for p in patches if p not in PATCHES]
    if unknown:
        raise BuildError(f"unknown patch {unknown[0]!r} (known: {', '.join(sorted(PATCHES))})")
    patches = sorted(set(patches))
    resolved = _resolve_ref(source, root)
    key = build_key(source, resolved, patches)
    final = root / key
    if (final / MANIFEST).is_file():
        return Build(key, final, json.loads((final / MANIFEST).read_text()), reused=True)
    root.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(root, ".build-")
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=root))
    try:
        site = work / "site"
        site.mkdir()
        fetched = _fetch(source, resolved, site, root, scratch=work / "tree")
        base_env = base_env_info(base_python) if base_python else None
        try:
            native = native_section(source.kind, site, fetched.tree,
                                    base_env.get("python") if base_env else None)
        except NativeError as exc:
            raise BuildError(f"source {source.label}: {exc}") from None
        shutil.rmtree(work / "tree", ignore_errors=True)
        try:
            before = [asdict(r) for r in probe_all(site)]
        except SourceTreeError as exc:
            raise BuildError(f"source {source.label}: {exc}") from None
        changed = []
        for name in patches:
            try:
                result = apply_patch(site, name)
            except PatchError as exc:
                raise BuildError(f"patch {name!r} does not apply to {source.label}: {exc}") from None
            changed.extend(asdict(f) for f in result.changed)
        after = [asdict(r) for r in probe_all(site)]
        files = package_files(site)
        manifest = {
            "key": key, "format": BUILD_FORMAT, "source": source.label, "kind": source.kind,
            "location": source.location,
            "commit" if source.kind == "git" else "version": resolved,
            **({"wheel": fetched.wheel} if fetched.wheel else {}),
            "patches": patches, "probes_before": before, "probes_after": after,
            "files_changed": changed, "file_count": len(files),
            "package_hash": _tree_hash(site, files), "native": native,
            "base_env": base_env, "created_at": datetime.now(UTC).isoformat(),
        }
        text = json.dumps(manifest, indent=2, default=str).replace(str(work), str(final))
        manifest = json.loads(text)
        (work / MANIFEST).write_text(text + "\n")
        try:
            work.rename(final)
        except OSError:  # built meanwhile by another process: keep theirs
            shutil.rmtree(work, ignore_errors=True)
            return Build(key, final, json.loads((final / MANIFEST).read_text()), reused=True)
        return Build(key, final, manifest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def sweep_leftovers(parent: Path, prefix: str) -> None:
    """Remove the work directories (``prefix*``) in ``parent`` that a killed process left: those
    untouched for LEFTOVER_SECONDS, so another process's build in the making stays."""
    now = time.time()
    for path in parent.glob(f"{prefix}*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and now - path.stat().st_mtime > LEFTOVER_SECONDS:
                shutil.rmtree(path, ignore_errors=True)


def _resolve_ref(source: Source, root: Path) -> str | None:
    if source.kind == "git":
        return resolve_commit(source, root)[1]
    return source.ref


def resolve_commit(source: Source, root: Path) -> tuple[Path, str]:
    """A git source's mirror (under the builds cache ``root``) and the full sha its commit (a
    short sha, branch or tag) names. A full sha the mirror already has is taken as it is, without
    fetching (it cannot move)."""
    full_sha = re.fullmatch(r"[0-9a-f]{40}", source.ref or "") is not None
    mirror = git_mirror(source.location, root, fetch=not full_sha)
    out = git(["rev-parse", "--verify", "--quiet", f"{source.ref}^{{commit}}"], mirror, check=False)
    if out.returncode != 0 and full_sha:  # a commit the mirror does not have yet
        mirror = git_mirror(source.location, root)
        out = git(["rev-parse", "--verify", "--quiet", f"{source.ref}^{{commit}}"], mirror,
                  check=False)
    if out.returncode != 0:
        raise BuildError(f"source {source.label}: unknown commit {source.ref!r} in "
                         f"{source.location}")
    return mirror, out.stdout.strip()


@dataclass
class Fetched:
    tree: Path | None = None  # a git or path source's tree (its native declarations are read there)
    wheel: dict[str, str] | None = None  # a release's wheel: name and sha256


def _fetch(source: Source, resolved: str | None, site: Path, root: Path, scratch: Path) -> Fetched:
    """The source's package into ``site`` (a git commit's tree is exported to ``scratch``)."""
    if source.kind == "pypi":
        wheel = download_wheel(resolved)
        unpack_package(wheel, site)
        fetched = Fetched(wheel={"name": wheel.name,
                                 "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()})
    elif source.kind == "git":
        mirror = git_mirror(source.location, root, fetch=False)  # resolved (and fetched) just before
        scratch.mkdir()
        archive = scratch / "tree.tar"
        git(["archive", "--format=tar", "-o", str(archive), resolved], mirror)
        shutil.unpack_archive(str(archive), scratch / "tree")
        archive.unlink()
        fetched = Fetched(_copy_package(scratch / "tree", site, source.label))
    else:
        fetched = Fetched(_copy_package(Path(source.location), site, source.label))
    if not (site / "sglang" / "__init__.py").is_file():
        raise BuildError(f"source {source.label}: no sglang package found")
    return fetched


def unpack_package(wheel: Path, site: Path) -> list[str]:
    """Every member of the wheel's ``sglang/`` package into ``site``, with the modes the wheel
    records (executable bits kept), each checked against the wheel's RECORD; the members' names.
    BuildError naming the wheel and the member that does not match."""
    with zipfile.ZipFile(wheel) as zf:
        record = _wheel_record(zf, wheel)
        members = [i for i in zf.infolist() if i.filename.startswith("sglang/") and not i.is_dir()]
        for info in members:
            data = zf.read(info)
            digest = "sha256=" + urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if record.get(info.filename) != digest:
                raise BuildError(f"{wheel.name}: {info.filename} does not match the wheel's RECORD "
                                 f"({record.get(info.filename) or 'not listed'})")
            target = site / info.filename
            if site.resolve() not in target.resolve().parents:
                raise BuildError(f"{wheel.name}: member {info.filename!r} leaves the package")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                target.chmod(mode | 0o600)
    return [i.filename for i in members]


def _wheel_record(zf: zipfile.ZipFile, wheel: Path) -> dict[str, str]:
    names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)]
    if len(names) != 1:
        raise BuildError(f"{wheel.name}: no single .dist-info/RECORD in the wheel")
    return {row[0]: row[1] for row in csv.reader(zf.read(names[0]).decode().splitlines())
            if len(row) >= 2}


def _copy_package(tree: Path, site: Path, label: str) -> Path:
    """The tree's package copied into ``site``; the tree's root (the parent of a ``python/`` given
    as the tree, where SGLang's ``rust/`` is beside it)."""
    for candidate in (tree / "python" / "sglang", tree / "sglang"):
        if (candidate / "__init__.py").is_file():
            shutil.copytree(candidate, site / "sglang",
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            if candidate.parent.name == "python" and (candidate.parent.parent / "rust").is_dir():
                return candidate.parent.parent
            return tree
    raise BuildError(f"source {label}: neither python/sglang nor sglang in {tree}")


# SGLang's wheels carry compiled extensions from 0.5.11 on (see ``builds.native``), built for one
# platform: the CPython 3.11 manylinux x86_64 wheel, what the base environments here run.
WHEEL_PLATFORM = ["--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
                  "--implementation", "cp", "--abi", "cp311"]


def wheel_cache() -> Path:
    configured = os.environ.get("EVALSVC_WHEEL_CACHE", "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "evalsvc" / "wheels"


def cached_wheel(cache: Path, version: str) -> Path | None:
    for path in sorted(cache.glob("sglang-*.whl")):
        try:
            name, found, _, _ = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            continue
        if name == "sglang" and found == Version(version):
            return path
    return None


def download_wheel(version: str) -> Path:
    """The release's wheel, from the cache or downloaded into it (``pip download --no-deps``)."""
    try:
        Version(version)
    except InvalidVersion:
        raise BuildError(f"sglang=={version}: not a version number") from None
    cache = wheel_cache()
    found = cached_wheel(cache, version)
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               *WHEEL_PLATFORM, "--disable-pip-version-check", "--dest", tmp, f"sglang=={version}"]
        try:
            done = children.run(cmd, capture_output=True, text=True, timeout=1200, check=False)
        except subprocess.TimeoutExpired:
            raise BuildError(f"sglang=={version}: the download timed out") from None
        got = cached_wheel(Path(tmp), version)
        if done.returncode != 0 or got is None:
            tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise BuildError(f"sglang=={version}: cannot download it from the package index "
                             f"({tail})")
        target = cache / got.name
        os.replace(got, target)
    return target


def git(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """``git ARGS`` in ``cwd`` (no prompts); with ``check``, a BuildError when it fails."""
    proc = children.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                        env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    if check and proc.returncode != 0:
        raise BuildError(f"git {' '.join(args[:2])} failed in {cwd}: {proc.stderr.strip()[-300:]}")
    return proc


def git_mirror(location: str, root: Path, fetch: bool = True) -> Path:
    """A bare mirror of the repository under the builds cache ``root``, fetched on each use
    (unless not ``fetch``)."""
    mirrors = root / "git"
    mirrors.mkdir(parents=True, exist_ok=True)
    mirror = mirrors / hashlib.sha256(location.encode()).hexdigest()[:16]
    if not mirror.is_dir():
        sweep_leftovers(mirrors, ".mirror-")
        tmp = Path(tempfile.mkdtemp(prefix=".mirror-", dir=mirrors))
        proc = children.run(["git", "clone", "--bare", "--quiet", location, str(tmp / "repo")],
                            capture_output=True, text=True,
                            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BuildError(f"repository {location}: cannot be cloned "
                             f"({proc.stderr.strip().splitlines()[-1] if proc.stderr else 'no output'})")
        try:
            (tmp / "repo").rename(mirror)
        except OSError:  # cloned meanwhile by another process: keep theirs
            if not mirror.is_dir():
                raise
        shutil.rmtree(tmp, ignore_errors=True)
    elif fetch:
        with contextlib.suppress(BuildError):
            git(["fetch", "--quiet", "--prune", "origin", "+refs/heads/*:refs/heads/*"], mirror)
    return mirror


def package_files(site: Path) -> list[str]:
    """Every file of the build's package, as ``sglang/...`` paths, sorted (Python's caches left
    out: an engine may write them after the build)."""
    return sorted(p.relative_to(site).as_posix() for p in (site / "sglang").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def _tree_hash(site: Path, files: list[str]) -> str:
    h = hashlib.sha256()
    for name in files:
        h.update(name.removeprefix("sglang/").encode() + b"\0" + (site / name).read_bytes())
    return h.hexdigest()


def installed_version(python: str) -> str | None:
    """The SGLang release installed in an environment (asked of its python, never imported here);
    None when it has none or the python cannot run."""
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        out = children.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def base_env_info(python: str) -> dict[str, Any]:
    """The base environment's native parts: versions of its python, torch and kernel packages, its
    prefix, and for the CPU environment (``sglang-kernel-cpu``) the kernel wheel's name and sha256
    (``cpu_kernel``, see ``native.cpu_kernel``). Asked of its python, which imports nothing."""
    code = ("import json, platform, site, sys, sysconfig, importlib.metadata as m\n"
            "out = {'python': platform.python_version(), 'prefix': sys.prefix}\n"
            "for p in ('torch', 'sgl-kernel', 'sglang-kernel', 'sglang-kernel-cpu',\n"
            "          'flashinfer-python', 'triton'):\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: pass\n"
            "paths = sysconfig.get_paths()\n"
            "dirs = [paths['purelib'], paths['platlib'], *site.getsitepackages()]\n"
            "out['site_dirs'] = list(dict.fromkeys(dirs))\n"
            "print(json.dumps(out))")
    try:
        proc = children.run([python, "-c", code], capture_output=True, text=True)
    except OSError as exc:
        raise BuildError(f"base python {python}: cannot run it ({exc.strerror})") from None
    if proc.returncode != 0:
        raise BuildError(f"base python {python}: cannot run it ({proc.stderr.strip()[-200:]})")
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise BuildError(f"base python {python}: said no versions ({proc.stdout[-200:]!r})") from None
    site_dirs = [Path(d) for d in info.pop("site_dirs", [])]
    kernel = cpu_kernel(Path(info["prefix"]), site_dirs)
    return {"executable": python, **info, **({"cpu_kernel": kernel} if kernel else {})}
