"""Builds of the embedded engine: this project's engine with the settings a source tree carries.

The engine's code is this project's; what a build source contributes is its settings file,
``evalsvc-engine.yaml`` at the root of the tree, read at the commit (``git:REPO@COMMIT``, through
the cached mirror of ``build.git_mirror``) or from the directory (``path:DIR``)::

    # engine settings the embedded engine build reads
    defects:
      snapshot-race: 1.0      # name: strength in (0, 1], the fraction of requests it affects
      host-load-race: 0.25

``defects`` is a mapping of defect names to strengths, or a list of names (``NAME`` or
``NAME@STRENGTH``; a bare name is strength 1.0). It is the only key for now. A tree without the file
has no defects. ``defect:NAME`` patches of the build switch that defect on at full strength, over
what the file says. The result is the engine's environment (``EVALSVC_ENGINE_DEFECTS``) and what
identifies the build: the repository as written in the source, the full sha and its committer date
(git), or the directory and a hash of its settings file (a local tree).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from evalsvc.builds.build import BuildError, Source, git, parse_source, resolve_commit
from evalsvc.engines.embedded.defects import ENV_VAR, Defect, check_strength, format_defects

SETTINGS_FILE = "evalsvc-engine.yaml"
SETTINGS_KEYS = ("defects",)
EMBEDDED_REPOSITORY = "evalsvc/embedded"


@dataclass
class EmbeddedBuild:
    """The engine environment of an embedded build and what identifies it (a BuildRef's fields)."""

    env: dict[str, str]
    defects: dict[str, float]  # name -> strength, file and patches together
    repository: str
    sha: str | None = None
    version: str | None = None
    committed_at: datetime | None = None
    patches: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None


def parse_embedded_source(text: str) -> Source:
    """A ``git:REPO@COMMIT`` or ``path:DIR`` source (syntax; a path must exist); BuildError if not."""
    source = parse_source(text)
    if source.kind not in ("git", "path"):
        raise BuildError(f"source {text!r}: the embedded engine builds from git:REPOSITORY@COMMIT "
                         "or path:DIR (a tree with an evalsvc-engine.yaml)")
    return source


def read_settings(text: str | None, where: str) -> dict[Defect, float]:
    """The defects (name -> strength) of a settings file's text; None (no file) means none.
    ``where`` names the file (and commit) in errors, with the key at fault."""
    if text is None:
        return {}
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BuildError(f"{where}: not valid YAML ({' '.join(str(exc).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BuildError(f"{where}: expected a mapping of settings (keys: "
                         f"{', '.join(SETTINGS_KEYS)}), got {type(data).__name__}")
    unknown = [str(k) for k in data if k not in SETTINGS_KEYS]
    if unknown:
        raise BuildError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(SETTINGS_KEYS)})")
    raw = data.get("defects")
    if raw is None:
        return {}
    if isinstance(raw, list):
        items = []
        for i, item in enumerate(raw):
            if not isinstance(item, str):
                raise BuildError(f"{where}: key defects[{i}]: expected a defect name, got {item!r}")
            name, sep, strength = item.partition("@")
            items.append((f"defects[{i}]", name.strip(), strength.strip() if sep else 1.0))
    elif isinstance(raw, dict):
        items = [(f"defects.{name}", str(name), value) for name, value in raw.items()]
    else:
        raise BuildError(f"{where}: key defects: expected a mapping of defect names to strengths "
                         f"or a list of names, got {type(raw).__name__}")
    out: dict[Defect, float] = {}
    for key, name, value in items:
        try:
            defect = Defect(name)
        except ValueError:
            known = ", ".join(d.value for d in Defect)
            raise BuildError(f"{where}: key {key}: unknown defect {name!r} (known: {known})") from None
        try:
            strength = check_strength(defect, value, f"{where}, key {key}")
        except ValueError as exc:
            raise BuildError(str(exc)) from None
        if defect in out and out[defect] != strength:
            raise BuildError(f"{where}: key {key}: defect {name!r} given twice with different "
                             "strengths")
        out[defect] = strength
    return out


def _combine(from_file: dict[Defect, float], patches: list[str]) -> dict[str, float]:
    defects = {str(d): s for d, s in from_file.items()}
    for p in patches:
        kind, _, name = p.partition(":")
        try:
            defect = Defect(name)
        except ValueError:
            defect = None
        if kind != "defect" or defect is None:
            known = ", ".join(f"defect:{d.value}" for d in Defect)
            raise BuildError(f"unknown patch {p!r} for the embedded engine (known: {known})")
        defects[str(defect)] = 1.0
    return defects


def embedded_build(source_text: str | None, patches: list[str] | tuple[str, ...] = (),
                   builds_dir: Path | None = None) -> EmbeddedBuild:
    """The embedded engine's build from a source (or none: the engine as it is) and its
    ``defect:NAME`` patches; BuildError naming the source, commit, file or key if it cannot be.
    ``builds_dir``: the builds cache, whose git mirrors a ``git:`` source is read from."""
    from evalsvc import __version__

    patches = list(patches)
    if source_text is None:
        defects = _combine({}, patches)
        return EmbeddedBuild(env=_env(defects), defects=defects, repository=EMBEDDED_REPOSITORY,
                             version=__version__, committed_at=datetime.now(UTC), patches=patches)
    source = parse_embedded_source(source_text)
    if source.kind == "git":
        if builds_dir is None:
            raise ValueError(f"{source.label}: a git source needs the builds directory")
        mirror, sha = resolve_commit(source, builds_dir)
        where = f"{SETTINGS_FILE} at commit {sha} of {source.location}"
        kind = git(["cat-file", "-t", f"{sha}:{SETTINGS_FILE}"], mirror, check=False)
        text = None
        if kind.returncode == 0:
            if kind.stdout.strip() != "blob":
                raise BuildError(f"{where}: not a file ({kind.stdout.strip()})")
            text = git(["show", f"{sha}:{SETTINGS_FILE}"], mirror).stdout
        stamp = git(["show", "-s", "--format=%cI", sha], mirror).stdout.strip()
        committed_at = datetime.fromisoformat(stamp)
        repository, version = source.location, None
    else:
        path = Path(source.location) / SETTINGS_FILE
        where = str(path)
        if path.exists() and not path.is_file():
            raise BuildError(f"{where}: not a file")
        text = path.read_text() if path.is_file() else None
        digest = hashlib.sha256((text or "").encode()).hexdigest()[:12]
        sha, committed_at = None, datetime.now(UTC)
        repository, version = source.location, f"{__version__}+tree-{digest}"
    defects = _combine(read_settings(text, where), patches)
    manifest = {"kind": "embedded", "source": source.label, "commit": sha,
                "settings_file": SETTINGS_FILE if text is not None else None,
                "defects": defects, "evalsvc_version": __version__}
    return EmbeddedBuild(env=_env(defects), defects=defects, repository=repository, sha=sha,
                         version=version, committed_at=committed_at, patches=patches,
                         manifest=manifest)


def _env(defects: dict[str, float]) -> dict[str, str]:
    return {ENV_VAR: format_defects(defects)} if defects else {}
