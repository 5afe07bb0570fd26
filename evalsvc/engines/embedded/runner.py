"""The forward side of the embedded engine: what SGLang runs on the GPU's forward stream.

The scheduler builds a :class:`ForwardBatch` (plain data: slots, KV indices, tokens, the deferred
state operations and host-tier loads it recorded) and hands it to :meth:`ModelRunner.forward`. In
order, a forward loads host-tier data, executes the deferred clears and copy-on-writes, runs the
model, writes KV and states back, takes the requested state snapshots, samples, and (with MTP)
drafts, verifies, accepts and runs the draft-extend. Everything that touches pool memory happens
here, in batch order; the scheduler only does bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .memory import HostPool, KVPool, StatePool
from .model import HybridLM, SegmentStates, batch_invariant

GREEDY_EPS = 1e-6


@dataclass
class SamplingInfo:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request (EOS unless ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass
class ReqView:
    """One request's part of a forward, in absolute positions."""

    rid: str
    slot: int  # working state slot
    start: int  # first position this forward processes
    kv_past: torch.Tensor  # KV indices of positions [0, start)
    kv_new: torch.Tensor  # KV indices for the tokens this forward may write
    input_ids: list[int] | None  # None: decode, the last sampled token (resolved here)
    sample: bool = False  # sample a next token from the last position
    sampling: SamplingInfo = field(default_factory=SamplingInfo)
    track: list[tuple[int, int]] = field(default_factory=list)  # (absolute length, slot) snapshots
    logprob_from: int | None = None  # return logprobs of prompt tokens at positions > this
    next_ids: list[int] = field(default_factory=list)  # prompt tokens at start+1, start+2, ...
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    budget: int = 1  # most tokens a verify step may commit (max_new_tokens left)
    track_interval: int = 0  # MTP + extra_buffer: snapshot at multiples of this
    track_slot: int = 0  # ... into this slot


@dataclass
class ForwardBatch:
    id: int
    mode: str  # "extend" | "decode" | "mixed" (an extend whose decode rows have no input_ids)
    reqs: list[ReqView]
    cow_src: list[int] | None = None
    cow_dst: list[int] | None = None
    clear: list[int] | None = None
    kv_loads: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # host, dev
    state_loads: list[tuple[int, int]] = field(default_factory=list)  # host slot, device slot
    late_state_loads: set[int] = field(default_factory=set)  # host-load-race: device slots whose
    # load lands after the forward read them
    spec: bool = False


@dataclass
class ReqResult:
    tokens: list[int] = field(default_factory=list)  # committed new tokens (empty mid-prefill)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float] = field(default_factory=list)  # positions logprob_from+1 ...
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    processed: int = 0  # tokens of this request now in KV and state
    tracked: int | None = None  # length of a snapshot taken in a verify step
    accepted_drafts: int = 0
    verified: bool = False
    finite: bool = True


class ModelRunner:
    def __init__(self, model: HybridLM, kv: KVPool, states: StatePool, host: HostPool | None,
                 spec_steps: int = 0, host_load_race: bool = False,
                 deterministic: bool = False) -> None:
        """``host_load_race``: every state load lands late (the scheduler marks single loads late
        with ``ForwardBatch.late_state_loads``)."""
        self.model = model
        self.kv = kv
        self.states = states
        self.host = host
        self.spec_steps = spec_steps
        self.host_load_race = host_load_race
        self.deterministic = deterministic
        self.last_token: dict[str, int] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.forward_count = 0

    # ---- entry point ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> list[ReqResult]:
        with batch_invariant(self.deterministic):
            return self._forward(fb)

    def _forward(self, fb: ForwardBatch) -> list[ReqResult]:
        for host_idx, dev_idx in fb.kv_loads:
            self.host.load_kv(self.kv, host_idx, dev_idx)
        self._load_states(fb, late=False)
        if fb.mode != "decode":  # deferred ops belong to the extend that first runs a request
            self.states.clear_slots(fb.clear or [])
            self.states.copy_from(fb.cow_src or [], fb.cow_dst or [])
        if fb.mode != "decode":
            results = self._extend(fb)
        elif fb.spec:
            results = self._verify(fb)
        else:
            results = self._decode(fb)
        self._load_states(fb, late=True)  # host-load-race: after the forward already read the slot
        self.forward_count += 1
        return results

    def release(self, rid: str) -> None:
        self.last_token.pop(rid, None)
        self.generators.pop(rid, None)

    def _load_states(self, fb: ForwardBatch, late: bool) -> None:
        for host_slot, dev_slot in fb.state_loads:
            if (self.host_load_race or dev_slot in fb.late_state_loads) == late:
                self.host.load_state(self.states, host_slot, dev_slot)

    # ---- state plumbing -------------------------------------------------------------------
    def _gather(self, slots: list[int]) -> SegmentStates:
        return SegmentStates([c[slots] for c in self.states.conv], [s[slots] for s in self.states.ssm])

    def _scatter(self, slots: list[int], st: SegmentStates) -> None:
        for pool, val in zip(self.states.conv, st.conv, strict=True):
            pool[slots] = val
        for pool, val in zip(self.states.ssm, st.ssm, strict=True):
            pool[slots] = val

    def _gather_draft(self, slots: list[int]) -> SegmentStates:
        return SegmentStates([self.states.draft_conv[slots]], [self.states.draft_ssm[slots]])

    def _scatter_draft(self, slots: list[int], st: SegmentStates) -> None:
        self.states.draft_conv[slots] = st.conv[0]
        self.states.draft_ssm[slots] = st.ssm[0]

    def _run_target(self, views: list[ReqView], ids: list[list[int]], capture, mode: str):
        lengths = [len(x) for x in ids]
        flat = torch.tensor([t for x in ids for t in x], dtype=torch.long)
        positions = torch.cat([torch.arange(v.start, v.start + n) for v, n in zip(views, lengths,
                                                                                     strict=True)])
        kv = self.kv.access([v.kv_past for v in views],
                            [v.kv_new[:n] for v, n in zip(views, lengths, strict=True)])
        out = self.model.forward_segments(flat, positions, lengths, kv,
                                          self._gather([v.slot for v in views]), capture, mode)
        return out, lengths

    # ---- extend ---------------------------------------------------------------------------
    def _extend(self, fb: ForwardBatch) -> list[ReqResult]:
        """An extend, or a mixed batch: its decode rows (``input_ids`` None) are one-token
        extends of the last sampled token, run by the same kernels as the prefill rows."""
        views = fb.reqs
        ids = [v.input_ids if v.input_ids is not None else [self.last_token[v.rid]]
               for v in views]
        capture = [(b, length - v.start) for b, v in enumerate(views) for length, _ in v.track]
        out, lengths = self._run_target(views, ids, capture, "extend")
        slots = [v.slot for v in views]
        self._scatter(slots, out.states)
        for b, v in enumerate(views):
            for length, slot in v.track:
                self._scatter([slot], out.captured[(b, length - v.start)])
        logits = self.model.logits(out.hidden)
        results = []
        offset = 0
        for b, v in enumerate(views):
            n = lengths[b]
            res = ReqResult(processed=v.start + n)
            rows = logits[offset: offset + n]
            res.finite = bool(torch.isfinite(rows).all())
            if v.logprob_from is not None:
                self._input_logprobs(v, rows, res)
            if v.sample:
                tok = self._sample(v, rows[-1])
                res.tokens = [tok]
                self._output_logprobs(v, rows[-1:], [tok], res)
                self.last_token[v.rid] = tok
            results.append(res)
            offset += n
        if fb.spec:
            self._draft_extend_after_prefill(views, ids, lengths, out.hidden)
        return results

    def _input_logprobs(self, v: ReqView, rows: torch.Tensor, res: ReqResult):
        # the logprob of the prompt token at position p comes from the logits at row p - 1
        first = max(v.logprob_from, v.start) - v.start
        end = min(len(rows), len(v.next_ids))
        if end > first:
            lp = torch.log_softmax(rows, dim=-1)[first:end]
            _logprobs(lp, v.next_ids[first:end], v, res.input_logprobs, res.input_top_logprobs,
                      res.input_ids_logprobs)

    def _output_logprobs(self, v: ReqView, rows: torch.Tensor, toks: list[int], res: ReqResult):
        lp = torch.log_softmax(rows, dim=-1)[: len(toks)]
        _logprobs(lp, toks, v, res.token_logprobs, res.top_logprobs, res.ids_logprobs)

    # ---- plain decode ---------------------------------------------------------------------
    def _decode(self, fb: ForwardBatch) -> list[ReqResult]:
        views = fb.reqs
        ids = [[self.last_token[v.rid]] for v in views]
        capture = [(b, 1) for b, v in enumerate(views) if v.track]
        out, _ = self._run_target(views, ids, capture, "decode")
        self._scatter([v.slot for v in views], out.states)
        for b, v in enumerate(views):
            for _, slot in v.track:
                self._scatter([slot], out.captured[(b, 1)])
        logits = self.model.logits(out.hidden)
        results = []
        for b, v in enumerate(views):
            res = ReqResult(processed=v.start + 1)
            res.finite = bool(torch.isfinite(logits[b]).all())
            tok = self._sample(v, logits[b])
            res.tokens = [tok]
            self._output_logprobs(v, logits[b: b + 1], [tok], res)
            self.last_token[v.rid] = tok
            results.append(res)
        return results

    # ---- speculative decoding (MTP) -------------------------------------------------------
    def _draft_extend_after_prefill(self, views, ids, lengths, hidden: torch.Tensor) -> None:
        """Advance draft state over the pairs (h_s, x_{s+1}) for s in [start-1, end-2]."""
        pair_h, pair_x, pair_len, keep = [], [], [], []
        offset = 0
        for v, x, n in zip(views, ids, lengths, strict=True):
            rows = hidden[offset: offset + n]
            hs = [rows[:-1]] if n > 1 else []
            xs = x[1:]
            if v.start > 0:
                hs.insert(0, self.states.draft_hidden[v.slot][None])
                xs = [x[0], *xs]
            pair_h.append(torch.cat(hs) if hs else rows[:0])
            pair_x.append(xs)
            pair_len.append(len(xs))
            keep.append(rows[-1])
            offset += n
        self._run_draft_extend(views, pair_h, pair_x, pair_len, keep,
                               [[(length, slot, length - max(v.start - 1, 0) - 1,
                                  hidden_row(lengths, b, length - 1 - v.start, hidden))
                                 for length, slot in v.track]
                                for b, v in enumerate(views)], mode="extend")

    def _run_draft_extend(self, views, pair_h, pair_x, pair_len, keep, tracks,
                          mode: str = "decode") -> None:
        """Draft-extend: run the MTP head over accepted pairs from each request's committed draft
        state; snapshot it where the target was snapshotted; keep the last target hidden state.
        ``mode``: ``extend`` after a prefill, ``decode`` after a verify."""
        active = [b for b, n in enumerate(pair_len) if n > 0]
        if active:
            slots = [views[b].slot for b in active]
            hidden = torch.cat([pair_h[b] for b in active])
            nxt = torch.tensor([t for b in active for t in pair_x[b]], dtype=torch.long)
            capture = [(i, k) for i, b in enumerate(active) for _, _, k, _ in tracks[b] if k > 0]
            _, st, captured = self.model.draft_segments(hidden, nxt, [pair_len[b] for b in active],
                                                        self._gather_draft(slots), capture, mode)
            self._scatter_draft(slots, st)
            for i, b in enumerate(active):
                for _, slot, k, _ in tracks[b]:
                    if k > 0:
                        self._scatter_draft([slot], captured[(i, k)])
        for b, v in enumerate(views):
            self.states.draft_hidden[v.slot] = keep[b]
            for _, slot, _, h in tracks[b]:
                self.states.draft_hidden[slot] = h

    def _verify(self, fb: ForwardBatch) -> list[ReqResult]:
        views = fb.reqs
        steps = self.spec_steps
        slots = [v.slot for v in views]
        last = [self.last_token[v.rid] for v in views]
        # draft: chain `steps` tokens from the committed draft state, on copies
        st = self._gather_draft(slots)
        h = self.states.draft_hidden[slots]
        tok = torch.tensor(last, dtype=torch.long)
        drafts = []
        for _ in range(steps):
            h, st, _ = self.model.draft_segments(h, tok, [1] * len(views), st)
            tok = self.model.draft_logits(h).argmax(-1)
            drafts.append(tok)
        draft_ids = torch.stack(drafts, 1).tolist() if drafts else [[] for _ in views]
        # verify: one target forward over [last, d1..dk], states after every position
        ids = [[x, *d] for x, d in zip(last, draft_ids, strict=True)]
        n = steps + 1
        capture = [(b, k) for b in range(len(views)) for k in range(1, n + 1)]
        out, _ = self._run_target(views, ids, capture, "target_verify")
        logits = self.model.logits(out.hidden).view(len(views), n, -1)
        results = []
        committed_all = []
        for b, v in enumerate(views):
            committed, accepted = self._accept(v, draft_ids[b], logits[b])
            m = len(committed)
            res = ReqResult(processed=v.start + m, verified=True, accepted_drafts=accepted)
            res.finite = bool(torch.isfinite(logits[b]).all())
            res.tokens = committed
            self._output_logprobs(v, logits[b, :m], committed, res)
            self.last_token[v.rid] = committed[-1]
            self._scatter([v.slot], out.captured[(b, m)])
            if v.track_interval:
                p = (v.start + m) // v.track_interval * v.track_interval
                if p > v.start:
                    self._scatter([v.track_slot], out.captured[(b, p - v.start)])
                    res.tracked = p
            results.append(res)
            committed_all.append(committed)
        # the buggy copy of the batch's one-shot metadata replays it onto live draft state
        self.states.clear_slots(fb.clear or [], draft_only=True)
        self.states.copy_from(fb.cow_src or [], fb.cow_dst or [], draft_only=True)
        # draft-extend over the committed tokens
        hid = out.hidden.view(len(views), n, -1)
        pair_h, pair_x, pair_len, keep, tracks = [], [], [], [], []
        for b, v in enumerate(views):
            m = len(committed_all[b])
            pair_h.append(torch.cat([self.states.draft_hidden[v.slot][None], hid[b, : m - 1]]))
            pair_x.append([last[b], *committed_all[b][:m - 1]])
            pair_len.append(m)
            keep.append(hid[b, m - 1])
            tr = []
            if results[b].tracked is not None:
                p = results[b].tracked
                tr.append((p, v.track_slot, p - v.start, hid[b, p - 1 - v.start]))
            tracks.append(tr)
        self._run_draft_extend(views, pair_h, pair_x, pair_len, keep, tracks)
        return results

    def _accept(self, v: ReqView, drafts: list[int], logits: torch.Tensor):
        """Chain verification. Greedy: accept while the draft equals the target's argmax.
        Sampling: accept draft d with probability p(d), else sample from p without d, which
        samples exactly from the target distribution. Returns (committed tokens, accepted)."""
        committed: list[int] = []
        accepted = 0
        for i, d in enumerate(drafts):
            if len(committed) >= v.budget - 1:
                break
            if v.sampling.greedy:
                ok = int(logits[i].argmax()) == d
                if not ok:
                    break
            else:
                probs = _probs(logits[i], v.sampling)
                u = torch.rand((), generator=self._generator(v))
                if u >= probs[d]:
                    probs[d] = 0.0
                    committed.append(self._draw(v, probs))
                    return committed, accepted
            committed.append(d)
            accepted += 1
            if d in v.sampling.stop_token_ids:
                return committed, accepted
        committed.append(self._sample(v, logits[len(committed)]))
        return committed, accepted

    # ---- sampling -------------------------------------------------------------------------
    def _generator(self, v: ReqView) -> torch.Generator:
        gen = self.generators.get(v.rid)
        if gen is None:
            gen = torch.Generator().manual_seed(v.sampling.seed)
            self.generators[v.rid] = gen
        return gen

    def _sample(self, v: ReqView, logits: torch.Tensor) -> int:
        if v.sampling.greedy:
            return int(logits.argmax())
        return self._draw(v, _probs(logits, v.sampling))

    def _draw(self, v: ReqView, probs: torch.Tensor) -> int:
        probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self._generator(v)))


def hidden_row(lengths: list[int], b: int, row: int, hidden: torch.Tensor) -> torch.Tensor:
    return hidden[sum(lengths[:b]) + row]


def _logprobs(lp: torch.Tensor, toks: list[int], v: ReqView, token_out: list[float],
              top_out: list[list[tuple[float, int]]], ids_out: list[list[tuple[float, int]]]):
    """Each row's logprob of its token, top-k and asked-for ids (``lp``: natural-log, one row per
    token of ``toks``), appended to the request's lists; all rows in one pass per kind."""
    rows = torch.arange(len(toks))
    token_out.extend(lp[rows, torch.tensor(toks)].tolist())
    if v.top_logprobs_num:
        vals, idx = torch.topk(lp, min(v.top_logprobs_num, lp.shape[-1]), dim=-1)
        top_out.extend([list(zip(a, i, strict=True))
                        for a, i in zip(vals.tolist(), idx.tolist(), strict=True)])
    if v.token_ids_logprob:
        asked = v.token_ids_logprob
        ids_out.extend([list(zip(a, asked, strict=True))
                        for a in lp[:, torch.tensor(asked)].tolist()])


def _probs(logits: torch.Tensor, s: SamplingInfo) -> torch.Tensor:
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)
    if s.top_k > 0 and s.top_k < probs.shape[-1]:
        kth = torch.topk(probs, s.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        drop = (cum - sorted_p) > s.top_p * cum[-1]
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    if s.min_p > 0.0:
        probs = torch.where(probs >= s.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs
