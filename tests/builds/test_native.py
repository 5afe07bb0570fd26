"""A build's native parts: the Rust extensions a git or path tree declares (SGLang's layouts of
2026 and of 0.5.13's time), which of them the build holds, and the base environment's CPU kernel,
read from fake environment directories. No wheels: the trees are written here."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import venv
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

import pytest

from evalsvc.builds.build import (
    BUILD_FORMAT,
    BuildError,
    base_env_info,
    build_key,
    make_build,
    parse_source,
)
from evalsvc.builds.native import (
    CPU_MARKER,
    NativeError,
    abi_mismatch,
    cpu_kernel,
    declared_extensions,
    label,
    native_section,
)

TREE_CORE = "sglang.srt.mem_cache.rust_tree_core.mem_cache"
SERVER = "sglang.srt.rust_extensions._server"
SO = ".cpython-311-x86_64-linux-gnu.so"
GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def sglang_tree(root: Path) -> Path:
    """SGLang's layout of 2026: python/sglang, rust/ with a workspace, the server crate in it and
    the radix-tree crate in its own workspace, named by the root's extension-manifests."""
    write(root / "python" / "sglang" / "__init__.py", "__version__ = '0.5.99'\n")
    write(root / "python" / "sglang" / "srt" / "mem_cache" / "rust_tree_core" / "__init__.py", "")
    write(root / "python" / "pyproject.toml", '[project]\nname = "sglang"\n')
    write(root / "rust" / "Cargo.toml",
          '[workspace]\nmembers = ["sglang-server"]\nexclude = ["sglang-radix-tree"]\n\n'
          '[workspace.metadata.sglang]\nextension-manifests = ["sglang-radix-tree/Cargo.toml"]\n')
    write(root / "rust" / "sglang-radix-tree" / "Cargo.toml",
          '[package]\nname = "sglang-radix-tree"\nversion = "0.1.0"\n\n'
          f'[package.metadata.sglang]\npython-module = "{TREE_CORE}"\nfeatures = ["python-extension"]\n'
          '\n[lib]\nname = "mem_cache"\ncrate-type = ["cdylib"]\n')
    write(root / "rust" / "sglang-server" / "Cargo.toml",
          '[package]\nname = "sglang-server"\nversion.workspace = true\n\n'
          f'[package.metadata.sglang]\npython-module = "{SERVER}"\n')
    write(root / "rust" / "sglang-types" / "Cargo.toml",  # a library crate: no extension
          '[package]\nname = "sglang-types"\nversion = "0.1.0"\n')
    return root


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_a_source_tree_declares_its_rust_extensions(tmp_path):
    tree = sglang_tree(tmp_path / "src")
    assert declared_extensions(tree) == [
        {"module": TREE_CORE, "crate": "sglang-radix-tree",
         "declared_in": "rust/sglang-radix-tree/Cargo.toml"},
        {"module": SERVER, "crate": "sglang-server", "declared_in": "rust/sglang-server/Cargo.toml"}]
    # 0.5.13's time: python/pyproject.toml's setuptools-rust table (and a maturin module name)
    old = tmp_path / "old"
    write(old / "python" / "pyproject.toml",
          '[[tool.setuptools-rust.ext-modules]]\ntarget = "sglang.srt.grpc._core"\n'
          'path = "../rust/sglang-grpc/Cargo.toml"\nbinding = "PyO3"\n\n'
          '[[tool.setuptools-rust.ext-modules]]\ntarget = "other_package._core"\npath = "x/Cargo.toml"\n'
          '\n[tool.maturin]\nmodule-name = "sglang.srt.fast._core"\n')
    write(old / "rust" / "sglang-grpc" / "Cargo.toml", '[package]\nname = "sglang-grpc"\n')
    assert declared_extensions(old) == [
        {"module": "sglang.srt.fast._core", "crate": None, "declared_in": "python/pyproject.toml"},
        {"module": "sglang.srt.grpc._core", "crate": "sglang-grpc",
         "declared_in": "python/pyproject.toml"}]
    assert declared_extensions(tmp_path / "nothing-here") == []
    assert [label(m) for m in (TREE_CORE, SERVER, "sglang.srt.grpc._core")] == [
        "rust_tree_core", "server", "grpc._core"]


@pytest.mark.parametrize(("path", "text", "message"), [
    ("rust/sglang-radix-tree/Cargo.toml", "[package\nname = 1", r"rust/sglang-radix-tree/Cargo\.toml: "
     r"cannot be read as TOML"),
    ("rust/sglang-server/Cargo.toml", '[package]\nname = "s"\n[package.metadata.sglang]\n'
     'python-module = "elsewhere._core"\n', r"python-module must name a module of the sglang "
     r"package, not 'elsewhere._core'"),
    ("rust/Cargo.toml", '[workspace.metadata.sglang]\nextension-manifests = ["gone/Cargo.toml"]\n',
     r"rust/Cargo\.toml: .*extension-manifests names 'gone/Cargo\.toml', which is not there"),
])
def test_a_declaration_that_cannot_be_read_fails_the_build_naming_the_file(tmp_path, path, text,
                                                                           message):
    tree = sglang_tree(tmp_path / "src")
    write(tree / path, text)
    with pytest.raises(NativeError, match=message):
        declared_extensions(tree)
    with pytest.raises(BuildError, match=message):
        make_build(f"path:{tree}", root=tmp_path / "builds")
    assert [p.name for p in (tmp_path / "builds").iterdir()] == []


def test_a_path_build_says_which_declared_extensions_it_lacks(tmp_path):
    tree = sglang_tree(tmp_path / "src")
    native = make_build(f"path:{tree}", root=tmp_path / "builds").manifest["native"]
    assert native["compiled"] == []
    assert [(d["module"], d["status"]) for d in native["declared"]] == [
        (TREE_CORE, "missing"), (SERVER, "missing")]
    assert native["missing"] == [TREE_CORE, SERVER]
    assert "Python TreeCore" in native["declared"][0]["without"]
    assert native["note"].startswith("evalsvc compiles no Rust extension")
    assert native["summary"] == "declares rust_tree_core, server; not built: Python core will run"
    # the same tree with the TreeCore built in place (an editable install): present, with its hash
    so = write(tree / "python" / "sglang" / "srt" / "mem_cache" / "rust_tree_core" / f"mem_cache{SO}",
               "not really ELF")
    built = make_build(f"path:{tree}", root=tmp_path / "builds2").manifest
    native = built["native"]
    assert [(d["module"], d["status"]) for d in native["declared"]] == [
        (TREE_CORE, "present"), (SERVER, "missing")]
    assert native["compiled"] == [{
        "path": f"sglang/srt/mem_cache/rust_tree_core/mem_cache{SO}", "module": TREE_CORE,
        "abi": "cpython-311-x86_64-linux-gnu", "size": so.stat().st_size,
        "sha256": hashlib.sha256(b"not really ELF").hexdigest()}]
    assert native["summary"] == ("1 compiled extension in the tree (rust_tree_core); declares "
                                 "server; not built: SGLang runs without them")
    assert built["file_count"] == 3  # __init__.py twice and the extension


def test_a_git_build_reads_the_commits_tree_and_python_dir_as_a_path(tmp_path):
    tree = sglang_tree(tmp_path / "src")
    git(tree, "init", "-q", "-b", "main")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "tree")
    made = make_build(f"git:{tree}@main", root=tmp_path / "builds")
    native = made.manifest["native"]
    assert native["missing"] == [TREE_CORE, SERVER]
    assert not (made.directory / "tree").exists()  # the exported tree is not kept
    assert sorted(p.name for p in made.directory.iterdir()) == ["manifest.json", "site"]
    # path:python/ of SGLang's layout: rust/ beside it is the tree's
    beside = make_build(f"path:{tree / 'python'}", root=tmp_path / "builds")
    assert beside.manifest["native"]["missing"] == [TREE_CORE, SERVER]


def test_compiled_files_for_another_python_cannot_load(tmp_path):
    site = tmp_path / "site"
    write(site / "sglang" / "__init__.py", "")
    write(site / "sglang" / "srt" / "rust_extensions" / f"_server{SO}", "x")
    write(site / "sglang" / "srt" / "grpc" / "_core.abi3.so", "x")
    write(site / "sglang" / "srt" / "grpc" / "__pycache__" / "junk.cpython-311.so", "x")
    native = native_section("pypi", site, base_python="3.12.1")
    assert [f["module"] for f in native["compiled"]] == ["sglang.srt.grpc._core", SERVER]
    assert native["unloadable"] == [f"sglang/srt/rust_extensions/_server{SO}"]
    assert native["summary"] == ("2 compiled extensions from the wheel (grpc._core, server); 1 "
                                 "compiled for another CPython than the base python 3.12.1: they "
                                 "cannot load")
    assert abi_mismatch(native["compiled"], "3.11.7") == [] == abi_mismatch(native["compiled"], None)
    assert native_section("pypi", tmp_path / "none")["summary"] == "no compiled extensions in the wheel"


def fake_env(root: Path, marker: dict | None, dist: str | None = "sglang_kernel_cpu-0.4.5+avx2",
             url: str | None = "file:///shared/sglang_kernel_cpu-0.4.5%2Bavx2-cp311-cp311-linux_x86_64.whl",
             archive_info: dict | None = None) -> tuple[Path, list[Path]]:
    site = root / "lib" / "python3.11" / "site-packages"
    (site / "sgl_kernel").mkdir(parents=True)
    if dist:
        write(site / f"{dist}.dist-info" / "METADATA",
              f"Metadata-Version: 2.1\nName: sglang-kernel-cpu\nVersion: {dist.split('-')[1]}\n\nbody\n")
        if url:
            write(site / f"{dist}.dist-info" / "direct_url.json",
                  json.dumps({"url": url, "archive_info": archive_info or {}}))
    if marker is not None:
        write(root / CPU_MARKER, json.dumps(marker))
    return root, [site]


PORTABLE = {"wheel": "sglang_kernel_cpu-0.4.5+avx2-cp311-cp311-linux_x86_64.whl", "sha256": "a" * 64}
AVX512 = {"wheel": "sglang_kernel_cpu-0.4.5-cp311-cp311-linux_x86_64.whl", "sha256": "b" * 64}


def test_the_cpu_kernel_of_a_base_environment(tmp_path):
    # the marker of make sglang-cpu, recipe 3: two builds, the installed one is the portable one
    env = fake_env(tmp_path / "v3", {"recipe": {"recipe_version": 3, "portable_kernel": PORTABLE,
                                                "kernel": AVX512}})
    assert cpu_kernel(*env) == {
        "package": "sglang-kernel-cpu", "version": "0.4.5+avx2", "wheel": PORTABLE["wheel"],
        "sha256": "a" * 64, "recorded_in": CPU_MARKER,
        "other_builds": [{**AVX512, "role": "kernel"}]}
    # recipe 2: one kernel_sha256; the wheel's name from the installer's direct_url.json
    env = fake_env(tmp_path / "v2", {"recipe": {"recipe_version": 2, "kernel_sha256": "c" * 64}},
                   dist="sglang_kernel_cpu-0.4.5",
                   url="file:///shared/sglang_kernel_cpu-0.4.5-cp311-cp311-linux_x86_64.whl")
    got = cpu_kernel(*env)
    assert (got["wheel"], got["sha256"], got["version"]) == (AVX512["wheel"], "c" * 64, "0.4.5")
    assert "other_builds" not in got
    # no marker: the hash pip recorded, else none and a note saying so
    env = fake_env(tmp_path / "pip", None, archive_info={"hashes": {"sha256": "d" * 64}})
    assert cpu_kernel(*env)["sha256"] == "d" * 64 and cpu_kernel(*env)["recorded_in"] == "direct_url.json"
    env = fake_env(tmp_path / "bare", None)
    assert cpu_kernel(*env)["sha256"] is None and "no record" in cpu_kernel(*env)["note"]
    # a GPU environment's sgl_kernel (sgl-kernel) is not the CPU kernel; an env without any: None
    assert cpu_kernel(*fake_env(tmp_path / "gpu", None, dist=None)) is None
    assert cpu_kernel(tmp_path / "empty", [tmp_path / "empty" / "site-packages"]) is None


def test_base_env_info_reads_the_kernel_of_a_real_interpreter(tmp_path):
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    fake_env(env, {"recipe": {"portable_kernel": PORTABLE, "kernel": None}})
    assert Path(site) == env / "lib" / "python3.11" / "site-packages"
    info = base_env_info(str(python))
    assert info["python"] == sys.version.split()[0] and info["prefix"] == str(env)
    assert info["sglang-kernel-cpu"] == "0.4.5+avx2"
    assert info["cpu_kernel"]["sha256"] == "a" * 64 and "other_builds" not in info["cpu_kernel"]
    assert "torch" not in info and "site_dirs" not in info
    with pytest.raises(BuildError, match=r"base python .*no-python: cannot run it"):
        base_env_info(str(tmp_path / "no-python"))


def test_the_build_format_is_part_of_the_key():
    source = parse_source("sglang==0.5.23")
    assert BUILD_FORMAT == 2
    key = build_key(source, "0.5.23", [])
    assert key == build_key(source, "0.5.23", []) and len(key) == 16
    old = hashlib.sha256(json.dumps(
        {"kind": "pypi", "location": "sglang", "ref": "0.5.23", "patches": []},
        sort_keys=True).encode()).hexdigest()[:16]
    assert key != old  # a format-1 build of the same release is another directory


def fake_wheel(cache: Path, files: dict[str, tuple[bytes, int]], record: dict[str, bytes]) -> Path:
    """A wheel of ``sglang==9.9.9`` in the wheel cache: files (name -> (data, mode)), and a RECORD
    that hashes ``record``'s data under each name (with a comma in one name, quoted as CSV)."""
    wheel = cache / "sglang-9.9.9-cp311-cp311-manylinux_2_34_x86_64.whl"
    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100000 | mode) << 16
            zf.writestr(info, data)
        for name, data in record.items():
            digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f'"{name}",sha256={digest},{len(data)}' if "," in name
                        else f"{name},sha256={digest},{len(data)}")
        rows.append("sglang-9.9.9.dist-info/RECORD,,")
        zf.writestr("sglang-9.9.9.dist-info/RECORD", "\n".join(rows) + "\n")
    return wheel


def test_a_wheel_is_unpacked_whole_with_modes_and_checked_against_its_record(tmp_path, monkeypatch):
    cache = tmp_path / "wheels"
    monkeypatch.setenv("EVALSVC_WHEEL_CACHE", str(cache))
    files = {"sglang/__init__.py": (b"", 0o644), f"sglang/srt/_core{SO}": (b"\x7fELF", 0o755),
             "sglang/kernels/jit/include/a,b.h": (b"#pragma once\n", 0o644),
             "tools/not-the-package.py": (b"", 0o644)}
    fake_wheel(cache, files, {name: data for name, (data, _) in files.items()})
    made = make_build("sglang==9.9.9", root=tmp_path / "builds")
    site = made.site
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()) == sorted(
        n for n in files if n.startswith("sglang/"))
    assert os.access(site / f"sglang/srt/_core{SO}", os.X_OK)
    assert not os.access(site / "sglang/__init__.py", os.X_OK)
    assert made.manifest["file_count"] == 3
    assert made.manifest["native"]["summary"] == "1 compiled extension from the wheel (srt._core)"
    # a member whose bytes are not what the RECORD says: the build fails naming it, nothing kept
    tampered = {name: data for name, (data, _) in files.items()}
    tampered["sglang/srt/_core" + SO] = b"other"
    fake_wheel(cache, files, tampered)
    with pytest.raises(BuildError, match=rf"sglang-9\.9\.9-.*\.whl: sglang/srt/_core{SO} does not "
                                         "match the wheel's RECORD"):
        make_build("sglang==9.9.9", root=tmp_path / "other-builds")
    assert list((tmp_path / "other-builds").iterdir()) == []
