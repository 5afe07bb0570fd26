"""End-to-end tests of the embedded engine over real HTTP, against real server subprocesses.

One engine with default flags (module scope) serves the API-shape tests; tests that need other flags
(or that take an engine down) start their own. The start-up refusals run the module without a server.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from evalsvc.engines.launch import EngineProcess, clean_env, embedded_command, free_port

STARTUP_LIMIT_S = 10.0
DEFECTS_ENV = "EVALSVC_ENGINE_DEFECTS"
HTTP_TIMEOUT = 120.0
SHORT_PROMPT = "def add(a, b):\n    return"  # < 64 tokens: never a prefix-cache hit


# ---- helpers ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    """The test process's environment without any defect switched on from outside."""
    return {k: v for k, v in clean_env().items() if k != DEFECTS_ENV}


def new_engine(tmp_dir: Path, flags: Sequence[str] = ()) -> EngineProcess:
    """An engine process, not started yet: ``with new_engine(...) as eng`` starts it, waits until it
    is healthy and takes its process group down at the end."""
    port = free_port()
    return EngineProcess(embedded_command(port, ["--random-seed", "0", *flags]), port, env=_env(),
                         log_path=tmp_dir / f"engine-{port}.log", startup_timeout=60.0)


def _client(eng: EngineProcess) -> httpx.Client:
    return httpx.Client(base_url=eng.base_url, timeout=HTTP_TIMEOUT)


def greedy(n: int = 16, **extra) -> dict:
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True, **extra}


def generate(client: httpx.Client, **body) -> dict | list:
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def metric(text: str, name: str) -> float:
    """The value of the (single-series) sample ``name`` in Prometheus text exposition."""
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name} not in /metrics:\n{text}"
    return float(m.group(1))


def unique_prompt(body: str) -> str:
    """A prompt no earlier request shares a prefix with."""
    return f"# {uuid.uuid4().hex}\n{body}"


def log_tail(eng: EngineProcess, lines: int = 40) -> str:
    return "\n".join(eng.log_path.read_text(errors="replace").splitlines()[-lines:])


def engine_pids_with_port(port: int) -> list[int]:
    needle = f"--port\0{port}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline + b"\0":
            pids.append(int(entry.name))
    return pids


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """The engine with default flags, shared by the API-shape tests."""
    with new_engine(tmp_path_factory.mktemp("engine")) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with _client(engine) as c:
        yield c


@pytest.fixture(scope="module")
def long_prompt(demo_prompts: list[str]) -> str:
    text = next(p for p in demo_prompts if len(p.encode()) >= 200)
    return text


# ---- start-up and shutdown ---------------------------------------------------------------------


@pytest.mark.slow
def test_engine_becomes_healthy_within_10s_of_spawn(engine: EngineProcess, client: httpx.Client):
    assert engine.startup_seconds is not None
    assert engine.startup_seconds < STARTUP_LIMIT_S
    assert client.get("/health_generate").status_code == 200
    assert client.get("/health").status_code == 200


@pytest.mark.slow
def test_sigterm_exits_zero_and_leaves_no_process(tmp_path: Path):
    with new_engine(tmp_path) as eng:
        pid, port = eng.proc.pid, eng.port
        assert os.getpgid(pid) == pid  # its own process group
        assert engine_pids_with_port(port) == [pid]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        code = eng.proc.wait(timeout=10)
        took = time.monotonic() - t0
        assert code == 0, log_tail(eng)
        assert took < 5.0
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
        assert engine_pids_with_port(port) == []


@pytest.mark.slow
def test_sigterm_with_a_request_in_flight_exits_zero_promptly(tmp_path: Path):
    with new_engine(tmp_path) as eng, _client(eng) as c, ThreadPoolExecutor(1) as pool:
        fut = pool.submit(c.post, "/generate",
                          json={"text": SHORT_PROMPT, "sampling_params": greedy(20000)})
        wait_until(lambda: metric(c.get("/metrics").text, "sglang:num_running_reqs") >= 1,
                   30, "the request to run")
        t0 = time.monotonic()
        os.kill(eng.proc.pid, signal.SIGTERM)
        code = eng.proc.wait(timeout=20)
        took = time.monotonic() - t0
        # the in-flight request is aborted and answered at once, not cut after a grace period
        resp = fut.result(timeout=10)
        assert resp.status_code == 503
        assert "shutting down" in resp.json()["error"]["message"]
        assert code == 0, log_tail(eng)
        assert took < 5.0
        with pytest.raises(ProcessLookupError):
            os.killpg(eng.proc.pid, 0)


# ---- /generate ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_32_concurrent_requests_all_complete_with_distinct_ids(client: httpx.Client):
    n, tokens = 32, 16

    def one(i: int) -> httpx.Response:
        return client.post("/generate", json={"text": f"x{i} = {i} * ",
                                              "sampling_params": greedy(tokens)})

    with ThreadPoolExecutor(n) as pool:
        resps = list(pool.map(one, range(n)))
    assert [r.status_code for r in resps] == [200] * n
    outs = [r.json() for r in resps]
    for out in outs:
        assert out["meta_info"]["completion_tokens"] == tokens
        assert len(out["output_ids"]) == tokens
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": tokens}
    assert len({o["meta_info"]["id"] for o in outs}) == n
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(f"x{i} = {i} * ") for i in range(n)]


@pytest.mark.slow
def test_generate_from_text(client: httpx.Client):
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(12))
    assert isinstance(out, dict)
    assert isinstance(out["text"], str)
    assert len(out["output_ids"]) == 12
    assert out["meta_info"]["prompt_tokens"] == len(SHORT_PROMPT.encode())
    assert out["meta_info"]["completion_tokens"] == 12


@pytest.mark.slow
def test_generate_from_input_ids_matches_text(client: httpx.Client):
    ids = list(SHORT_PROMPT.encode())  # the shipped tokenizer is byte-level
    by_ids = generate(client, input_ids=ids, sampling_params=greedy(12))
    by_text = generate(client, text=SHORT_PROMPT, sampling_params=greedy(12))
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]


@pytest.mark.slow
def test_batch_of_texts_returns_a_list_in_order(client: httpx.Client):
    texts = ["a", "import os\n", "class Foo:\n    def"]
    outs = generate(client, text=texts, sampling_params=greedy(5))
    assert isinstance(outs, list)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(t) for t in texts]
    assert all(o["meta_info"]["completion_tokens"] == 5 for o in outs)
    assert len({o["meta_info"]["id"] for o in outs}) == len(texts)


@pytest.mark.slow
def test_batch_of_input_ids_with_per_item_sampling_params(client: httpx.Client):
    outs = generate(client, input_ids=[[100, 101], [102, 103, 104]],
                    sampling_params=[greedy(3), greedy(6)])
    assert isinstance(outs, list)
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 3]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 6]


@pytest.mark.slow
def test_temperature_zero_is_deterministic(client: httpx.Client):
    a = generate(client, text=SHORT_PROMPT, sampling_params=greedy(24))
    b = generate(client, text=SHORT_PROMPT, sampling_params=greedy(24))
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]
    assert a["meta_info"]["id"] != b["meta_info"]["id"]


@pytest.mark.slow
def test_max_new_tokens_zero_returns_empty_completion(client: httpx.Client):
    out = generate(client, text=SHORT_PROMPT, sampling_params={"max_new_tokens": 0})
    assert out["text"] == ""
    assert out["output_ids"] == []
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["prompt_tokens"] == len(SHORT_PROMPT.encode())


@pytest.mark.slow
def test_logprobs_from_position_zero(client: httpx.Client):
    ids = list(SHORT_PROMPT.encode())
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(8), return_logprob=True,
                   logprob_start_len=0)
    meta = out["meta_info"]
    ins = meta["input_token_logprobs"]
    assert len(ins) == meta["prompt_tokens"] == len(ids)
    assert ins[0] == [None, ids[0], None]
    assert [e[1] for e in ins] == ids
    for lp, _tid, text in ins[1:]:
        assert isinstance(lp, float)
        assert math.isfinite(lp)
        assert lp <= 0.0
        assert text is None
    assert any(lp < 0.0 for lp, _, _ in ins[1:])
    outs = meta["output_token_logprobs"]
    assert len(outs) == meta["completion_tokens"] == 8
    assert [e[1] for e in outs] == out["output_ids"]
    assert all(math.isfinite(lp) and lp <= 0.0 and text is None for lp, _, text in outs)
    assert "input_top_logprobs" not in meta


@pytest.mark.slow
def test_logprobs_default_start_covers_no_input_positions(client: httpx.Client):
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(4), return_logprob=True)
    assert out["meta_info"]["input_token_logprobs"] == []
    assert len(out["meta_info"]["output_token_logprobs"]) == 4


@pytest.mark.slow
def test_top_logprobs_three_per_position_sorted_descending(client: httpx.Client):
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(6), return_logprob=True,
                   logprob_start_len=0, top_logprobs_num=3)
    meta = out["meta_info"]
    in_top, out_top = meta["input_top_logprobs"], meta["output_top_logprobs"]
    assert len(in_top) == meta["prompt_tokens"]
    assert in_top[0] is None
    assert len(out_top) == meta["completion_tokens"] == 6
    for pos in [*in_top[1:], *out_top]:
        assert len(pos) == 3
        lps = [e[0] for e in pos]
        assert lps == sorted(lps, reverse=True)
        assert len({e[1] for e in pos}) == 3
    # greedy: every output token is the top-1 candidate, with the same logprob
    for (lp, tid, _), pos in zip(meta["output_token_logprobs"], out_top, strict=True):
        assert pos[0][1] == tid
        assert pos[0][0] == pytest.approx(lp)
    # a prompt token's logprob is at most the top-1 at its position
    for (lp, _, _), pos in zip(meta["input_token_logprobs"][1:], in_top[1:], strict=True):
        assert lp <= pos[0][0] + 1e-6


@pytest.mark.slow
def test_output_top_and_ids_logprobs_cover_every_token_with_default_start(client: httpx.Client):
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(4), return_logprob=True,
                   top_logprobs_num=3, token_ids_logprob=[97, 98])
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    assert len(meta["output_top_logprobs"]) == 4
    assert len(meta["output_token_ids_logprobs"]) == 4
    assert [pos[0][1] for pos in meta["output_top_logprobs"]] == out["output_ids"]


@pytest.mark.slow
def test_token_ids_logprob_reports_the_requested_ids(client: httpx.Client):
    wanted = [97, 98, 32]
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(4), return_logprob=True,
                   logprob_start_len=0, top_logprobs_num=259, token_ids_logprob=wanted)
    meta = out["meta_info"]
    assert len(meta["output_token_ids_logprobs"]) == 4
    assert len(meta["input_token_ids_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_ids_logprobs"][0] is None
    # each requested id's logprob equals its entry in the full top-k list at the same position
    for pos, full in zip(meta["output_token_ids_logprobs"], meta["output_top_logprobs"], strict=True):
        assert [e[1] for e in pos] == wanted
        table = {tid: lp for lp, tid, _ in full}
        for lp, tid, _ in pos:
            assert lp == pytest.approx(table[tid])


@pytest.mark.slow
def test_return_text_in_logprobs_fills_the_third_slot(client: httpx.Client):
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(6), return_logprob=True,
                   logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = out["meta_info"]
    ins, outs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert all(isinstance(e[2], str) for e in ins + outs)
    assert "".join(e[2] for e in ins) == SHORT_PROMPT
    assert all(isinstance(e[2], str) for pos in meta["output_top_logprobs"] for e in pos)


@pytest.mark.slow
def test_meta_info_fields(client: httpx.Client):
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(5))
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "e2e_latency"):
        assert key in meta, key
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(SHORT_PROMPT.encode())
    assert meta["completion_tokens"] == len(out["output_ids"]) == 5
    assert isinstance(meta["cached_tokens"], int) and meta["cached_tokens"] >= 0
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0


@pytest.mark.slow
def test_rid_is_returned_as_id(client: httpx.Client):
    rid = f"my-request-{uuid.uuid4().hex}"
    out = generate(client, text=SHORT_PROMPT, rid=rid, sampling_params=greedy(2))
    assert out["meta_info"]["id"] == rid


def _pick_stop(text: str) -> str:
    for k in range(4, len(text) - 3):
        cand = text[k:k + 3]
        if cand.strip() and cand.isascii():
            return cand
    pytest.fail(f"no usable stop string in the greedy output {text!r}")


@pytest.mark.slow
def test_stop_string_ends_generation_and_is_trimmed(client: httpx.Client):
    free = generate(client, text=SHORT_PROMPT, sampling_params=greedy(48))
    stop = _pick_stop(free["text"])
    cut = free["text"].find(stop)
    out = generate(client, text=SHORT_PROMPT, sampling_params=greedy(48, stop=[stop]))
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"]
    assert out["text"] == free["text"][:cut]
    assert meta["completion_tokens"] < 48
    assert out["output_ids"] == free["output_ids"][:meta["completion_tokens"]]


@pytest.mark.slow
def test_sampling_seed_makes_temperature_one_reproducible(client: httpx.Client):
    def sample(seed: int) -> list[int]:
        params = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True,
                  "sampling_seed": seed}
        return generate(client, text=SHORT_PROMPT, sampling_params=params)["output_ids"]

    first = sample(1234)
    assert sample(1234) == first
    # and the seed is what fixes it: other seeds sample other continuations
    assert len({tuple(sample(s)) for s in (1, 2, 3, 4)} | {tuple(first)}) > 1


@pytest.mark.slow
def test_shared_prefix_hits_the_prefix_cache(client: httpx.Client, long_prompt: str):
    prompt = unique_prompt(long_prompt)
    first = generate(client, text=prompt, sampling_params=greedy(4))
    assert first["meta_info"]["cached_tokens"] == 0
    second = generate(client, text=prompt + "\n# and some more text\n", sampling_params=greedy(4))
    meta = second["meta_info"]
    assert 0 < meta["cached_tokens"] <= first["meta_info"]["prompt_tokens"]
    details = meta["cached_tokens_details"]
    assert details["device"] + details["host"] == meta["cached_tokens"]


# ---- malformed requests --------------------------------------------------------------------------

MALFORMED = [
    pytest.param({"json": {"text": "hi", "tempreature": 0}}, ["tempreature"], id="unknown-field"),
    pytest.param({"json": {"text": "hi", "sampling_params": {"tempreature": 0}}},
                 ["sampling_params", "tempreature"], id="unknown-sampling-param"),
    pytest.param({"json": {"text": "hi", "sampling_params": {"max_new_tokens": -1}}},
                 ["max_new_tokens"], id="negative-max-new-tokens"),
    pytest.param({"json": {"sampling_params": {"max_new_tokens": 1}}}, ["text", "input_ids"],
                 id="no-text-no-input-ids"),
    pytest.param({"json": {"input_ids": [1, 2, 100000]}}, ["input_ids", "100000"],
                 id="out-of-vocabulary-id"),
    pytest.param({"json": {"text": 5}}, ["text"], id="text-wrong-type"),
    pytest.param({"content": b"{not json", "headers": {"content-type": "application/json"}},
                 ["JSON"], id="body-not-json"),
    pytest.param({"json": {"text": "abc", "return_logprob": True, "logprob_start_len": 10}},
                 ["logprob_start_len"], id="logprob-start-beyond-prompt"),
    pytest.param({"json": {"text": "abc", "return_logprob": True, "token_ids_logprob": [1000]}},
                 ["token_ids_logprob", "1000"], id="token-ids-logprob-out-of-vocabulary"),
    pytest.param({"json": {"text": "abc", "return_logprob": True, "token_ids_logprob": [-1]}},
                 ["token_ids_logprob", "-1"], id="token-ids-logprob-negative"),
    pytest.param({"json": {"text": ["a", "b"], "return_logprob": True,
                           "token_ids_logprob": [[1]]}},
                 ["token_ids_logprob"], id="token-ids-logprob-batch-length"),
    pytest.param({"json": {"text": "abc", "return_logprob": True, "logprob_start_len": [0]}},
                 ["logprob_start_len"], id="per-item-list-for-single-request"),
    pytest.param({"json": {"text": ["a", "b"], "return_logprob": [True]}},
                 ["return_logprob"], id="per-item-list-shorter-than-batch"),
    pytest.param({"json": {"text": ["a", "b"], "top_logprobs_num": [1, 2, 3]}},
                 ["top_logprobs_num"], id="per-item-list-longer-than-batch"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("request_kwargs", "names"), MALFORMED)
def test_malformed_request_gets_400_naming_the_field(client: httpx.Client, request_kwargs: dict,
                                                     names: list[str]):
    resp = client.post("/generate", **request_kwargs)
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    message = body["error"]["message"]
    assert isinstance(message, str)
    for name in names:
        assert name in message
    # and the server keeps serving
    out = generate(client, text="ok", sampling_params=greedy(2))
    assert out["meta_info"]["completion_tokens"] == 2


@pytest.mark.slow
def test_a_bad_request_does_not_disturb_one_in_flight(client: httpx.Client):
    n = 1000  # seconds of decoding: still running when the bad request is answered
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.post, "/generate",
                          json={"text": SHORT_PROMPT, "sampling_params": greedy(n)})
        wait_until(lambda: fut.done() or metric(client.get("/metrics").text,
                                                "sglang:num_running_reqs") >= 1,
                   30, "the long request to run")
        bad = client.post("/generate", json={"text": "a", "return_logprob": True,
                                             "token_ids_logprob": [1000]})
        assert not fut.done(), "the long request finished before the bad one; make it longer"
        good = fut.result(timeout=HTTP_TIMEOUT)
    assert bad.status_code == 400
    assert good.status_code == 200, good.text
    assert good.json()["meta_info"]["completion_tokens"] == n


# ---- /flush_cache --------------------------------------------------------------------------------


@pytest.mark.slow
def test_flush_cache_when_idle_succeeds_and_empties_the_prefix_cache(client: httpx.Client,
                                                                     long_prompt: str):
    prompt = unique_prompt(long_prompt)
    generate(client, text=prompt, sampling_params=greedy(2))
    assert generate(client, text=prompt, sampling_params=greedy(2))["meta_info"]["cached_tokens"] > 0
    resp = client.post("/flush_cache")
    assert resp.status_code == 200
    assert resp.text.startswith("Cache flushed.")
    assert generate(client, text=prompt, sampling_params=greedy(2))["meta_info"]["cached_tokens"] == 0
    assert client.get("/flush_cache").status_code == 200  # GET is accepted as well


@pytest.mark.slow
def test_flush_cache_is_refused_while_a_request_runs(client: httpx.Client):
    n = 1000  # seconds of decoding: still running when the flush is answered
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(generate, client, text=SHORT_PROMPT, sampling_params=greedy(n))
        wait_until(lambda: fut.done() or metric(client.get("/metrics").text,
                                                "sglang:num_running_reqs") >= 1,
                   30, "the long request to run")
        resp = client.post("/flush_cache")
        assert not fut.done(), "the long request finished before the flush; make it longer"
        long_out = fut.result(timeout=HTTP_TIMEOUT)
    assert resp.status_code == 400
    assert resp.text == "Flush cache failed.\n"
    assert long_out["meta_info"]["completion_tokens"] == n
    assert client.post("/flush_cache").status_code == 200  # idle again


# ---- /server_info --------------------------------------------------------------------------------


def _check_server_info_shape(info: dict) -> None:
    assert isinstance(info["version"], str) and info["version"]
    assert isinstance(info["internal_states"], list)
    assert isinstance(info["internal_states"][0], dict)
    assert "startup_time" in info["internal_states"][0]


@pytest.mark.slow
def test_server_info_resolves_default_args(client: httpx.Client):
    info = client.get("/server_info").json()
    _check_server_info_shape(info)
    assert info["mamba_radix_cache_strategy"] == "extra_buffer"
    assert info["disable_overlap_schedule"] is False
    assert info["speculative_algorithm"] is None
    assert info["internal_states"][0]["mamba_radix_cache_strategy"] == "extra_buffer"
    assert info["model"]["family"] == "mamba2"
    assert info["random_seed"] == 0


@pytest.mark.slow
def test_get_server_info_is_an_alias(client: httpx.Client):
    resp = client.get("/get_server_info")
    assert resp.status_code == 200
    old, new = resp.json(), client.get("/server_info").json()
    _check_server_info_shape(old)
    for key in ("mamba_radix_cache_strategy", "disable_overlap_schedule", "port", "version",
                "model_path"):
        assert old[key] == new[key]


@pytest.mark.slow
def test_server_info_without_overlap_resolves_no_buffer(tmp_path: Path):
    with new_engine(tmp_path, ["--disable-overlap-schedule"]) as eng, _client(eng) as c:
        info = c.get("/server_info").json()
        _check_server_info_shape(info)
        assert info["mamba_radix_cache_strategy"] == "no_buffer"
        assert info["disable_overlap_schedule"] is True
        out = generate(c, text=SHORT_PROMPT, sampling_params=greedy(4))
        assert out["meta_info"]["completion_tokens"] == 4


@pytest.mark.slow
def test_server_info_reports_defect_strengths(tmp_path: Path):
    port = free_port()
    argv = embedded_command(port, ["--random-seed", "0", "--inject-defect", "snapshot-race@0.25"])
    with EngineProcess(argv, port, env={**_env(), DEFECTS_ENV: "host-load-race"},
                       log_path=tmp_path / "engine.log", startup_timeout=60.0) as eng, \
            _client(eng) as c:
        info = c.get("/server_info").json()
        assert info["defects"] == ["snapshot-race", "host-load-race"]
        assert info["defect_strengths"] == {"snapshot-race": 0.25, "host-load-race": 1.0}
        assert info["internal_states"][0]["defect_strengths"] == info["defect_strengths"]


@pytest.mark.slow
def test_nextn_speculative_decoding_reports_acceptance(tmp_path: Path, long_prompt: str,
                                                       client: httpx.Client):
    with new_engine(tmp_path, ["--speculative-algorithm", "NEXTN"]) as eng, _client(eng) as c:
        info = c.get("/server_info").json()
        _check_server_info_shape(info)
        assert info["speculative_algorithm"] == "EAGLE"
        assert info["speculative_num_steps"] == 3
        assert info["speculative_eagle_topk"] == 1
        assert info["speculative_num_draft_tokens"] == 4
        assert info["disable_overlap_schedule"] is True

        prompt = unique_prompt(long_prompt)
        out = generate(c, text=prompt, sampling_params=greedy(48))
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 48
        verify = meta["spec_verify_ct"]
        assert verify > 0
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / verify)
        assert 0.0 <= meta["spec_accept_rate"] <= 1.0
        assert meta["spec_num_proposed_drafts"] == verify * 3
        assert 0 <= meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
        assert meta["spec_accept_rate"] == pytest.approx(
            meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"])
        hist = meta["spec_accept_histogram"]
        assert len(hist) == 4
        assert sum(hist) == verify
        assert sum(i * k for i, k in enumerate(hist)) == meta["spec_num_correct_drafts"]

        state = c.get("/server_info").json()["internal_states"][0]
        assert state["avg_spec_accept_length"] > 1.0

    # speculative decoding does not change greedy output: the default engine produces the same
    plain = generate(client, text=prompt, sampling_params=greedy(48))
    assert "spec_verify_ct" not in plain["meta_info"]
    assert plain["output_ids"] == out["output_ids"]


# ---- /metrics ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_metrics_count_requests_and_prompt_tokens(client: httpx.Client, long_prompt: str):
    before = client.get("/metrics")
    assert before.status_code == 200
    assert before.headers["content-type"].startswith("text/plain")
    text = before.text
    for name in ("sglang:num_requests_total", "sglang:prompt_tokens_total",
                 "sglang:generation_tokens_total", "sglang:cache_hit_rate"):
        metric(text, name)
    assert "# TYPE sglang:cache_hit_rate gauge" in text

    prompt = unique_prompt("x = 1\n")
    generate(client, text=prompt, sampling_params=greedy(3))
    after = client.get("/metrics").text
    assert metric(after, "sglang:prompt_tokens_total") - metric(text, "sglang:prompt_tokens_total") \
        == len(prompt.encode())
    assert metric(after, "sglang:num_requests_total") - metric(text, "sglang:num_requests_total") == 1
    assert metric(after, "sglang:generation_tokens_total") \
        - metric(text, "sglang:generation_tokens_total") >= 3

    # the hit rate is the ratio of the two cache counters
    hit = unique_prompt(long_prompt)
    generate(client, text=hit, sampling_params=greedy(2))
    generate(client, text=hit + "more", sampling_params=greedy(2))
    final = client.get("/metrics").text
    cached, prompt_total = (metric(final, "sglang:cached_tokens_total"),
                            metric(final, "sglang:prompt_tokens_total"))
    assert cached > 0
    assert metric(final, "sglang:cache_hit_rate") == pytest.approx(cached / prompt_total)


# ---- models --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_is_the_mamba2_family(client: httpx.Client):
    info = client.get("/server_info").json()
    assert info["model"]["family"] == "mamba2"
    assert Path(info["model_path"]).name == "hybrid-mamba2-tiny"


@pytest.mark.slow
def test_shipped_gdn_model_by_name_serves(tmp_path: Path):
    with new_engine(tmp_path, ["--model-path", "hybrid-gdn-tiny"]) as eng, _client(eng) as c:
        info = c.get("/server_info").json()
        assert info["model"]["family"] == "gated_deltanet"
        assert Path(info["model_path"]).name == "hybrid-gdn-tiny"
        out = generate(c, text=SHORT_PROMPT, sampling_params=greedy(8))
        assert out["meta_info"]["completion_tokens"] == 8
        assert len(out["output_ids"]) == 8


# ---- start-up refusals (no server) ----------------------------------------------------------------


def _run_engine_module(flags: list[str], env: dict[str, str] | None = None
                       ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "evalsvc.engines.embedded", "--port", str(free_port()), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env=env if env is not None else _env())


REFUSALS = [
    pytest.param(["--no-such-flag"], ["--no-such-flag"], id="unknown-flag"),
    pytest.param(["--mamba-radix-cache-strategy", "no_buffer"],
                 ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"],
                 id="no-buffer-with-overlap"),
    pytest.param(["--enable-hierarchical-cache", "--disable-radix-cache"],
                 ["enable-hierarchical-cache", "disable-radix-cache"], id="hicache-without-radix"),
    pytest.param(["--inject-defect", "nonsense"], ["nonsense"], id="unknown-defect-flag"),
    pytest.param(["--inject-defect", "snapshot-race@1.5"], ["snapshot-race", "1.5", "--inject-defect"],
                 id="bad-defect-strength"),
    pytest.param(["--model-path", "/nonexistent"], ["/nonexistent"], id="missing-model-path"),
]


@pytest.mark.parametrize(("flags", "names"), REFUSALS)
def test_bad_flags_refuse_to_start_with_exit_2(flags: list[str], names: list[str]):
    res = _run_engine_module(flags)
    assert res.returncode == 2, res.stderr
    for name in names:
        assert name in res.stderr
    assert "Uvicorn running" not in res.stderr


def test_unknown_defect_in_environment_refuses_to_start():
    res = _run_engine_module([], env={**_env(), DEFECTS_ENV: "nonsense"})
    assert res.returncode == 2, res.stderr
    assert "nonsense" in res.stderr
    assert DEFECTS_ENV in res.stderr

