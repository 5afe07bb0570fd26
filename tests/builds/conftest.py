"""Real SGLang releases' sources for the build tests: wheels downloaded once into
``$EVALSVC_WHEEL_CACHE`` and unpacked per session. With ``CI`` set a wheel that cannot be downloaded
fails the test; elsewhere it is skipped with the reason."""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from evalsvc.builds.build import BuildError, download_wheel


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unpack_sources(wheel: Path, dest: Path) -> Path:
    """The wheel's Python files and its ``.dist-info`` (not its compiled extensions) under ``dest``."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(".py") or ".dist-info/" in m]
        archive.extractall(dest, members)
    return dest


@pytest.fixture(scope="session")
def release_tree(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``release_tree(version)``: an unpacked wheel root (shared by the session: do not modify)."""
    roots: dict[str, Path] = {}
    failures: dict[str, str] = {}  # tried once per session

    def get(version: str) -> Path:
        if version not in roots and version not in failures:
            try:
                wheel = download_wheel(version)
            except BuildError as exc:
                failures[version] = str(exc)
            else:
                roots[version] = unpack_sources(wheel, tmp_path_factory.mktemp(f"sglang-{version}"))
        if version in failures:
            if not in_ci():
                pytest.skip(f"sglang {version} wheel not available (CI is not set): {failures[version]}")
            pytest.fail(failures[version], pytrace=False)
        return roots[version]

    return get


@pytest.fixture
def writable_tree(release_tree: Callable[[str], Path], tmp_path: Path) -> Callable[[str], Path]:
    """``writable_tree(version)``: a private copy of the release's unpacked tree."""

    def get(version: str) -> Path:
        return Path(shutil.copytree(release_tree(version), tmp_path / version))

    return get
