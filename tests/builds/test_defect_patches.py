"""Defect patches: a known SGLang bug put back into a real release's source by an ast-located edit.

``defect:deferred-ops-dropped`` (PR #24954's review): with no extra buffer, a prefix hit whose
prefill is split into chunks loses its deferred copy-on-write. The edit is checked three ways on
real releases: it applies where the deferred COW exists (0.5.13 on) and nowhere earlier; SGLang's
own ``ScheduleBatch._collect_deferred_mamba_cow_and_clear``, taken from the patched file and run on
requests, drops exactly the COW of chunked requests with the extra buffer off, and nothing else;
and a build with it is a build of its own, its manifest naming the patch and the file it changed.

``defect:mixed-chunk-tracking-dropped`` (PR #39342 reversed): 0.5.23 with it has 0.5.22's
``ScheduleBatch.mix_with_running`` statement for statement, and SGLang's own method, run on a prefill
batch mixed with running decodes, keeps the prefill rows' tracking without it and drops it with it,
as 0.5.22 does as released; 0.5.22 is the unplanted control (applying the defect there changes
nothing).
"""

from __future__ import annotations

import ast
import json
import logging
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from evalsvc.builds.build import make_build
from evalsvc.builds.patches import PATCHES, PatchError, apply_patch
from evalsvc.builds.probes import FORWARD_STREAM_MAMBA_OPS, MIXED_CHUNK_TRACKING, Status, probe, probe_all
from evalsvc.engines.sglang_server import parse_defect_events

DEFECT = "defect:deferred-ops-dropped"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
# the first release with the deferred COW (PR #24954), the CPU one, one of each later spelling
RELEASES = ["0.5.13", "0.5.17", "0.5.19", "0.5.23"]

torch = pytest.importorskip("torch")


def collector(root: Path) -> Callable:
    """SGLang's own ``ScheduleBatch._collect_deferred_mamba_cow_and_clear`` from the tree at
    ``root``, compiled alone; the names its releases read the server settings through are given
    ``settings`` (extra buffer on or off)."""
    path = root / SCHEDULE_BATCH
    text = path.read_text()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)
               and n.name == "ScheduleBatch")
    function = next(n for n in cls.body if isinstance(n, ast.FunctionDef)
                    and n.name == "_collect_deferred_mamba_cow_and_clear")
    source = textwrap.dedent(ast.get_source_segment(text, function, padded=True))
    settings = SimpleNamespace(extra_buffer=False)

    class Mamba:  # 0.5.20 on: get_exec().mamba.enable_mamba_extra_buffer, an attribute
        enable_mamba_extra_buffer = property(lambda _: settings.extra_buffer)

    server_args = SimpleNamespace(enable_mamba_extra_buffer=lambda: settings.extra_buffer)
    exec_settings = SimpleNamespace(mamba=Mamba())
    namespace = {"torch": torch, "logging": logging, "__name__": "sglang.srt.managers.schedule_batch",
                 "get_server_args": lambda: server_args,
                 "get_global_server_args": lambda: server_args,
                 "mamba_extra_buffer_enabled": lambda: settings.extra_buffer,
                 "get_exec": lambda: exec_settings}
    exec(compile(source, str(path), "exec"), namespace)
    run = namespace[function.name]
    run.settings = settings
    return run


class Req(SimpleNamespace):
    @property
    def kv(self) -> Req:  # 0.5.19 on keep the Mamba state fields on ``req.kv``
        return self


def request(slot: int, cow_from: int | None, extend: int, total: int) -> Req:
    """A request with a fresh state slot, a prefix-hit COW source (or none: a cold request, whose
    slot needs clearing), and an extend of ``extend`` of its ``total`` tokens."""
    ids = list(range(total))
    return Req(
        rid=f"req-{slot}", mamba_pool_idx=torch.tensor(slot), mamba_needs_clear=cow_from is None,
        mamba_cow_src_index=None if cow_from is None else torch.tensor([cow_from]),
        full_untruncated_fill_ids=ids, get_fill_ids=lambda: ids[:extend],
        fill_ids=ids[:extend], origin_input_ids=ids, output_ids=[])


def collect(run: Callable, reqs: list[Req], extra_buffer: bool = False
            ) -> dict[str, list[int] | None]:
    run.settings.extra_buffer = extra_buffer
    batch = SimpleNamespace()
    run(batch, reqs)
    return {k: None if getattr(batch, k) is None else getattr(batch, k).tolist()
            for k in ("mamba_cow_src_indices", "mamba_cow_dst_indices", "mamba_clear_indices")}


@pytest.mark.wheels
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("version", RELEASES)
def test_the_defect_drops_exactly_the_chunked_prefix_hits_copy_on_write(
        version: str, writable_tree: Callable[[str], Path], caplog) -> None:
    root = writable_tree(version)
    clean = collector(root)
    result = apply_patch(root, DEFECT)
    assert (result.before.status, result.after.status) == (Status.ABSENT, Status.PRESENT)
    assert [c.path for c in result.changed] == [SCHEDULE_BATCH]
    defective = collector(root)

    def batch() -> list[Req]:  # chunked hit, whole hit, cold chunked request
        return [request(3, 7, extend=64, total=200), request(4, 8, extend=50, total=50),
                request(5, None, extend=64, total=200)]

    assert collect(clean, batch()) == {"mamba_cow_src_indices": [7, 8],
                                       "mamba_cow_dst_indices": [3, 4], "mamba_clear_indices": [5]}
    reqs = batch()
    with caplog.at_level(logging.WARNING, logger="sglang.srt.managers.schedule_batch"):
        assert collect(defective, reqs) == {"mamba_cow_src_indices": [8],
                                            "mamba_cow_dst_indices": [4],
                                            "mamba_clear_indices": [5]}
    assert reqs[0].mamba_cow_src_index is None and not reqs[0].mamba_needs_clear  # gone for good
    # each drop is logged with the request's rid: what a run lays beside its samples
    assert parse_defect_events(caplog.text) == [(DEFECT, "req-3")]
    # the extra buffer's path is untouched
    assert collect(defective, batch(), extra_buffer=True) == collect(clean, batch(),
                                                                      extra_buffer=True)
    # the fix it undoes in part is still recognised; applying again changes nothing
    assert probe(root, FORWARD_STREAM_MAMBA_OPS).status is Status.PRESENT
    assert apply_patch(root, DEFECT).changed == []


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_the_defect_is_refused_before_the_deferred_copy_on_write_exists(
        writable_tree: Callable[[str], Path]) -> None:
    root = writable_tree("0.5.12.post1")
    before = (root / SCHEDULE_BATCH).read_bytes()
    with pytest.raises(PatchError, match=r"not applicable to sglang 0\.5\.12\.post1"):
        apply_patch(root, DEFECT)
    assert (root / SCHEDULE_BATCH).read_bytes() == before


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_a_build_with_the_defect_is_its_own_build_and_says_so(
        tmp_path: Path, release_tree: Callable[[str], Path]) -> None:
    release_tree("0.5.17")  # downloaded (or skipped / failed) like the other wheel tests
    clean = make_build("sglang==0.5.17", root=tmp_path, base_python=sys.executable)
    defective = make_build("sglang==0.5.17", [DEFECT], root=tmp_path)
    assert defective.key != clean.key
    manifest = json.loads((defective.directory / "manifest.json").read_text())
    assert manifest["patches"] == [DEFECT]
    assert [f["path"] for f in manifest["files_changed"]] == [SCHEDULE_BATCH]
    assert manifest["package_hash"] != clean.manifest["package_hash"]
    assert "defect patch defect:deferred-ops-dropped" in (
        defective.site / SCHEDULE_BATCH).read_text()
    assert DEFECT in PATCHES and PATCHES[DEFECT].check is not None


# --- defect:mixed-chunk-tracking-dropped (PR #39342 reversed) -----------------------------------

MIXED_DEFECT = "defect:mixed-chunk-tracking-dropped"
TRACK = ("mamba_track_indices", "mamba_track_mask", "mamba_track_seqlens",
         "mamba_prefill_track_mask_cpu", "mamba_track_seqlens_cpu")


def mix_with_running(root: Path) -> ast.FunctionDef:
    module = ast.parse((root / SCHEDULE_BATCH).read_bytes())
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == "ScheduleBatch")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "mix_with_running")


def compiled_mix(root: Path) -> Callable:
    """SGLang's own ``ScheduleBatch.mix_with_running`` from the tree at ``root``, compiled alone."""
    path = root / SCHEDULE_BATCH
    text = path.read_text()
    source = textwrap.dedent(ast.get_source_segment(text, mix_with_running(root), padded=True))
    namespace = {"__builtins__": __builtins__, "torch": torch,
                 "ForwardMode": SimpleNamespace(MIXED="mixed"),
                 "get_exec": lambda: SimpleNamespace(mamba=SimpleNamespace(
                     enable_mamba_extra_buffer_lazy=False))}
    exec(compile("from __future__ import annotations\n" + source, str(path), "exec"), namespace)
    return namespace["mix_with_running"]


class Batch(SimpleNamespace):
    def batch_size(self) -> int:
        return len(self.reqs)

    def merge_batch(self, other: Batch) -> None:
        """What every release's ``merge_batch`` does to the rows and the track fields (its probe
        checks the ``None``s): rows appended, tracking dropped."""
        self.reqs = self.reqs + other.reqs
        self.out_cache_loc = torch.cat([self.out_cache_loc, other.out_cache_loc])
        for name in TRACK:
            setattr(self, name, None)


def mixed_step(run: Callable) -> Batch:
    """A prefill batch of two requests (the first reaches a track point: slot 5 at 64 tokens) mixed
    with three running decodes."""
    req = lambda: SimpleNamespace(refresh_fill_ids=lambda: None)  # noqa: E731
    prefill = Batch(
        reqs=[req(), req()], spec_algorithm=SimpleNamespace(is_none=lambda: True),
        out_cache_loc=torch.arange(100, 110), prefix_lens=[0, 0], extend_lens=[70, 30],
        extend_num_tokens=100, extend_logprob_start_lens=[0, 0],
        mamba_track_indices=torch.tensor([5, 6]), mamba_track_mask=torch.tensor([True, False]),
        mamba_track_seqlens=torch.tensor([64, -1]), mamba_prefill_track_mask_cpu=[True, False],
        mamba_track_seqlens_cpu=[64, -1])
    running = Batch(reqs=[req(), req(), req()], seq_lens_cpu=torch.tensor([10, 11, 12]),
                    req_pool_indices=torch.tensor([1, 2, 3]), req_pool_indices_cpu=[1, 2, 3],
                    out_cache_loc=torch.tensor([7, 8, 9]))
    run(prefill, running)
    return prefill


def tracking(batch: Batch) -> dict[str, list | None]:
    return {name: (value.tolist() if isinstance(value, torch.Tensor) else value)
            for name in TRACK for value in [getattr(batch, name)]}


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_the_mixed_chunk_defect_puts_0_5_22_back_into_0_5_23(
        writable_tree: Callable[[str], Path], release_tree: Callable[[str], Path]) -> None:
    root = writable_tree("0.5.23")
    clean = compiled_mix(root)
    statuses = {r.fix: r.status for r in probe_all(root)}
    assert statuses[MIXED_CHUNK_TRACKING] is Status.PRESENT

    result = apply_patch(root, MIXED_DEFECT)

    assert (result.before.status, result.after.status) == (Status.ABSENT, Status.PRESENT)
    assert [c.path for c in result.changed] == [SCHEDULE_BATCH]
    # only the fix it reverses changes; the method is 0.5.22's, statement for statement
    assert {r.fix: r.status for r in probe_all(root)} == {
        **statuses, MIXED_CHUNK_TRACKING: Status.ABSENT}
    assert ast.dump(mix_with_running(root)) == ast.dump(mix_with_running(release_tree("0.5.22")))
    assert "defect patch defect:mixed-chunk-tracking-dropped" in (root / SCHEDULE_BATCH).read_text()
    # run: the fix keeps the prefill rows' tracking with the decode tails untracked; the defect,
    # like 0.5.22 as released, leaves the mixed forward nothing to track
    assert tracking(mixed_step(clean)) == {
        "mamba_track_indices": [5, 6, -1, -1, -1], "mamba_track_mask": [True] + [False] * 4,
        "mamba_track_seqlens": [64, -1, -1, -1, -1],
        "mamba_prefill_track_mask_cpu": [True] + [False] * 4, "mamba_track_seqlens_cpu": [64] + [-1] * 4}
    dropped = dict.fromkeys(TRACK)
    assert tracking(mixed_step(compiled_mix(root))) == dropped
    assert tracking(mixed_step(compiled_mix(release_tree("0.5.22")))) == dropped
    assert apply_patch(root, MIXED_DEFECT).changed == []


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_0_5_22_carries_the_mixed_chunk_defect_as_released(
        writable_tree: Callable[[str], Path]) -> None:
    root = writable_tree("0.5.22")
    before = (root / SCHEDULE_BATCH).read_bytes()
    result = apply_patch(root, MIXED_DEFECT)
    assert result.before.status is Status.PRESENT and result.changed == []
    assert (root / SCHEDULE_BATCH).read_bytes() == before
    assert probe(root, MIXED_CHUNK_TRACKING).status is Status.ABSENT
    with pytest.raises(PatchError, match=r"PR #39342 backport not available for sglang 0\.5\.22; "
                                         r"evaluate a release that contains it \(0\.5\.23 or later\)"):
        apply_patch(root, MIXED_CHUNK_TRACKING)


@pytest.mark.wheels
@pytest.mark.timeout(1800)
def test_the_mixed_chunk_defect_is_refused_where_no_tracked_batch_mixes(
        writable_tree: Callable[[str], Path]) -> None:
    root = writable_tree("0.5.3")
    before = (root / SCHEDULE_BATCH).read_bytes()
    with pytest.raises(PatchError, match=r"defect:mixed-chunk-tracking-dropped: not applicable to sglang "
                                         r"0\.5\.3 .*no mixed-chunk merge of Mamba-tracked batches"):
        apply_patch(root, MIXED_DEFECT)
    assert (root / SCHEDULE_BATCH).read_bytes() == before
