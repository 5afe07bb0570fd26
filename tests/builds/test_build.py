"""Engine builds: a git repository's commits laid over, cached, patched, with a manifest.

The repository is made in a temporary directory from a real release's sources (0.5.19, the last
release without PR #37165): one commit as released, one with the fix as it went upstream.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from array import array
from pathlib import Path

import pytest

from evalsvc.builds.build import BuildError, download_wheel, make_build, parse_source
from evalsvc.builds.patches import PATCHES, apply_patch
from evalsvc.builds.probes import FIXES

pytestmark = pytest.mark.wheels

FIX = "pr37165-clear-deferred-mamba-metadata"
BIG = "pr24954-forward-stream-mamba-ops"
GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def wheel_or_skip(version: str) -> Path:
    try:
        return download_wheel(version)
    except BuildError as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(str(exc))
        pytest.skip(f"sglang {version} wheel not available: {exc}")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple[Path, str, str]:
    """A git repository with SGLang's layout (python/sglang): (path, before-fix sha, fix sha)."""
    root = tmp_path_factory.mktemp("sglang-repo")
    with zipfile.ZipFile(wheel_or_skip("0.5.19")) as zf:
        zf.extractall(root / "python", [m for m in zf.namelist()
                                        if m.startswith("sglang/") and m.endswith(".py")])
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "release 0.5.19")
    before = git(root, "rev-parse", "HEAD")
    apply_patch(root / "python", FIX)  # the upstream fix commit
    git(root, "commit", "-qam", "Clear deferred init metadata before speculative decode")
    return root, before, git(root, "rev-parse", "HEAD")


def statuses(manifest: dict, key: str) -> dict[str, str]:
    return {p["fix"]: p["status"] for p in manifest[key]}


def test_git_commits_overlay_cache_and_manifest(repo, tmp_path):
    path, before, fixed = repo
    root = tmp_path / "builds"
    old = make_build(f"git:{path}@{before[:10]}", root=root)
    assert statuses(old.manifest, "probes_before")[FIX] == "absent"
    assert old.manifest["commit"] == before  # a short sha resolves to the full one
    assert (old.site / "sglang" / "srt" / "managers" / "schedule_batch.py").is_file()
    assert old.env()["PYTHONPATH"].split(os.pathsep)[0] == str(old.site)
    new = make_build(f"git:{path}@{fixed}", root=root)
    assert statuses(new.manifest, "probes_before")[FIX] == "present"
    patched = make_build(f"git:{path}@{before}", [FIX], root=root)
    assert statuses(patched.manifest, "probes_after")[FIX] == "present"
    assert [f["path"] for f in patched.manifest["files_changed"]] == [
        "sglang/srt/managers/schedule_batch.py"]
    assert patched.manifest["package_hash"] == new.manifest["package_hash"]  # same code as upstream
    again = make_build(f"git:{path}@{before}", [FIX], root=root)
    assert again.reused and again.directory == patched.directory
    assert json.loads((patched.directory / "manifest.json").read_text()) == patched.manifest
    # the overlay comes first on the path of the engine's python
    out = subprocess.run([sys.executable, "-c",
                          "import importlib.util as u; print(u.find_spec('sglang').origin)"],
                         env={**os.environ, **patched.env()}, capture_output=True, text=True)
    assert out.stdout.strip() == str(patched.site / "sglang" / "__init__.py"), out.stderr[-500:]


def test_a_killed_builds_leftovers_are_swept_and_one_in_the_making_stays(repo, tmp_path):
    path, before, _ = repo
    root = tmp_path / "builds"
    killed, making = root / ".build-0123456789abcdef-killed", root / ".build-fedcba9876543210-now"
    for d in (killed, making):
        (d / "site" / "sglang").mkdir(parents=True)
    day_ago = time.time() - 25 * 3600
    os.utime(killed, (day_ago, day_ago))
    make_build(f"git:{path}@{before}", root=root)
    assert not killed.exists() and (making / "site" / "sglang").is_dir()


def test_bad_builds_fail_clearly_and_cache_nothing(repo, tmp_path):
    path, before, _ = repo
    root = tmp_path / "builds"
    cases = [
        (f"git:{path}@0123456789abcdef", [], "unknown commit"),
        (f"git:{tmp_path}/no-such-repo@{before}", [], "cannot be cloned"),
        (f"git:{path}@{before}", ["no-such-patch"], "unknown patch 'no-such-patch'"),
        ("sglang==0.0.999", [], "cannot download"),
        ("sglang==latest-and-greatest", [], "not a version number"),
        ("git:nowhere", [], "git:REPOSITORY@COMMIT"),
    ]
    for source, patches, message in cases:
        with pytest.raises(BuildError, match=message):
            make_build(source, patches, root=root)
    # a patch that cannot apply (PR #24954 has no backport for 0.5.12.post1): an error naming it
    wheel_or_skip("0.5.12.post1")
    with pytest.raises(BuildError, match=BIG):
        make_build("sglang==0.5.12.post1", [BIG], root=root)
    leftovers = [p.name for p in root.iterdir() if p.name != "git"] if root.exists() else []
    assert leftovers == [], f"half-built builds left behind: {leftovers}"
    assert set(PATCHES) >= {FIX, BIG}


def test_probe_cli_json(tmp_path):
    wheel_or_skip("0.5.20")
    out = subprocess.run([sys.executable, "-m", "evalsvc.cli", "probe", "sglang==0.5.20", "--json"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "EVALSVC_BUILDS_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    # every fix up to 0.5.20 is in it; #39342 came in 0.5.23, #29068 is in no release
    assert {r["fix"]: r["status"] for r in rows} == {
        **dict.fromkeys(FIXES, "present"), "pr39342-mixed-chunk-mamba-tracking": "absent",
        "pr29068-cpu-conv-varlen-state": "absent"}
    assert all(r["evidence"] for r in rows)


def test_build_cli_prints_the_manifest(tmp_path):
    wheel_or_skip("0.5.19")
    cmd = [sys.executable, "-m", "evalsvc.cli", "build", "sglang==0.5.19", "--patch", FIX,
           "--base-python", sys.executable]
    env = {**os.environ, "EVALSVC_BUILDS_DIR": str(tmp_path)}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    manifest = json.loads(first.stdout)
    assert manifest["version"] == "0.5.19" and manifest["patches"] == [FIX]
    assert statuses(manifest, "probes_before")[FIX] == "absent"
    assert statuses(manifest, "probes_after")[FIX] == "present"
    assert manifest["base_env"]["python"].startswith("3.11") and "torch" in manifest["base_env"]
    second = json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                       env=env).stdout)
    assert second["reused"] and second["directory"] == manifest["directory"]
    bad = subprocess.run([sys.executable, "-m", "evalsvc.cli", "build", "sglang==0.5.19", "--patch",
                          "nope"], capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "unknown patch 'nope'" in bad.stderr


def wheel_members(wheel: Path) -> dict[str, zipfile.ZipInfo]:
    with zipfile.ZipFile(wheel) as zf:
        return {i.filename: i for i in zf.infolist()
                if i.filename.startswith("sglang/") and not i.is_dir()}


# 0.5.13: a small release with one compiled extension (and a tools/ folder beside sglang/, which
# is not the package); 0.5.23: the Rust extensions, the Rust TreeCore among them
@pytest.mark.parametrize(("version", "compiled"), [
    ("0.5.13", ["grpc._core"]),
    ("0.5.23", ["rust_tree_core", "bench", "grpc", "multimodal", "server"])])
def test_a_release_build_is_every_file_of_the_wheels_package(version, compiled, tmp_path):
    wheel = wheel_or_skip(version)
    members = wheel_members(wheel)
    made = make_build(f"sglang=={version}", root=tmp_path)
    files = sorted(p.relative_to(made.site).as_posix() for p in (made.site / "sglang").rglob("*")
                   if p.is_file())
    assert files == sorted(members)
    with zipfile.ZipFile(wheel) as zf:
        h = hashlib.sha256()
        for name in files:
            data = zf.read(name)
            assert (made.site / name).read_bytes() == data, name
            h.update(name.removeprefix("sglang/").encode() + b"\0" + data)
            executable = bool((members[name].external_attr >> 16) & 0o111)
            assert os.access(made.site / name, os.X_OK) == executable, name
    m = made.manifest
    assert m["format"] == 2 and m["file_count"] == len(members)
    assert m["package_hash"] == h.hexdigest()
    assert m["wheel"] == {"name": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    assert [f["path"] for f in m["native"]["compiled"]] == sorted(n for n in members
                                                                  if n.endswith(".so"))
    assert m["native"]["declared"] == [] and m["native"]["missing"] == []
    assert m["native"]["summary"] == (f"{len(compiled)} compiled extension"
                                      f"{'s' if len(compiled) > 1 else ''} from the wheel "
                                      f"({', '.join(compiled)})")
    if version == "0.5.23":  # what sglang.kernels.jit looks for as it is imported
        jit = made.site / "sglang" / "kernels" / "jit"
        assert any((jit / "include").iterdir()) and any((jit / "csrc").iterdir())


# The Rust TreeCore's extension links libtorch (its RUNPATH is torch/lib beside the package, as
# installed), so torch is imported first, as SGLang's own loader does. Its parent packages are
# registered with the build's directories: sglang/__init__.py imports SGLang's runtime
# dependencies (orjson and the rest), which this project's python does not have.
TREE_CORE_IMPORT = """
import hashlib, sys, types
from array import array
import torch
site = sys.argv[1]
for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
    module = types.ModuleType(name)
    module.__path__ = [site + "/" + name.replace(".", "/")]
    sys.modules[name] = module
import sglang.srt.mem_cache.rust_tree_core.mem_cache as core
print(core.__file__)
print(" ".join(core.get_hash_str(array("q", [1, 2, 3, 4]), None, 2)))
"""


def test_a_build_of_0_5_23_imports_its_rust_tree_core(tmp_path):
    wheel_or_skip("0.5.23")
    made = make_build("sglang==0.5.23", root=tmp_path)
    out = subprocess.run([sys.executable, "-c", TREE_CORE_IMPORT, str(made.site)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    path, hashes = out.stdout.split("\n")[:2]
    assert path == str(made.site / "sglang" / "srt" / "mem_cache" / "rust_tree_core"
                       / "mem_cache.cpython-311-x86_64-linux-gnu.so")
    # the core's page hashes: SHA-256 over each page's token ids (32-bit), chained
    first = hashlib.sha256(array("i", [1, 2]).tobytes())
    second = hashlib.sha256(first.digest() + array("i", [3, 4]).tobytes())
    assert hashes.split() == [first.hexdigest(), second.hexdigest()]


@pytest.mark.sglang_contract
def test_sglangs_own_loader_takes_the_builds_rust_tree_core(tmp_path):
    """In 0.5.23's env (SGLang's runtime dependencies), SGLang's Rust extension loader imports
    the build's bundled TreeCore, compiling nothing."""
    from tests.engines.test_sglang_contract import release_python

    python = release_python("0.5.23")
    made = make_build("sglang==0.5.23", root=tmp_path)
    code = ("from sglang.srt.mem_cache.rust_tree_core.extension import bindings\n"
            "print(bindings.__file__)")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **made.env(), "SGLANG_RUST_BUILD_MODE": "never"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(
        made.site / "sglang" / "srt" / "mem_cache" / "rust_tree_core"
        / "mem_cache.cpython-311-x86_64-linux-gnu.so")


def test_a_build_of_an_older_format_is_not_reused(repo, tmp_path):
    path, before, _ = repo
    root = tmp_path / "builds"
    source = parse_source(f"git:{path}@{before}")
    old_key = hashlib.sha256(json.dumps({"kind": "git", "location": source.location,
                                         "ref": before, "patches": []},
                                        sort_keys=True).encode()).hexdigest()[:16]
    (root / old_key / "site" / "sglang").mkdir(parents=True)  # format 1: no format in its key
    (root / old_key / "manifest.json").write_text(json.dumps({"key": old_key}))
    made = make_build(f"git:{path}@{before}", root=root)
    assert not made.reused and made.key != old_key and made.manifest["format"] == 2
