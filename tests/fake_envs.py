"""Two SGLang environments as the builders leave them, each standing in for a different release:
``make sglang-cpu``'s (its marker says SGLang 0.5.17) and one of ``evalsvc.builds.sglang_env``'s
(0.5.23). Each one's ``bin/python`` is a script that notes its calls in ``calls`` beside it, then
runs the fake SGLang server reporting its own release (``tests/data/fake-python``), and, asked what
it holds, shows that release's metadata (and nothing else of it)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from evalsvc.builds import engine_envs, sglang_cpu, sglang_env

FAKE_PYTHON = Path(__file__).parent / "data" / "fake-python"
CPU_RELEASE, OTHER_RELEASE = "0.5.17", "0.5.23"
# the names the service gives them (evalsvc/builds/engine_envs.py discovered)
CPU_ENV, OTHER_ENV = f"sglang-cpu-{CPU_RELEASE}", f"sglang-{OTHER_RELEASE}"


def fake_env(prefix: Path, release: str) -> Path:
    """The python of a fake environment at ``prefix`` that holds SGLang ``release``."""
    dist = prefix / "fake-site" / f"sglang-{release}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {release}\n")
    python = prefix / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$@" >> {prefix / "calls"}\n'
        f"export FAKE_SGLANG_VERSION={release}\n"
        'if [ "$1" = "-c" ]; then\n'
        f'    PYTHONPATH={prefix / "fake-site"}${{PYTHONPATH:+:$PYTHONPATH}} '
        'exec "${FAKE_SGLANG_PYTHON:-python3}" "$@"\n'
        "fi\n"
        f'exec {FAKE_PYTHON} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def build_envs(root: Path, monkeypatch) -> dict[str, Path]:
    """Both environments under ``root``, where the service discovers them (this process's
    builders' locations pointed there): their pythons by the names the service lists."""
    cpu = root / "venv-sglang-cpu"
    cpu_python = fake_env(cpu, CPU_RELEASE)
    (cpu / sglang_cpu.MARKER).write_text(json.dumps({"sglang_version": CPU_RELEASE}))
    other = root / "sglang-envs" / OTHER_RELEASE
    other_python = fake_env(other, OTHER_RELEASE)
    (other / sglang_env.MARKER).write_text(json.dumps({"sglang_version": OTHER_RELEASE}))
    monkeypatch.setattr(engine_envs, "SGLANG_CPU_ENV", cpu)
    monkeypatch.setenv(sglang_env.ENV_DIR_VARIABLE, str(root / "sglang-envs"))
    return {CPU_ENV: cpu_python, OTHER_ENV: other_python}


def calls(python: Path) -> str:
    """What the environment of ``python`` was asked to run, a line a call."""
    path = python.parent.parent / "calls"
    return path.read_text() if path.exists() else ""
