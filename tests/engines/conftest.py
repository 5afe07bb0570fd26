"""Fixtures of the tests that run real SGLang 0.5.17 on this CPU: its environment and the shipped
tiny Qwen3-Next.

The environment is ``make sglang-cpu``'s (``.venv-sglang-cpu/`` in the checkout) when it is up to
date, else the one beside the contract envs (``$EVALSVC_SGLANG_ENV_DIR``, default
``~/.cache/evalsvc/sglang-envs``), made there by the same recipe (``evalsvc.builds.sglang_cpu``)
when missing, so that a second run reuses it. A missing kernel wheel fails these tests under CI
and skips them elsewhere, naming what to do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evalsvc.builds import sglang_cpu
from evalsvc.builds.sglang_env import env_root
from evalsvc.paths import shipped_sglang_model_dir
from tests.conftest import in_ci

ENV_NAME = "cpu-0.5.17"


def missing_sglang_cpu(exc: Exception) -> None:
    """Fail under CI, skip elsewhere: real SGLang on this CPU cannot run here."""
    if in_ci():
        pytest.fail(f"CI is set and real SGLang on this CPU needs its kernel wheels: {exc}",
                    pytrace=False)
    pytest.skip(f"{exc} (then `make sglang-cpu`)")


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """The python of an up-to-date SGLang CPU environment."""
    try:
        wheels = sglang_cpu.kernel_wheels()
    except sglang_cpu.SGLangCPUError as exc:
        missing_sglang_cpu(exc)
    for dest in (sglang_cpu.DEFAULT_DEST, env_root() / ENV_NAME):
        if sglang_cpu.up_to_date(dest, wheels):
            return dest / "bin" / "python"
    return sglang_cpu.ensure(env_root() / ENV_NAME)


@pytest.fixture(scope="session")
def qwen3_next() -> Path:
    """The shipped tiny Qwen3-Next, trained (training/qwen3_next.py; CI never trains)."""
    model = shipped_sglang_model_dir("qwen3-next-tiny")
    assert model is not None
    return model


@pytest.fixture
def sglang_one_thread(monkeypatch) -> None:
    """The SGLang servers a test starts compute on one thread, as the embedded engine does by
    default (``EVALSVC_ENGINE_THREADS``). Without its AMX path SGLang leaves torch at one thread
    per core, and the suite's three workers share two cores: a second thread only waits on the
    others' work (BENCHMARKS.md, "The test suite"). Engines inherit the variable from the test."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
