"""Structural probes: does an SGLang source tree carry the known Mamba state-reuse fixes?

A source tree is a directory that holds the ``sglang`` package: an unpacked wheel's root, or a git
checkout's ``python/`` directory (the checkout's top directory is accepted too). Nothing is
imported; the files are parsed with :mod:`ast` and the probes look at classes, methods, assignments
and calls, never at line numbers or exact text, so they follow code that moved between releases.

Each probe answers ``present``, ``absent`` or ``not_applicable`` (the code the fix changes does not
exist in that tree), with evidence lines naming file, class, function and what was found or missing.

``pr24954-forward-stream-mamba-ops`` (SGLang PR #24954, issue #24221). Applicable when the tree has a
``MambaPool`` and a prefix cache for Mamba state (a class with ``Mamba`` in its name derived from
``BasePrefixCache`` or the unified tree's ``TreeComponent``, found in ``srt/mem_cache`` files whose
path names Mamba: ``mamba_radix_cache.py``, ``hi_mamba_radix_cache.py``,
``unified_cache_components/mamba_component.py``, ``unified_cache/components/mamba_component.py``,
``unified_cache/components/mamba.py``). Present when all of these hold:

* ``MambaPool`` defines ``clear_slots`` and no longer defines ``fork_from``;
* the request-to-token pool records a fresh slot's clear (``<req>.mamba_needs_clear = True``);
* a Mamba cache class records prefix-hit copy-on-write (``<req>.mamba_cow_src_index = <value>``)
  instead of copying, donates the request's slot (``donate_mamba_ping_pong_slot(...)``) and calls
  no ``fork_from``;
* ``ScheduleBatch`` declares ``mamba_cow_src_indices``, ``mamba_cow_dst_indices`` and
  ``mamba_clear_indices`` and has a method that fills them (``_collect_deferred_mamba_cow_and_clear``);
* ``ForwardBatch`` declares the three fields;
* an executor reads them and calls ``clear_slots`` on the forward path, and its class calls it:
  ``_execute_deferred_mamba_cow_and_clear`` in ``layers/attention/hybrid_linear_attn_backend.py``
  (0.5.13, 0.5.14) or ``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear`` in
  ``model_executor/model_runner.py`` (0.5.15 and later); found by what the function does, so a
  rename is still found.

Anything less is ``absent``; the evidence marks each part ``[found]`` or ``[missing]``.

``pr37165-clear-deferred-mamba-metadata`` (SGLang PR #37165). Applicable when ``ScheduleBatch``
declares the three deferred fields (that is, from PR #24954 on). Present when
``ScheduleBatch.prepare_for_decode`` assigns ``self.<field> = None`` for all three as top-level
statements before its speculative branch (the first top-level ``if`` whose test names something
``spec``: ``if not self.spec_algorithm.is_none():``, in 0.5.13 ``if self.is_spec_v2:``).
"""

from __future__ import annotations

import ast
import email.parser
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class Status(StrEnum):
    PRESENT = "present"
    ABSENT = "absent"
    NOT_APPLICABLE = "not_applicable"


@dataclass(frozen=True)
class Fix:
    name: str
    pr: int
    title: str


FORWARD_STREAM_MAMBA_OPS = "pr24954-forward-stream-mamba-ops"
CLEAR_DEFERRED_MAMBA_METADATA = "pr37165-clear-deferred-mamba-metadata"

FIXES: dict[str, Fix] = {
    FORWARD_STREAM_MAMBA_OPS: Fix(
        FORWARD_STREAM_MAMBA_OPS,
        24954,
        "Mamba state operations on the forward stream (deferred COW/clear, slot donation)",
    ),
    CLEAR_DEFERRED_MAMBA_METADATA: Fix(
        CLEAR_DEFERRED_MAMBA_METADATA,
        37165,
        "Clear deferred Mamba COW/clear indices in ScheduleBatch.prepare_for_decode",
    ),
}

DEFERRED_FIELDS = ("mamba_cow_src_indices", "mamba_cow_dst_indices", "mamba_clear_indices")

SCHEDULE_BATCH = "srt/managers/schedule_batch.py"
MEMORY_POOL = "srt/mem_cache/memory_pool.py"
FORWARD_BATCH_INFO = "srt/model_executor/forward_batch_info.py"
EXECUTOR_FILES = ("srt/layers/attention/hybrid_linear_attn_backend.py", "srt/model_executor/model_runner.py")
EXECUTOR_FALLBACK_DIRS = ("srt/layers/attention", "srt/model_executor")
MULTI_LAYER_EAGLE = "srt/speculative/multi_layer_eagle_worker_v2.py"
MAMBA_CACHE_BASES = frozenset({"BasePrefixCache", "TreeComponent"})

_ENDS_LEADING_RUN = (
    ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.TryStar, ast.Match,
    ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Return, ast.Raise,
)

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


class SourceTreeError(ValueError):
    """The directory holds no parseable ``sglang`` package."""


@dataclass
class ProbeResult:
    fix: str
    status: Status
    evidence: list[str] = field(default_factory=list)


def find_package(root: Path) -> Path:
    """The ``sglang`` package directory under ``root`` (``root/sglang`` or ``root/python/sglang``)."""
    root = Path(root)
    for candidate in (root / "sglang", root / "python" / "sglang"):
        if (candidate / "__init__.py").is_file() and (candidate / "srt").is_dir():
            return candidate
    raise SourceTreeError(
        f"{root}: no sglang package here (looked for sglang/__init__.py with sglang/srt/, and the same "
        "under python/); pass an unpacked wheel's root or a git checkout's python/ directory"
    )


def source_version(root: Path) -> str | None:
    """The release a source tree says it is (``sglang/_version.py``, ``sglang/version.py``, or the
    wheel's ``*.dist-info/METADATA``), or None (a git checkout before a build)."""
    pkg = find_package(root)
    for name in ("_version.py", "version.py"):
        path = pkg / name
        if not path.is_file():
            continue
        try:
            module = ast.parse(path.read_bytes(), filename=str(path))
        except SyntaxError:
            continue
        for node in module.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            names = {t.id for t in _flatten_targets(targets) if isinstance(t, ast.Name)}
            value = getattr(node, "value", None)
            if names & {"__version__", "version"} and isinstance(value, ast.Constant) \
                    and isinstance(value.value, str):
                return value.value
    for meta in sorted(pkg.parent.glob("sglang-*.dist-info/METADATA")):
        text = meta.read_text(encoding="utf-8", errors="replace")
        version = email.parser.Parser().parsestr(text, headersonly=True)["Version"]
        if version:
            return version.strip()
    return None


class SourceTree:
    """Parsed modules of one sglang package, each parsed once."""

    def __init__(self, root: Path) -> None:
        self.pkg = find_package(root)
        self._modules: dict[str, ast.Module | None] = {}

    def path(self, rel: str) -> Path:
        return self.pkg / rel

    def label(self, rel: str) -> str:
        return f"sglang/{rel}"

    def module(self, rel: str) -> ast.Module | None:
        """``rel`` (relative to the package, e.g. ``srt/managers/schedule_batch.py``) parsed, or None
        when the file does not exist."""
        if rel not in self._modules:
            path = self.path(rel)
            if not path.is_file():
                self._modules[rel] = None
            else:
                try:
                    self._modules[rel] = ast.parse(path.read_bytes(), filename=str(path))
                except (SyntaxError, ValueError) as exc:
                    raise SourceTreeError(f"{path}: cannot parse: {exc}") from exc
        return self._modules[rel]

    def files_under(self, rel_dir: str) -> list[str]:
        base = self.path(rel_dir)
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.pkg).as_posix() for p in base.rglob("*.py"))


# --- ast helpers -------------------------------------------------------------------------------


def _flatten_targets(targets: Sequence[ast.expr]) -> Iterator[ast.expr]:
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            yield from _flatten_targets(target.elts)
        else:
            yield target


def _assignments(node: ast.AST) -> Iterator[tuple[ast.expr, ast.expr | None, ast.stmt]]:
    """(target, value, statement) for every assignment in ``node``, nested ones included."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            for target in _flatten_targets(sub.targets):
                yield target, sub.value, sub
        elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
            yield sub.target, sub.value, sub


def _is_none(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Constant) and value.value is None


def _is_self_attr(target: ast.expr, attr: str) -> bool:
    return (isinstance(target, ast.Attribute) and target.attr == attr
            and isinstance(target.value, ast.Name) and target.value.id == "self")


def _classes(module: ast.Module | None) -> dict[str, ast.ClassDef]:
    if module is None:
        return {}
    return {node.name: node for node in module.body if isinstance(node, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, FunctionNode]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _functions(module: ast.Module) -> Iterator[tuple[str, FunctionNode, ast.ClassDef | None]]:
    """(qualified name, function, owning class) for module-level functions and methods."""
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node, None
        elif isinstance(node, ast.ClassDef):
            for name, method in _methods(node).items():
                yield f"{node.name}.{name}", method, node


def _base_names(cls: ast.ClassDef) -> set[str]:
    out = set()
    for base in cls.bases:
        if isinstance(base, ast.Name):
            out.add(base.id)
        elif isinstance(base, ast.Attribute):
            out.add(base.attr)
    return out


def _declares(cls: ast.ClassDef, attr: str) -> bool:
    """The class declares ``attr`` at class level or assigns ``self.attr`` in a method."""
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == attr for t in _flatten_targets(node.targets)
        ):
            return True
    return any(_is_self_attr(target, attr) for target, _, _ in _assignments(cls))


def _calls(node: ast.AST, attr: str) -> list[ast.Call]:
    """Calls of ``<anything>.attr(...)`` or ``attr(...)`` inside ``node``."""
    out = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if (isinstance(func, ast.Attribute) and func.attr == attr) or (
                isinstance(func, ast.Name) and func.id == attr
            ):
                out.append(sub)
    return out


def _reads_attr(node: ast.AST, attr: str) -> bool:
    return any(
        isinstance(sub, ast.Attribute) and sub.attr == attr and isinstance(sub.ctx, ast.Load)
        for sub in ast.walk(node)
    )


def _mentions_spec(expr: ast.expr) -> bool:
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Name) and "spec" in sub.id.lower():
            return True
        if isinstance(sub, ast.Attribute) and "spec" in sub.attr.lower():
            return True
    return False


def _short(node: ast.AST, limit: int = 70) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- prepare_for_decode (PR #37165) -------------------------------------------------------------


@dataclass(frozen=True)
class DecodeClearing:
    """Where ``prepare_for_decode`` clears the deferred fields, relative to its speculative branch.

    Indices are positions in ``function.body`` (top-level statements of the method)."""

    function: FunctionNode
    spec_index: int | None
    cleared: dict[str, int]
    insert_index: int

    @property
    def complete(self) -> bool:
        return all(name in self.cleared for name in DEFERRED_FIELDS)

    @property
    def spec_branch(self) -> ast.stmt | None:
        return None if self.spec_index is None else self.function.body[self.spec_index]


def find_schedule_batch(module: ast.Module | None) -> ast.ClassDef | None:
    return _classes(module).get("ScheduleBatch")


def find_prepare_for_decode(module: ast.Module | None) -> FunctionNode | None:
    cls = find_schedule_batch(module)
    return None if cls is None else _methods(cls).get("prepare_for_decode")


def inspect_prepare_for_decode(function: FunctionNode) -> DecodeClearing:
    """Find the speculative branch and the top-level ``self.<field> = None`` statements before it,
    and where the fix belongs: after the leading run of simple statements (``self.forward_mode =
    ForwardMode.DECODE``, the ``input_embeds`` reset, ...), and after the ``forward_mode`` and
    ``input_embeds`` assignments wherever they are, always before the speculative branch."""
    body = function.body
    spec_index = next(
        (i for i, stmt in enumerate(body) if isinstance(stmt, ast.If) and _mentions_spec(stmt.test)), None
    )
    if spec_index is not None:
        limit = spec_index
    else:
        limit = next((i for i, stmt in enumerate(body) if isinstance(stmt, ast.Return)), len(body))
    cleared: dict[str, int] = {}
    anchors: list[int] = []
    for i, stmt in enumerate(body[:limit]):
        if not isinstance(stmt, ast.Assign):
            continue
        for target in _flatten_targets(stmt.targets):
            for name in DEFERRED_FIELDS:
                if _is_self_attr(target, name) and _is_none(stmt.value):
                    cleared.setdefault(name, i)
            if _is_self_attr(target, "forward_mode") or _is_self_attr(target, "input_embeds"):
                anchors.append(i + 1)
    leading = 0
    while leading < limit and not isinstance(body[leading], _ENDS_LEADING_RUN):
        leading += 1
    return DecodeClearing(function, spec_index, cleared, max([leading, *anchors]))


# --- probes ------------------------------------------------------------------------------------


def _check(checks: list[tuple[bool, str]], ok: bool, text: str) -> bool:
    checks.append((ok, text))
    return ok


def _render(checks: list[tuple[bool, str]]) -> list[str]:
    return [f"[{'found' if ok else 'missing'}] {text}" for ok, text in checks]


def _mamba_cache_classes(tree: SourceTree) -> list[tuple[str, ast.ClassDef]]:
    """Prefix-cache classes for Mamba state: ``Mamba`` in the class name, derived from
    ``BasePrefixCache`` / ``TreeComponent`` or from another such class. Files under
    ``srt/mem_cache`` whose path names Mamba first; all of ``srt/mem_cache`` when none is found."""
    all_files = tree.files_under("srt/mem_cache")
    named = [rel for rel in all_files if "mamba" in rel.removeprefix("srt/mem_cache/").lower()]
    for files in (named, all_files):
        candidates = [
            (rel, cls) for rel in files for cls in _classes(tree.module(rel)).values()
            if "mamba" in cls.name.lower()
        ]
        accepted: dict[str, tuple[str, ast.ClassDef]] = {}
        changed = True
        while changed:
            changed = False
            for rel, cls in candidates:
                if cls.name not in accepted and _base_names(cls) & (MAMBA_CACHE_BASES | set(accepted)):
                    accepted[cls.name] = (rel, cls)
                    changed = True
        if accepted:
            return list(accepted.values())
    return []


def _find_mamba_pool(tree: SourceTree) -> tuple[str, ast.ClassDef] | None:
    cls = _classes(tree.module(MEMORY_POOL)).get("MambaPool")
    if cls is not None:
        return MEMORY_POOL, cls
    for rel in tree.files_under("srt/mem_cache"):
        cls = _classes(tree.module(rel)).get("MambaPool")
        if cls is not None:
            return rel, cls
    return None


def _find_executor(tree: SourceTree, files: Sequence[str]) -> tuple[str, str, FunctionNode, list[str]] | None:
    """A function that reads the deferred fields and calls ``clear_slots``, and the functions of its
    class (or module) that call it: (file, qualified name, function, callers)."""
    for rel in files:
        module = tree.module(rel)
        if module is None:
            continue
        for qualname, func, owner in _functions(module):
            if not (_calls(func, "clear_slots") and _reads_attr(func, "mamba_clear_indices")
                    and _reads_attr(func, "mamba_cow_src_indices")):
                continue
            scope = owner if owner is not None else module
            callers = [q for q, f, _ in _functions(_as_module(scope))
                       if f is not func and _calls(f, func.name)]
            return rel, qualname, func, callers
    return None


def _as_module(scope: ast.ClassDef | ast.Module) -> ast.Module:
    if isinstance(scope, ast.Module):
        return scope
    return ast.Module(body=[scope], type_ignores=[])


def _probe_forward_stream(tree: SourceTree) -> ProbeResult:
    fix = FORWARD_STREAM_MAMBA_OPS
    pool = _find_mamba_pool(tree)
    if pool is None:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{tree.label('srt/mem_cache')}: no class MambaPool: this tree keeps no Mamba state pool"
        ])
    pool_rel, pool_cls = pool
    caches = _mamba_cache_classes(tree)
    if not caches:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{tree.label(pool_rel)}: class MambaPool exists",
            f"{tree.label('srt/mem_cache')}: no Mamba prefix-cache class (Mamba* derived from "
            f"{'/'.join(sorted(MAMBA_CACHE_BASES))}): Mamba states are not kept in the radix tree",
        ])
    checks: list[tuple[bool, str]] = []
    cache_names = ", ".join(f"{tree.label(rel)}: {cls.name}" for rel, cls in caches)
    evidence = [f"Mamba prefix caches: {cache_names}"]

    pool_methods = _methods(pool_cls)
    pool_label = f"{tree.label(pool_rel)}: MambaPool"
    _check(checks, "clear_slots" in pool_methods, f"{pool_label}.clear_slots (clearing split out of alloc)")
    _check(checks, "fork_from" not in pool_methods,
           f"{pool_label}.fork_from removed" if "fork_from" not in pool_methods
           else f"{pool_label}.fork_from still defined (the old copy-on-cache path)")
    if "copy_from" in pool_methods:
        params = [a.arg for a in pool_methods["copy_from"].args.args[1:]]
        evidence.append(f"{pool_label}.copy_from({', '.join(params)})")

    pool_module = tree.module(pool_rel)
    needs_clear = [
        (q, stmt) for q, f, _ in _functions(pool_module) for target, value, stmt in _assignments(f)
        if isinstance(target, ast.Attribute) and target.attr == "mamba_needs_clear"
        and isinstance(value, ast.Constant) and value.value is True
    ] if pool_module is not None else []
    _check(checks, bool(needs_clear),
           f"{tree.label(pool_rel)}: fresh-slot clear recorded (<req>.mamba_needs_clear = True)"
           + (f" in {needs_clear[0][0]}" if needs_clear else ""))

    cow, donate, fork = [], [], []
    for rel, cls in caches:
        for name, method in _methods(cls).items():
            where = f"{tree.label(rel)}: {cls.name}.{name}"
            if any(isinstance(t, ast.Attribute) and t.attr == "mamba_cow_src_index" and not _is_none(v)
                   for t, v, _ in _assignments(method)):
                cow.append(where)
            if _calls(method, "donate_mamba_ping_pong_slot"):
                donate.append(where)
            if _calls(method, "fork_from"):
                fork.append(where)
    _check(checks, bool(cow), "prefix-hit COW recorded on the request (<req>.mamba_cow_src_index = ...)"
           + (f" in {', '.join(cow)}" if cow else " in any Mamba cache class"))
    _check(checks, bool(donate), "slot donated to the tree (donate_mamba_ping_pong_slot(...))"
           + (f" in {', '.join(donate)}" if donate else " in any Mamba cache class"))
    _check(checks, not fork, "no fork_from(...) copies in the Mamba caches" if not fork
           else f"fork_from(...) copy still called in {', '.join(fork)}")

    batch_module = tree.module(SCHEDULE_BATCH)
    batch = find_schedule_batch(batch_module)
    batch_label = f"{tree.label(SCHEDULE_BATCH)}: ScheduleBatch"
    declared = batch is not None and all(_declares(batch, f) for f in DEFERRED_FIELDS)
    _check(checks, declared, f"{batch_label} declares {', '.join(DEFERRED_FIELDS)}" if batch is not None
           else f"{tree.label(SCHEDULE_BATCH)}: no class ScheduleBatch")
    collectors = [] if batch is None else [
        name for name, method in _methods(batch).items()
        if any(_is_self_attr(t, "mamba_cow_src_indices") and not _is_none(v)
               for t, v, _ in _assignments(method))
    ]
    _check(checks, bool(collectors),
           f"{batch_label}.{collectors[0]} fills the deferred indices" if collectors
           else f"{batch_label}: no method fills the deferred indices "
                "(_collect_deferred_mamba_cow_and_clear)")

    forward_batch = _classes(tree.module(FORWARD_BATCH_INFO)).get("ForwardBatch")
    _check(checks, forward_batch is not None and all(_declares(forward_batch, f) for f in DEFERRED_FIELDS),
           f"{tree.label(FORWARD_BATCH_INFO)}: ForwardBatch carries the deferred indices to the forward pass")

    executor = _find_executor(tree, EXECUTOR_FILES)
    if executor is None and declared:
        rest = [rel for d in EXECUTOR_FALLBACK_DIRS for rel in tree.files_under(d)
                if rel not in EXECUTOR_FILES]
        executor = _find_executor(tree, rest)
    if executor is None:
        _check(checks, False, "executor on the forward path (reads the deferred indices, calls "
               "clear_slots) in " + " or ".join(tree.label(rel) for rel in EXECUTOR_FILES))
    else:
        rel, qualname, _, callers = executor
        _check(checks, bool(callers), f"{tree.label(rel)}: executor {qualname} (reads the deferred indices, "
               f"calls clear_slots), called from {', '.join(callers) if callers else 'nowhere in its class'}")

    ok = all(c for c, _ in checks)
    return ProbeResult(fix, Status.PRESENT if ok else Status.ABSENT, evidence + _render(checks))


def _probe_clear_metadata(tree: SourceTree) -> ProbeResult:
    fix = CLEAR_DEFERRED_MAMBA_METADATA
    label = tree.label(SCHEDULE_BATCH)
    module = tree.module(SCHEDULE_BATCH)
    batch = find_schedule_batch(module)
    if batch is None:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [f"{label}: no class ScheduleBatch"])
    declared = [f for f in DEFERRED_FIELDS if _declares(batch, f)]
    if not declared:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{label}: ScheduleBatch has no {', '.join(DEFERRED_FIELDS)} (no deferred Mamba COW/clear, "
            "PR #24954 not in this tree): nothing to clear"
        ])
    evidence = [f"{label}: ScheduleBatch declares {', '.join(declared)}"]
    function = _methods(batch).get("prepare_for_decode")
    if function is None:
        return ProbeResult(fix, Status.ABSENT,
                           [*evidence, f"[missing] {label}: ScheduleBatch.prepare_for_decode"])
    info = inspect_prepare_for_decode(function)
    where = f"{label}: ScheduleBatch.prepare_for_decode"
    branch = info.spec_branch
    if branch is None:
        evidence.append(f"{where}: no top-level speculative branch; looked before the first return")
    else:
        evidence.append(f"{where}: speculative branch `if {_short(branch.test)}:` at line {branch.lineno}")
    for name in DEFERRED_FIELDS:
        if name in info.cleared:
            stmt = function.body[info.cleared[name]]
            evidence.append(f"[found] {where}: self.{name} = None at line {stmt.lineno}, before the branch")
        else:
            evidence.append(f"[missing] {where}: self.{name} = None before the speculative branch")
    elsewhere = sorted(
        name for name, method in _methods(batch).items()
        if method is not function and any(_is_self_attr(t, DEFERRED_FIELDS[0]) and _is_none(v)
                                          for t, v, _ in _assignments(method))
    )
    if elsewhere:
        evidence.append(f"{label}: also reset to None in ScheduleBatch.{', ScheduleBatch.'.join(elsewhere)}")
    replay = [
        q for q, f, _ in _functions(tree.module(MULTI_LAYER_EAGLE) or ast.Module(body=[], type_ignores=[]))
        if _reads_attr(f, "mamba_clear_indices") and _calls(f, "clear_slots")
    ]
    if replay:
        evidence.append(f"{tree.label(MULTI_LAYER_EAGLE)}: {', '.join(replay)} applies the indices to draft "
                        "pools (where stale ones are replayed)")
    return ProbeResult(fix, Status.PRESENT if info.complete else Status.ABSENT, evidence)


_PROBES = {
    FORWARD_STREAM_MAMBA_OPS: _probe_forward_stream,
    CLEAR_DEFERRED_MAMBA_METADATA: _probe_clear_metadata,
}


def _probe_tree(tree: SourceTree, fix: str) -> ProbeResult:
    if fix not in _PROBES:
        raise ValueError(f"unknown fix {fix!r}; known: {', '.join(FIXES)}")
    result = _PROBES[fix](tree)
    version = source_version(tree.pkg.parent)
    result.evidence.insert(0, f"sglang {version or '(version unknown)'} at {tree.pkg}")
    return result


def probe(root: Path, fix: str) -> ProbeResult:
    """Whether the source tree at ``root`` carries ``fix`` (a name in :data:`FIXES`)."""
    if fix not in _PROBES:
        raise ValueError(f"unknown fix {fix!r}; known: {', '.join(FIXES)}")
    return _probe_tree(SourceTree(root), fix)


def probe_all(root: Path) -> list[ProbeResult]:
    """Every fix in :data:`FIXES`, in order, parsing each file once."""
    tree = SourceTree(root)
    return [_probe_tree(tree, fix) for fix in FIXES]
