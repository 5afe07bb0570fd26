"""The fix probes and patches against real SGLang releases from PyPI, and against small synthetic trees.

Wheels are downloaded once (``pip download --no-deps``, for CPython 3.11 on manylinux x86_64, the
sources are the same everywhere) into ``$EVALSVC_WHEEL_CACHE`` (default ``~/.cache/evalsvc/wheels``)
and reused; each test session unpacks their Python sources into a temporary directory. With ``CI``
set a wheel that cannot be downloaded fails the tests; elsewhere they are skipped with the reason.

Releases (what the probes must say, found by reading every release from 0.5.1 to 0.5.23):

* 0.5.3: ``MambaPool`` but no Mamba radix cache (hybrid GDN models disable the radix cache):
  both fixes not applicable.
* 0.5.12.post1: ``MambaRadixCache`` copying with ``fork_from`` on the scheduler, no deferred
  COW/clear: #24954 absent, #37165 not applicable. The last release before #24954.
* 0.5.13: first release with #24954 (executor in the attention backend, an ``is_spec_v2`` branch
  first in ``prepare_for_decode``); #37165 absent.
* 0.5.19: #24954 (executor in ``ModelRunner``), #37165 absent. The last release before #37165.
* 0.5.20: both present, the first release with #37165.
* 0.5.23: both present; ``mamba_radix_cache.py`` is gone, the Mamba cache is
  ``unified_cache/components/mamba.py``.

The 2026 tracking fixes, found by reading every release from 0.5.13 to 0.5.23 (``TABLE``):
#30986 and #32555 land in 0.5.17; #34184, #32606 and #29792 in 0.5.18; #37836 in 0.5.20; #39342
in 0.5.23. #34184 and #32555 are not applicable to 0.5.13 and 0.5.14 (no padded request rows in
the prefill graph, no static decode track buffer); they are absent in 0.5.15 and 0.5.16.

#29068 (the CPU kernel's varlen conv ignores the conv state; unmerged) is absent from every release
with the GDN backend's ``is_cpu()`` branch (0.5.12.post1 to 0.5.23, which all bind the kernel's
``causal_conv1d_fn_cpu``) and not applicable to 0.5.3 (no CPU branch).
"""

from __future__ import annotations

import ast
import hashlib
import py_compile
from collections.abc import Callable
from pathlib import Path

import pytest

from evalsvc.builds.patches import PATCHES, PatchError, apply_patch
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
    SourceTreeError,
    Status,
    probe,
    probe_all,
)

A, B = FORWARD_STREAM_MAMBA_OPS, CLEAR_DEFERRED_MAMBA_METADATA
MIXED, TAIL, PREFIX, GRID = (MIXED_CHUNK_TRACKING, PREFILL_GRAPH_TRACK_TAIL, DECODE_GRAPH_TRACK_PREFIX,
                             MAMBA2_TRACK_GRID)
SPEC, OVERLAP, LOAD_BACK = PREFILL_GRAPH_SPEC_TRACKING, OVERLAP_TRACK_BOUNDARY, ABORTED_LOAD_BACK
CONV = CPU_CONV_VARLEN_STATE
NA, ABSENT, PRESENT = Status.NOT_APPLICABLE, Status.ABSENT, Status.PRESENT
# every release from 0.5.13 on, and two before (README "Engine builds" has the same table)
TABLE = """
release       24954 37165 39342 34184 32555 37836 32606 29792 30986 29068
0.5.3         n/a   n/a   n/a   n/a   n/a   n/a   n/a   n/a   n/a n/a
0.5.12.post1  -     n/a   -     n/a   n/a   n/a   -     n/a   -   -
0.5.13        P     -     -     n/a   n/a   -     -     -     -   -
0.5.14        P     -     -     n/a   n/a   -     -     -     -   -
0.5.15        P     -     -     -     -     -     -     -     -   -
0.5.16        P     -     -     -     -     -     -     -     -   -
0.5.17        P     -     -     -     P     -     -     -     P   -
0.5.18        P     -     -     P     P     -     P     P     P   -
0.5.19        P     -     -     P     P     -     P     P     P   -
0.5.20        P     P     -     P     P     P     P     P     P   -
0.5.21        P     P     -     P     P     P     P     P     P   -
0.5.22        P     P     -     P     P     P     P     P     P   -
0.5.23        P     P     P     P     P     P     P     P     P   -
"""


def parse_table(text: str) -> dict[str, dict[str, Status]]:
    header, *rows = [line.split() for line in text.strip().splitlines()]
    by_pr = {str(f.pr): name for name, f in FIXES.items()}
    fixes = [by_pr[pr] for pr in header[1:]]
    cell = {"P": PRESENT, "-": ABSENT, "n/a": NA}
    return {version: {fix: cell[c] for fix, c in zip(fixes, cells, strict=True)}
            for version, *cells in rows}


EXPECTED = parse_table(TABLE)
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"

def tree_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def decode_head(path: Path) -> tuple[list[ast.stmt], int]:
    """Top-level statements of ScheduleBatch.prepare_for_decode and the index of its first `if` that
    tests something speculative (found independently of the probe's helpers)."""
    module = ast.parse(path.read_bytes())
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "ScheduleBatch")
    func = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "prepare_for_decode")
    spec = next(i for i, s in enumerate(func.body) if isinstance(s, ast.If) and "spec" in ast.unparse(s.test))
    return func.body, spec


def cleared_at(body: list[ast.stmt], name: str) -> int | None:
    for i, stmt in enumerate(body):
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and ast.unparse(stmt.targets[0]) == f"self.{name}"
                and isinstance(stmt.value, ast.Constant) and stmt.value.value is None):
            return i
    return None


# --- against the releases ----------------------------------------------------------------------


@pytest.mark.wheels
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("version", list(EXPECTED))
def test_probes_per_release(version: str, release_tree: Callable[[str], Path]) -> None:
    root = release_tree(version)
    results = probe_all(root)
    assert [r.fix for r in results] == list(FIXES)
    got = {r.fix: r.status for r in results}
    assert got == EXPECTED[version], "\n".join(line for r in results for line in [r.fix, *r.evidence])
    for result in results:
        assert result.evidence[0].startswith(f"sglang {version} at ")
        assert len(result.evidence) > 1
        single = probe(root, result.fix)
        assert (single.status, single.evidence) == (result.status, result.evidence)


@pytest.mark.wheels
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    ("version", "fix", "expected"),
    [
        ("0.5.3", A, "no Mamba prefix-cache class"),
        ("0.5.12.post1", A, "fork_from(...) copy still called in sglang/srt/mem_cache/mamba_radix_cache.py: "
                            "MambaRadixCache.cache_unfinished_req"),
        ("0.5.12.post1", B, "ScheduleBatch has no mamba_cow_src_indices"),
        ("0.5.13", A, "[found] sglang/srt/layers/attention/hybrid_linear_attn_backend.py: executor "
                      "MambaAttnBackendBase._execute_deferred_mamba_cow_and_clear"),
        ("0.5.13", B, "speculative branch `if self.is_spec_v2:`"),
        ("0.5.19", A, "[found] sglang/srt/model_executor/model_runner.py: executor "
                      "ModelRunner._maybe_execute_deferred_mamba_cow_and_clear"),
        ("0.5.19", B, "[missing] sglang/srt/managers/schedule_batch.py: ScheduleBatch.prepare_for_decode: "
                      "self.mamba_clear_indices = None before the speculative branch"),
        ("0.5.23", A, "Mamba prefix caches: sglang/srt/mem_cache/unified_cache/components/mamba.py: "
                      "MambaComponent"),
        ("0.5.23", B, "[found] sglang/srt/managers/schedule_batch.py: ScheduleBatch.prepare_for_decode: "
                      "self.mamba_cow_src_indices = None"),
        ("0.5.22", MIXED, "[missing] sglang/srt/managers/schedule_batch.py: ScheduleBatch.mix_with_running: "
                          "self.mamba_track_indices restored after merge_batch"),
        ("0.5.23", MIXED, "[found] sglang/srt/managers/schedule_batch.py: ScheduleBatch.mix_with_running "
                          "sets self.mamba_track_mask again after merge_batch"),
        ("0.5.17", TAIL, "[missing] sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py: "
                         "PrefillCudaGraphRunner.load_batch clears the padded tail of its static buffers"),
        ("0.5.18", TAIL, "[found] sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py: "
                         "PrefillCudaGraphRunner.load_batch clears the padded tail of mamba_track_indices"),
        ("0.5.16", PREFIX, "MambaAttnBackendBase._replay_metadata reads self.mamba_track_indices_buf (line"),
        ("0.5.17", PREFIX, "MambaAttnBackendBase._replay_metadata reads self.mamba_track_indices_buf[:bs]"),
        ("0.5.19", GRID, "[missing] sglang/srt/layers/attention/hybrid_linear_attn_backend.py: MambaAttn"
                         "BackendBase._init_track_ssm_indices `if isinstance(self, Mamba2AttnBackend):`"),
        ("0.5.13", SPEC, "[missing] sglang/srt/model_executor/piecewise_cuda_graph_runner.py: "
                         "PiecewiseCudaGraphRunner.is_mamba_track_enabled excludes speculative decoding"),
        ("0.5.23", SPEC, "PrefillCudaGraphRunner._is_mamba_track_enabled does not exclude speculative"),
        ("0.5.17", OVERLAP, "_mamba_check_track_boundary tests `req.kv_committed_len % interval`"),
        ("0.5.18", OVERLAP, "(batch.mamba_decode_batch_idx_cpu)"),
        ("0.5.16", LOAD_BACK, "MambaComponent.build_hicache_transfers allocates the request's slot "
                              "(self.cache.req_to_token_pool.mamba_allocator.alloc(1))"),
        ("0.5.23", LOAD_BACK, "[found] sglang/srt/mem_cache/unified_cache/components/mamba.py: "
                              "MambaComponent.finalize_load_back frees the slot"),
        ("0.5.3", CONV, "no `is_cpu()` branch that binds causal_conv1d_fn"),
        ("0.5.17", CONV, "[missing] sglang/srt/layers/attention/linear/gdn_backend.py: `causal_conv1d_fn = "
                         "causal_conv1d_fn_cpu` in the is_cpu() branch (line 62): binds "
                         "sgl_kernel.mamba.causal_conv1d_fn_cpu, the kernel's varlen conv"),
        ("0.5.23", CONV, "`causal_conv1d_fn = causal_conv1d_fn_cpu` in the is_cpu() branch (line 186)"),
    ],
)
def test_probe_evidence_follows_moved_code(
    version: str, fix: str, expected: str, release_tree: Callable[[str], Path]
) -> None:
    evidence = probe(release_tree(version), fix).evidence
    assert any(expected in line for line in evidence), "\n".join(evidence)


@pytest.mark.wheels
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("version", ["0.5.13", "0.5.19"])
def test_patch_clear_metadata(version: str, writable_tree: Callable[[str], Path]) -> None:
    root = writable_tree(version)
    before = tree_hashes(root)
    assert probe(root, B).status is ABSENT

    result = apply_patch(root, B)

    assert (result.before.status, result.after.status, result.version) == (ABSENT, PRESENT, version)
    assert probe(root, B).status is PRESENT
    assert probe(root, A).status is PRESENT
    after = tree_hashes(root)
    assert [c.path for c in result.changed] == [SCHEDULE_BATCH]
    assert {k for k in before if before[k] != after.get(k)} == {SCHEDULE_BATCH}
    assert set(after) == set(before)
    for change in result.changed:
        assert (change.sha256_before, change.sha256_after) == (before[change.path], after[change.path])
        py_compile.compile(str(root / change.path), cfile=str(root.parent / "patched.pyc"), doraise=True)
    body, spec = decode_head(root / SCHEDULE_BATCH)
    positions = [cleared_at(body, name) for name in DEFERRED_FIELDS]
    assert all(p is not None and p < spec for p in positions), positions
    assert positions == sorted(positions)
    assert cleared_at(body[: positions[0]], "forward_mode") is None  # assigned, not cleared
    assert any(ast.unparse(s).startswith("self.forward_mode = ") for s in body[: positions[0]])
    assert any(ast.unparse(s) == "self.input_embeds = None" for s in body[: positions[0]])

    again = apply_patch(root, B)
    assert again.changed == [] and again.before.status is PRESENT
    assert tree_hashes(root) == after


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_patched_0_5_19_matches_0_5_20(
    writable_tree: Callable[[str], Path], release_tree: Callable[[str], Path]
) -> None:
    """The backport puts the statements where SGLang's own fix did: 0.5.19 patched has the head of
    prepare_for_decode (everything before the speculative branch) that 0.5.20 has."""
    root = writable_tree("0.5.19")
    apply_patch(root, B)
    patched, patched_spec = decode_head(root / SCHEDULE_BATCH)
    fixed, fixed_spec = decode_head(release_tree("0.5.20") / SCHEDULE_BATCH)
    assert patched_spec == fixed_spec
    assert [ast.dump(s) for s in patched[: patched_spec + 1]] == [
        ast.dump(s) for s in fixed[: fixed_spec + 1]
    ]


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_patches_refused_before_the_fixed_code_exists(writable_tree: Callable[[str], Path]) -> None:
    root = writable_tree("0.5.12.post1")
    before = tree_hashes(root)
    with pytest.raises(PatchError, match=r"pr37165-clear-deferred-mamba-metadata: not applicable to sglang "
                                         r"0\.5\.12\.post1.*ScheduleBatch has no mamba_cow_src_indices"):
        apply_patch(root, B)
    assert tree_hashes(root) == before
    with pytest.raises(PatchError, match=r"PR #24954 backport not available for sglang 0\.5\.12\.post1; "
                                         r"evaluate a release that contains it"):
        apply_patch(root, A)
    assert tree_hashes(root) == before


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_forward_stream_patch_not_applicable_and_already_present(
    writable_tree: Callable[[str], Path], release_tree: Callable[[str], Path]
) -> None:
    root = writable_tree("0.5.3")
    before = tree_hashes(root)
    with pytest.raises(PatchError, match=r"pr24954-forward-stream-mamba-ops: not applicable to sglang "
                                         r"0\.5\.3 .*no Mamba prefix-cache class"):
        apply_patch(root, A)
    assert tree_hashes(root) == before
    present = apply_patch(release_tree("0.5.13"), A)
    assert present.changed == [] and present.after.status is PRESENT


GDN_BACKEND = "sglang/srt/layers/attention/linear/gdn_backend.py"


def cpu_branch(path: Path) -> list[ast.stmt]:
    """The body of gdn_backend.py's top-level `elif is_cpu():` (found independently of the probe)."""
    module = ast.parse(path.read_bytes())
    for node in module.body:
        while isinstance(node, ast.If):
            if ast.unparse(node.test) == "is_cpu()":
                return node.body
            node = node.orelse[0] if len(node.orelse) == 1 else None
    raise AssertionError(f"{path}: no is_cpu() branch")


@pytest.mark.wheels
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("version", ["0.5.13", "0.5.17", "0.5.23"])
def test_patch_cpu_conv_varlen_state(
    version: str, writable_tree: Callable[[str], Path], release_tree: Callable[[str], Path]
) -> None:
    root = writable_tree(version)
    before = tree_hashes(root)
    others = {r.fix: r.status for r in probe_all(root) if r.fix != CONV}
    assert probe(root, CONV).status is ABSENT

    result = apply_patch(root, CONV)

    assert (result.before.status, result.after.status, result.version) == (ABSENT, PRESENT, version)
    assert [c.path for c in result.changed] == [GDN_BACKEND]
    after = tree_hashes(root)
    assert {k for k in before if before[k] != after.get(k)} == {GDN_BACKEND} and set(after) == set(before)
    py_compile.compile(str(root / GDN_BACKEND), cfile=str(root.parent / "patched.pyc"), doraise=True)
    assert {r.fix: r.status for r in probe_all(root) if r.fix != CONV} == others
    assert any("calls the kernel's non-varlen causal_conv1d_fwd_cpu per request" in line
               for line in result.after.evidence), result.after.evidence
    # the CPU branch: the kernel's import kept, its conv bound to the per-request wrapper defined
    # there, which loops over the requests and calls the non-varlen path on a one-slot view
    branch = cpu_branch(root / GDN_BACKEND)
    text = [ast.unparse(s) for s in branch]
    assert text[0].startswith("from sgl_kernel.mamba import causal_conv1d_fn_cpu")
    assert "causal_conv1d_fn = causal_conv1d_fn_cpu_per_request" in text
    wrapper = next(s for s in branch if isinstance(s, ast.FunctionDef))
    assert wrapper.name == "causal_conv1d_fn_cpu_per_request"
    loop = next(n for n in ast.walk(wrapper) if isinstance(n, ast.For))
    call = next(n for n in ast.walk(loop) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "torch.ops.sgl_kernel.causal_conv1d_fwd_cpu")
    assert [ast.unparse(a) for a in call.args[3:]] == [
        "conv_states[slot:slot + 1]", "None", "one_slot",
        "None if has_initial_state is None else has_initial_state[i:i + 1]", "activation == 'silu'",
        "-1", "True"]
    # the rest of the branch as released, where the binding was the kernel's varlen wrapper
    released = [ast.unparse(s) for s in cpu_branch(release_tree(version) / GDN_BACKEND)]
    assert [t for t in text if not t.startswith(("causal_conv1d_fn =", "def "))] == [
        t for t in released if not t.startswith("causal_conv1d_fn =")]
    assert "causal_conv1d_fn = causal_conv1d_fn_cpu" in released

    again = apply_patch(root, CONV)
    assert again.changed == [] and again.before.status is PRESENT
    assert tree_hashes(root) == after


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_cpu_conv_patch_refused_without_a_cpu_branch(writable_tree: Callable[[str], Path]) -> None:
    root = writable_tree("0.5.3")
    before = tree_hashes(root)
    with pytest.raises(PatchError, match=r"pr29068-cpu-conv-varlen-state: not applicable to sglang "
                                         r"0\.5\.3 .*no `is_cpu\(\)` branch that binds causal_conv1d_fn"):
        apply_patch(root, CONV)
    assert tree_hashes(root) == before


# --- without wheels ----------------------------------------------------------------------------


def test_unknown_patch_and_fix_names(tmp_path: Path) -> None:
    with pytest.raises(PatchError, match=r"unknown patch 'pr99999-nothing'; known: pr37165-clear-deferred"):
        apply_patch(tmp_path, "pr99999-nothing")
    with pytest.raises(ValueError, match=r"unknown fix 'pr99999-nothing'"):
        probe(tmp_path, "pr99999-nothing")
    assert {name for name, patch in PATCHES.items() if patch.check is None} == set(FIXES)
    assert PATCHES[B].available and not PATCHES[A].available
    assert PATCHES["defect:deferred-ops-dropped"].available


@pytest.mark.parametrize("layout", ["empty", "package-without-srt", "not-a-package"])
def test_probe_without_sglang_is_a_clear_error(tmp_path: Path, layout: str) -> None:
    if layout == "package-without-srt":
        (tmp_path / "sglang").mkdir()
        (tmp_path / "sglang" / "__init__.py").write_text("")
    elif layout == "not-a-package":
        (tmp_path / "sglang" / "srt").mkdir(parents=True)
    with pytest.raises(SourceTreeError, match=rf"{tmp_path}: no sglang package here"):
        probe_all(tmp_path)
    with pytest.raises(SourceTreeError, match="no sglang package here"):
        apply_patch(tmp_path, B)


SYNTHETIC_BATCH = """\
class ScheduleBatch:
    mamba_cow_src_indices = None
    mamba_cow_dst_indices = None
    mamba_clear_indices = None

    def prepare_for_decode(self):
        \"\"\"Docstring.\"\"\"
        self.forward_mode = ForwardMode.DECODE
        self.input_embeds = None  # reset
{middle}
    def filter_batch(self):
        self.mamba_cow_src_indices = None
"""
SPEC_BRANCH = """\
        if not self.spec_algorithm.is_none():
            return
        self.seq_lens = self.seq_lens + 1
"""


def synthetic_tree(root: Path, middle: str, newline: str = "\n") -> Path:
    pkg = root / "python" / "sglang"
    (pkg / "srt" / "managers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text('__version__ = "0.0.0.synthetic"\n')
    text = SYNTHETIC_BATCH.format(middle=middle).replace("\n", newline)
    (pkg / "srt" / "managers" / "schedule_batch.py").write_bytes(text.encode())
    return root


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_patch_on_a_checkout_layout_keeps_line_endings(tmp_path: Path, newline: str) -> None:
    root = synthetic_tree(tmp_path, SPEC_BRANCH, newline)
    target = root / "python" / SCHEDULE_BATCH
    assert probe(root, B).status is ABSENT
    assert probe(root, A).status is NA

    result = apply_patch(root, B)

    assert result.version == "0.0.0.synthetic" and result.after.status is PRESENT
    data = target.read_bytes()
    assert data.count(b"\r\n") == (data.count(b"\n") if newline == "\r\n" else 0)
    lines = data.decode().splitlines()
    start = lines.index("        self.input_embeds = None  # reset")
    assert lines[start + 1: start + 6] == ["", *(f"        self.{n} = None" for n in DEFERRED_FIELDS),
                                           "        if not self.spec_algorithm.is_none():"]


def test_patch_without_its_anchor_raises_and_changes_nothing(tmp_path: Path) -> None:
    root = synthetic_tree(tmp_path, "        self.seq_lens = self.seq_lens + 1\n")
    before = tree_hashes(root)
    assert probe(root, B).status is ABSENT
    with pytest.raises(PatchError, match=r"pr37165-clear-deferred-mamba-metadata: .*schedule_batch\.py: .*"
                                         r"no speculative branch.*nothing was changed"):
        apply_patch(root, B)
    assert tree_hashes(root) == before


MIXED_BATCH = """\
class ScheduleBatch:
    mamba_track_indices = None

    def mix_with_running(self, running_batch):
        running_bs = running_batch.batch_size()
{save}
        self.merge_batch(running_batch)
{restore}
        self.extend_lens = self.extend_lens + [1] * running_bs

    def merge_batch(self, other):
        self.mamba_track_indices = None
        self.mamba_track_mask = None
"""
SAVE = """\
        # keep the prefill rows' tracking
        saved = None
        if self.mamba_track_indices is not None:
            saved = (self.mamba_track_indices, self.mamba_track_mask)
"""
RESTORE = """\
        if saved is not None:
            self.mamba_track_indices = pad(saved[0], running_bs)
            self.mamba_track_mask = pad(saved[1], running_bs)
"""


def test_mixed_chunk_probe_and_defect_on_a_checkout_layout(tmp_path: Path) -> None:
    fixed = synthetic_tree(tmp_path / "fixed", "")
    unfixed = synthetic_tree(tmp_path / "unfixed", "")
    for root, save, restore in ((fixed, SAVE, RESTORE), (unfixed, "", "")):
        (root / "python" / SCHEDULE_BATCH).write_text(MIXED_BATCH.format(save=save, restore=restore))
    assert probe(fixed, MIXED).status is PRESENT
    assert probe(unfixed, MIXED).status is ABSENT
    defect = "defect:mixed-chunk-tracking-dropped"
    assert apply_patch(unfixed, defect).changed == []  # the defect is there as written

    result = apply_patch(fixed, defect)

    assert (result.before.status, result.after.status) == (ABSENT, PRESENT)
    assert probe(fixed, MIXED).status is ABSENT
    text = (fixed / "python" / SCHEDULE_BATCH).read_text()
    assert "saved" not in text and "keep the prefill rows' tracking" not in text
    assert "running_bs = running_batch.batch_size()" in text  # read by what stays
    assert f"# defect patch {defect}" in text
    method = lambda root: next(  # noqa: E731
        ast.dump(f) for c in ast.parse((root / "python" / SCHEDULE_BATCH).read_text()).body
        for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "mix_with_running")
    assert method(fixed) == method(unfixed)
