"""Streaming ``/generate`` as SGLang 0.5.23 streams it, against real engine processes: ``data:``
events, cumulative (default) or incremental (``--incremental-streaming-output``), logprobs and
``meta_info`` in every chunk, ``data: [DONE]`` at the end; and the incremental detokenizer."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from evalsvc.engines.embedded.outputs import Detokenizer, StreamState, find_printable_text
from evalsvc.engines.launch import EngineProcess

from .test_server import SHORT_PROMPT, _client, generate, greedy, metric, new_engine, wait_until


def stream(client: httpx.Client, **body) -> list[dict | str]:
    """The events of a streamed /generate: parsed chunks, and "[DONE]"."""
    events: list[dict | str] = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with new_engine(tmp_path_factory.mktemp("stream")) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with _client(engine) as c:
        yield c


@pytest.fixture(scope="module")
def incremental(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    with new_engine(tmp_path_factory.mktemp("incremental"),
                    ["--incremental-streaming-output"]) as eng, _client(eng) as c:
        yield c


@pytest.mark.slow
def test_cumulative_stream_ends_with_the_answer_of_a_plain_request(client: httpx.Client):
    body = {"text": SHORT_PROMPT, "sampling_params": greedy(12), "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}
    plain = generate(client, **body)
    events = stream(client, **body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    counts = [len(c["output_ids"]) for c in chunks]
    # one per token (--stream-interval 1), unless steps came faster than the chunks went out
    # (then the newest is sent, as SGLang coalesces them)
    assert counts == sorted(set(counts)) and counts[-1] == 12 and len(counts) >= 3
    for k, chunk in zip(counts, chunks, strict=True):
        meta = chunk["meta_info"]
        assert chunk["output_ids"] == plain["output_ids"][:k]
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"] == k
        assert meta["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"][:k]
        assert meta["output_top_logprobs"] == plain["meta_info"]["output_top_logprobs"][:k]
        assert meta["input_token_logprobs"] == plain["meta_info"]["input_token_logprobs"]
        assert plain["text"].startswith(chunk["text"])
        assert meta["num_retractions"] == 0 and meta["reasoning_tokens"] == 0
        assert meta["prompt_tokens"] == plain["meta_info"]["prompt_tokens"]
        if k < 12:
            assert meta["finish_reason"] is None and "e2e_latency" not in meta
    assert "response_sent_to_client_ts" in chunks[0]["meta_info"]
    assert "response_sent_to_client_ts" not in chunks[1]["meta_info"]
    last = chunks[-1]
    assert last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert last["meta_info"]["e2e_latency"] > 0
    assert len({c["meta_info"]["id"] for c in chunks}) == 1


@pytest.mark.slow
def test_incremental_stream_sends_what_is_new(incremental: httpx.Client):
    body = {"text": SHORT_PROMPT, "sampling_params": greedy(10), "return_logprob": True,
            "top_logprobs_num": 2}
    plain = generate(incremental, **body)
    events = stream(incremental, **body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["text"] for c in chunks) == plain["text"]
    assert [t for c in chunks for t in c["output_ids"]] == plain["output_ids"]
    assert [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]] \
        == plain["meta_info"]["output_token_logprobs"]
    assert [e for c in chunks for e in c["meta_info"]["output_top_logprobs"]] \
        == plain["meta_info"]["output_top_logprobs"]
    # the count is the total so far, as SGLang reports it before slicing
    assert [c["meta_info"]["output_token_logprobs_length"] for c in chunks] \
        == list(itertools.accumulate(len(c["output_ids"]) for c in chunks))


@pytest.mark.slow
def test_stream_interval_sends_the_first_token_at_once_then_every_interval(client: httpx.Client):
    events = stream(client, text=SHORT_PROMPT, sampling_params=greedy(10, stream_interval=4))
    counts = [len(c["output_ids"]) for c in events[:-1]]
    assert counts[-1] == 10 and set(counts) <= {1, 5, 9, 10} and len(counts) >= 2


@pytest.mark.slow
def test_a_stop_string_is_never_streamed(client: httpx.Client):
    free = generate(client, text=SHORT_PROMPT, sampling_params=greedy(48))
    stop = next(free["text"][k:k + 3] for k in range(4, 40) if free["text"][k:k + 3].strip())
    plain = generate(client, text=SHORT_PROMPT, sampling_params=greedy(48, stop=[stop]))
    chunks = stream(client, text=SHORT_PROMPT, sampling_params=greedy(48, stop=[stop]))[:-1]
    assert all(stop not in c["text"] for c in chunks)
    assert chunks[-1]["text"] == plain["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.slow
def test_a_batch_streams_interleaved_with_each_request_index(client: httpx.Client):
    texts = ["import os\n", "class Foo:\n    def", "x = [i for i in"]
    chunks = stream(client, text=texts, sampling_params=greedy(5))[:-1]
    assert sorted({c["index"] for c in chunks}) == [0, 1, 2]
    plain = generate(client, text=texts, sampling_params=greedy(5))
    for i in range(3):
        mine = [c for c in chunks if c["index"] == i]
        counts = [len(c["output_ids"]) for c in mine]
        assert counts == sorted(set(counts)) and counts[-1] == 5
        assert mine[-1]["output_ids"] == plain[i]["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"] is not None


@pytest.mark.slow
def test_prefill_only_stream_is_one_finished_chunk(client: httpx.Client):
    events = stream(client, text=SHORT_PROMPT, sampling_params={"max_new_tokens": 0},
                    return_prompt_token_ids=True)
    assert len(events) == 2 and events[-1] == "[DONE]"
    chunk = events[0]
    assert chunk["output_ids"] == [] and chunk["text"] == ""
    assert chunk["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert chunk["prompt_token_ids"] == list(SHORT_PROMPT.encode())


@pytest.mark.slow
def test_a_request_the_scheduler_refuses_is_a_plain_400(client: httpx.Client):
    resp = client.post("/generate", json={"text": "abc", "stream": True, "return_logprob": True,
                                          "logprob_start_len": 10})
    assert resp.status_code == 400
    assert "logprob_start_len" in resp.json()["error"]["message"]


@pytest.mark.slow
def test_a_client_that_leaves_a_stream_aborts_its_request(tmp_path: Path):
    with new_engine(tmp_path) as eng, _client(eng) as c:
        with c.stream("POST", "/generate", json={"text": SHORT_PROMPT, "stream": True,
                                                 "sampling_params": greedy(60000)}) as resp:
            lines = resp.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: ")
                next(lines)
        t0 = time.monotonic()
        wait_until(lambda: metric(c.get("/metrics").text, "sglang:num_running_reqs") == 0, 30,
                   "the abandoned request to be aborted")
        assert time.monotonic() - t0 < 30
        assert c.post("/flush_cache").status_code == 200


def test_the_detokenizer_holds_back_an_incomplete_utf8_character():
    from evalsvc.engines.embedded.tokenizer import TextTokenizer
    from evalsvc.paths import shipped_models

    class Sched:  # what Detokenizer reads
        tokenizer = TextTokenizer(shipped_models()["hybrid-mamba2-tiny"])

    detok = Detokenizer(Sched, list(b"x = "))
    sent = [detok.step([b]) for b in "'é €'".encode()]
    # bytes of é and € alone are not text: nothing is sent until the character is whole
    assert sent == ["'", "", "é", " ", "", "", "€", "'"]
    assert "".join(sent) == "'é €'"


def test_find_printable_text_keeps_whole_words():
    assert find_printable_text("def add") == "def "
    assert find_printable_text("line\n") == "line\n"
    assert find_printable_text("中文") == "中文"


def test_stream_admits_snapshots_as_sglang_s_scheduler_sends_them():
    from evalsvc.engines.embedded.tokenizer import TextTokenizer
    from evalsvc.paths import shipped_models

    sched = SimpleNamespace(tokenizer=TextTokenizer(shipped_models()["hybrid-mamba2-tiny"]))
    req = SimpleNamespace(sp=SimpleNamespace(stream_interval=4, stop=[]),
                          output_ids=list(b"abcdefghij"))
    st = StreamState(0, incremental=False, stream_interval=1, prompt_token_ids=False)
    assert [n for n in range(1, 11) if st.admit(req, sched, n)] == [1, 5, 9]
    # a tail that could start the stop string "END" holds the chunk back until it cannot
    req = SimpleNamespace(sp=SimpleNamespace(stream_interval=None, stop=["END"]),
                          output_ids=list(b"x = E1 EN2"))
    st = StreamState(0, incremental=False, stream_interval=1, prompt_token_ids=False)
    assert [n for n in range(1, 11) if st.admit(req, sched, n)] == [1, 2, 3, 4, 6, 7, 10]
