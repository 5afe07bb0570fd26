"""The job page's build card shows a build's native parts and its base environment's torch and CPU
kernel, from manifests that real builds wrote: a release's wheel (compiled extensions), a source
tree that declares Rust extensions it does not hold, over a CPU environment's python."""

from __future__ import annotations

import html as html_lib
import re
import venv
from datetime import UTC, datetime

from evalsvc.builds.build import make_build
from evalsvc.jobs.builds import made_build_ref
from evalsvc.store.db import Store
from tests.builds.test_native import AVX512, PORTABLE, SO, fake_env, fake_wheel, sglang_tree
from tests.dashboard.test_pages import CLEAN, MAMBA, make_client, results
from tests.store.factories import build_ref, record


def card(html: str) -> str:
    """The (first) build card of a job page, as text without tags."""
    start = html.index('<section class="card build"')
    section = html[start:html.index("</section>", start)]
    return " ".join(html_lib.unescape(re.sub(r"<[^>]+>", " ", section)).split())


def test_the_build_card_shows_native_parts_and_the_base_torch_and_kernel(tmp_path, monkeypatch):
    env = tmp_path / "cpu-env"
    venv.create(env, with_pip=False)
    fake_env(env, {"recipe": {"recipe_version": 3, "portable_kernel": PORTABLE, "kernel": AVX512}})
    python = str(env / "bin" / "python")
    monkeypatch.setenv("EVALSVC_WHEEL_CACHE", str(tmp_path / "wheels"))
    files = {"sglang/__init__.py": (b"", 0o644),
             f"sglang/srt/mem_cache/rust_tree_core/mem_cache{SO}": (b"\x7fELF", 0o755)}
    fake_wheel(tmp_path / "wheels", files, {n: d for n, (d, _) in files.items()})
    release = make_build("sglang==9.9.9", base_python=python, root=tmp_path / "builds").manifest
    tree = make_build(f"path:{sglang_tree(tmp_path / 'src')}", base_python=python,
                      root=tmp_path / "builds").manifest
    when = datetime(2026, 3, 1, tzinfo=UTC)
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        record(store, tmp_path / "results", "job-release", made_build_ref(release, when),
               [results(MAMBA, "mamba2", CLEAN)])
        record(store, tmp_path / "results", "job-tree", made_build_ref(tree, when, commit="ddd444"),
               [results(MAMBA, "mamba2", CLEAN)])
        record(store, tmp_path / "results", "job-old", build_ref("eee555"),  # recorded before
               [results(MAMBA, "mamba2", CLEAN)])
    finally:
        store.close()
    with make_client(tmp_path) as client:
        wheel, source, old = (card(client.get(f"/jobs/{job}").text)
                              for job in ("job-release", "job-tree", "job-old"))
    assert "native parts 1 compiled extension from the wheel (rust_tree_core) base torch" in wheel
    assert ("base torch / kernel torch none CPU kernel "
            f"{PORTABLE['wheel']} sha256 aaaaaaaaaaaa beside it {AVX512['wheel']} (kernel) "
            "sha256 bbbbbbbbbbbb base environment") in wheel
    assert ("native parts declares rust_tree_core, server; not built: Python core will run "
            "missing sglang.srt.mem_cache.rust_tree_core.mem_cache "
            "(rust/sglang-radix-tree/Cargo.toml) : the Python TreeCore runs (SGLang falls back to it "
            "silently) missing sglang.srt.rust_extensions._server (rust/sglang-server/Cargo.toml) : "
            "SGLang runs without sglang.srt.rust_extensions._server") in source
    assert "evalsvc compiles no Rust extension" in source
    assert "native parts not recorded base torch / kernel torch none base environment" in old
