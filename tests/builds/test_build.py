"""Engine builds: a git repository's commits laid over, cached, patched, with a manifest.

The repository is made in a temporary directory from a real release's sources (0.5.19, the last
release without PR #37165): one commit as released, one with the fix as it went upstream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from evalsvc.builds.build import BuildError, download_wheel, make_build
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
    # every fix up to 0.5.20 is in it; #39342 came in 0.5.23
    assert {r["fix"]: r["status"] for r in rows} == {
        **dict.fromkeys(FIXES, "present"), "pr39342-mixed-chunk-mamba-tracking": "absent"}
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
