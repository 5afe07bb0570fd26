"""The scheduler's request lifecycle beyond generate-and-answer: progress callbacks (streaming),
aborts (SGLang's ``/abort_request``), and prefix-cache namespaces (``extra_key``, ``cache_salt``)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from .conftest import FAMILIES, LocalEngine, request, token_prompts


def pools_free(eng: LocalEngine) -> bool:
    """Every KV token and state slot is back in its pool (after a flush)."""
    eng.flush()
    return (eng.sched.kv.slots.available() == eng.args.max_total_tokens
            and eng.sched.states.slots.available() == eng.args.max_mamba_cache_size)


@pytest.mark.parametrize("flags", [[], ["--disable-overlap-schedule"]])
def test_progress_is_called_after_every_step_with_new_tokens(flags, demo_prompts, engine_factory):
    eng = engine_factory(["--model-path", FAMILIES[0], "--random-seed", "0", *flags])
    ids = token_prompts(eng.tok, demo_prompts)[0][:40]
    seen: list[int] = []
    done = threading.Event()
    eng.sched.submit(request("r", ids, max_new_tokens=6), lambda req: done.set(),
                     lambda req: seen.append(len(req.output_ids)))
    assert done.wait(60)
    assert seen == [1, 2, 3, 4, 5]  # the last step's tokens come with the answer


def test_progress_with_mtp_comes_per_verify_step(demo_prompts, engine_factory):
    eng = engine_factory(["--model-path", FAMILIES[0], "--random-seed", "0",
                          "--speculative-algorithm", "NEXTN"])
    ids = token_prompts(eng.tok, demo_prompts)[0][:40]
    seen: list[int] = []
    done: list = []
    event = threading.Event()
    eng.sched.submit(request("r", ids, max_new_tokens=24), lambda req: (done.append(req),
                                                                         event.set()),
                     lambda req: seen.append(len(req.output_ids)))
    assert event.wait(60)
    assert seen == sorted(seen) and seen[0] == 1
    assert len(seen) + 1 < 24  # verify steps accept several tokens at once
    assert done[0].spec_verify_ct == len(seen)  # one per step after the prefill's token


@pytest.mark.parametrize("flags", [[], ["--disable-overlap-schedule"]])
def test_abort_of_a_running_request_keeps_what_it_generated(flags, demo_prompts, engine_factory):
    eng = engine_factory(["--model-path", FAMILIES[0], "--random-seed", "0", *flags])
    ids = token_prompts(eng.tok, demo_prompts)[0][:40]
    out: list = []
    done = threading.Event()
    started = threading.Event()
    eng.sched.submit(request("long-1", ids, max_new_tokens=5000),
                     lambda req: (out.append(req), done.set()),
                     lambda req: started.set() if len(req.output_ids) >= 3 else None)
    assert started.wait(60)
    eng.sched.abort("long")  # no request has exactly this rid: nothing happens
    time.sleep(0.2)
    assert not done.is_set()
    eng.sched.abort("long-1")
    assert done.wait(60)
    req = out[0]
    assert req.error is None
    assert req.finished_reason == {"type": "abort", "message": "Aborted", "status_code": None,
                                   "err_type": None}
    assert 3 <= len(req.output_ids) < 5000
    assert pools_free(eng)


def test_abort_of_a_waiting_request_answers_it_at_once(demo_prompts, engine_factory):
    eng = engine_factory(["--model-path", FAMILIES[0], "--random-seed", "0",
                          "--max-running-requests", "1"])
    ids = token_prompts(eng.tok, demo_prompts)[0][:40]
    answers: dict[str, object] = {}
    events = {rid: threading.Event() for rid in ("first", "second")}
    started = threading.Event()

    def done(req):
        answers[req.rid] = req
        events[req.rid].set()

    eng.sched.submit(request("first", ids, max_new_tokens=5000), done,
                     lambda req: started.set())
    eng.sched.submit(request("second", ids, max_new_tokens=8), done)
    assert started.wait(60)
    eng.sched.abort("second")
    assert events["second"].wait(30)
    assert not events["first"].is_set()
    second = answers["second"]
    assert second.finished_reason == {"type": "abort", "message": "Abort in waiting queue"}
    assert second.output_ids == []
    eng.sched.abort(None)  # abort_all
    assert events["first"].wait(60)
    assert answers["first"].finished_reason["type"] == "abort"
    assert pools_free(eng)


@pytest.mark.parametrize("model", FAMILIES)
def test_cache_namespaces_share_prefixes_only_within_themselves(model, demo_prompts,
                                                                engine_factory):
    """SGLang's ``extra_key`` and ``cache_salt``: a cached prefix is found only by requests with
    the same key and salt; a hit inside a namespace equals a cold recompute (float32)."""
    eng = engine_factory(["--model-path", model, "--random-seed", "0"])
    ids = token_prompts(eng.tok, demo_prompts)[0][:100]
    longer = ids + token_prompts(eng.tok, demo_prompts)[1][:20]

    def one(rid, prompt, namespace):
        return eng.generate([replace(request(rid, prompt, logprob_start_len=len(ids),
                                             max_new_tokens=4), namespace=namespace)])[0]

    one("seed", ids, ("", "tenant-a"))
    assert one("shared", longer, None).cached_tokens == 0
    assert one("other", longer, ("", "tenant-b")).cached_tokens == 0
    assert one("salted", longer, ("salt", "tenant-a")).cached_tokens == 0
    hit = one("same", longer, ("", "tenant-a"))
    assert hit.cached_tokens == 64  # the prefill's chunk-aligned snapshot of the 100 tokens
    eng.flush()
    cold = one("cold", longer, ("", "tenant-a"))
    assert cold.cached_tokens == 0
    assert hit.input_logprobs + hit.output_logprobs == pytest.approx(
        cold.input_logprobs + cold.output_logprobs, abs=1e-5)
    assert pools_free(eng)
