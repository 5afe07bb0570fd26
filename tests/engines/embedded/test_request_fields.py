"""Every GenerateReqInput field over real HTTP: the honoured ones act, the others are accepted at
their defaults and refused by name otherwise; and the native endpoints beside /generate
(``/abort_request``, ``/tokenize``, ``/detokenize``, ``/model_info``, ``/ping``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from evalsvc.engines.embedded.protocol import UNSUPPORTED_FIELDS, UNSUPPORTED_SAMPLING
from evalsvc.engines.launch import EngineProcess

from .test_server import (
    SHORT_PROMPT,
    _client,
    generate,
    greedy,
    metric,
    new_engine,
    unique_prompt,
    wait_until,
)

# what SGLang's bench_serving sends with every request (benchmark/serving.py,
# async_request_sglang_generate), and a client sending every default of the release
BENCH_SERVING = {"stream": True, "lora_path": None, "return_logprob": False,
                 "return_routed_experts": False, "logprob_start_len": -1}
HONOURED_AT_DEFAULT = {
    "session_id": None, "return_entropy": False, "routing_key": None,
    "return_prompt_token_ids": False, "log_metrics": True, "routed_dp_rank": None,
    "data_parallel_rank": None, "conversation_id": None, "background": False, "priority": None,
    "no_logs": False, "custom_labels": None, "external_trace_header": None,
    "received_time": None, "kv_hints": None, "extra_key": None, "cache_salt": None,
    "return_text_in_logprobs": False, "token_ids_logprob": None, "top_logprobs_num": None,
    "return_logprob": None, "logprob_start_len": None, "rid": None,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with new_engine(tmp_path_factory.mktemp("fields"), ["--max-running-requests", "2"]) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with _client(engine) as c:
        yield c


def refused(client: httpx.Client, body: dict) -> str:
    resp = client.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]["message"]


@pytest.mark.slow
def test_every_field_at_its_default_is_accepted(client: httpx.Client):
    body = {name: default for name, (default, _) in UNSUPPORTED_FIELDS.items()}
    body.update(HONOURED_AT_DEFAULT)
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(4), **body)
    assert out["meta_info"]["completion_tokens"] == 4
    # and SGLang's sampling parameters at theirs, null meaning the default
    params = {name: default for name, (default, _) in UNSUPPORTED_SAMPLING.items()}
    params.update(temperature=None, top_k=1073741824, stream_interval=None, custom_params=None,
                  spaces_between_special_tokens=True)
    out = generate(client, text=SHORT_PROMPT, sampling_params={**greedy(4), **params})
    assert out["meta_info"]["completion_tokens"] == 4


@pytest.mark.slow
def test_bench_serving_payload_streams(client: httpx.Client):
    with client.stream("POST", "/generate", json={"text": SHORT_PROMPT, **BENCH_SERVING,
                                                  "sampling_params": greedy(3)}) as resp:
        assert resp.status_code == 200
        data = [line for line in resp.iter_lines() if line]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2][6:])["meta_info"]["completion_tokens"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_a_value_the_engine_cannot_honour_is_refused_by_name(client: httpx.Client, name: str):
    message = refused(client, {"text": "hi", "sampling_params": greedy(2), name: "x"})
    assert message.startswith(f"{name}: ")
    assert "not supported" in message


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(UNSUPPORTED_SAMPLING))
def test_a_sampling_value_the_engine_cannot_honour_is_refused_by_name(client: httpx.Client,
                                                                      name: str):
    message = refused(client, {"text": "hi", "sampling_params": {**greedy(2), name: "x"}})
    assert f"sampling_params.{name}: " in message


@pytest.mark.slow
def test_several_refusals_are_named_together(client: httpx.Client):
    message = refused(client, {"text": "hi", "image_data": "a.png", "lora_path": "l",
                               "return_hidden_states": True})
    for name in ("image_data", "lora_path", "return_hidden_states"):
        assert name in message


@pytest.mark.slow
def test_data_parallel_rank_other_than_zero_is_refused(client: httpx.Client):
    assert generate(client, text="hi", sampling_params=greedy(1), routed_dp_rank=0)
    assert "routed_dp_rank" in refused(client, {"text": "hi", "routed_dp_rank": 1})
    assert "data_parallel_rank" in refused(client, {"text": "hi", "data_parallel_rank": 2})
    assert "priority" in refused(client, {"text": "hi", "priority": 2**64})


@pytest.mark.slow
def test_return_prompt_token_ids(client: httpx.Client):
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(2),
                   return_prompt_token_ids=True)
    assert out["prompt_token_ids"] == list(SHORT_PROMPT.encode())
    assert "prompt_token_ids" not in generate(client, text=SHORT_PROMPT,
                                              sampling_params=greedy(2))


@pytest.mark.slow
def test_a_batch_rid_is_expanded_per_item(client: httpx.Client):
    outs = generate(client, text=["a", "b"], rid="job", sampling_params=greedy(1))
    assert [o["meta_info"]["id"] for o in outs] == ["job_0", "job_1"]


@pytest.mark.slow
def test_extra_key_and_cache_salt_isolate_cached_prefixes(client: httpx.Client,
                                                          demo_prompts: list[str]):
    prompt = unique_prompt(next(p for p in demo_prompts if len(p.encode()) >= 200))
    generate(client, text=prompt, sampling_params=greedy(2), extra_key="a")
    more = prompt + "\n# more\n"
    assert generate(client, text=more, sampling_params=greedy(2))["meta_info"]["cached_tokens"] == 0
    assert generate(client, text=more, sampling_params=greedy(2), extra_key="b",
                    )["meta_info"]["cached_tokens"] == 0
    assert generate(client, text=more, sampling_params=greedy(2), extra_key="a",
                    cache_salt="s")["meta_info"]["cached_tokens"] == 0
    assert generate(client, text=more, sampling_params=greedy(2), extra_key="a",
                    )["meta_info"]["cached_tokens"] > 0
    # per item in a batch; an empty string is no key at all, as SGLang normalises it
    outs = generate(client, text=[more, more], extra_key=["a", ""], sampling_params=greedy(1))
    assert outs[0]["meta_info"]["cached_tokens"] > 0


@pytest.mark.slow
def test_abort_request_by_rid_and_all(client: httpx.Client):
    rid = f"abort-me-{uuid.uuid4().hex}"
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(client.post, "/generate", json={
            "text": SHORT_PROMPT, "rid": rid, "sampling_params": greedy(60000)})
        wait_until(lambda: metric(client.get("/metrics").text, "sglang:num_running_reqs") >= 1,
                   30, "the request to run")
        assert client.post("/abort_request", json={"rid": ""}).status_code == 200  # ignored
        time.sleep(0.2)
        assert not fut.done()
        assert client.post("/abort_request", json={"rid": rid}).status_code == 200
        out = fut.result(timeout=60)
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 60000
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(client.post, "/generate", json={
            "text": f"{i} {SHORT_PROMPT}", "sampling_params": greedy(20000)}) for i in range(3)]
        # all three must have reached the scheduler (two running, one waiting) before the
        # abort: one still on its way would miss abort_all, as in SGLang, and run 20000 tokens
        def two_run_one_waits() -> bool:
            text = client.get("/metrics").text
            return (metric(text, "sglang:num_running_reqs") >= 2
                    and metric(text, "sglang:num_queue_reqs") >= 1)

        wait_until(two_run_one_waits, 30, "two requests to run and one to wait")
        assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
        reasons = [f.result(timeout=60).json()["meta_info"]["finish_reason"] for f in futs]
    # two ran (--max-running-requests 2), one still waited
    assert sorted(r["message"] for r in reasons) == ["Abort in waiting queue", "Aborted",
                                                     "Aborted"]
    assert client.post("/flush_cache").status_code == 200


@pytest.mark.slow
def test_tokenize_and_detokenize(client: httpx.Client):
    out = client.post("/tokenize", json={"prompt": "def f():"}).json()
    assert out == {"tokens": list(b"def f():"), "count": 8, "max_model_len": 8192}
    out = client.post("/v1/tokenize", json={"prompt": ["a", "bc"]}).json()
    assert out["tokens"] == [[97], [98, 99]] and out["count"] == [1, 2]
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"][0] == 257 and chat["tokens"][-1] == 10  # <|bos|> ... "assistant\n"
    assert client.post("/detokenize", json={"tokens": [104, 105, 256]}).json() == {"text": "hi"}
    both = client.post("/v1/detokenize", json={"tokens": [[104], [105, 256]],
                                               "skip_special_tokens": False}).json()
    assert both == {"text": ["h", "i<|endoftext|>"]}
    for path, body, name in [("/tokenize", {}, "prompt"),
                             ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                             ("/detokenize", {"tokens": [10**6]}, "tokens"),
                             ("/detokenize", {"tokens": "x"}, "tokens")]:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, (path, body, resp.text)
        assert resp.json()["object"] == "error" and name in resp.json()["message"]


@pytest.mark.slow
def test_model_info_and_ping(client: httpx.Client, engine: EngineProcess):
    info = client.get("/model_info").json()
    assert info["model_path"].endswith("hybrid-mamba2-tiny")
    assert info["tokenizer_path"] == info["model_path"] == info["served_model_name"]
    assert info["is_generation"] is True
    assert info["architectures"] == ["EvalsvcMamba2HybridForCausalLM"]
    assert client.get("/get_model_info").json() == info
    assert client.get("/ping").status_code == 200


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/models", "/v1/models/x", "/v1/completions",
                                  "/v1/chat/completions", "/tokenize", "/v1/tokenize",
                                  "/detokenize", "/v1/detokenize", "/abort_request", "/model_info",
                                  "/ping"])
def test_new_endpoints_refuse_or_ignore_hostile_bodies_without_a_500(client: httpx.Client,
                                                                     path: str):
    for body in ("[" * 100_000, "\xff", '{"a": "\\ud800"}', '{"prompt": "\\ud800"}',
                 '{"messages": [{"role": "user", "content": "\\udfff"}]}', "[1, 2]"):
        for method in ("GET", "POST"):
            resp = client.request(method, path, content=body,
                                  headers={"content-type": "application/json"})
            assert resp.status_code < 500, (method, path, body[:20], resp.text[:300])
