"""Building an SGLang env (``evalsvc.builds.sglang_env``) with its installer, uv, against pip,
which built them before, on the same release, with the same packages.

    .venv/bin/python benchmarks/sglang_env.py [--version 0.5.23] [--pairs 2] [--out PATH]

Each pair builds the release's env twice, in turn, each in a temporary folder of its own:

* ``uv``: ``sglang_env._install`` as it is (torch through the env's pip, SGLang and the rest
  through uv, nothing compiled at install; the build's smoke import compiles what it imports);
* ``pip``: ``pip_install`` below, the recipe before (``python -m venv``, pip for everything,
  compiled at install).

Both then run the same smoke import and package listing (``sglang_env._build``). A warm-up pair
runs first and is not counted, so both installers find their caches warm (a first build with cold
caches also downloads what it installs). Reports each build's seconds, its steps and the ratio
uv / pip pair by pair, and checks that both envs hold the same package versions (pip's own and
the seed packages aside). Results go to ``benchmarks/results/sglang_env.json``; BENCHMARKS.md
quotes them. Each pip build takes two to three minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from evalsvc.builds import sglang_env  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SEEDS = {"pip", "setuptools", "wheel"}


def pip_install(version: str, tmp: Path) -> list[dict[str, Any]]:
    """The env's install as it was before uv: every step through pip, compiled at install."""
    steps = []

    def step(name: str, argv: list[str]) -> None:
        t = time.monotonic()
        sglang_env._run(version, name, argv, timeout=3600)
        steps.append({"step": name, "seconds": round(time.monotonic() - t, 1)})

    step("create virtualenv", [sys.executable, "-m", "venv", str(tmp)])
    python = str(sglang_env.env_python(tmp))
    constraints = tmp / "evalsvc-constraints.txt"
    constraints.write_text("\n".join([sglang_env.TORCH, *sglang_env.EXTRA_PINS]) + "\n")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
           "--progress-bar", "off", "-c", str(constraints)]
    step(f"install sglang=={version} --no-deps", [*pip, "--no-deps", f"sglang=={version}"])
    pins = sglang_env.sglang_pins(sglang_env._site_packages(tmp, version), version)
    constraints.write_text("\n".join([sglang_env.TORCH, *sglang_env.EXTRA_PINS, *pins]) + "\n")
    step("install dependencies", [*pip, sglang_env.TORCH, *sglang_env._dependencies(version)])
    (sglang_env._site_packages(tmp, version) / "sitecustomize.py").write_text(
        sglang_env.SITECUSTOMIZE)
    return steps


def build(version: str, installer: str) -> dict[str, Any]:
    """One build in a temporary env folder, removed after: its marker's figures."""
    install = sglang_env._install if installer == "uv" else pip_install
    with tempfile.TemporaryDirectory(prefix=f"env-{installer}-") as root:
        t = time.monotonic()
        real = sglang_env._install
        sglang_env._install = install
        try:
            sglang_env._build(version, Path(root), Path(root) / version)
        finally:
            sglang_env._install = real
        seconds = time.monotonic() - t
        marker = sglang_env.read_marker(Path(root) / version)
    packages = {k.lower().replace("_", "-"): v for k, v in marker["packages"].items()
                if k.lower() not in SEEDS}
    return {"seconds": round(seconds, 1), "steps": marker["steps"],
            "size_mib": marker["size_bytes"] >> 20, "packages": packages}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="0.5.23")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "sglang_env.json")
    args = ap.parse_args(argv)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # as `make test` runs the builds
    pairs = []
    for i in range(args.pairs + 1):
        uv, pip = build(args.version, "uv"), build(args.version, "pip")
        if uv["packages"] != pip["packages"]:
            diff = sorted(set(uv["packages"].items()) ^ set(pip["packages"].items()))
            raise SystemExit(f"the two envs differ: {diff}")
        label = "warm-up" if i == 0 else f"pair {i}"
        print(f"{label}: uv {uv['seconds']} s, pip {pip['seconds']} s, "
              f"ratio {uv['seconds'] / pip['seconds']:.2f}", flush=True)
        if i:
            pairs.append({"uv": {k: uv[k] for k in ("seconds", "steps", "size_mib")},
                          "pip": {k: pip[k] for k in ("seconds", "steps", "size_mib")},
                          "ratio": round(uv["seconds"] / pip["seconds"], 3)})
    out = {"version": args.version, "packages": len(uv["packages"]), "pairs": pairs,
           "median_ratio": statistics.median(p["ratio"] for p in pairs),
           "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"median uv / pip: {out['median_ratio']:.2f} ({len(pairs)} pairs, "
          f"{out['packages']} packages alike); {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
