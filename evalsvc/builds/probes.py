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

The 2026 bug classes of Mamba state tracking (``extra_buffer``), each found by what the code does:

``pr39342-mixed-chunk-mamba-tracking``. Applicable when ``ScheduleBatch`` has ``mix_with_running``,
``merge_batch`` and ``mamba_track_indices``. Present when ``merge_batch`` keeps the track fields, or
``mix_with_running`` sets ``self.mamba_track_indices`` and ``self.mamba_track_mask`` again after its
``merge_batch(...)`` call (0.5.23); absent when the merge leaves them ``None`` for the mixed forward.

``pr34184-prefill-graph-track-tail``. Applicable when a prefill CUDA-graph runner
(``model_executor/**/*{prefill,piecewise}*graph*.py``) that knows ``mamba_track_mask`` clears the
padded request rows of its static buffers (``<buf>[bs:r].zero_()``). Present when such a clear covers
``mamba_track_mask`` and ``mamba_track_indices`` (named in the buffer or the loop around it).

``pr32555-decode-graph-track-prefix``. Applicable when the hybrid linear-attention backend allocates
``self.mamba_track_indices_buf``. Present when every read of it is sliced (``[:bs]``); a bare read
hands the whole ``max_bs`` buffer, whose tail Mamba2's ``[-num_decodes:]`` binds.

``pr37836-mamba2-track-global-grid``. Applicable when an ``_init_track_ssm_indices*`` method has an
``if isinstance(self, Mamba2AttnBackend):`` branch. Present when that branch places requests on the
batch-wide chunk grid (a ``cumsum`` or a ``*start_loc*``); absent when it counts ``h`` per request.

``pr32606-prefill-graph-spec-tracking``. Applicable when a prefill CUDA-graph runner has an
``is_mamba_track_enabled`` gate. Present when its return no longer names speculative decoding (the
landed fix, 0.5.18, dropped ``spec_algorithm.is_none()``; PR #32606's own approach was not merged).

``pr29792-overlap-track-boundary``. Applicable when ``_mamba_check_track_boundary`` exists. Absent
when its non-speculative branch tests ``req.kv_committed_len % interval`` directly; present when it
tests a length corrected with the batch's own snapshot (``batch.mamba_decode_batch_idx_cpu``).

``pr30986-aborted-load-back-slot``. Applicable when a Mamba cache component has
``build_hicache_transfers``. Present when that build allocates no device slot and a method of the
class frees the slot and sets ``<req>.mamba_pool_idx = None`` (``finalize_load_back``).

``pr29068-cpu-conv-varlen-state``. Applicable when a top-level ``is_cpu()`` branch of the GDN backend
binds ``causal_conv1d_fn``. Present when it binds a function of the module that calls the kernel's
``causal_conv1d_fwd_cpu`` in a loop, non-varlen (``query_start_loc`` ``None``) on a one-slot slice of
the pool; absent when it binds the kernel's varlen wrapper ``causal_conv1d_fn_cpu``.
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
MIXED_CHUNK_TRACKING = "pr39342-mixed-chunk-mamba-tracking"
PREFILL_GRAPH_TRACK_TAIL = "pr34184-prefill-graph-track-tail"
DECODE_GRAPH_TRACK_PREFIX = "pr32555-decode-graph-track-prefix"
MAMBA2_TRACK_GRID = "pr37836-mamba2-track-global-grid"
PREFILL_GRAPH_SPEC_TRACKING = "pr32606-prefill-graph-spec-tracking"
OVERLAP_TRACK_BOUNDARY = "pr29792-overlap-track-boundary"
ABORTED_LOAD_BACK = "pr30986-aborted-load-back-slot"
CPU_CONV_VARLEN_STATE = "pr29068-cpu-conv-varlen-state"

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
    MIXED_CHUNK_TRACKING: Fix(
        MIXED_CHUNK_TRACKING,
        39342,
        "Mixed-chunk batches keep the prefill rows' Mamba tracking across merge_batch",
    ),
    PREFILL_GRAPH_TRACK_TAIL: Fix(
        PREFILL_GRAPH_TRACK_TAIL,
        34184,
        "Prefill CUDA graph clears the stale tail rows of its Mamba track buffers",
    ),
    DECODE_GRAPH_TRACK_PREFIX: Fix(
        DECODE_GRAPH_TRACK_PREFIX,
        32555,
        "Decode CUDA graph hands out only the refreshed [:bs] prefix of the track buffer",
    ),
    MAMBA2_TRACK_GRID: Fix(
        MAMBA2_TRACK_GRID,
        37836,
        "Mamba2 prefill tracking indexes the batch-wide chunk grid at each request's start",
    ),
    PREFILL_GRAPH_SPEC_TRACKING: Fix(
        PREFILL_GRAPH_SPEC_TRACKING,
        32606,
        "Prefill CUDA graph registers Mamba tracking buffers under speculative decoding",
    ),
    OVERLAP_TRACK_BOUNDARY: Fix(
        OVERLAP_TRACK_BOUNDARY,
        29792,
        "Decode track-boundary bookkeeping corrects kv_committed_len for the overlap lookahead",
    ),
    ABORTED_LOAD_BACK: Fix(
        ABORTED_LOAD_BACK,
        30986,
        "An aborted host-tier Mamba load-back frees the slot it allocated and unbinds the request",
    ),
    CPU_CONV_VARLEN_STATE: Fix(
        CPU_CONV_VARLEN_STATE,
        29068,
        "The CPU gated-deltanet prefill conv starts each extend from its cached conv state",
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


# --- the 2026 tracking bug classes ---------------------------------------------------------------

TRACK_FIELDS = ("mamba_track_indices", "mamba_track_mask")
HYBRID_BACKEND = "srt/layers/attention/hybrid_linear_attn_backend.py"
RESULT_PROCESSOR = "srt/managers/scheduler_components/batch_result_processor.py"


def _mentions(node: ast.AST, name: str) -> bool:
    """``name`` appears in ``node`` as a string constant, an attribute or a variable."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and sub.value == name:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == name:
            return True
        if isinstance(sub, ast.Name) and sub.id == name:
            return True
    return False


def _is_tail_slice(node: ast.AST) -> bool:
    """``<x>[bs:r]``: the padded request rows of a static buffer (both bounds, the lower one a
    request count: a name with ``bs`` or ``req`` in it, not a token count)."""
    if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice)
            and node.slice.lower is not None and node.slice.upper is not None):
        return False
    return any(isinstance(n, ast.Name) and ("bs" in n.id.lower() or "req" in n.id.lower())
               for n in ast.walk(node.slice.lower))


def _graph_runner_files(tree: SourceTree) -> list[str]:
    """Prefill CUDA-graph runner modules: ``model_executor/runner/prefill_cuda_graph_runner.py``
    (0.5.14 on) or ``model_executor/piecewise_cuda_graph_runner.py`` (0.5.13), found by name."""
    out = []
    for rel in tree.files_under("srt/model_executor"):
        name = rel.rsplit("/", 1)[-1]
        if "graph" in name and ("prefill" in name or "piecewise" in name):
            out.append(rel)
    return out


def _backend_files(tree: SourceTree) -> list[str]:
    if tree.module(HYBRID_BACKEND) is not None:
        return [HYBRID_BACKEND]
    return [rel for rel in tree.files_under("srt/layers/attention") if "linear" in rel or "mamba" in rel]


def _probe_mixed_chunk_tracking(tree: SourceTree) -> ProbeResult:
    fix = MIXED_CHUNK_TRACKING
    label = tree.label(SCHEDULE_BATCH)
    batch = find_schedule_batch(tree.module(SCHEDULE_BATCH))
    methods = _methods(batch) if batch is not None else {}
    mix, merge = methods.get("mix_with_running"), methods.get("merge_batch")
    if batch is None or mix is None or merge is None or not _declares(batch, TRACK_FIELDS[0]):
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{label}: no ScheduleBatch with mix_with_running, merge_batch and mamba_track_indices "
            "(no mixed-chunk merge of Mamba-tracked batches)"])
    where = f"{label}: ScheduleBatch"
    dropped = [f for f in TRACK_FIELDS
               if any(_is_self_attr(t, f) and _is_none(v) for t, v, _ in _assignments(merge))]
    evidence = [f"{where}.merge_batch sets {', '.join(f'self.{f} = None' for f in dropped)}" if dropped
                else f"{where}.merge_batch keeps {', '.join(TRACK_FIELDS)}"]
    at = next((i for i, stmt in enumerate(mix.body) if _calls(stmt, "merge_batch")), None)
    if at is None:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            *evidence, f"{where}.mix_with_running does not call merge_batch"])
    after = ast.Module(body=mix.body[at + 1:], type_ignores=[])
    restored = [f for f in TRACK_FIELDS
                if any(_is_self_attr(t, f) and not _is_none(v) for t, v, _ in _assignments(after))]
    for name in TRACK_FIELDS:
        if name in restored:
            evidence.append(f"[found] {where}.mix_with_running sets self.{name} again after merge_batch "
                            "(the prefill rows' tracking, decode tails untracked)")
        elif name in dropped:
            evidence.append(f"[missing] {where}.mix_with_running: self.{name} restored after merge_batch "
                            "(the prefill rows' tracking is dropped, their slot donated unwritten)")
    ok = not dropped or all(f in restored for f in TRACK_FIELDS)
    return ProbeResult(fix, Status.PRESENT if ok else Status.ABSENT, evidence)


def _sentinel_tail_functions(tree: SourceTree, files: Sequence[str]
                             ) -> list[tuple[str, str, FunctionNode]]:
    """Functions that clear the padded tail of static buffers (``<buf>[bs:r].zero_()``)."""
    out = []
    for rel in files:
        module = tree.module(rel)
        if module is None or not _mentions(module, "mamba_track_mask"):
            continue
        for qualname, func, _ in _functions(module):
            if any(isinstance(c.func, ast.Attribute) and c.func.attr in ("zero_", "fill_")
                   and _is_tail_slice(c.func.value) for c in ast.walk(func) if isinstance(c, ast.Call)):
                out.append((rel, qualname, func))
    return out


def _tail_cleared_names(func: FunctionNode) -> set[str]:
    """What the padded-tail clears of ``func`` name: the receiver of each ``<buf>[a:b].zero_()`` (or
    ``fill_``) and the iterable of each loop around it (``for name in ("mamba_track_mask", ...)``)."""
    names: set[str] = set()

    def visit(node: ast.AST, loops: list[ast.expr]) -> None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("zero_", "fill_") and _is_tail_slice(node.func.value):
            for scope in (node.func.value.value, *loops):
                for sub in ast.walk(scope):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                        names.add(sub.value)
                    elif isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
        inner = [*loops, node.iter] if isinstance(node, ast.For) else loops
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(func, [])
    return names


def _probe_prefill_graph_track_tail(tree: SourceTree) -> ProbeResult:
    fix = PREFILL_GRAPH_TRACK_TAIL
    files = _graph_runner_files(tree)
    found = _sentinel_tail_functions(tree, files)
    if not found:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{', '.join(tree.label(f) for f in files) or tree.label('srt/model_executor')}: no prefill "
            "CUDA-graph runner with Mamba tracking that clears the padded request rows of its static "
            "buffers (<buf>[bs:r].zero_())"])
    evidence, ok = [], True
    for rel, qualname, func in found:
        cleared = _tail_cleared_names(func)
        covers = all(name in cleared for name in TRACK_FIELDS)
        ok = ok and covers
        evidence.append(f"[{'found' if covers else 'missing'}] {tree.label(rel)}: {qualname} clears the "
                        f"padded tail of {' and '.join(TRACK_FIELDS)}" if covers else
                        f"[missing] {tree.label(rel)}: {qualname} clears the padded tail of its static "
                        f"buffers but not {' and '.join(TRACK_FIELDS)} (stale rows keep live slots)")
    return ProbeResult(fix, Status.PRESENT if ok else Status.ABSENT, evidence)


def _probe_decode_graph_track_prefix(tree: SourceTree) -> ProbeResult:
    fix = DECODE_GRAPH_TRACK_PREFIX
    attr = "mamba_track_indices_buf"
    allocated, reads = [], []
    for rel in _backend_files(tree):
        module = tree.module(rel)
        if module is None:
            continue
        for qualname, func, _ in _functions(module):
            parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
            for target, value, _ in _assignments(func):
                if _is_self_attr(target, attr) and value is not None and not _is_none(value):
                    allocated.append(f"{tree.label(rel)}: {qualname}")
            for node in ast.walk(func):
                if (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.ctx, ast.Load)
                        and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    parent = parents.get(node)
                    sliced = isinstance(parent, ast.Subscript) and parent.value is node \
                        and isinstance(parent.slice, ast.Slice) and parent.slice.upper is not None
                    shown = _short(parent if sliced else node)
                    reads.append((sliced, f"{tree.label(rel)}: {qualname} reads {shown} "
                                          f"(line {node.lineno})"))
    if not allocated or not reads:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{tree.label(HYBRID_BACKEND)}: no static decode-graph track buffer self.{attr}"])
    evidence = [f"self.{attr} allocated in {allocated[0]}"]
    evidence += [f"[{'found' if sliced else 'missing'}] {text}"
                 + ("" if sliced else ": the whole max_bs buffer, whose tail is never refreshed")
                 for sliced, text in reads]
    ok = all(sliced for sliced, _ in reads)
    return ProbeResult(fix, Status.PRESENT if ok else Status.ABSENT, evidence)


def _is_mamba2_test(test: ast.expr) -> bool:
    return (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance"
            and len(test.args) == 2 and isinstance(test.args[1], ast.Name)
            and test.args[1].id == "Mamba2AttnBackend")


def _probe_mamba2_track_grid(tree: SourceTree) -> ProbeResult:
    fix = MAMBA2_TRACK_GRID
    branches = []
    for rel in _backend_files(tree):
        module = tree.module(rel)
        if module is None:
            continue
        for qualname, func, _ in _functions(module):
            if not func.name.startswith("_init_track_ssm_indices"):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.If) and _is_mamba2_test(node.test):
                    branches.append((rel, qualname, node))
    if not branches:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{tree.label(HYBRID_BACKEND)}: no _init_track_ssm_indices with a Mamba2 branch "
            "(no extra-buffer tracking of Mamba2 prefill states)"])
    evidence, ok = [], True
    for rel, qualname, node in branches:
        body = ast.Module(body=node.body, type_ignores=[])
        global_grid = bool(_calls(body, "cumsum")) or any(
            "start_loc" in (n.id if isinstance(n, ast.Name) else n.attr)
            for n in ast.walk(body) if isinstance(n, ast.Name | ast.Attribute))
        ok = ok and global_grid
        where = f"{tree.label(rel)}: {qualname} `if {_short(node.test)}:` (line {node.lineno})"
        evidence.append(f"[found] {where} places each request at its start in the flattened batch "
                        "(query_start_loc / cumsum of extend lengths)" if global_grid else
                        f"[missing] {where} indexes h per request ({_short(node.body[0])}), not on the "
                        "batch-wide chunk grid")
    return ProbeResult(fix, Status.PRESENT if ok else Status.ABSENT, evidence)


def _probe_prefill_graph_spec_tracking(tree: SourceTree) -> ProbeResult:
    fix = PREFILL_GRAPH_SPEC_TRACKING
    gates = []
    for rel in _graph_runner_files(tree):
        module = tree.module(rel)
        if module is None:
            continue
        for qualname, func, owner in _functions(module):
            if owner is not None and func.name.lstrip("_") == "is_mamba_track_enabled":
                gates.append((rel, qualname, func))
    if not gates:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{tree.label('srt/model_executor')}: no prefill CUDA-graph runner with an "
            "is_mamba_track_enabled gate"])
    evidence, ok = [], True
    for rel, qualname, func in gates:
        returns = [n.value for n in ast.walk(func) if isinstance(n, ast.Return) and n.value is not None]
        spec = any(_mentions_spec(r) for r in returns)
        ok = ok and not spec
        shown = "; ".join(_short(r, 110) for r in returns)
        evidence.append(f"[missing] {tree.label(rel)}: {qualname} excludes speculative decoding "
                        f"(return {shown}): the track buffers are never registered" if spec else
                        f"[found] {tree.label(rel)}: {qualname} does not exclude speculative decoding "
                        f"(return {shown})")
    return ProbeResult(fix, Status.PRESENT if ok else Status.ABSENT, evidence)


def _probe_overlap_track_boundary(tree: SourceTree) -> ProbeResult:
    fix = OVERLAP_TRACK_BOUNDARY
    name = "_mamba_check_track_boundary"
    files = [RESULT_PROCESSOR] if tree.module(RESULT_PROCESSOR) is not None else \
        tree.files_under("srt/managers/scheduler_components")
    found = [(rel, q, f) for rel in files if tree.module(rel) is not None
             for q, f, _ in _functions(tree.module(rel)) if f.name == name]
    if not found:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{tree.label(RESULT_PROCESSOR)}: no {name} (no decode track-boundary bookkeeping)"])
    rel, qualname, func = found[0]
    where = f"{tree.label(rel)}: {qualname}"
    branch = next((n for n in ast.walk(func) if isinstance(n, ast.If) and _mentions_spec(n.test)
                   and _mentions(n.test, "is_none")), None)
    if branch is None:
        return ProbeResult(fix, Status.ABSENT, [f"[missing] {where}: no non-speculative branch "
                                                "(`if <batch>.spec_algorithm.is_none():`)"])
    body = ast.Module(body=branch.body, type_ignores=[])
    direct = [n for n in ast.walk(body) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)
              and isinstance(n.left, ast.Attribute) and n.left.attr == "kv_committed_len"]
    batch_reads = sorted({_short(n) for n in ast.walk(body) if isinstance(n, ast.Attribute)
                          and isinstance(n.value, ast.Name) and n.value.id == "batch"})
    if direct:
        return ProbeResult(fix, Status.ABSENT, [
            f"[missing] {where} tests `{_short(direct[0])}` on the shared request (line {direct[0].lineno}): "
            "under overlap it already carries the next batch's step"])
    ok = bool(batch_reads)
    return ProbeResult(fix, Status.PRESENT if ok else Status.ABSENT, [
        f"[found] {where} tests the boundary on a length corrected with the batch's own snapshot "
        f"({', '.join(batch_reads)})" if ok else
        f"[missing] {where}: the boundary test reads nothing of the batch's own snapshot"])


def _probe_aborted_load_back(tree: SourceTree) -> ProbeResult:
    fix = ABORTED_LOAD_BACK
    classes = [(rel, cls) for rel, cls in _mamba_cache_classes(tree)
               if "build_hicache_transfers" in _methods(cls)]
    if not classes:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{tree.label('srt/mem_cache')}: no Mamba cache component with build_hicache_transfers "
            "(no host-tier load-back of Mamba states)"])
    evidence, ok = [], True
    for rel, cls in classes:
        methods = _methods(cls)
        where = f"{tree.label(rel)}: {cls.name}"
        allocs = [c for c in _calls(methods["build_hicache_transfers"], "alloc")
                  if "host" not in ast.unparse(c.func).lower()]  # a device slot, not the host pool's
        unwinds = [name for name, m in methods.items() if _calls(m, "free") and any(
            isinstance(t, ast.Attribute) and t.attr == "mamba_pool_idx" and _is_none(v)
            for t, v, _ in _assignments(m))]
        evidence.append(f"[missing] {where}.build_hicache_transfers allocates the request's slot "
                        f"({_short(allocs[0])}) before the load-back is known to proceed" if allocs else
                        f"[found] {where}.build_hicache_transfers allocates nothing")
        evidence.append(f"[found] {where}.{unwinds[0]} frees the slot and unbinds the request "
                        "(<req>.mamba_pool_idx = None)" if unwinds else
                        f"[missing] {where}: no method frees the slot of an aborted load-back and "
                        "unbinds the request")
        ok = ok and not allocs and bool(unwinds)
    return ProbeResult(fix, Status.PRESENT if ok else Status.ABSENT, evidence)


# --- the CPU causal conv's state handoff (PR #29068) --------------------------------------------

GDN_BACKEND = "srt/layers/attention/linear/gdn_backend.py"
CPU_CONV_OP = "causal_conv1d_fwd_cpu"
CONV_BINDING = "causal_conv1d_fn"


@dataclass(frozen=True)
class CPUConvBinding:
    """Where a module binds its prefill conv for ``is_cpu()``: the branch and the assignment."""

    rel: str
    branch: list[ast.stmt]
    assign: ast.Assign

    @property
    def bound(self) -> str:
        return ast.unparse(self.assign.value)


def _is_cpu_test(test: ast.expr) -> bool:
    func = test.func if isinstance(test, ast.Call) and not test.args else None
    return (isinstance(func, ast.Name) and func.id == "is_cpu") or (
        isinstance(func, ast.Attribute) and func.attr == "is_cpu")


def find_cpu_conv_binding(tree: SourceTree) -> CPUConvBinding | None:
    """The top-level ``if``/``elif is_cpu():`` branch that assigns ``causal_conv1d_fn``, in the GDN
    backend (0.5.12.post1 on) or the hybrid linear-attention backend."""
    for rel in (GDN_BACKEND, HYBRID_BACKEND):
        found = cpu_conv_binding(tree.module(rel), rel)
        if found is not None:
            return found
    return None


def cpu_conv_binding(module: ast.Module | None, rel: str) -> CPUConvBinding | None:
    for node in module.body if module is not None else []:
        while isinstance(node, ast.If):
            if _is_cpu_test(node.test):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
                            and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == CONV_BINDING:
                        return CPUConvBinding(rel, node.body, stmt)
            node = node.orelse[0] if len(node.orelse) == 1 else None
    return None


def per_request_conv(function: FunctionNode) -> ast.Call | None:
    """The call of the kernel's conv in ``function`` that carries the state: inside a loop (per
    request), on the non-varlen path (``query_start_loc``, the fifth argument, ``None``) and with
    a one-slot slice of the pool (the fourth, ``conv_states[slot : slot + 1]``)."""
    for loop in ast.walk(function):
        if not isinstance(loop, ast.For | ast.While):
            continue
        for call in _calls(loop, CPU_CONV_OP):
            args = call.args
            if len(args) >= 5 and _is_none(args[4]) and isinstance(args[3], ast.Subscript) \
                    and isinstance(args[3].slice, ast.Slice):
                return call
    return None


def _probe_cpu_conv_varlen_state(tree: SourceTree) -> ProbeResult:
    fix = CPU_CONV_VARLEN_STATE
    found = find_cpu_conv_binding(tree)
    if found is None:
        return ProbeResult(fix, Status.NOT_APPLICABLE, [
            f"{tree.label(GDN_BACKEND)}, {tree.label(HYBRID_BACKEND)}: no `is_cpu()` branch that "
            f"binds {CONV_BINDING} (no CPU kernel path for the gated-deltanet prefill conv)"])
    where = f"{tree.label(found.rel)}: `{CONV_BINDING} = {_short(found.assign.value)}` in the is_cpu() " \
            f"branch (line {found.assign.lineno})"
    module = tree.module(found.rel)
    assert module is not None
    imported = {alias.asname or alias.name: node.module for node in found.branch
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    value = found.assign.value
    name = value.id if isinstance(value, ast.Name) else None
    defined = next((node for node in [*found.branch, *module.body]
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name),
                   None)
    if defined is not None:
        call = per_request_conv(defined)
        if call is not None:
            return ProbeResult(fix, Status.PRESENT, [
                f"[found] {where}: {name} calls the kernel's non-varlen {CPU_CONV_OP} per request on "
                f"a one-slot view of the pool ({_short(call.args[3])}, line {call.lineno})"])
        return ProbeResult(fix, Status.ABSENT, [
            f"[missing] {where}: {name} makes no per-request non-varlen {CPU_CONV_OP} call on a "
            "one-slot view of the pool"])
    source = f"{imported[name]}.{name}" if name in imported else _short(value)
    return ProbeResult(fix, Status.ABSENT, [
        f"[missing] {where}: binds {source}, the kernel's varlen conv (query_start_loc given), "
        "which the CPU kernel without PR #29068 (sglang-kernel-cpu 0.4.5 included) starts from zeros: "
        "the conv state and has_initial_state are ignored"])


_PROBES = {
    FORWARD_STREAM_MAMBA_OPS: _probe_forward_stream,
    CLEAR_DEFERRED_MAMBA_METADATA: _probe_clear_metadata,
    MIXED_CHUNK_TRACKING: _probe_mixed_chunk_tracking,
    PREFILL_GRAPH_TRACK_TAIL: _probe_prefill_graph_track_tail,
    DECODE_GRAPH_TRACK_PREFIX: _probe_decode_graph_track_prefix,
    MAMBA2_TRACK_GRID: _probe_mamba2_track_grid,
    PREFILL_GRAPH_SPEC_TRACKING: _probe_prefill_graph_spec_tracking,
    OVERLAP_TRACK_BOUNDARY: _probe_overlap_track_boundary,
    ABORTED_LOAD_BACK: _probe_aborted_load_back,
    CPU_CONV_VARLEN_STATE: _probe_cpu_conv_varlen_state,
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
