"""Hostile requests to the embedded engine's HTTP API: each gets a 400 whose message names the
field (SGLang's ``{"error": {"message": ...}}``), never a 500, and the engine keeps serving
everyone else. One real engine process serves the whole module; a brief hypothesis fuzz of
``/generate`` bodies runs against it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evalsvc.engines.launch import EngineProcess, clean_env, embedded_command, free_port

OK = {"max_new_tokens": 2}
DEEP = 100_000


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[EngineProcess]:
    port = free_port()
    env = {k: v for k, v in clean_env().items() if k != "EVALSVC_ENGINE_DEFECTS"}
    log = tmp_path_factory.mktemp("hostile") / "engine.log"
    with EngineProcess(embedded_command(port, ["--random-seed", "0"]), port, env=env,
                       log_path=log, startup_timeout=120) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.base_url, timeout=120) as c:
        yield c


def post(client: httpx.Client, body: dict | str | bytes) -> httpx.Response:
    """A /generate request; a str or bytes body is sent as is (NaN, lone surrogates, depth)."""
    if isinstance(body, dict):
        body = json.dumps(body)  # NaN and Infinity as Python writes them, as many clients do
    return client.post("/generate", content=body, headers={"content-type": "application/json"})


def assert_refused(resp: httpx.Response, *names: str) -> str:
    assert resp.status_code == 400, resp.text[:500]
    message = resp.json()["error"]["message"]
    for name in names:
        assert name in message, message
    return message


def assert_serving(client: httpx.Client) -> None:
    """The engine still answers a good request, and its cache can still be flushed."""
    resp = post(client, {"text": "def f(x):", "sampling_params": OK})
    assert resp.status_code == 200, resp.text
    assert client.post("/flush_cache").status_code == 200


HOSTILE = {
    # the prompt (found by the fuzz below: a batch of texts beside an empty input_ids list)
    "text_batch_with_empty_input_ids": ({"text": [""], "input_ids": [], "sampling_params": OK},
                                        ["input_ids"]),
    # sampling parameters
    "seed_too_big": ({"text": "hi", "sampling_params": {**OK, "sampling_seed": 2**70}},
                     ["sampling_params.sampling_seed"]),
    "seed_too_small": ({"text": "hi", "sampling_params": {**OK, "sampling_seed": -(2**70)}},
                       ["sampling_params.sampling_seed"]),
    "seed_not_int": ({"text": "hi", "sampling_params": {**OK, "sampling_seed": 1.5}},
                     ["sampling_params.sampling_seed"]),
    "temperature_nan": ({"text": "hi", "sampling_params": {**OK, "temperature": float("nan")}},
                        ["sampling_params.temperature"]),
    "temperature_inf": ({"text": "hi", "sampling_params": {**OK, "temperature": float("inf")}},
                        ["sampling_params.temperature"]),
    "temperature_negative": ({"text": "hi", "sampling_params": {**OK, "temperature": -0.5}},
                             ["sampling_params.temperature"]),
    "top_p_nan": ({"text": "hi", "sampling_params": {**OK, "top_p": float("nan")}},
                  ["sampling_params.top_p"]),
    "top_p_zero": ({"text": "hi", "sampling_params": {**OK, "top_p": 0}},
                   ["sampling_params.top_p"]),
    "min_p_inf": ({"text": "hi", "sampling_params": {**OK, "min_p": float("inf")}},
                  ["sampling_params.min_p"]),
    "top_k_zero": ({"text": "hi", "sampling_params": {**OK, "top_k": 0}},
                   ["sampling_params.top_k"]),
    "top_k_negative": ({"text": "hi", "sampling_params": {**OK, "top_k": -7}},
                       ["sampling_params.top_k"]),
    "max_new_tokens_negative": ({"text": "hi", "sampling_params": {"max_new_tokens": -1}},
                                ["sampling_params.max_new_tokens"]),
    "max_new_tokens_huge": ({"text": "hi", "sampling_params": {"max_new_tokens": 2**70}},
                            ["max_new_tokens"]),
    "min_new_tokens_huge": ({"text": "hi", "sampling_params": {**OK, "min_new_tokens": 2**70}},
                            ["min_new_tokens"]),
    "stop_token_ids_huge": ({"text": "hi", "sampling_params": {**OK, "stop_token_ids": [2**70]}},
                            ["sampling_params.stop_token_ids"]),
    "stop_not_strings": ({"text": "hi", "sampling_params": {**OK, "stop": [1, 2]}},
                         ["sampling_params.stop"]),
    "sampling_params_not_object": ({"text": "hi", "sampling_params": 5}, ["sampling_params"]),
    "unknown_sampling_param": ({"text": "hi", "sampling_params": {**OK, "colour": 1}},
                               ["sampling_params.colour"]),
    # the prompt
    "input_ids_out_of_vocab": ({"input_ids": [1, 10**6], "sampling_params": OK}, ["input_ids"]),
    "input_ids_negative": ({"input_ids": [-1], "sampling_params": OK}, ["input_ids"]),
    "input_ids_huge": ({"input_ids": [2**70], "sampling_params": OK}, ["input_ids"]),
    "input_ids_float": ({"input_ids": [1.5, 2], "sampling_params": OK}, ["input_ids"]),
    "input_ids_whole_float": ({"input_ids": [1.0, 2], "sampling_params": OK}, ["input_ids"]),
    "input_ids_bool": ({"input_ids": [True, False], "sampling_params": OK}, ["input_ids"]),
    "input_ids_strings": ({"input_ids": ["1"], "sampling_params": OK}, ["input_ids"]),
    "input_ids_empty": ({"input_ids": [], "sampling_params": OK}, ["input_ids"]),
    "input_ids_ragged": ({"input_ids": [[1, 2], 3], "sampling_params": OK}, ["input_ids"]),
    "text_with_a_batch_of_input_ids": ({"text": "hi", "input_ids": [[]], "sampling_params": OK},
                                       ["input_ids"]),
    "text_empty": ({"text": "", "sampling_params": OK}, ["text"]),
    "text_not_string": ({"text": 5, "sampling_params": OK}, ["text"]),
    "text_lone_surrogate": ('{"text": "a\\ud800b", "sampling_params": {"max_new_tokens": 2}}',
                            ["text", "surrogate"]),
    "batch_text_lone_surrogate": ('{"text": ["ok", "\\udfff"], "sampling_params": '
                                  '{"max_new_tokens": 2}}', ["text[1]", "surrogate"]),
    "stop_lone_surrogate": ('{"text": "hi", "sampling_params": {"max_new_tokens": 2, '
                            '"stop": "\\udc00"}}', ["sampling_params.stop", "surrogate"]),
    "rid_lone_surrogate": ('{"text": "hi", "rid": "\\ud83d", "sampling_params": '
                           '{"max_new_tokens": 2}}', ["rid", "surrogate"]),
    "no_prompt": ({"sampling_params": OK}, ["text", "input_ids"]),
    # logprobs
    "logprob_start_len_negative": ({"text": "hi", "return_logprob": True, "logprob_start_len": -2,
                                    "sampling_params": OK}, ["logprob_start_len"]),
    "logprob_start_len_past_prompt": ({"text": "hi", "return_logprob": True,
                                       "logprob_start_len": 2**70, "sampling_params": OK},
                                      ["logprob_start_len"]),
    "top_logprobs_num_negative": ({"text": "hi", "return_logprob": True, "top_logprobs_num": -1,
                                   "sampling_params": OK}, ["top_logprobs_num"]),
    "top_logprobs_num_huge": ({"text": "hi", "return_logprob": True, "top_logprobs_num": 2**70,
                               "sampling_params": OK}, ["top_logprobs_num"]),
    "token_ids_logprob_out_of_vocab": ({"text": "hi", "return_logprob": True,
                                        "token_ids_logprob": [2**70], "sampling_params": OK},
                                       ["token_ids_logprob"]),
    # ids and batches
    "rid_int": ({"text": "hi", "rid": 5, "sampling_params": OK}, ["rid"]),
    "rid_list_for_one": ({"text": "hi", "rid": ["a"], "sampling_params": OK}, ["rid"]),
    "rid_duplicates": ({"text": ["a", "b"], "rid": ["x", "x"], "sampling_params": OK},
                       ["Duplicate request IDs"]),
    "batch_empty": ({"text": [], "sampling_params": OK}, ["text"]),
    "batch_sampling_params_count": ({"text": ["a", "b"], "sampling_params": [OK]},
                                    ["sampling_params"]),
    "batch_logprob_start_len_count": ({"text": ["a", "b"], "logprob_start_len": [0],
                                       "sampling_params": OK}, ["logprob_start_len"]),
    "unknown_field": ({"text": "hi", "colour": "red", "sampling_params": OK}, ["colour"]),
    # the body itself
    "nested_too_deep": ("[" * DEEP + "]" * DEEP, ["nested"]),
    "object_nested_too_deep": ('{"text": "hi", "custom_params": ' + '{"a": ' * DEEP + "1"
                               + "}" * DEEP + "}", ["nested"]),
    "not_json": ("{", ["JSON"]),
    "not_utf8": (b'{"text": "\xff"}', ["JSON"]),
    "not_an_object": ("[1, 2]", ["JSON object"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_generate_request_is_a_400_naming_the_field(client, case):
    body, names = HOSTILE[case]
    assert_refused(post(client, body), *names)


@pytest.mark.slow
def test_the_engine_serves_on_after_hostile_requests(client):
    for body, _ in HOSTILE.values():
        post(client, body)
    assert_serving(client)


@pytest.mark.slow
def test_text_with_a_nul_is_generated_from(client):
    """NUL is a character like any other (SGLang tokenizes it): an answer, not an error."""
    resp = post(client, {"text": "a\u0000b", "sampling_params": OK})
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["prompt_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/flush_cache", "/server_info", "/get_server_info", "/metrics",
                                  "/get_model_info", "/health", "/health_generate"])
def test_other_endpoints_refuse_or_ignore_bodies_without_a_500(client, path):
    for body in ("[" * DEEP, "\xff", '{"a": "\\ud800"}'):
        for method in ("GET", "POST"):
            resp = client.request(method, path, content=body)
            assert resp.status_code < 500, (method, path, resp.status_code, resp.text[:300])


# ---- a brief fuzz of /generate ---------------------------------------------------------------

INTS = st.one_of(st.sampled_from([0, 1, 2, -1, -2, 258, 259, 2**31, 2**63, 2**64, 2**70,
                                  -(2**63) - 1, -(2**70)]), st.integers(-300, 300))
FLOATS = st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -0.0]),
                   st.floats(-2, 2))
TEXT = st.text(st.characters(codec=None, categories=None), max_size=8)  # surrogates and NUL too
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)


def one_or_batch(values: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(values, st.lists(values, max_size=3), JSONISH)


# field -> what the fuzz puts there; "sampling_params.X" goes into sampling_params
FIELDS = {
    "text": one_or_batch(TEXT),
    "input_ids": st.one_of(st.lists(INTS, max_size=4), st.lists(st.lists(INTS, max_size=3),
                                                                 max_size=3), JSONISH),
    "rid": one_or_batch(TEXT),
    "return_logprob": one_or_batch(st.booleans()),
    "logprob_start_len": one_or_batch(INTS),
    "top_logprobs_num": one_or_batch(INTS),
    "token_ids_logprob": st.one_of(st.lists(INTS, max_size=3), JSONISH),
    "sampling_params": st.one_of(JSONISH, st.lists(st.just({"max_new_tokens": 1}), max_size=3)),
    **{f"sampling_params.{k}": st.one_of(SCALARS, JSONISH) for k in (
        "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "stop", "stop_token_ids",
        "sampling_seed", "ignore_eos", "n", "skip_special_tokens", "no_stop_trim")},
    # a few values only: a valid large one would generate for minutes
    "sampling_params.max_new_tokens": st.sampled_from([-1, 0, 1, 2**70, 10**6, "2", None, 1.5]),
    **{k: SCALARS for k in ("priority", "extra_key", "stream", "log_metrics", "colour")},
    "custom_params": JSONISH,
}


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzzed_generate_bodies_are_answered_or_refused_never_a_500(client, data):
    """A good request with one or two fields replaced by hostile values."""
    body = {"text": "def f(x):", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    for name in data.draw(st.lists(st.sampled_from(list(FIELDS)), min_size=1, max_size=2,
                                   unique=True), label="fields"):
        value = data.draw(FIELDS[name], label=name)
        if name.startswith("sampling_params.") and isinstance(body["sampling_params"], dict):
            body["sampling_params"][name.split(".", 1)[1]] = value
        elif not name.startswith("sampling_params."):
            body[name] = value
    resp = post(client, body)
    assert resp.status_code in (200, 400), (body, resp.status_code, resp.text[:300])
    if resp.status_code == 400:
        assert resp.json()["error"]["message"]


@pytest.mark.slow
def test_the_engine_serves_on_after_the_fuzz(client):
    assert_serving(client)


# ---- the scheduler, under what gets past the HTTP checks -------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--disable-overlap-schedule"]])
def test_a_failed_step_leaves_the_scheduler_usable(engine_factory, flags):
    """A step that raises (here a seed torch refuses, sent past the HTTP checks) aborts its
    requests with an error; afterwards the cache flushes and requests run as before."""
    import threading

    from tests.engines.embedded.conftest import request

    eng = engine_factory(["--random-seed", "0", *flags])
    bad = request("bad", list(range(1, 40)), max_new_tokens=4, temperature=1.0, seed=2**70)
    done = threading.Event()
    eng.sched.submit(bad, lambda req: done.set())
    assert done.wait(120)
    assert eng.sched.flush_cache()
    out = eng.one(list(range(1, 40)), max_new_tokens=4)
    assert len(out.output_ids) == 4
