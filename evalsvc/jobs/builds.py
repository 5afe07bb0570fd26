"""A build of a job made ready to run: the engine spec its runs launch, the build the store
records, and the build request each run carries. One way for the job service and ``evalsvc run``.

An SGLang build is made where the runs go (``prepare``: the dispatcher's ``prepare_build``, the
local one for ``evalsvc run``); the embedded engine's build is its environment and is read here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from evalsvc.engines.base import EngineSpec
from evalsvc.engines.registry import engine_kind
from evalsvc.jobs.spec import BuildSpec
from evalsvc.store.record import BuildRef

SGLANG_REPOSITORY = "sgl-project/sglang"


class Prepare(Protocol):
    def __call__(self, source: str | None, patches: list[str], python: str | None,
                 env_name: str | None = None) -> dict[str, Any]:
        """``dispatch.base.prepare_build`` where the runs go, over the SGLang environment
        ``python`` (named ``env_name``); BuildError if it cannot be made."""


@dataclass(frozen=True)
class Provenance:
    """What the operator says of the evaluated build where the build cannot tell (``evalsvc run``'s
    ``--repository``, ``--commit``, ``--commit-time``, ``--branch``); a build's own commit wins."""

    repository: str | None = None
    commit: str | None = None
    committed_at: datetime | None = None
    branch: str | None = None


class ReadyBuild(NamedTuple):
    engine: EngineSpec  # what the runs launch (the embedded build's environment in it)
    ref: BuildRef  # what the store records
    request: dict[str, Any] | None  # what each SGLang run carries (``dispatch.base``); None: none


def ready_build(base: EngineSpec, build: BuildSpec | dict[str, Any], prepare: Prepare,
                builds_dir: Path, said: Provenance | None = None) -> ReadyBuild:
    """One build of a job on ``base`` (the job's engine kind and SGLang python); an embedded
    build's git source is read through its mirror in ``builds_dir``. BuildError naming the
    source, commit, patch or file when it cannot be made."""
    b = BuildSpec.model_validate(build) if isinstance(build, dict) else build  # a stored job's
    said = said or Provenance()
    when = said.committed_at or datetime.now(UTC)
    if engine_kind(base.kind).local_builds:
        from evalsvc.builds.embedded import embedded_build

        eb = embedded_build(b.source, b.patches, builds_dir)
        sha = eb.sha or said.commit
        ref = BuildRef(said.repository or eb.repository, sha=sha,
                       version=None if sha else eb.version,
                       committed_at=said.committed_at or eb.committed_at, branch=said.branch,
                       patches=eb.patches, manifest=eb.manifest)
        return ReadyBuild(replace(base, env={**base.env, **eb.env}), ref, None)
    from evalsvc.dispatch.base import InstalledBuild, build_info

    info = build_info(prepare(b.source, b.patches, base.python, base.env_name))
    if isinstance(info, InstalledBuild):  # the SGLang installed in the engine's python
        ref = BuildRef(said.repository or SGLANG_REPOSITORY, sha=said.commit,
                       version=None if said.commit else info.version, committed_at=when,
                       branch=said.branch)
        return ReadyBuild(replace(base, version=info.version), ref, info.request())
    ref = made_build_ref(info.manifest, when, said.repository, said.commit, said.branch)
    return ReadyBuild(replace(base, version=info.manifest.get("version")), ref, info.request())


def made_build_ref(manifest: dict[str, Any], committed_at: datetime,
                   repository: str | None = None, commit: str | None = None,
                   branch: str | None = None) -> BuildRef:
    """The build the store records for an SGLang build made from a source (its manifest,
    ``builds.build``): its repository and commit (``repository``, ``commit``: what the operator
    says, where the manifest names none), else its release, else its code's hash."""
    m = manifest
    return BuildRef(repository=repository or (m["location"] if m["kind"] != "pypi"
                                              else SGLANG_REPOSITORY),
                    sha=m.get("commit") or commit,
                    version=m.get("version") or (None if m.get("commit") or commit
                                                 else "tree-" + m["package_hash"][:12]),
                    committed_at=committed_at, branch=branch, patches=m["patches"],
                    probes={p["fix"]: p["status"] for p in m["probes_after"]},
                    base_env=m.get("base_env"), manifest=m)
