"""Named patches that backport a known SGLang fix into a source tree, as structural source transforms.

A patch belongs to one fix in :data:`evalsvc.builds.probes.FIXES` and has the fix's name.
:func:`apply_patch` probes the tree first: a fix that is already present changes nothing, a fix that
is not applicable (the code it changes does not exist) is refused with :class:`PatchError`. Otherwise
the transform locates its anchors in the parse of each file (:mod:`ast` nodes and their line/column
positions, never fixed line numbers or text), edits the text at those positions, re-parses the result
and checks the transform's own postcondition, and compiles it with :func:`compile`. Files are written
only after every transform succeeded, each replaced atomically; then the probe runs again and must
say ``present``, or every file is restored and :class:`PatchError` is raised.

Patches:

* ``pr37165-clear-deferred-mamba-metadata``: inserts ``self.mamba_cow_src_indices = None``,
  ``self.mamba_cow_dst_indices = None`` and ``self.mamba_clear_indices = None`` into
  ``ScheduleBatch.prepare_for_decode`` where SGLang's own fix has them: after the leading simple
  statements (``self.forward_mode = ForwardMode.DECODE``, the ``input_embeds`` reset), before the
  context-parallel reset and the speculative branch, with a blank line either side. Applied to 0.5.19
  it gives the statements 0.5.20 has there.
* ``pr24954-forward-stream-mamba-ops``: not available. The PR changes about ten modules (Mamba pool,
  radix caches, unified-cache component, schedule batch, forward batch, attention backends,
  speculative info) of a tree that was moving quickly; no faithful backport to the releases before
  it (0.5.3.post3 to 0.5.12.post1) exists here, so applying it raises :class:`PatchError`.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from evalsvc.builds.probes import (
    CLEAR_DEFERRED_MAMBA_METADATA,
    DEFERRED_FIELDS,
    FIXES,
    FORWARD_STREAM_MAMBA_OPS,
    SCHEDULE_BATCH,
    ProbeResult,
    SourceTree,
    Status,
    find_prepare_for_decode,
    inspect_prepare_for_decode,
    probe,
    source_version,
)


class PatchError(Exception):
    """A patch is unknown, unavailable, not applicable, or could not be applied; nothing was written."""


Transform = Callable[[SourceTree], dict[str, bytes]]


@dataclass(frozen=True)
class Patch:
    name: str
    fix: str
    description: str
    transform: Transform | None = None
    unavailable: str | None = None

    @property
    def available(self) -> bool:
        return self.transform is not None


@dataclass(frozen=True)
class FileChange:
    path: str
    sha256_before: str
    sha256_after: str


@dataclass
class PatchResult:
    patch: str
    fix: str
    version: str | None
    before: ProbeResult
    after: ProbeResult
    changed: list[FileChange] = field(default_factory=list)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def _split_lines(text: str) -> list[str]:
    """Lines with their endings, split where the Python tokenizer ends a line (not on form feeds)."""
    return _LINE.findall(text)


def _ending(line: str) -> str:
    stripped = line.rstrip("\r\n")
    return line[len(stripped):]


def _insert_decode_clearing(tree: SourceTree) -> dict[str, bytes]:
    fix = CLEAR_DEFERRED_MAMBA_METADATA
    rel = SCHEDULE_BATCH
    path = tree.path(rel)

    def fail(why: str) -> PatchError:
        return PatchError(f"{fix}: {path}: {why}; nothing was changed")

    data = path.read_bytes()
    try:
        module = ast.parse(data, filename=str(path))
        text = data.decode("utf-8")
    except (SyntaxError, UnicodeDecodeError) as exc:
        raise fail(f"cannot parse ({exc})") from exc
    function = find_prepare_for_decode(module)
    if function is None:
        raise fail("no ScheduleBatch.prepare_for_decode")
    info = inspect_prepare_for_decode(function)
    if info.spec_index is None:
        raise fail("ScheduleBatch.prepare_for_decode has no speculative branch (an `if` on spec_*) "
                   "to insert before")
    body, index = function.body, info.insert_index
    lines = _split_lines(text)
    anchor = body[index]  # index <= spec_index: there is always a statement to insert before
    indent = lines[anchor.lineno - 1][: anchor.col_offset]
    if indent.strip() or len(indent.encode("utf-8")) != anchor.col_offset:
        raise fail(f"statement at line {anchor.lineno} does not start its line")
    if index > 0:
        previous = body[index - 1]
        if anchor.lineno <= previous.end_lineno:
            raise fail(f"statements share line {previous.end_lineno}")
        at = previous.end_lineno
        newline = _ending(lines[at - 1])
        block = [newline, *(f"{indent}self.{name} = None{newline}" for name in DEFERRED_FIELDS)]
    else:
        if anchor.lineno == function.lineno:
            raise fail("prepare_for_decode's body starts on its def line")
        at = anchor.lineno - 1
        newline = _ending(lines[at]) or "\n"
        block = [*(f"{indent}self.{name} = None{newline}" for name in DEFERRED_FIELDS), newline]
    new_data = "".join(lines[:at] + block + lines[at:]).encode("utf-8")

    try:
        new_module = ast.parse(new_data, filename=str(path))
    except SyntaxError as exc:
        raise fail(f"the edit does not parse ({exc})") from exc
    new_function = find_prepare_for_decode(new_module)
    if new_function is None or not inspect_prepare_for_decode(new_function).complete:
        raise fail("after the edit prepare_for_decode still lacks the assignments before the "
                   "speculative branch")
    return {rel: new_data}


def _unavailable(fix: str, why: str) -> Patch:
    return Patch(fix, fix, FIXES[fix].title, unavailable=why)


PATCHES: dict[str, Patch] = {
    CLEAR_DEFERRED_MAMBA_METADATA: Patch(
        CLEAR_DEFERRED_MAMBA_METADATA,
        CLEAR_DEFERRED_MAMBA_METADATA,
        "Insert the three `self.<field> = None` assignments at the top of ScheduleBatch.prepare_for_decode, "
        "before the speculative branch (SGLang PR #37165)",
        transform=_insert_decode_clearing,
    ),
    FORWARD_STREAM_MAMBA_OPS: _unavailable(
        FORWARD_STREAM_MAMBA_OPS,
        "PR #24954 backport not available for {version}; evaluate a release that contains it "
        "(0.5.13 or later)",
    ),
}


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def apply_patch(root: Path, name: str) -> PatchResult:
    """Apply the patch ``name`` (a key of :data:`PATCHES`) to the source tree at ``root``."""
    if name not in PATCHES:
        raise PatchError(f"unknown patch {name!r}; known: {', '.join(PATCHES)}")
    patch = PATCHES[name]
    tree = SourceTree(root)
    version = source_version(root)
    before = probe(root, patch.fix)
    if before.status is Status.PRESENT:
        return PatchResult(name, patch.fix, version, before, before)
    if before.status is Status.NOT_APPLICABLE:
        reasons = "; ".join(before.evidence[1:])
        raise PatchError(f"{name}: not applicable to sglang {version or '(version unknown)'} at {tree.pkg}, "
                         f"refusing to patch: {reasons}")
    if patch.transform is None:
        raise PatchError(f"{name}: " + (patch.unavailable or "no transform").format(
            version=f"sglang {version}" if version else f"the tree at {tree.pkg} (version unknown)"))

    new_files = patch.transform(tree)
    originals: dict[str, bytes] = {}
    for rel, data in new_files.items():
        path = tree.path(rel)
        originals[rel] = path.read_bytes()
        try:
            compile(data, str(path), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            raise PatchError(
                f"{name}: {path}: the patched module does not compile ({exc}); nothing was changed"
            ) from exc

    written: list[str] = []
    try:
        for rel, data in new_files.items():
            _write_atomic(tree.path(rel), data)
            written.append(rel)
        after = probe(root, patch.fix)
        if after.status is not Status.PRESENT:
            raise PatchError(f"{name}: after patching the probe says {after.status.value}, "
                             "restored the files: " + "; ".join(after.evidence[1:]))
    except BaseException:
        for rel in written:
            _write_atomic(tree.path(rel), originals[rel])
        raise
    changed = [FileChange(f"sglang/{rel}", _sha256(originals[rel]), _sha256(data))
               for rel, data in new_files.items()]
    return PatchResult(name, patch.fix, version, before, after, changed)
