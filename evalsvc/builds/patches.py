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
* ``defect:deferred-ops-dropped``: a *defect patch*, the reverse of a fix: it puts back the bug PR
  #24954's review found (KL 0.0006 -> 0.06 with chunked prefill and no extra buffer), so that a
  build of real SGLang carries a known state bug for the service to catch. In
  ``ScheduleBatch._collect_deferred_mamba_cow_and_clear`` it inserts, first in the loop over the
  batch's requests, an ``if`` that drops a request's recorded copy-on-write when the extra buffer is
  off and this extend does not reach the end of the request's input (its prefill is split into
  chunks): the source index is forgotten and the fresh slot is neither copied nor cleared, so the
  first chunk runs on whatever that slot held. Each drop logs ``DEFECT_EVENT`` with the request's
  ``rid``, so a run shows which requests the defect reached. The strategy is read the way
  ``prepare_for_extend`` reads it (the test of its first ``if`` on the extra buffer); the chunk test compares
  ``Req.get_fill_ids()`` with ``full_untruncated_fill_ids`` where ``Req`` has them (0.5.13 on), else
  ``fill_ids`` with ``origin_input_ids + output_ids``. Its probe says ``present`` once the loop
  starts with that ``if``; a tree without the collector (before PR #24954) is ``not_applicable``.
* ``defect:mixed-chunk-tracking-dropped``: a defect patch that reverses PR #39342 (0.5.23). In
  ``ScheduleBatch.mix_with_running`` it removes the top-level statements that carry the prefill
  rows' Mamba tracking across ``merge_batch``: after the merge, those that set a track field again;
  before it, those that assign a local only they read (``prefill_track``, with the lazy-buffer undo
  in its block). ``merge_batch`` then leaves the track fields ``None`` for the mixed forward, which
  writes no checkpoint, while the cache still donates the slot the prefill claimed. Applied to 0.5.23
  it gives, statement for statement, 0.5.22's ``mix_with_running``. Its probe is the fix's probe
  turned round: ``present`` wherever #39342 is absent, so 0.5.13 to 0.5.22 carry the defect as
  released (applying it there changes nothing) and 0.5.23 carries it only when planted.
* ``pr29068-cpu-conv-varlen-state``: in ``layers/attention/linear/gdn_backend.py``'s ``is_cpu()``
  branch, replaces ``causal_conv1d_fn = causal_conv1d_fn_cpu`` (the kernel's varlen conv, which
  ignores the conv state and ``has_initial_state``) with a function defined there that calls the
  kernel's non-varlen ``causal_conv1d_fwd_cpu`` per request on a one-slot view of the pool.
* ``pr24954-forward-stream-mamba-ops``: not available. The PR changes about ten modules (Mamba pool,
  radix caches, unified-cache component, schedule batch, forward batch, attention backends,
  speculative info) of a tree that was moving quickly; no faithful backport to the releases before
  it (0.5.3.post3 to 0.5.12.post1) exists here, so applying it raises :class:`PatchError`.
* The 2026 tracking fixes (``pr39342-...``, ``pr34184-...``, ``pr32555-...``, ``pr37836-...``,
  ``pr32606-...``, ``pr29792-...``, ``pr30986-...``): probed, not backported; applying one to a
  release without it raises :class:`PatchError` naming the first release that has it.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from evalsvc.builds.probes import (
    ABORTED_LOAD_BACK,
    CLEAR_DEFERRED_MAMBA_METADATA,
    CPU_CONV_VARLEN_STATE,
    DECODE_GRAPH_TRACK_PREFIX,
    DEFERRED_FIELDS,
    FIXES,
    FORWARD_STREAM_MAMBA_OPS,
    MAMBA2_TRACK_GRID,
    MIXED_CHUNK_TRACKING,
    OVERLAP_TRACK_BOUNDARY,
    PREFILL_GRAPH_SPEC_TRACKING,
    PREFILL_GRAPH_TRACK_TAIL,
    SCHEDULE_BATCH,
    TRACK_FIELDS,
    FunctionNode,
    ProbeResult,
    SourceTree,
    Status,
    _assignments,
    _calls,
    _classes,
    _is_none,
    _is_self_attr,
    _methods,
    _probe_mixed_chunk_tracking,
    cpu_conv_binding,
    find_cpu_conv_binding,
    find_prepare_for_decode,
    find_schedule_batch,
    inspect_prepare_for_decode,
    per_request_conv,
    probe,
    source_version,
)
from evalsvc.engines.sglang_server import DEFECT_EVENT


class PatchError(Exception):
    """A patch is unknown, unavailable, not applicable, or could not be applied; nothing was written."""


Transform = Callable[[SourceTree], dict[str, bytes]]


@dataclass(frozen=True)
class Patch:
    name: str
    fix: str  # the fix it backports; for a defect patch, its own name
    description: str
    transform: Transform | None = None
    unavailable: str | None = None
    # a defect patch's own probe (present: the defect is in the tree); fixes use FIXES' probes
    check: Callable[[SourceTree], ProbeResult] | None = None

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


def _read_module(tree: SourceTree, rel: str, patch: str
                 ) -> tuple[Path, ast.Module, str, Callable[[str], PatchError]]:
    """A file a transform edits: its path, parse, text, and the error that names the patch."""
    path = tree.path(rel)

    def fail(why: str) -> PatchError:
        return PatchError(f"{patch}: {path}: {why}; nothing was changed")

    data = path.read_bytes()
    try:
        module = ast.parse(data, filename=str(path))
        text = data.decode("utf-8")
    except (SyntaxError, UnicodeDecodeError) as exc:
        raise fail(f"cannot parse ({exc})") from exc
    return path, module, text, fail


def _insert_decode_clearing(tree: SourceTree) -> dict[str, bytes]:
    rel = SCHEDULE_BATCH
    path, module, text, fail = _read_module(tree, rel, CLEAR_DEFERRED_MAMBA_METADATA)
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


DEFERRED_OPS_DROPPED = "defect:deferred-ops-dropped"
COLLECT_DEFERRED = "_collect_deferred_mamba_cow_and_clear"
DEFECT_COMMENT = ("# defect patch {name} (SGLang PR #24954 review): with no extra\n"
                  "# buffer, a request whose prefill is split into chunks loses its deferred\n"
                  "# copy-on-write; its fresh slot is neither copied nor cleared.")


def _collector_loop(module: ast.Module | None) -> tuple[FunctionNode, ast.For] | None:
    """``ScheduleBatch._collect_deferred_mamba_cow_and_clear`` and its loop over requests."""
    cls = find_schedule_batch(module)
    function = _methods(cls).get(COLLECT_DEFERRED) if cls is not None else None
    if function is None:
        return None
    loop = next((s for s in function.body if isinstance(s, ast.For)
                 and isinstance(s.target, ast.Name)), None)
    return (function, loop) if loop is not None else None


def _state_holder(loop: ast.For) -> str | None:
    """Where the loop reads a request's Mamba state fields: ``req`` (up to 0.5.17) or ``req.kv``
    (0.5.19 on), from its first ``.mamba_cow_src_index``."""
    for stmt in loop.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Attribute) and node.attr == "mamba_cow_src_index":
                return ast.unparse(node.value)
    return None


def _drops_cow(loop: ast.For) -> bool:
    """Whether the loop starts with an ``if`` that forgets the request's COW source and skips it."""
    first = loop.body[0]
    holder = _state_holder(loop)
    return (isinstance(first, ast.If) and isinstance(first.body[-1], ast.Continue)
            and any(isinstance(s, ast.Assign) and len(s.targets) == 1
                    and ast.unparse(s.targets[0]) == f"{holder}.mamba_cow_src_index"
                    and isinstance(s.value, ast.Constant) and s.value.value is None
                    for s in first.body))


def _probe_dropped_cow(tree: SourceTree) -> ProbeResult:
    name = DEFERRED_OPS_DROPPED
    found = _collector_loop(tree.module(SCHEDULE_BATCH))
    label = tree.label(SCHEDULE_BATCH)
    if found is None:
        return ProbeResult(name, Status.NOT_APPLICABLE, [
            f"{label}: no ScheduleBatch.{COLLECT_DEFERRED} with a loop over requests (the deferred "
            "COW/clear of PR #24954 is not in this tree)"])
    if _drops_cow(found[1]):
        return ProbeResult(name, Status.PRESENT, [
            f"{label}: ScheduleBatch.{COLLECT_DEFERRED} drops the COW of chunked requests "
            f"(line {found[1].body[0].lineno})"])
    return ProbeResult(name, Status.ABSENT, [
        f"{label}: ScheduleBatch.{COLLECT_DEFERRED} records every request's COW"])


def _extra_buffer_test(module: ast.Module) -> str | None:
    """How ``prepare_for_extend`` asks whether the extra buffer is on, as one expression: the test of
    its first ``if`` on ``extra_buffer`` (not ``lazy``), with the function's own locals replaced by
    what they were assigned. The releases spell it ``get_global_server_args().enable_mamba_extra_
    buffer()`` (0.5.13), ``server_args.enable_mamba_extra_buffer()`` (0.5.17), ``mamba_extra_
    buffer_enabled()`` (0.5.19) and ``get_exec().mamba.enable_mamba_extra_buffer`` (0.5.20 on)."""
    cls = find_schedule_batch(module)
    function = _methods(cls).get("prepare_for_extend") if cls is not None else None
    if function is None:
        return None
    assigned = {node.targets[0].id: node.value for node in ast.walk(function)
                if isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)}

    class Inline(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.expr:
            return assigned.get(node.id, node)

    tests = sorted((n for n in ast.walk(function) if isinstance(n, ast.If)), key=lambda n: n.lineno)
    for node in tests:
        test = node.test
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test = test.operand
        text = ast.unparse(test)
        if "extra_buffer" in text and "lazy" not in text:
            return ast.unparse(Inline().visit(copy.deepcopy(test)))
    return None


def _chunked_test(module: ast.Module, var: str) -> str | None:
    """An expression that is true when this extend of ``var`` stops short of its input's end."""
    req = _classes(module).get("Req")
    if req is None:
        return None
    methods = _methods(req)
    assigned = {t.attr for node in ast.walk(req) if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Attribute)}
    if "get_fill_ids" in methods and "full_untruncated_fill_ids" in assigned:
        return f"len({var}.get_fill_ids()) < len({var}.full_untruncated_fill_ids)"
    if "fill_ids" in assigned:
        return f"len({var}.fill_ids) < len({var}.origin_input_ids) + len({var}.output_ids)"
    return None


def _drop_chunked_cow(tree: SourceTree) -> dict[str, bytes]:
    name = DEFERRED_OPS_DROPPED
    rel = SCHEDULE_BATCH
    path, module, text, fail = _read_module(tree, rel, name)
    found = _collector_loop(module)
    if found is None:
        raise fail(f"no ScheduleBatch.{COLLECT_DEFERRED} with a loop over requests")
    loop = found[1]
    var = loop.target.id
    holder = _state_holder(loop)
    if holder is None:
        raise fail(f"the loop of {COLLECT_DEFERRED} reads no mamba_cow_src_index")
    if not any(isinstance(node, ast.Import) and any(a.name == "logging" and a.asname is None
                                                    for a in node.names) for node in module.body):
        raise fail("the module does not import logging, which the edit logs each drop with")
    extra_buffer = _extra_buffer_test(module)
    if extra_buffer is None:
        raise fail("ScheduleBatch.prepare_for_extend has no `if` on the extra buffer to read the "
                   "Mamba strategy from")
    chunked = _chunked_test(module, var)
    if chunked is None:
        raise fail("Req has neither get_fill_ids/full_untruncated_fill_ids nor fill_ids to tell a "
                   "chunked extend")
    lines = _split_lines(text)
    anchor = loop.body[0]
    indent = lines[anchor.lineno - 1][: anchor.col_offset]
    if indent.strip() or anchor.lineno == loop.lineno:
        raise fail(f"statement at line {anchor.lineno} does not start its line")
    newline = _ending(lines[anchor.lineno - 1]) or "\n"
    block = [*(f"{indent}{c}" for c in DEFECT_COMMENT.format(name=name).split("\n")),
             f"{indent}if ({holder}.mamba_cow_src_index is not None",
             f"{indent}        and not {extra_buffer}",
             f"{indent}        and {chunked}):",
             f"{indent}    {holder}.mamba_cow_src_index = None",
             f"{indent}    {holder}.mamba_needs_clear = False",
             f"{indent}    logging.getLogger(__name__).warning("
             f"{DEFECT_EVENT.format(name=name, rid='%s')!r}, {var}.rid)",
             f"{indent}    continue"]
    at = anchor.lineno - 1
    new_data = "".join(lines[:at] + [line + newline for line in block] + lines[at:]).encode("utf-8")
    try:
        new_module = ast.parse(new_data, filename=str(path))
    except SyntaxError as exc:
        raise fail(f"the edit does not parse ({exc})") from exc
    new_found = _collector_loop(new_module)
    if new_found is None or not _drops_cow(new_found[1]):
        raise fail(f"after the edit {COLLECT_DEFERRED} does not start its loop with the drop")
    return {rel: new_data}


MIXED_CHUNK_TRACKING_DROPPED = "defect:mixed-chunk-tracking-dropped"
MIXED_DEFECT_COMMENT = ("# defect patch {name} (SGLang PR #39342 reversed): merge_batch\n"
                        "# drops the Mamba track fields and nothing restores the prefill rows'\n"
                        "# tracking, so their claimed slot is donated unwritten.")


def _mix_with_running(module: ast.Module | None) -> FunctionNode | None:
    cls = find_schedule_batch(module)
    return _methods(cls).get("mix_with_running") if cls is not None else None


def _tracking_restore(function: FunctionNode) -> list[ast.stmt]:
    """The top-level statements of ``mix_with_running`` that carry the prefill rows' tracking across
    ``merge_batch``: after the merge, those that set a track field again; before it, those that assign
    a local those read (``prefill_track = None``, ``if self.mamba_track_indices is not None:
    prefill_track = (...)``). Empty when the method has none (0.5.22 and earlier)."""
    body = function.body
    at = next((i for i, stmt in enumerate(body) if _calls(stmt, "merge_batch")), None)
    if at is None:
        return []
    after = [stmt for stmt in body[at + 1:]
             if any(_is_self_attr(t, f) and not _is_none(v) for f in TRACK_FIELDS
                    for t, v, _ in _assignments(stmt))]
    def reads(stmts: list[ast.stmt]) -> set[str]:
        return {n.id for stmt in stmts for n in ast.walk(stmt)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}

    kept = reads([stmt for stmt in body if stmt not in after])
    only_restore = reads(after) - kept  # ``prefill_track``, not ``running_bs``
    before = [stmt for stmt in body[:at]
              if any(isinstance(t, ast.Name) and t.id in only_restore for t, _, _ in _assignments(stmt))]
    return before + after


def _probe_tracking_dropped(tree: SourceTree) -> ProbeResult:
    """Present where PR #39342's fix is absent: the defect is the release's own code before it."""
    fixed = _probe_mixed_chunk_tracking(tree)
    status = {Status.PRESENT: Status.ABSENT, Status.ABSENT: Status.PRESENT}.get(fixed.status, fixed.status)
    return ProbeResult(MIXED_CHUNK_TRACKING_DROPPED, status, fixed.evidence)


def _drop_mixed_chunk_tracking(tree: SourceTree) -> dict[str, bytes]:
    name = MIXED_CHUNK_TRACKING_DROPPED
    rel = SCHEDULE_BATCH
    path, module, text, fail = _read_module(tree, rel, name)
    function = _mix_with_running(module)
    if function is None:
        raise fail("no ScheduleBatch.mix_with_running")
    remove = _tracking_restore(function)
    if not remove:
        raise fail("ScheduleBatch.mix_with_running sets no Mamba track field after merge_batch")
    lines = _split_lines(text)
    first = remove[0]
    indent = lines[first.lineno - 1][: first.col_offset]
    if indent.strip():
        raise fail(f"statement at line {first.lineno} does not start its line")
    drop: set[int] = set()  # 0-based line numbers
    for stmt in remove:
        if any(stmt.lineno <= other.end_lineno and other.lineno <= stmt.end_lineno and other is not stmt
               for other in function.body if other not in remove):
            raise fail(f"statement at line {stmt.lineno} shares its lines with another")
        start = stmt.lineno - 1
        while start > 0 and lines[start - 1].strip().startswith("#"):  # its own comment goes too
            start -= 1
        drop.update(range(start, stmt.end_lineno))
    first_line = min(drop)
    newline = _ending(lines[first.lineno - 1]) or "\n"
    comment = [f"{indent}{c}{newline}" for c in MIXED_DEFECT_COMMENT.format(name=name).split("\n")]
    out = []
    for i, line in enumerate(lines):
        if i == first_line:
            out.extend(comment)
        if i not in drop:
            out.append(line)
    new_data = "".join(out).encode("utf-8")
    try:
        new_module = ast.parse(new_data, filename=str(path))
    except SyntaxError as exc:
        raise fail(f"the edit does not parse ({exc})") from exc
    new_function = _mix_with_running(new_module)
    if new_function is None or _tracking_restore(new_function):
        raise fail("after the edit mix_with_running still restores the Mamba tracking")
    return {rel: new_data}


PER_REQUEST_CONV = "causal_conv1d_fn_cpu_per_request"
PER_REQUEST_CONV_SOURCE = '''\
# fix {name} (SGLang PR #29068): the CPU kernel's varlen causal conv
# (query_start_loc given) starts every sequence from zeros, ignoring the conv state
# and has_initial_state, so an extend from a cached prefix gets its first width - 1
# outputs wrong and an extend shorter than width - 1 leaves a wrong state. Its
# non-varlen path, called per request on a one-slot view of the pool, carries it.
def {function}(
    mixed_qkv_transposed,
    conv_weights,
    bias,
    activation,
    conv_states,
    has_initial_state,
    cache_indices,
    query_start_loc,
    seq_lens_cpu,
):
    if query_start_loc is None:
        return {original}(
            mixed_qkv_transposed,
            conv_weights,
            bias,
            activation,
            conv_states,
            has_initial_state,
            cache_indices,
            query_start_loc,
            seq_lens_cpu,
        )
    dim, total = mixed_qkv_transposed.shape
    out = mixed_qkv_transposed.new_zeros(total, dim).t()  # [dim, T], laid out as the kernel's
    starts = query_start_loc.tolist()
    slots = (
        cache_indices.tolist()
        if cache_indices is not None
        else list(range(len(starts) - 1))
    )
    one_slot = torch.zeros(1, dtype=torch.int32)
    for i in range(len(starts) - 1):
        start, end, slot = starts[i], starts[i + 1], slots[i]
        if end <= start or slot == -1:
            continue
        seq = mixed_qkv_transposed[:, start:end].t().contiguous()[None].transpose(1, 2)
        out[:, start:end] = torch.ops.sgl_kernel.causal_conv1d_fwd_cpu(
            seq,
            conv_weights,
            bias,
            conv_states[slot : slot + 1],
            None,
            one_slot,
            None if has_initial_state is None else has_initial_state[i : i + 1],
            activation == "silu",
            -1,
            True,
        )[0]
    return out
'''


def _imports_torch(module: ast.Module) -> bool:
    return any(isinstance(node, ast.Import) and any(a.name == "torch" and a.asname is None
                                                     for a in node.names) for node in module.body)


def _per_request_cpu_conv(tree: SourceTree) -> dict[str, bytes]:
    name = CPU_CONV_VARLEN_STATE
    found = find_cpu_conv_binding(tree)
    if found is None:
        raise PatchError(f"{name}: no is_cpu() branch binds causal_conv1d_fn; nothing was changed")
    rel, assign = found.rel, found.assign
    path, module, text, fail = _read_module(tree, rel, name)
    if not _imports_torch(module):
        raise fail("the module does not `import torch` at top level")
    if any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == PER_REQUEST_CONV
           for n in ast.walk(module)):
        raise fail(f"{PER_REQUEST_CONV} is already defined")
    lines = _split_lines(text)
    indent = lines[assign.lineno - 1][: assign.col_offset]
    if indent.strip() or any(stmt is not assign and stmt.lineno <= assign.end_lineno
                             and assign.lineno <= stmt.end_lineno for stmt in found.branch):
        raise fail(f"the assignment at line {assign.lineno} does not have its lines to itself")
    newline = _ending(lines[assign.end_lineno - 1]) or "\n"
    source = PER_REQUEST_CONV_SOURCE.format(name=name, function=PER_REQUEST_CONV,
                                            original=found.bound)
    block = [f"{indent}{line}".rstrip() + newline for line in source.rstrip("\n").split("\n")]
    block.append(newline)
    block.append(f"{indent}causal_conv1d_fn = {PER_REQUEST_CONV}{newline}")
    new_data = "".join(lines[: assign.lineno - 1] + block + lines[assign.end_lineno:]).encode("utf-8")
    try:
        new_module = ast.parse(new_data, filename=str(path))
    except SyntaxError as exc:
        raise fail(f"the edit does not parse ({exc})") from exc
    new_found = cpu_conv_binding(new_module, rel)
    function = next((n for n in (new_found.branch if new_found else []) if isinstance(n, ast.FunctionDef)
                     and n.name == PER_REQUEST_CONV), None)
    if new_found is None or new_found.bound != PER_REQUEST_CONV or function is None \
            or per_request_conv(function) is None:
        raise fail(f"after the edit the is_cpu() branch does not bind {PER_REQUEST_CONV}")
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
    DEFERRED_OPS_DROPPED: Patch(
        DEFERRED_OPS_DROPPED,
        DEFERRED_OPS_DROPPED,
        "Defect: drop the deferred copy-on-write of a prefix hit whose prefill is split into chunks "
        "when the extra buffer is off (the bug PR #24954's review found)",
        transform=_drop_chunked_cow,
        check=_probe_dropped_cow,
    ),
    MIXED_CHUNK_TRACKING_DROPPED: Patch(
        MIXED_CHUNK_TRACKING_DROPPED,
        MIXED_CHUNK_TRACKING_DROPPED,
        "Defect: reverse PR #39342 in ScheduleBatch.mix_with_running, so a mixed-chunk batch drops "
        "the prefill rows' Mamba tracking and their slot is donated unwritten (0.5.22's behaviour)",
        transform=_drop_mixed_chunk_tracking,
        check=_probe_tracking_dropped,
    ),
    CPU_CONV_VARLEN_STATE: Patch(
        CPU_CONV_VARLEN_STATE,
        CPU_CONV_VARLEN_STATE,
        "Bind the GDN backend's CPU prefill conv to a per-request call of the kernel's non-varlen "
        "causal_conv1d_fwd_cpu on a one-slot view of the pool, which carries the conv state "
        "(the kernel's varlen path ignores it; SGLang PR #29068)",
        transform=_per_request_cpu_conv,
    ),
    FORWARD_STREAM_MAMBA_OPS: _unavailable(
        FORWARD_STREAM_MAMBA_OPS,
        "PR #24954 backport not available for {version}; evaluate a release that contains it "
        "(0.5.13 or later)",
    ),
    **{fix: _unavailable(fix, f"PR #{FIXES[fix].pr} backport not available for {{version}}; evaluate a "
                              f"release that contains it ({first} or later)")
       for fix, first in [(MIXED_CHUNK_TRACKING, "0.5.23"), (PREFILL_GRAPH_TRACK_TAIL, "0.5.18"),
                          (DECODE_GRAPH_TRACK_PREFIX, "0.5.17"), (MAMBA2_TRACK_GRID, "0.5.20"),
                          (PREFILL_GRAPH_SPEC_TRACKING, "0.5.18"), (OVERLAP_TRACK_BOUNDARY, "0.5.18"),
                          (ABORTED_LOAD_BACK, "0.5.17")]},
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


def _probe_patch(patch: Patch, root: Path) -> ProbeResult:
    if patch.check is None:
        return probe(root, patch.fix)
    result = patch.check(SourceTree(root))
    result.evidence.insert(0, f"sglang {source_version(root) or '(version unknown)'} at "
                              f"{SourceTree(root).pkg}")
    return result


def apply_patch(root: Path, name: str) -> PatchResult:
    """Apply the patch ``name`` (a key of :data:`PATCHES`) to the source tree at ``root``."""
    if name not in PATCHES:
        raise PatchError(f"unknown patch {name!r}; known: {', '.join(PATCHES)}")
    patch = PATCHES[name]
    tree = SourceTree(root)
    version = source_version(root)
    before = _probe_patch(patch, root)
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
        after = _probe_patch(patch, root)
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
