"""The response side of the native API: SGLang's output dicts and ``meta_info``, whole and streamed.

A finished request answers ``{"text", "output_ids", "meta_info"}`` as SGLang's tokenizer manager
builds it (``_handle_batch_output``). With ``stream: true`` it is sent as server-sent events, as
SGLang 0.5.23 streams it (``http_server.serve_generate_request``, ``_stream_one_response``,
``DetokenizerManager``):

* one ``data: {...}`` chunk after every step that produced tokens (every ``stream_interval`` tokens,
  the first token at once; none while the tail could be the start of a stop string), then the
  finished chunk, then ``data: [DONE]``;
* cumulative by default: each chunk carries the whole text and ``output_ids`` so far and
  ``meta_info`` with the logprobs so far; with ``--incremental-streaming-output`` the text, the ids
  and the output-side logprob lists are what is new since the last chunk;
* text is detokenized incrementally: a chunk never ends inside a UTF-8 sequence that the next
  tokens complete (only its printable part is sent, and the rest later);
* a batch streams its requests interleaved, each chunk with the request's ``index``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from .scheduler import Req, Scheduler

INIT_DETOKENIZE_OFFSET = 5  # prompt tokens decoded before the output, as SGLang's Req does
OUTPUT_SIDE_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")

# Every meta_info key SGLang 0.5.23's tokenizer manager writes, and when the engine writes it:
# "always", "finished" (the last chunk or the answer), "first" (the first chunk sent), "logprob",
# "top_logprobs", "token_ids_logprob" (as asked), "speculative" (with MTP, finished), or the reason
# the engine never does. ``tests/engines/test_sglang_api_surface.py`` reads SGLang's list from its
# source, so a key a release adds fails until it is in this table.
META_INFO_KEYS: dict[str, str] = {
    "id": "always", "finish_reason": "always", "prompt_tokens": "always",
    "weight_version": "always", "num_retractions": "always", "reasoning_tokens": "always",
    "completion_tokens": "always", "cached_tokens": "always", "cached_tokens_details": "always",
    "e2e_latency": "finished", "response_sent_to_client_ts": "first",
    "input_token_logprobs": "logprob", "output_token_logprobs": "logprob",
    "output_token_logprobs_length": "logprob",
    "input_top_logprobs": "top_logprobs", "output_top_logprobs": "top_logprobs",
    "input_token_ids_logprobs": "token_ids_logprob", "output_token_ids_logprobs": "token_ids_logprob",
    "spec_verify_ct": "speculative", "spec_accept_length": "speculative",
    "spec_accept_rate": "speculative", "spec_num_correct_drafts": "speculative",
    "spec_num_proposed_drafts": "speculative", "spec_correct_drafts_histogram": "speculative",
    "spec_cap_length": "never: ragged verify caps (SGLang's SGLANG_RAGGED_VERIFY_MODE)",
    "spec_block_accept_length": "never: ragged verify caps (SGLang's SGLANG_RAGGED_VERIFY_MODE)",
    "spec_cap_lens_histogram": "never: ragged verify caps (SGLang's SGLANG_RAGGED_VERIFY_MODE)",
    "hidden_states": "never: return_hidden_states is refused",
    "routed_experts": "never: return_routed_experts is refused (dense models)",
    "indexer_topk": "never: return_indexer_topk is refused",
    "output_token_sampling_mask": "never: return_sampling_mask is refused",
    "output_token_sampling_logprobs": "never: return_sampling_mask is refused",
    "output_token_sampling_mask_length": "never: return_sampling_mask is refused",
    "image_tokens": "never: text-only models", "audio_tokens": "never: text-only models",
    "video_tokens": "never: text-only models",
    "dp_rank": "never: one data-parallel rank (SGLang writes it for DP attention)",
}
# Keys the engine writes beyond SGLang 0.5.23's: older releases' names that clients still parse.
LEGACY_META_INFO_KEYS = {"spec_accept_histogram": "spec_correct_drafts_histogram before 0.5.20"}


def build_meta(req: Req, scheduler: Scheduler, upto: int | None = None) -> dict:
    """SGLang's ``meta_info`` for a finished request, or (``upto``) for a running one as it was
    with its first ``upto`` output tokens: the scheduler only appends to a request's output lists,
    so their first ``upto`` entries can be read from another thread. Logprobs are natural-log, as
    ``[logprob, token_id, text|null]`` per position (the first prompt position's is null)."""
    tok = scheduler.tokenizer
    text_on = req.inp.return_text_in_logprobs
    finished = upto is None
    n = len(req.output_ids) if finished else upto
    out_ids = req.output_ids[:n]

    def triple(lp, tid):
        return [lp, tid, tok.token_text(tid) if text_on else None]

    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finished_reason if finished else None,
        "prompt_tokens": req.prompt_len,
        "weight_version": "default",
        "num_retractions": 0,  # the engine never retracts a running request
    }
    if req.inp.return_logprob:
        k = req.logprob_start_len
        ins = req.origin[k:]
        meta["input_token_logprobs"] = (
            [triple(None, ins[0])] + [triple(lp, t) for lp, t in
                                      zip(req.input_logprobs, ins[1:], strict=False)]
            if ins else [])
        meta["output_token_logprobs"] = [triple(lp, t) for lp, t in
                                         zip(req.output_logprobs[:n], out_ids, strict=False)]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if req.inp.top_logprobs_num:
            meta["input_top_logprobs"] = ([None] + [[triple(lp, t) for lp, t in pos]
                                                    for pos in req.input_top_logprobs]
                                          if meta["input_token_logprobs"] else [])
            meta["output_top_logprobs"] = [[triple(lp, t) for lp, t in pos]
                                           for pos in req.output_top_logprobs[:n]]
        if req.inp.token_ids_logprob:
            meta["input_token_ids_logprobs"] = ([None] + [[triple(lp, t) for lp, t in pos]
                                                          for pos in req.input_ids_logprobs]
                                                if meta["input_token_logprobs"] else [])
            meta["output_token_ids_logprobs"] = [[triple(lp, t) for lp, t in pos]
                                                 for pos in req.output_ids_logprobs[:n]]
    meta.update({
        "reasoning_tokens": 0,  # no reasoning parser: nothing counts as reasoning
        "completion_tokens": n,
        "cached_tokens": req.cached_tokens,
        "cached_tokens_details": (
            {"device": req.cached_tokens - req.host_cached_tokens, "host": req.host_cached_tokens}
            if req.cached_tokens else None),
    })
    if not finished:
        return meta
    end = req.finished_at or time.perf_counter()
    meta["e2e_latency"] = end - req.created
    if scheduler.spec_steps and req.spec_verify_ct:
        proposed = req.spec_verify_ct * scheduler.spec_steps
        meta.update({
            "spec_verify_ct": req.spec_verify_ct,
            "spec_accept_length": len(req.output_ids) / req.spec_verify_ct,
            "spec_accept_rate": req.spec_correct_drafts / proposed,
            "spec_num_correct_drafts": req.spec_correct_drafts,
            "spec_num_proposed_drafts": proposed,
            "spec_correct_drafts_histogram": list(req.spec_histogram),
            "spec_accept_histogram": list(req.spec_histogram),
        })
    return meta


def final_text(req: Req, scheduler: Scheduler) -> str:
    """The finished request's text: the EOS that ended it left out, a matched stop string cut."""
    tok = scheduler.tokenizer
    ids = req.output_ids
    if req.sp.skip_special_tokens and ids and ids[-1] == tok.eos_token_id:
        text = tok.decode(ids[:-1])
    else:
        text = tok.decode(ids)
    reason = req.finished_reason or {}
    if reason.get("type") == "stop" and isinstance(reason.get("matched"), str) \
            and not req.sp.no_stop_trim:
        cut = text.find(reason["matched"])
        if cut >= 0:
            text = text[:cut]
    return text


def build_output(req: Req, scheduler: Scheduler, prompt_token_ids: bool = False) -> dict:
    """The answer of a finished request (SGLang's non-streaming ``/generate`` item)."""
    out = {"text": final_text(req, scheduler), "output_ids": list(req.output_ids),
           "meta_info": build_meta(req, scheduler)}
    if prompt_token_ids:
        out["prompt_token_ids"] = list(req.origin)
    return out


def find_printable_text(text: str) -> str:
    """The longest prefix of ``text`` made of whole words (SGLang's ``find_printable_text``)."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(text[-1]):
        return text
    if len(text) > 1 and _is_cjk(text[-2]):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_cjk(ch: str) -> bool:
    return any(lo <= ord(ch) <= hi for lo, hi in _CJK)


class Detokenizer:
    """SGLang's incremental detokenization of one request (``DetokenizerManager``'s decode
    status): decode from a few tokens before the unsent ones, and send only text that no later
    token can change (not ending in U+FFFD, the mark of an incomplete UTF-8 sequence)."""

    def __init__(self, scheduler: Scheduler, prompt: list[int]) -> None:
        self.decode = scheduler.tokenizer.decode
        self.read_offset = min(len(prompt), INIT_DETOKENIZE_OFFSET)
        self.decode_ids = list(prompt[len(prompt) - self.read_offset:])
        self.surr_offset = 0
        self.decoded_text = ""
        self.sent_offset = 0  # characters of text sent

    def step(self, new_ids: list[int]) -> str:
        """The text to send for the tokens that came since the last step."""
        self.decode_ids += new_ids
        surr = self.decode(self.decode_ids[self.surr_offset:self.read_offset])
        new_text = self.decode(self.decode_ids[self.surr_offset:])[len(surr):]
        pending = self.sent_offset - len(self.decoded_text)
        if new_text and not new_text.endswith("\ufffd"):
            self.decoded_text += new_text
            self.surr_offset, self.read_offset = self.read_offset, len(self.decode_ids)
            self.sent_offset = len(self.decoded_text)
            return new_text[pending:]
        printable = find_printable_text(new_text)
        self.sent_offset = len(self.decoded_text) + len(printable)
        return printable[pending:]


@dataclass
class StreamState:
    """What one streamed request has sent so far. Its chunks are built on the event loop from
    snapshots (the request with its first n output tokens) that the scheduler's thread reports
    after every step: ``admit`` is SGLang's scheduler-side choice of the steps to send, and of
    the admitted snapshots that wait together only the newest is sent, as SGLang's tokenizer
    manager coalesces the outputs queued for a request."""

    index: int  # the request's place in its batch
    incremental: bool
    stream_interval: int  # the server's --stream-interval
    prompt_token_ids: bool
    detok: Detokenizer | None = None
    emitted: int = 0  # tokens of the snapshots admitted so far (the scheduler's send offset)
    sent_tokens: int = 0
    sent_logprobs: int = 0
    text: str = ""  # the text sent so far
    first_sent: bool = False
    stop_max_tokens: int | None = None

    def admit(self, req: Req, scheduler: Scheduler, n: int) -> bool:
        """Whether the snapshot of n tokens is sent: every ``stream_interval`` tokens, the first
        at once, and never while the output's tail could be the start of a stop string."""
        unsent = n - self.emitted
        interval = req.sp.stream_interval or self.stream_interval
        if not (interval == 1 or unsent >= interval or (self.emitted == 0 and unsent > 0)):
            return False
        if self._may_start_a_stop_string(req, scheduler, n):
            return False
        self.emitted = n
        return True

    def progress(self, req: Req, scheduler: Scheduler, n: int) -> dict:
        """The chunk of the snapshot of n tokens."""
        if self.detok is None:
            self.detok = Detokenizer(scheduler, req.origin)
        delta = self.detok.step(req.output_ids[self.sent_tokens:n])
        return self._chunk(req, build_meta(req, scheduler, upto=n), req.output_ids[:n], delta)

    def final(self, req: Req, scheduler: Scheduler) -> dict:
        """The finished request's chunk."""
        text = final_text(req, scheduler)
        delta = text[len(self.text):] if text.startswith(self.text) else text
        chunk = self._chunk(req, build_meta(req, scheduler), list(req.output_ids), delta)
        if not self.incremental:
            chunk["text"] = text
        return chunk

    def _chunk(self, req: Req, meta: dict, ids: list[int], delta: str) -> dict:
        if self.incremental:
            for key in OUTPUT_SIDE_KEYS:
                if key in meta:
                    meta[key] = meta[key][self.sent_logprobs:]
            out = {"text": delta, "output_ids": ids[self.sent_tokens:], "meta_info": meta}
        else:
            out = {"text": self.text + delta, "output_ids": ids, "meta_info": meta}
        self.text += delta
        self.sent_tokens = self.sent_logprobs = len(ids)
        if not self.first_sent:
            self.first_sent = True
            meta["response_sent_to_client_ts"] = time.time()
        if self.prompt_token_ids:
            out["prompt_token_ids"] = list(req.origin)
        return out

    def _may_start_a_stop_string(self, req: Req, scheduler: Scheduler, n: int) -> bool:
        """SGLang's ``check_match_stop_str_prefix``: the tail of the output (as many tokens as the
        longest stop string has, plus one) holds a stop string or ends with the start of one."""
        if not req.sp.stop:
            return False
        if self.stop_max_tokens is None:
            self.stop_max_tokens = max(len(scheduler.tokenizer.encode(s)) for s in req.sp.stop)
        k = min(self.stop_max_tokens + 1, n)
        tail = scheduler.tokenizer.decode(req.output_ids[n - k:n])
        for stop in req.sp.stop:
            if not stop:
                continue
            if stop in tail:
                return True
            if any(tail.endswith(stop[:i]) for i in range(1, min(len(tail), len(stop)) + 1)):
                return True
        return False


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line (``[DONE]`` as it is)."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {body}\n\n".encode()
