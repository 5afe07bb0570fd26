"""evalsvc as a real package: its wheel carries the matrices, thresholds, nightly schedules and the
dashboard's templates and static files (package data, read through importlib.resources), and an
installed wheel, not the editable checkout, runs ``evalsvc run smoke`` from another directory.

The wheel goes into a fresh virtual environment without downloading anything: a ``.pth`` line
there points at this environment's site-packages for the dependencies (torch and the rest), and the
wheel is installed with --no-deps; the checks make sure that the installed evalsvc is the one
imported. About a minute (one config of the smoke matrix on the embedded engine)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheels

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "mamba2-eb-ov-c64"  # one config of the smoke matrix: about 30 s on two CPU cores
SHIPPED = ["evalsvc/configs/smoke.yaml", "evalsvc/configs/smoke-bf16.yaml",
           "evalsvc/configs/mamba-full.yaml", "evalsvc/configs/sglang-cpu.yaml",
           "evalsvc/configs/sglang-cpu-full.yaml", "evalsvc/configs/sglang-inkling.yaml",
           "evalsvc/engines/sglang_inkling_tiny.py",
           "evalsvc/assets/sglang-models/inkling-tiny/model.safetensors",
           "evalsvc/configs/thresholds.yaml", "evalsvc/configs/nightly.yaml",
           "evalsvc/dashboard/templates/base.html", "evalsvc/dashboard/templates/overview.html",
           "evalsvc/dashboard/static/dashboard.css", "evalsvc/dashboard/static/dashboard.js"]

PROBE = """
import json, sys
from pathlib import Path
import evalsvc
from evalsvc.app import create_app
from evalsvc.dashboard.views import DASHBOARDS_DIR, templates
from evalsvc.matrix import matrix_names, resolve_matrix_path
from evalsvc.paths import SHIPPED_CONFIGS_DIR, config_file
from evalsvc.settings import Settings
from fastapi.testclient import TestClient

app = create_app(Settings(data_dir=Path(sys.argv[1]), nightly=False), start_runner=False)
with TestClient(app) as client:
    page, css = client.get("/"), client.get("/static/dashboard.css")
print(json.dumps({
    "evalsvc": evalsvc.__file__, "configs": str(SHIPPED_CONFIGS_DIR),
    "smoke": str(resolve_matrix_path("smoke", allow_path=False)), "matrices": matrix_names(),
    "thresholds": str(config_file("thresholds.yaml")), "dashboard": str(DASHBOARDS_DIR),
    "template": templates.get_template("base.html").filename,
    "page": [page.status_code, page.headers.get("content-type", "")],
    "css": [css.status_code, len(css.content)],
}))
"""


def tool(name: str) -> str:
    local = Path(sysconfig.get_path("scripts")) / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (a dependency of evalsvc)")
    return found


def run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float
        ) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{argv[:3]}: exit {res.returncode}\n{res.stdout[-4000:]}\n" \
                                f"{res.stderr[-4000:]}"
    return res


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that would import the checkout's evalsvc."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("EVALSVC_")}
    return {**env, **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (the checkout stays untouched) with this
    environment's setuptools (no build isolation: nothing downloaded)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT / "evalsvc", src / "evalsvc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(work / "dist"), str(src)], cwd=work, env=clean_env(), timeout=300)
    (found,) = (work / "dist").glob("evalsvc-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh environment with the wheel installed (--no-deps) and this environment's
    site-packages behind it, through a .pth line, for the dependencies."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root.parent,
        env=clean_env(), timeout=120)
    python = root / "bin" / "python"
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       cwd=root, env=clean_env(), timeout=60).stdout.strip())
    (purelib / "zz_evalsvc_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run([tool("uv"), "pip", "install", "--offline", "--no-deps", "--python", str(python),
         str(wheel)], cwd=root, env=clean_env(), timeout=300)
    return root


def test_the_wheel_carries_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in SHIPPED if n not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    assert not any(n.startswith(("configs/", "dashboards/")) for n in names), "top-level data"
    templates = {n for n in names if n.startswith("evalsvc/dashboard/templates/")}
    assert templates == {f"evalsvc/dashboard/templates/{p.name}"
                         for p in (ROOT / "evalsvc" / "dashboard" / "templates").glob("*.html")}


def test_the_installed_wheel_finds_its_files(venv, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = run([str(venv / "bin" / "python"), "-c", PROBE, str(tmp_path / "data")], cwd=elsewhere,
              env=clean_env(), timeout=300)
    found = json.loads(res.stdout.strip().splitlines()[-1])
    package = Path(found["evalsvc"]).parent
    assert package.is_relative_to(venv) and "site-packages" in package.parts, found["evalsvc"]
    assert not package.is_relative_to(ROOT), "the checkout's evalsvc was imported"
    assert Path(found["configs"]) == package / "configs"
    assert Path(found["smoke"]) == package / "configs" / "smoke.yaml"
    assert {"smoke", "smoke-bf16", "mamba-full", "sglang-cpu"} <= set(found["matrices"])
    assert Path(found["thresholds"]) == package / "configs" / "thresholds.yaml"
    assert Path(found["dashboard"]) == package / "dashboard"
    assert Path(found["template"]) == package / "dashboard" / "templates" / "base.html"
    assert found["page"][0] == 200 and found["page"][1].startswith("text/html"), found["page"]
    assert found["css"][0] == 200 and found["css"][1] > 0


def test_the_installed_wheel_runs_the_smoke_matrix_from_another_directory(venv, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    run([str(venv / "bin" / "evalsvc"), "run", "smoke", "--no-store", "--config", CONFIG,
         "--out", str(out)], cwd=elsewhere,
        env=clean_env(EVALSVC_DATA_DIR=str(tmp_path / "data")), timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert summary and {row["config"] for row in summary} == {CONFIG}
    assert all(row["verdict"] == "pass" for row in summary), summary
    assert not (elsewhere / "configs").exists() and not any(elsewhere.iterdir())
