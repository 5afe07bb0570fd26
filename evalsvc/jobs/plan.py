"""What a job runs on one build: the matrix expanded for the engine, narrowed to the configs asked.

Pure (no store, no engine): the service plans each build of a job with it, ``evalsvc run`` its
one build, and a job's validation checks the configs it names against it.
"""

from __future__ import annotations

from collections.abc import Iterable

from evalsvc.engines.base import EngineSpec
from evalsvc.engines.registry import engine_kind
from evalsvc.matrix import Config, MatrixFile, expand


class UnknownConfigs(ValueError):
    """Configs asked for that the matrix does not have: ``unknown``, and the ``known`` ones."""

    def __init__(self, matrix: str, unknown: list[str], known: list[str]) -> None:
        super().__init__(f"{', '.join(unknown)}: not in matrix {matrix}")
        self.matrix, self.unknown, self.known = matrix, unknown, known


def hardware(engine: EngineSpec) -> str:
    """The hardware class a config's fingerprint names (the engine kind's: the embedded engine
    runs on CPUs)."""
    return engine_kind(engine.kind).hardware


def plan_runs(matrix: MatrixFile, engine: EngineSpec, workload_version: str = "",
              configs: Iterable[str] | None = None, strict: bool = True) -> list[Config]:
    """The configs to run of ``matrix`` on ``engine`` (for its SGLang release, if any), in the
    matrix's order, only those named in ``configs`` when given. UnknownConfigs when ``configs``
    names one the matrix does not have, unless not ``strict`` (then it is left out: a job
    validated before its build was made, whose release excludes it)."""
    expanded = expand(matrix, hardware=hardware(engine), workload_version=workload_version,
                      sglang_version=engine.version if engine_kind(engine.kind).versioned
                      else None)
    if not configs:
        return expanded
    wanted = set(configs)
    unknown = sorted(wanted - {c.name for c in expanded})
    if unknown and strict:
        raise UnknownConfigs(matrix.name, unknown, [c.name for c in expanded])
    return [c for c in expanded if c.name in wanted]
