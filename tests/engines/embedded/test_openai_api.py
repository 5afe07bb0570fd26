"""The OpenAI-compatible surface over real HTTP: models, completions and chat completions,
streamed and not, with logprobs, against what the native API returns for the same request.
(``tests/engines/test_sglang_api_surface.py`` drives it with the real ``openai`` client.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from evalsvc.engines.launch import EngineProcess

from .test_server import SHORT_PROMPT, _client, generate, greedy, new_engine

# under 64 tokens with the template's (byte-level) tokens, as SHORT_PROMPT alone: never a prefix-cache
# hit, so the same chat asked twice computes the same numbers (a hit resumes from a cached state,
# equal to a cold recompute only to float32 rounding, which depends on the CPU's kernels)
CHAT = [{"role": "system", "content": "Python."},
        {"role": "user", "content": [{"type": "text", "text": SHORT_PROMPT}]}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with new_engine(tmp_path_factory.mktemp("openai"), ["--served-model-name", "tiny",
                                                         "--enable-cache-report"]) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with _client(engine) as c:
        yield c


def events(client: httpx.Client, path: str, body: dict) -> list[dict | str]:
    out: list[dict | str] = []
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line:
                assert line.startswith("data: ")
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat_ids(client: httpx.Client, messages: list[dict]) -> list[int]:
    return client.post("/tokenize", json={"messages": messages}).json()["tokens"]


@pytest.mark.slow
def test_models_list_the_served_model(client: httpx.Client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 8192
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.slow
def test_completion_equals_the_native_answer(client: httpx.Client):
    native = generate(client, text=SHORT_PROMPT, sampling_params=greedy(8), return_logprob=True,
                      top_logprobs_num=2)
    out = client.post("/v1/completions", json={"model": "tiny", "prompt": SHORT_PROMPT,
                                               "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True, "logprobs": 2}).json()
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    choice = out["choices"][0]
    assert choice["text"] == native["text"]
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == [e[0] for e in native["meta_info"]["output_token_logprobs"]]
    assert lp["tokens"] == [chr(e[1]) for e in native["meta_info"]["output_token_logprobs"]]
    assert [list(t.values()) for t in lp["top_logprobs"]] == [
        [e[0] for e in pos] for pos in native["meta_info"]["output_top_logprobs"]]
    assert out["usage"]["prompt_tokens"] == len(SHORT_PROMPT.encode())
    assert out["usage"]["completion_tokens"] == 8
    assert out["usage"]["total_tokens"] == len(SHORT_PROMPT.encode()) + 8
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # --enable-cache-report


@pytest.mark.slow
def test_completion_echo_with_logprobs_covers_the_prompt(client: httpx.Client):
    out = client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 3,
                                               "temperature": 0, "echo": True,
                                               "logprobs": 1}).json()
    choice = out["choices"][0]
    assert choice["text"].startswith("def f(x):")
    lp = choice["logprobs"]
    assert lp["tokens"][:9] == list("def f(x):")
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == 12


@pytest.mark.slow
def test_completion_stream_adds_up_to_the_answer(client: httpx.Client):
    body = {"prompt": [SHORT_PROMPT, "import os\n"], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream_options": {"include_usage": True}}
    whole = client.post("/v1/completions", json=body).json()
    evs = events(client, "/v1/completions", body)
    assert evs[-1] == "[DONE]"
    usage = evs[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    chunks = [e for e in evs[:-2] if e["choices"]]
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"]
        assert [v for c in mine for v in c["logprobs"]["token_logprobs"]] \
            == whole["choices"][i]["logprobs"]["token_logprobs"]
        # one chunk a step, but steps that finish before the stream is written are sent together
        # (SGLang's tokenizer manager coalesces a request's queued outputs the same way)
        assert 1 <= len(mine) <= 6
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + ["length"]


@pytest.mark.slow
def test_chat_renders_the_template_and_equals_the_native_answer(client: httpx.Client):
    ids = chat_ids(client, CHAT)
    assert ids[0] == 257  # <|bos|>, the template's turn opener
    assert len(ids) < 64  # no cache hit (the comment at CHAT)
    native = generate(client, input_ids=ids, sampling_params=greedy(6), return_logprob=True,
                      top_logprobs_num=2)
    out = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 2, "return_meta_info": True}).json()
    assert out["object"] == "chat.completion"
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": native["text"],
                                 "reasoning_content": None}
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [
        e[0] for e in native["meta_info"]["output_token_logprobs"]]
    assert [c["bytes"] for c in content] == [[t] for t in native["output_ids"]]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert choice["meta_info"]["prompt_tokens"] == len(ids)
    assert native["meta_info"]["cached_tokens"] == choice["meta_info"]["cached_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.slow
def test_chat_stream_opens_with_the_role_and_ends_with_the_reason(client: httpx.Client):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    evs = events(client, "/v1/chat/completions", body)
    assert evs[-1] == "[DONE]"
    deltas = [e["choices"][0] for e in evs[:-1]]
    assert deltas[0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert deltas[-1]["finish_reason"] == "length" and "content" not in deltas[-1]["delta"]
    text = "".join(d["delta"].get("content", "") for d in deltas)
    assert text == whole["choices"][0]["message"]["content"]
    assert [c["logprob"] for d in deltas if d["logprobs"] for c in d["logprobs"]["content"]] \
        == [c["logprob"] for c in whole["choices"][0]["logprobs"]["content"]]


@pytest.mark.slow
def test_chat_without_max_tokens_generates_until_a_stop(client: httpx.Client):
    """No max_tokens: as many as the context leaves (SGLang), not a default like 16."""
    native = generate(client, input_ids=chat_ids(client, CHAT), sampling_params=greedy(64))
    ids = native["output_ids"]
    k = next(k for k in range(20, 64) if ids[k] not in ids[:k])
    out = client.post("/v1/chat/completions", json={
        "messages": CHAT, "temperature": 0, "stop_token_ids": [ids[k]],
        "return_token_ids": True}).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == ids[k]
    assert choice["response_token_ids"] == ids[:k + 1]


REFUSED = [
    ("/v1/completions", {"prompt": "x", "n": 2}, "sampling_params.n"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 2.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "lora_path": "adapter"}, "lora_path"),
    ("/v1/completions", {"prompt": ""}, "Prompt cannot be empty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}},
     "json_schema"),
    ("/v1/chat/completions", {"messages": []}, "Messages cannot be empty"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "a.png"}}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "return_token_ids": True},
     "return_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "return_hidden_states": True},
     "return_hidden_states"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "name"), REFUSED)
def test_what_the_engine_cannot_do_is_a_400_naming_it(client: httpx.Client, path: str, body: dict,
                                                      name: str):
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["object"] == "error" and err["code"] == 400
    assert name in err["message"]
