"""The engine registry: one entry per kind, and the package asks it instead of comparing names."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from evalsvc.engines.base import EngineSpec, engine_command
from evalsvc.engines.registry import (
    DEFAULT_ENGINE,
    ENGINES,
    EngineName,
    engine_kind,
    is_engine_process,
    kinds_with,
    known_engines,
    serving_engine,
)
from evalsvc.jobs.spec import JobSpec
from evalsvc.matrix import ENGINE_ENV, ENGINE_FLAGS, MatrixFile

PACKAGE = Path(__file__).resolve().parents[2] / "evalsvc"


def test_the_names_are_the_registrys():
    assert set(typing.get_args(EngineName)) == set(ENGINES) == {"embedded", "sglang"}
    assert DEFAULT_ENGINE in ENGINES
    assert known_engines() == "embedded or sglang"
    assert all(name == e.name for name, e in ENGINES.items())
    assert {n: e.flags for n, e in ENGINES.items()} == ENGINE_FLAGS
    assert {n: e.env for n, e in ENGINES.items()} == ENGINE_ENV
    # the pydantic fields take exactly the registry's names
    for model, field in ((MatrixFile, "engine"), (JobSpec, "engine")):
        assert set(model.model_json_schema()["properties"][field]["enum"]) == set(ENGINES)


def test_an_unknown_kind_is_named():
    with pytest.raises(KeyError, match=r"unknown engine 'vllm' \(known: embedded or sglang"):
        engine_kind("vllm")


@pytest.mark.parametrize("kind", list(ENGINES))
def test_each_kind_builds_its_command_line(kind):
    argv = engine_command(EngineSpec(kind=kind, python="/py"), {"model_path": "m", "page_size": 4},
                          port=30000)
    assert argv[0] == "/py" and "--page-size" in argv and argv[argv.index("--port") + 1] == "30000"
    assert is_engine_process(" ".join(argv))
    assert engine_kind(kind).process_marker in " ".join(argv)


def test_capabilities():
    assert kinds_with("injects_defects") == ["embedded"]
    assert kinds_with("uses_engine_envs") == ["sglang"]
    assert kinds_with("local_builds") == ["embedded"]
    assert kinds_with("local_builds", has=False) == ["sglang"]
    assert serving_engine("evalsvc_hybrid") == "embedded"
    assert serving_engine("qwen3_next") == serving_engine(None) == "sglang"
    assert not is_engine_process("/usr/bin/python -m http.server")


# comparisons with such a name that are about something else
NOT_ENGINE_KINDS = {
    "evalsvc/dashboard/views.py": "a build manifest's kind (builds.embedded writes 'embedded')",
}


def test_no_branch_on_an_engine_name_outside_the_registry():
    """A kind's behaviour is an entry's field: no ``engine == "sglang"``, ``kind != "embedded"``,
    ``in ("embedded", "sglang")`` elsewhere (the engine package itself aside)."""
    names = "|".join(map(re.escape, ENGINES))
    pattern = re.compile(rf'\b(engine|kind)\s*(==|!=)\s*"({names})"|in \("({names})", "({names})"\)')
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if path.name == "registry.py" or "embedded" in rel.parts[1:-1]:
            continue
        if str(rel) in NOT_ENGINE_KINDS or "migrations" in rel.parts:  # history keeps its kinds
            continue
        found += [f"{rel}:{i}: {line.strip()}"
                  for i, line in enumerate(path.read_text().splitlines(), 1)
                  if pattern.search(line)]
    assert not found, "\n".join(found)
