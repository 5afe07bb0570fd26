"""The engine boundary: how a config becomes a running server, for either engine.

Both engines speak SGLang's HTTP API and take SGLang's flags; they differ only in the command that
starts them. ``EngineSpec`` says which engine (and for SGLang, which python and release).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from evalsvc.engines.launch import EngineProcess
from evalsvc.engines.registry import DEFAULT_ENGINE, EngineName, engine_kind


@dataclass
class EngineSpec:
    kind: EngineName = DEFAULT_ENGINE  # a name of engines.registry.ENGINES
    python: str | None = None  # the engine build's python (sglang); default: this one
    # the name of that python's environment (builds.engine_envs), by which a Ray node finds its own
    env_name: str | None = None
    version: str | None = None  # SGLang release the command line is spelled for (None: newest)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 120.0
    host: str = "127.0.0.1"  # loopback only: the command builders refuse any other
    die_with_parent: bool = False  # the engine is killed when its launcher dies (Ray workers)
    unset_env: list[str] = field(default_factory=list)  # names the engine does not inherit

    def with_env(self, env: dict[str, str]) -> EngineSpec:
        """This spec with ``env`` (a matrix's ``engine_env``) under its own variables."""
        return replace(self, env={**env, **self.env}) if env else self


def engine_command(spec: EngineSpec, args: dict[str, Any], port: int) -> list[str]:
    """The argument list that starts a server for ``args`` (SGLang ServerArgs fields)."""
    return engine_kind(spec.kind).command(args, port=port, python=spec.python or sys.executable,
                                          version=spec.version, host=spec.host)


def spawn(spec: EngineSpec, args: dict[str, Any], port: int,
          log_path: Path | None) -> EngineProcess:
    """Start a server's process; not ready yet (``EngineProcess.wait_ready``)."""
    proc = EngineProcess(engine_command(spec, args, port), port, env=spec.env, log_path=log_path,
                         startup_timeout=spec.startup_timeout, host=spec.host,
                         die_with_parent=spec.die_with_parent, unset_env=spec.unset_env)
    proc.start()
    return proc


def launch(spec: EngineSpec, args: dict[str, Any], port: int,
           log_path: Path | None) -> EngineProcess:
    """Start a server and wait until it is healthy (raises EngineStartError with the log tail;
    the process stopped)."""
    proc = spawn(spec, args, port, log_path)
    try:
        proc.wait_ready()
    except BaseException:
        proc.stop()
        raise
    return proc
