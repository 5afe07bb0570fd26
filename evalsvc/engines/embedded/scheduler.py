"""The scheduler of the embedded engine: requests, batches, the prefix cache and its state slots.

It follows SGLang's scheduler for hybrid models:

* A waiting queue, a running batch, and at most one chunked request. Prefill batches go first,
  limited by ``--chunked-prefill-size`` tokens; a prompt that does not fit is split into chunks.
* A prefix match ends at a tree node that holds a recurrent state. On a hit the request gets its own
  slot and a copy-on-write from the node's slot is *recorded*; on a miss a clear is recorded. Both
  run at the start of the forward that first processes the request (on the forward stream).
* ``no_buffer``: after every extend the whole processed prefix is cached with a copy of the state;
  at the end the request's slot is donated to the tree.
  ``extra_buffer``: requests own ping-pong track slots; the forward snapshots the state at
  chunk-aligned prefill positions (relative to the prefix; the chunk is the larger of the mixers'
  64 tokens and ``--page-size``) and at decode lengths on the grid of both that chunk and
  ``--mamba-track-interval``, and the tree receives the track slot holding the newest snapshot
  (donated).
* ``--page-size`` above 1: prefix matches end on whole pages, and a prompt is cut into chunks at
  page boundaries.
* ``--enable-mixed-chunk``: a prefill batch takes the running decode requests along as one-token
  rows (SGLang's ``mix_with_running``), its chunk budget less one token per running request; not
  when any request of either batch asks for logprobs. The prefill rows keep their snapshots; the
  decode rows take none in that step.
* Overlap: the scheduler prepares batch N+1 while batch N runs on a forward thread; results of N are
  processed after N+1 is launched. Pool memory is only touched on that thread, in batch order.
* HiCache: nodes are written to a host tier (write_through, write_through_selective, write_back),
  survive device eviction there, and are loaded back on a hit.
* MTP: every decode step drafts, verifies in one target forward, accepts, and runs a draft-extend.

Defects (see ``defects.py``) switch single mechanisms to the buggy variant, for the requests their
strength selects (``_affected``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from evalsvc.engines.sglang_server import DEFECT_EVENT

from .args import EngineArgs, mamba_cache_chunk_size, mamba_track_grid
from .defects import Defect, affects
from .memory import HostPool, KVPool, StatePool
from .model import HybridLM
from .radix import RadixCache, TreeNode
from .runner import ForwardBatch, ModelRunner, ReqResult, ReqView, SamplingInfo
from .tokenizer import TextTokenizer

log = logging.getLogger("evalsvc.engine")

MAX_PREFILL_TOKENS = 16384  # extend tokens per batch when chunked prefill is off


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None  # streamed outputs: tokens per chunk (None: the server's)


@dataclass
class GenerateInput:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    namespace: tuple[str, str] | None = None  # (cache_salt, extra_key): the prefix cache's
    key: str | None = None  # the internal id (``rid_key``) when the caller picks it, to abort by


class Req:
    def __init__(self, inp: GenerateInput, seed: int, done: Callable[[Req], None],
                 progress: Callable[[Req], None] | None = None) -> None:
        self.rid = inp.rid
        self.origin = list(inp.input_ids)
        self.inp = inp
        self.sp = inp.sampling
        self.seed = seed
        self.done = done
        self.progress = progress  # called on the scheduler's thread after each step with tokens
        self.output_ids: list[int] = []
        self.finished_reason: dict | None = None
        self.to_finish: dict | None = None  # an abort, applied after the step in flight
        self.error: str | None = None
        # logprob start as SGLang's scheduler normalises it
        start = inp.logprob_start_len if inp.return_logprob else -1
        if start == -1:
            start = len(self.origin) if (inp.return_logprob or self.sp.max_new_tokens == 0) else -1
        self.logprob_start_len = start
        # cache and memory
        self.kv = torch.zeros(0, dtype=torch.long)  # KV indices of positions [0, len(kv))
        self.cache_protected_len = 0  # kv[:this] belongs to the tree (locked through last_node)
        self.last_node: TreeNode | None = None
        self.processed = 0  # positions whose KV and state are computed (in batch order)
        self.scheduled = 0  # positions handed to forwards so far
        self.slot: int | None = None
        self.track_slots: list[int] = []
        self.track_next = 0
        self.last_track: tuple[int, int] | None = None  # (length, slot) of the newest snapshot
        self.pending_op: tuple | None = None  # ("cow", src) | ("clear",): recorded at match
        self.branching: int | None = None
        self.cached_tokens = 0
        self.host_cached_tokens = 0
        self.reserved = 0  # KV tokens this request may still allocate
        self.inflight = 0
        # results
        self.input_logprobs: list[float] = []
        self.input_top_logprobs: list = []
        self.input_ids_logprobs: list = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list = []
        self.output_ids_logprobs: list = []
        self.spec_verify_ct = 0
        self.spec_correct_drafts = 0
        self.spec_histogram: list[int] = []
        self.created = time.perf_counter()
        self.finished_at: float | None = None
        self.released = False
        self.key = inp.key or rid_key(inp.rid)  # unique even if a client reuses a rid

    @property
    def prompt_len(self) -> int:
        return len(self.origin)

    @property
    def fill(self) -> list[int]:
        return self.origin + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def max_prefix_len(self) -> int:
        limit = len(self.origin) - 1
        if self.inp.return_logprob and self.logprob_start_len >= 0:
            limit = min(limit, self.logprob_start_len)
        return max(limit, 0)


class ScheduleBatch:
    """A batch as the scheduler knows it. The three ``mamba_*`` fields are one-shot metadata for
    the extend that records them (SGLang's names)."""

    _ids = 0

    def __init__(self, reqs: list[Req], mode: str) -> None:
        ScheduleBatch._ids += 1
        self.id = ScheduleBatch._ids
        self.reqs = reqs
        self.mode = mode
        self.decoding: list[Req] = []  # a mixed batch: the running requests it decodes
        self.mamba_cow_src_indices: list[int] | None = None
        self.mamba_cow_dst_indices: list[int] | None = None
        self.mamba_clear_indices: list[int] | None = None
        # stale-spec-metadata: the entries of the above that survive into decode
        self.stale_ops: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.kv_loads: list = []
        self.state_loads: list = []
        self.late_state_loads: set[int] = set()  # host-load-race: device slots loaded late
        self.views: dict[str, ReqView] = {}


class Stream:
    """The forward stream: work runs in submission order, on a thread of its own in overlap mode
    and inline otherwise."""

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self._q: queue.Queue = queue.Queue()
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="forward-stream", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        if not self.threaded:
            _run_into(fut, fn)
        else:
            self._q.put((fut, fn))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            _run_into(*item)

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=10)


def _run_into(fut: Future, fn: Callable[[], Any]) -> None:
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        fut.set_exception(exc)


class Scheduler:
    def __init__(self, args: EngineArgs, model: HybridLM, tokenizer: TextTokenizer) -> None:
        self.args = args
        self.model = model
        self.tokenizer = tokenizer
        self.defects = set(args.defects)
        self.defect_strengths = {d: args.defect_strengths.get(d, 1.0) for d in args.defects}
        self.radix = not args.disable_radix_cache
        self.strategy = args.mamba_radix_cache_strategy if self.radix else None
        self.overlap = not args.disable_overlap_schedule
        self.spec_steps = args.speculative_num_steps if args.speculative_algorithm else 0
        self.chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else None
        self.page = args.page_size
        self.cache_chunk = mamba_cache_chunk_size(self.page)
        self.track_grid = mamba_track_grid(self.page, args.mamba_track_interval)
        # as SGLang's ``is_mixed_chunk``: mixing needs chunked prefill
        self.mixed_chunk = args.enable_mixed_chunk and self.chunk is not None
        self.n_track = 0
        if self.strategy == "extra_buffer":
            self.n_track = 2 if self.overlap else 1
        self.kv = KVPool(model, args.max_total_tokens)
        self.states = StatePool(model, args.max_mamba_cache_size, with_draft=self.spec_steps > 0)
        self.host: HostPool | None = None
        if args.enable_hierarchical_cache:
            tokens, slots = args.host_pool_sizes(self.kv.bytes_per_token(),
                                                 self.states.bytes_per_slot())
            self.host = HostPool(self.kv, self.states, tokens, slots)
        self.tree = RadixCache(self, args.hicache_write_policy if self.host else None,
                               page_size=self.page)
        if args.tree_core_fallback and self.radix:  # SGLang's line, which the launcher reads
            log.info("Using the Python TreeCore: %s", args.tree_core_fallback)
        self.runner = ModelRunner(model, self.kv, self.states, self.host, self.spec_steps,
                                  deterministic=args.enable_deterministic_inference)
        self.stream = Stream(threaded=self.overlap)
        self.preimages = Preimages(self.states) if self.overlap else None
        self.waiting: deque[Req] = deque()
        self.running = ScheduleBatch([], "decode")
        self.chunked_req: Req | None = None
        self.to_merge: list[Req] = []
        self.to_merge_batch: ScheduleBatch | None = None
        self.inflight_batches = 0
        self._launches = 0
        self.inbox: queue.Queue = queue.Queue()
        self.held: list[Req] = []  # finished requests whose answer waits for the step ahead
        self.stats = Stats()
        self._stop = threading.Event()
        self._seed_counter = 0
        self._thread: threading.Thread | None = None

    # ---- public, thread-safe ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._event_loop, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.stream.close()

    def submit(self, inp: GenerateInput, done: Callable[[Req], None],
               progress: Callable[[Req], None] | None = None) -> None:
        """Queue a request. ``done(req)`` is called once it is finished (or refused);
        ``progress(req)``, if given, after every step that gave it new tokens before that. Both
        run on the scheduler's thread."""
        self.inbox.put(("generate", (inp, done, progress)))

    def abort(self, rid: str | None, key: str | None = None) -> None:
        """Abort as SGLang's ``/abort_request`` does: the requests whose rid starts with ``rid``
        if one has exactly that rid (``rid`` None: every request), or the one request with
        internal ``key``. A waiting request finishes at once; a running one after its step in
        flight, keeping what it generated."""
        self.inbox.put(("abort", (rid, key)))

    def flush_cache(self) -> bool:
        fut: Future = Future()
        self.inbox.put(("flush", fut))
        return fut.result(timeout=60)

    def _affected(self, defect: Defect, req: Req) -> bool:
        """Whether a switched-on defect acts on this request (its strength selects by prompt)."""
        strength = self.defect_strengths.get(defect)
        return strength is not None and affects(defect, req.origin, strength)

    def busy(self) -> int:
        return self.stats.num_running + self.stats.num_waiting + self.inbox.qsize()

    # ---- event loop -----------------------------------------------------------------------
    def _event_loop(self) -> None:
        last: tuple[ScheduleBatch, Future] | None = None
        while not self._stop.is_set():
            self._recv(block=last is None and self._idle())
            try:
                batch = self._next_batch()
                fut = self._launch(batch) if batch is not None else None
                if last is not None:
                    self._process(*last)
                last = (batch, fut) if batch is not None else None
                if not self.overlap and last is not None:
                    self._process(*last)
                    last = None
            except Exception:
                log.exception("scheduler step failed; aborting the requests involved")
                # a batch launched ahead of the one that failed is never processed: wait for the
                # forward stream to finish it, so nothing counts as in flight after the abort
                # (else every later /flush_cache is refused)
                self.stream.submit(lambda: None).result()
                self.inflight_batches = 0
                self._abort_all("internal error in the embedded engine (see its log)")
                last = None
            self._update_gauges()
        self._recv(block=False)  # what came in during shutdown is answered too
        self._abort_all("the server is shutting down", status=503)

    def _idle(self) -> bool:
        return (not self.waiting and not self.running.reqs and self.chunked_req is None
                and not self.to_merge and self.inflight_batches == 0)

    def _recv(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "generate":
                self._add_request(*payload)
            elif kind == "abort":
                self._abort(*payload)
            elif kind == "flush":
                payload.set_result(self._flush())

    def _add_request(self, inp: GenerateInput, done: Callable[[Req], None],
                     progress: Callable[[Req], None] | None = None) -> None:
        seed = inp.sampling.sampling_seed
        if seed is None:
            seed = self.args.random_seed * 1_000_003 + self._seed_counter
            self._seed_counter += 1
        req = Req(inp, seed, done, progress)
        need = req.prompt_len + req.sp.max_new_tokens + self.spec_steps + 1
        if req.logprob_start_len > req.prompt_len:
            return self._reject(req, f"logprob_start_len={req.logprob_start_len} is higher than the "
                                     f"number of input tokens {req.prompt_len}. Please use a "
                                     "smaller logprob_start_len.")
        if need > self.args.max_total_tokens:
            return self._reject(req, f"the request needs {need} tokens (input {req.prompt_len} + "
                                     f"max_new_tokens {req.sp.max_new_tokens}), more than "
                                     f"--max-total-tokens {self.args.max_total_tokens}")
        self.waiting.append(req)
        self.stats.num_requests += 1

    def _abort(self, rid: str | None, key: str | None) -> None:
        reqs = list(self.waiting) + list(self.running.reqs) + list(self.to_merge)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        reqs = [r for r in reqs if not r.finished and r.to_finish is None]
        if key is not None:
            hit = [r for r in reqs if r.key == key]
        elif rid is None:
            hit = reqs
        elif any(r.rid == rid for r in reqs):
            hit = [r for r in reqs if r.rid.startswith(rid)]
        else:
            hit = []
        for req in hit:
            if req in self.waiting:  # nothing allocated yet
                self.waiting.remove(req)
                req.finished_reason = {"type": "abort", "message": "Abort in waiting queue"}
                req.finished_at = time.perf_counter()
                req.done(req)
            else:
                req.to_finish = {"type": "abort", "message": "Aborted", "status_code": None,
                                 "err_type": None}

    def _reject(self, req: Req, message: str) -> None:
        req.error = message
        req.finished_reason = {"type": "abort", "message": message, "status_code": 400}
        req.done(req)

    def _flush(self) -> bool:
        if not self._idle():
            log.info("Cache not flushed because there are pending requests. #queue-req: %d, "
                     "#running-req: %d", len(self.waiting), len(self.running.reqs))
            return False
        self.stream.submit(lambda: None).result()
        self.tree.reset()
        self.kv.slots.clear()
        self.states.slots.clear()
        if self.host is not None:
            self.host.token_slots.clear()
            self.host.state_slots.clear()
        self.stats.reset_cache_counters()
        log.info("Cache flushed successfully!")
        return True

    # ---- TreeOwner -------------------------------------------------------------------------
    def free_kv(self, idx: torch.Tensor) -> None:
        if len(idx):
            self.kv.slots.free(idx.tolist())

    def free_state(self, slot: int) -> None:
        self.states.slots.free([slot])

    def backup_node(self, node: TreeNode) -> bool:
        host = self.host
        n_tok = len(node.key) if node.on_device and node.host_value is None else 0
        n_state = 1 if node.mamba is not None and node.host_mamba is None else 0
        if host.token_slots.available() < n_tok or host.state_slots.available() < n_state:
            self.tree.evict_host(n_tok - host.token_slots.available(),
                                 n_state - host.state_slots.available())
        if host.token_slots.available() < n_tok or host.state_slots.available() < n_state:
            return False
        if n_tok:
            host_idx = torch.tensor(host.token_slots.alloc(n_tok), dtype=torch.long)
            dev_idx = node.value.clone()
            node.host_value = host_idx
            self.stream.submit(lambda: host.backup_kv(self.kv, dev_idx, host_idx))
        if n_state:
            host_slot, dev_slot = host.state_slots.alloc(1)[0], node.mamba
            node.host_mamba = host_slot
            self.stream.submit(lambda: host.backup_state(self.states, dev_slot, host_slot))
        self.stats.host_backups += 1
        return True

    def free_host(self, node: TreeNode) -> None:
        if node.host_value is not None:
            self.host.token_slots.free(node.host_value.tolist())
        if node.host_mamba is not None:
            self.host.state_slots.free([node.host_mamba])
        node.host_value, node.host_mamba = None, None

    # ---- allocation -------------------------------------------------------------------------
    def _alloc_kv(self, n: int) -> torch.Tensor:
        short = n - self.kv.slots.available()
        if short > 0 and self.radix:
            self.tree.evict_tokens(short)
        return torch.tensor(self.kv.slots.alloc(n), dtype=torch.long)

    def _alloc_state(self) -> int:
        if self.states.slots.available() < 1 and self.radix:
            self.tree.evict_states(1)
        return self.states.slots.alloc(1)[0]

    def _slots_per_req(self) -> int:
        return 2 + self.n_track

    def _outstanding_kv(self) -> int:
        reqs = self.running.reqs + self.to_merge + ([self.chunked_req] if self.chunked_req else [])
        return sum(r.reserved for r in reqs)

    # ---- batch formation -------------------------------------------------------------------
    def _next_batch(self) -> ScheduleBatch | None:
        self._merge_finished_prefills()
        batch = self._prefill_batch()
        if batch is not None:
            if self._can_mix(batch):
                self._mix_with_running(batch)
            return batch
        self.running.reqs = [r for r in self.running.reqs if not r.finished]
        if not self.running.reqs:
            self.running = ScheduleBatch([], "decode")
            return None
        self._prepare_for_decode(self.running)
        return self.running

    def _merge_finished_prefills(self) -> None:
        if not self.to_merge:
            return
        if not self.running.reqs and self.to_merge_batch is not None:
            # the extend batch itself becomes the running batch (and keeps its fields)
            self.running = self.to_merge_batch
            self.running.reqs = [r for r in self.to_merge if not r.finished]
        else:
            self.running.reqs += [r for r in self.to_merge if not r.finished]
        self.to_merge = []
        self.to_merge_batch = None

    def _can_mix(self, batch: ScheduleBatch) -> bool:
        """SGLang's rule for a mixed batch: mixed chunk on, requests decoding, and no request of
        either batch asking for logprobs (of its input or its output)."""
        self.running.reqs = [r for r in self.running.reqs if not r.finished]
        return (self.mixed_chunk and bool(self.running.reqs)
                and not any(r.inp.return_logprob for r in batch.reqs + self.running.reqs))

    def _mix_with_running(self, batch: ScheduleBatch) -> None:
        """Decode the running requests in the prefill batch, one token each, after its prefill
        rows; the batch joins the running batch afterwards as a whole (prefills that finished,
        then the decode rows)."""
        decoding = self.running.reqs
        batch.mode = "mixed"
        batch.decoding = decoding
        for req in batch.reqs:
            view = batch.views[req.key]
            if view.track and self._affected(Defect.MIXED_CHUNK_TRACKING_DROPPED, req):
                # the merge drops the prefill rows' tracking, but the snapshot's slot stays
                # planned (``req.last_track``) and is donated to the tree unwritten
                view.track = []
        for req in decoding:
            self._decode_view(batch, req, track=False)
        batch.reqs = batch.reqs + decoding
        self.to_merge = self.to_merge + decoding
        self.running = ScheduleBatch([], "decode")
        self.stats.mixed_batches += 1

    def _prefill_batch(self) -> ScheduleBatch | None:
        budget = self.chunk or MAX_PREFILL_TOKENS
        if self.mixed_chunk:  # the running requests' decode tokens share the chunk
            budget -= sum(1 for r in self.running.reqs if not r.finished)
        reqs: list[Req] = []
        batch = ScheduleBatch(reqs, "extend")
        if self.chunked_req is not None and self.chunked_req.finished:  # aborted
            self.chunked_req = None
        if self.chunked_req is not None and budget >= self.page:
            req = self.chunked_req
            self.chunked_req = None
            self._cache_unfinished(req)
            budget -= self._schedule_extend(batch, req, budget)
        running = len(self.running.reqs) + len(reqs)
        while self.waiting and budget >= self.page and self.chunked_req is None:
            if running >= self.args.max_running_requests:
                break
            req = self.waiting[0]
            if not self._admit(req, batch):
                break
            self.waiting.popleft()
            budget -= self._schedule_extend(batch, req, budget)
            running += 1
        if not reqs:
            return None
        self._collect_deferred_ops(batch)
        return batch

    def _admit(self, req: Req, batch: ScheduleBatch) -> bool:
        """Match the prefix, reserve memory, take slots; False leaves the request waiting."""
        node, prefix = self.tree.root_of(req.inp.namespace), torch.zeros(0, dtype=torch.long)
        match = None
        if self.radix:
            match = self.tree.match_prefix(req.origin[: req.max_prefix_len()], req.inp.namespace)
            node = match.node
        self.tree.lock(node)
        need_kv = (req.prompt_len - (match.length if match else 0) + req.sp.max_new_tokens
                   + self.spec_steps + 1)
        free_kv = self.kv.slots.available() + (self.tree.evictable_tokens() if self.radix else 0)
        host_kv = match.host_tokens if match else 0
        free_states = self.states.slots.available() + (
            self.tree.evictable_states() if self.radix else 0)
        outstanding_states = len(self.running.reqs) + len(batch.reqs)
        if (free_kv - self._outstanding_kv() - host_kv < need_kv
                or free_states - outstanding_states < self._slots_per_req()):
            self.tree.unlock(node)
            return False
        if match is not None and match.length:
            state_from_host = self._load_back(match, batch, req)
            prefix = match.device_indices()
            req.branching = self._branching(req, match)
            # as SGLang counts it: a state loaded from the host makes a host hit of at least 1
            req.host_cached_tokens = max(match.host_tokens, int(state_from_host))
        req.last_node = node
        req.kv = prefix
        req.cache_protected_len = len(prefix)
        req.processed = req.scheduled = len(prefix)
        req.cached_tokens = len(prefix)
        req.reserved = need_kv
        req.slot = self._alloc_state()
        req.track_slots = [self._alloc_state() for _ in range(self.n_track)]
        if match is not None and match.length:
            req.pending_op = ("cow", node.mamba)
        else:
            req.pending_op = ("clear",)
        self.stats.prompt_tokens += req.prompt_len
        self.stats.cached_tokens += req.cached_tokens
        return True

    def _branching(self, req: Req, match) -> int | None:
        """extra_buffer: where a snapshot would let later requests branch off this prefix."""
        if self.strategy != "extra_buffer":
            return None
        node, pos, key = self.tree.root_of(req.inp.namespace), 0, req.origin[: req.max_prefix_len()]
        while pos < len(key):  # every token the tree has, states or not
            child = node.children.get(key[pos])
            if child is None:
                break
            n = 0
            while n < len(child.key) and pos + n < len(key) and child.key[n] == key[pos + n]:
                n += 1
            pos += n
            if n < len(child.key):
                break
            node = child
        pos = pos // self.page * self.page  # the tree holds whole pages
        aligned = pos // self.cache_chunk * self.cache_chunk
        return aligned if aligned > match.length else None

    def _load_back(self, match, batch: ScheduleBatch, req: Req) -> bool:
        """HiCache hit: bring host-only KV and state of the matched path back to the device.
        Returns whether the state came from the host."""
        for node in match.path:
            if not node.on_device:
                dev = self._alloc_kv(len(node.key))
                batch.kv_loads.append((node.host_value.clone(), dev))
                node.value = dev
        node = match.node
        if node.mamba is None:
            node.mamba = self._alloc_state()
            batch.state_loads.append((node.host_mamba, node.mamba))
            if self._affected(Defect.HOST_LOAD_RACE, req):  # lands after the forward read it
                batch.late_state_loads.add(node.mamba)
            self.stats.host_loads += 1
            return True
        return False

    def _schedule_extend(self, batch: ScheduleBatch, req: Req, budget: int) -> int:
        start = req.scheduled
        end = min(req.prompt_len, start + budget)
        final = end == req.prompt_len
        if not final:  # a cut lands on a page boundary (``start`` is on one)
            end = end // self.page * self.page
        kv_new = self._alloc_kv(end - start)
        req.kv = torch.cat([req.kv, kv_new])
        req.reserved -= end - start
        req.scheduled = end
        view = ReqView(
            rid=req.key, slot=req.slot, start=start, kv_past=req.kv[:start], kv_new=kv_new,
            input_ids=req.origin[start:end], sample=final and req.sp.max_new_tokens > 0,
            sampling=self._sampling(req), next_ids=req.origin[start + 1: end + 1])
        if req.inp.return_logprob:
            view.top_logprobs_num = req.inp.top_logprobs_num
            view.token_ids_logprob = req.inp.token_ids_logprob
            if req.logprob_start_len < req.prompt_len:
                view.logprob_from = req.logprob_start_len
        if self.strategy == "extra_buffer":
            self._plan_prefill_track(req, view, start, end)
        batch.reqs.append(req)
        batch.views[req.key] = view
        req.inflight += 1
        if not final:
            self.chunked_req = req
        elif req.sp.max_new_tokens > 1:  # the rest finish with this extend
            self.to_merge.append(req)
            self.to_merge_batch = batch
        return end - start

    def _plan_prefill_track(self, req: Req, view: ReqView, start: int, end: int) -> None:
        c = self.cache_chunk
        length = None
        if end - start >= c:
            length = start + (end - start) // c * c
        b = req.branching
        if b is not None and start < b < end and (b - start) % c == 0:
            length = b
        if length is None:
            return
        slot = req.track_slots[req.track_next]
        view.track.append((length, slot))
        req.last_track = (length, slot)
        req.track_next = (req.track_next + 1) % len(req.track_slots)

    def _collect_deferred_ops(self, batch: ScheduleBatch) -> None:
        """Gather the COW/clear recorded at match time into the batch's one-shot fields."""
        src, dst, clear = [], [], []
        stale_src, stale_dst, stale_clear = [], [], []
        for req in batch.reqs:
            op, req.pending_op = req.pending_op, None
            if op is None:
                continue
            chunked = req.scheduled < req.prompt_len
            if (op[0] == "cow" and chunked and self.strategy == "no_buffer"
                    and self._affected(Defect.DEFERRED_OPS_DROPPED, req)):
                # the split-prefill path loses the hit's copy-on-write
                log.warning(DEFECT_EVENT.format(name=Defect.DEFERRED_OPS_DROPPED.value,
                                                rid=req.rid))
                continue
            stale = self._affected(Defect.STALE_SPEC_METADATA, req)
            if op[0] == "cow":
                src.append(op[1])
                dst.append(req.slot)
                if stale:
                    stale_src.append(op[1])
                    stale_dst.append(req.slot)
            else:
                clear.append(req.slot)
                if stale:
                    stale_clear.append(req.slot)
        batch.stale_ops = (stale_src, stale_dst, stale_clear)
        batch.mamba_cow_src_indices = src or None
        batch.mamba_cow_dst_indices = dst or None
        batch.mamba_clear_indices = clear or None

    def _prepare_for_decode(self, batch: ScheduleBatch) -> None:
        batch.mode = "decode"
        batch.kv_loads, batch.state_loads = [], []
        batch.late_state_loads = set()
        # the fix resets the one-shot fields; the defect keeps those its requests recorded
        src, dst, clear = batch.stale_ops
        batch.mamba_cow_src_indices = src or None
        batch.mamba_cow_dst_indices = dst or None
        batch.mamba_clear_indices = clear or None
        batch.views = {}
        for req in batch.reqs:
            self._decode_view(batch, req, track=True)

    def _decode_view(self, batch: ScheduleBatch, req: Req, track: bool) -> None:
        """One decode step of ``req`` in ``batch`` (its view, KV, snapshot); ``track``: whether
        the step may snapshot (not in a mixed batch)."""
        n = self.spec_steps + 1
        start = req.scheduled
        kv_new = self._alloc_kv(n)
        req.kv = torch.cat([req.kv, kv_new])
        req.reserved -= n
        req.scheduled = start + (1 if not self.spec_steps else 0)
        view = ReqView(rid=req.key, slot=req.slot, start=start, kv_past=req.kv[:start],
                       kv_new=kv_new, input_ids=None, sample=True,
                       sampling=self._sampling(req),
                       budget=req.sp.max_new_tokens - len(req.output_ids))
        if req.inp.return_logprob:
            view.top_logprobs_num = req.inp.top_logprobs_num
            view.token_ids_logprob = req.inp.token_ids_logprob
        if self.strategy == "extra_buffer" and track:
            slot = req.track_slots[req.track_next]
            if self.spec_steps:
                view.track_interval, view.track_slot = self.args.mamba_track_interval, slot
            elif (start + 1) % self.track_grid == 0:
                # the snapshot becomes the request's newest when this batch's result is
                # processed (``_apply``), not before: under overlap the batch ahead of a
                # finishing step is dropped, and its snapshot with it
                view.track.append((start + 1, slot))
                req.track_next = (req.track_next + 1) % len(req.track_slots)
        batch.views[req.key] = view
        req.inflight += 1

    def _sampling(self, req: Req) -> SamplingInfo:
        sp = req.sp
        stops = tuple(sp.stop_token_ids)
        if not sp.ignore_eos and self.tokenizer.eos_token_id is not None:
            stops += (self.tokenizer.eos_token_id,)
        return SamplingInfo(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                            min_p=sp.min_p, seed=req.seed, stop_token_ids=stops)

    # ---- launching and results ---------------------------------------------------------------
    def _launch(self, batch: ScheduleBatch) -> Future:
        """Hand the batch to the forward stream; the future yields (launch, results)."""
        self._launches += 1
        fb = ForwardBatch(
            id=self._launches, mode=batch.mode, reqs=[batch.views[r.key] for r in batch.reqs],
            cow_src=batch.mamba_cow_src_indices, cow_dst=batch.mamba_cow_dst_indices,
            clear=batch.mamba_clear_indices, kv_loads=list(batch.kv_loads),
            state_loads=list(batch.state_loads), late_state_loads=set(batch.late_state_loads),
            spec=self.spec_steps > 0)
        launch = Launch(fb.id, fb.mode, list(batch.reqs), list(fb.reqs))
        self.inflight_batches += 1
        return self.stream.submit(lambda: (launch, self._forward(fb)))

    def _forward(self, fb: ForwardBatch) -> list[ReqResult]:
        if self.preimages is not None:
            self.preimages.record(fb)
        return self.runner.forward(fb)

    def _process(self, batch: ScheduleBatch, fut: Future) -> None:
        try:
            launch, results = fut.result()
        finally:
            self.inflight_batches -= 1
        if self.preimages is not None:
            self.preimages.synchronized(launch.id)
        self.stats.forward_count += 1
        for req, view, res in zip(launch.reqs, launch.views, results, strict=True):
            req.inflight -= 1
            if req.finished:  # overlap: a step past the end; drop it
                self._maybe_release(req)
                continue
            self._apply(req, res, launch.mode, view)
            if not req.finished and req.to_finish is not None and not res.tokens:
                req.finished_reason = req.to_finish  # aborted mid-prefill
            if req.finished:
                self._finish(req)
                continue
            if launch.mode != "decode" and req.processed == req.prompt_len:
                self._cache_unfinished(req)
            if req.progress is not None and res.tokens:
                req.progress(req)
        self.running.reqs = [r for r in self.running.reqs if not r.finished]
        if launch.mode != "decode" and not self.overlap:
            self._merge_finished_prefills()

    def _apply(self, req: Req, res: ReqResult, mode: str, view: ReqView) -> None:
        if not res.finite:
            req.error = "the model produced non-finite logits"
            req.finished_reason = {"type": "abort", "message": req.error, "status_code": 500}
            return
        req.processed = res.processed
        req.input_logprobs += res.input_logprobs
        req.input_top_logprobs += res.input_top_logprobs
        req.input_ids_logprobs += res.input_ids_logprobs
        if mode == "decode":
            if self.spec_steps:  # a verify step: give back the KV of rejected positions
                extra = req.kv[res.processed:]
                req.kv = req.kv[: res.processed]
                req.scheduled = res.processed
                req.reserved += len(extra)
                self.kv.slots.free(extra.tolist())
                req.spec_verify_ct += 1
                req.spec_correct_drafts += res.accepted_drafts
                if not req.spec_histogram:
                    req.spec_histogram = [0] * (self.spec_steps + 1)
                req.spec_histogram[res.accepted_drafts] += 1
                self.stats.spec_verify_ct += 1
                self.stats.spec_accepted_tokens += len(res.tokens)
                self.stats.spec_correct_drafts += res.accepted_drafts
                if res.tracked is not None:
                    req.last_track = (res.tracked, req.track_slots[req.track_next])
                    req.track_next = (req.track_next + 1) % len(req.track_slots)
            elif view.track:
                req.last_track = view.track[-1]
        if req.processed == req.prompt_len and req.sp.max_new_tokens == 0:
            req.finished_reason = {"type": "length", "length": 0}
            return
        for i, tok in enumerate(res.tokens):
            req.output_ids.append(tok)
            req.output_logprobs.append(res.token_logprobs[i])
            if res.top_logprobs:
                req.output_top_logprobs.append(res.top_logprobs[i])
            if res.ids_logprobs:
                req.output_ids_logprobs.append(res.ids_logprobs[i])
            self.stats.generation_tokens += 1
            if self._check_finish(req):
                break

    def _check_finish(self, req: Req) -> bool:
        if req.to_finish is not None:
            req.finished_reason = req.to_finish
            return True
        sp = req.sp
        tok = req.output_ids[-1]
        if sp.stop:
            text = self.tokenizer.decode(req.output_ids)
            for s in sp.stop:
                if s and s in text:
                    req.finished_reason = {"type": "stop", "matched": s}
                    return True
        if len(req.output_ids) >= sp.min_new_tokens and (tok in sp.stop_token_ids or (
                not sp.ignore_eos and tok == self.tokenizer.eos_token_id)):
            req.finished_reason = {"type": "stop", "matched": tok}
            return True
        if len(req.output_ids) >= sp.max_new_tokens:
            req.finished_reason = {"type": "length", "length": sp.max_new_tokens}
            return True
        return False

    def _finish(self, req: Req) -> None:
        req.finished_at = time.perf_counter()
        self.stats.finished_requests += 1
        if req.inflight > 0:  # the overlap's step ahead still holds it: released when back
            self.held.append(req)
        else:
            self._release(req)

    def _maybe_release(self, req: Req) -> None:
        if req.inflight == 0 and not req.released:
            self._release(req)

    def _release(self, req: Req) -> None:
        """Cache a finished request in the tree, then answer it (as SGLang does): a request sent
        once this one is answered finds its prefix cached."""
        req.released = True
        self._cache_finished(req)
        key = req.key
        self.stream.submit(lambda: self.runner.release(key))
        if req in self.held:
            self.held.remove(req)
        req.done(req)

    # ---- caching requests in the tree ------------------------------------------------------
    def _cache_unfinished(self, req: Req) -> None:
        """After an extend: put the processed prefix into the tree with its state."""
        if not self.radix:
            return
        if self.strategy == "no_buffer":
            length = req.processed
            new = self._alloc_state()
            self.stream.submit(lambda: self.states.copy_from([req.slot], [new]))
            self._insert(req, length, new)
            return
        if req.last_track is None:
            return
        length, slot = req.last_track
        req.last_track = None
        if self._affected(Defect.SNAPSHOT_RACE, req):
            # the old fork: copy the snapshot now, on the scheduler, without waiting for the
            # forward that writes it
            new = self._alloc_state()
            self.states.write(new, self.preimages.host_read(slot) if self.preimages
                              else self.states.read(slot))
            self._insert(req, length, new)
            return
        i = req.track_slots.index(slot)
        req.track_slots[i] = self._alloc_state()  # donate the snapshot's slot to the tree
        self._insert(req, length, slot)

    def _insert(self, req: Req, length: int, slot: int) -> None:
        _node, dup, took = self.tree.insert(req.fill[:length], req.kv[:length], slot,
                                           protected=req.cache_protected_len,
                                           namespace=req.inp.namespace)
        if not took:
            self.free_state(slot)
        self.free_kv(dup)
        self.tree.unlock(req.last_node)
        match = self.tree.match_prefix(req.fill[:length], req.inp.namespace)
        new = match.device_indices()
        req.kv = torch.cat([new, req.kv[len(new):]])
        req.cache_protected_len = len(new)
        req.last_node = match.node
        self.tree.lock(match.node)

    def _cache_finished(self, req: Req) -> None:
        """At the end: insert the newest snapshot (no_buffer: the live slot, donated), free the rest."""
        fill, owned = req.fill, req.cache_protected_len
        keep = 0
        snapshot = self._finished_snapshot(req) if self.radix and req.error is None else None
        if snapshot is not None and snapshot[0] > owned:
            length, slot = snapshot
            _, dup, took = self.tree.insert(fill[:length], req.kv[:length], slot, protected=owned,
                                            namespace=req.inp.namespace)
            self.free_kv(dup)
            keep = length
            if took and slot == req.slot:
                req.slot = None
            elif took:
                req.track_slots.remove(slot)
        rest = req.kv[max(keep, owned):]
        if len(rest):
            self.free_kv(rest)
        req.kv = req.kv[:0]
        for slot in ([req.slot] if req.slot is not None else []) + req.track_slots:
            self.free_state(slot)
        req.slot, req.track_slots = None, []
        if req.last_node is not None:
            self.tree.unlock(req.last_node)
            req.last_node = None

    def _finished_snapshot(self, req: Req) -> tuple[int, int] | None:
        """(length, slot) of the state to cache at the end, if it matches a prefix of the tokens."""
        if self.strategy == "no_buffer":
            if req.slot is None or req.processed > len(req.fill):
                return None
            return req.processed, req.slot
        if req.last_track is not None and req.last_track[0] <= min(req.processed, len(req.fill)):
            return req.last_track
        return None

    def _abort_all(self, message: str, status: int = 500) -> None:
        for req in self.held:  # finished, the answer waited for the step ahead: it is whole
            req.done(req)
        self.held.clear()
        reqs = list(self.waiting) + list(self.running.reqs) + list(self.to_merge)
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        self.waiting.clear()
        self.running = ScheduleBatch([], "decode")
        self.to_merge, self.chunked_req = [], None
        for req in reqs:
            if not req.finished:
                req.error = message
                req.finished_reason = {"type": "abort", "message": message, "status_code": status}
                req.done(req)
        self.tree.reset()
        self.kv.slots.clear()
        self.states.slots.clear()

    def _update_gauges(self) -> None:
        self.stats.num_running = len(self.running.reqs) + len(self.to_merge) + (
            1 if self.chunked_req else 0)
        self.stats.num_waiting = len(self.waiting)
        self.stats.kv_used = self.args.max_total_tokens - self.kv.slots.available()
        self.stats.states_used = self.args.max_mamba_cache_size - self.states.slots.available()


@dataclass
class Launch:
    id: int
    mode: str
    reqs: list[Req]
    views: list[ReqView]  # what the forward was asked, per request (its snapshots included)


_rid_counter = iter(range(1, 1 << 62))


def rid_key(rid: str) -> str:
    return f"{rid}#{next(_rid_counter)}"


class Preimages:
    """Overlap mode: what a scheduler-side read of a state slot sees while the forward that
    writes it has not been waited for. Each forward records the slots it will write, with their
    contents before it runs; ``host_read`` returns those until the scheduler synchronises."""

    def __init__(self, states: StatePool) -> None:
        self.states = states
        self.lock = threading.Lock()
        self.pending: dict[int, dict[int, list[torch.Tensor]]] = {}

    def record(self, fb: ForwardBatch) -> None:
        slots = set(fb.cow_dst or []) | set(fb.clear or []) | {d for _, d in fb.state_loads}
        for v in fb.reqs:
            slots.add(v.slot)
            slots.update(s for _, s in v.track)
            if v.track_interval:
                slots.add(v.track_slot)
        with self.lock:
            self.pending[fb.id] = {s: self.states.read(s) for s in slots}

    def synchronized(self, batch_id: int) -> None:
        with self.lock:
            self.pending.pop(batch_id, None)

    def host_read(self, slot: int) -> list[torch.Tensor]:
        with self.lock:
            for batch_id in sorted(self.pending):
                if slot in self.pending[batch_id]:
                    return [t.clone() for t in self.pending[batch_id][slot]]
            return self.states.read(slot)


@dataclass
class Stats:
    num_requests: int = 0
    finished_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    forward_count: int = 0
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    spec_correct_drafts: int = 0
    host_backups: int = 0
    host_loads: int = 0
    mixed_batches: int = 0  # prefill batches that decoded the running requests too
    num_running: int = 0
    num_waiting: int = 0
    kv_used: int = 0
    states_used: int = 0

    def reset_cache_counters(self) -> None:
        self.prompt_tokens = self.cached_tokens = 0

    @property
    def avg_spec_accept_length(self) -> float | None:
        if not self.spec_verify_ct:
            return None
        return self.spec_accepted_tokens / self.spec_verify_ct
