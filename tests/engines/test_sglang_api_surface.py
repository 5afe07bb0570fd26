"""The embedded engine serves SGLang's own clients: checked against the newest release's code.

The release's env (``evalsvc.builds.sglang_env``, built by the first run) provides SGLang's own
field lists, read by ``tests/engines/sglang_surface.py`` from ``GenerateReqInput``,
``SamplingParams``, the tokenizer manager's ``meta_info`` and the OpenAI protocol, so a release
that adds a field fails here until the engine knows it; and SGLang's client code, run unchanged
against embedded engine processes: the ``openai`` client, ``python -m sglang.bench_serving``
streaming a ``random-ids`` dataset (no hub), and the multi-turn KL helpers with their Mamba-aware
cache bounds.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from evalsvc.engines.embedded.openai_api import CHAT_PASSTHROUGH, PASSTHROUGH, ChatIn, CompletionIn
from evalsvc.engines.embedded.outputs import LEGACY_META_INFO_KEYS, META_INFO_KEYS
from evalsvc.engines.embedded.protocol import UNSUPPORTED_FIELDS, GenerateReqIn, SamplingParamsIn
from evalsvc.engines.launch import EngineProcess, clean_env, embedded_command, free_port

from .test_sglang_contract import release_python

VERSION = "0.5.23"
SURFACE = Path(__file__).resolve().parent / "sglang_surface.py"
CLIENTS = Path(__file__).resolve().parent / "sglang_clients"
# SamplingParams fields SGLang fills itself (``normalize``), never sent by a client
SAMPLING_INTERNAL = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                     "is_normalized", "ebnf_full_assistant"}

pytestmark = [pytest.mark.sglang_contract, pytest.mark.slow, pytest.mark.timeout(3600),
              pytest.mark.xdist_group(f"sglang-{VERSION}")]


def run_in_env(python: Path, argv: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"  # nothing here may need the hub
    done = subprocess.run([str(python), *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, check=False)
    assert done.returncode == 0, f"{argv[0]} exited {done.returncode}:\n{done.stderr[-6000:]}"
    return done


@pytest.fixture(scope="module")
def python() -> Path:
    return release_python(VERSION)


@pytest.fixture(scope="module")
def surface(python: Path) -> dict[str, Any]:
    out = json.loads(run_in_env(python, [str(SURFACE)], timeout=600).stdout)
    assert out["sglang_version"] == VERSION
    return out


def engine_process(tmp_path: Path, flags: list[str]) -> EngineProcess:
    port = free_port()
    env = {k: v for k, v in clean_env().items() if k != "EVALSVC_ENGINE_DEFECTS"}
    return EngineProcess(embedded_command(port, ["--random-seed", "0", *flags]), port, env=env,
                         log_path=tmp_path / f"engine-{port}.log", startup_timeout=120)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with engine_process(tmp_path_factory.mktemp("surface"), []) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.base_url, timeout=300) as c:
        yield c


# ---- the release's fields, from its own code --------------------------------------------------


def test_the_engine_has_every_generate_field_of_the_release(surface: dict[str, Any]):
    release = [f["name"] for f in surface["generate_fields"]]
    assert len(release) == 72  # SGLang 0.5.23's GenerateReqInput
    assert sorted(set(release) - set(GenerateReqIn.model_fields)) == [], \
        "GenerateReqInput fields the embedded engine does not know"
    assert sorted(set(GenerateReqIn.model_fields) - set(release)) == [], \
        "request fields the release does not have"


def test_the_engine_has_every_sampling_param_of_the_release(surface: dict[str, Any]):
    release = {f["name"] for f in surface["sampling_fields"]} - SAMPLING_INTERNAL
    assert release == set(SamplingParamsIn.model_fields)


def test_the_engine_knows_every_meta_info_key_of_the_release(surface: dict[str, Any]):
    release = set(surface["meta_info_keys"])
    assert {"num_retractions", "reasoning_tokens", "output_token_logprobs_length"} <= release
    assert sorted(release - set(META_INFO_KEYS)) == [], "meta_info keys the engine does not know"
    assert sorted(set(META_INFO_KEYS) - release) == [], "keys the release does not write"


def test_the_engine_knows_every_openai_request_field_of_the_release(surface: dict[str, Any]):
    dp = {"routed_dp_rank", "data_parallel_rank"}
    for name, model, extra in [("CompletionRequest", CompletionIn, ()),
                               ("ChatCompletionRequest", ChatIn, CHAT_PASSTHROUGH)]:
        known = set(model.model_fields) | set(PASSTHROUGH) | set(extra) | dp
        assert sorted(set(surface["openai_fields"][name]) - known) == [], name


def test_a_request_with_every_field_at_the_release_default_is_served(surface: dict[str, Any],
                                                                     client: httpx.Client):
    body = {f["name"]: f["default"] for f in surface["generate_fields"]
            if "default_repr" not in f}
    body.update(text="def add(a, b):", sampling_params={
        f["name"]: f["default"] for f in surface["sampling_fields"]
        if f["name"] not in SAMPLING_INTERNAL and "default_repr" not in f})
    body["sampling_params"]["max_new_tokens"] = 4
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] == 4
    with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert [line for line in resp.iter_lines() if line][-1] == "data: [DONE]"


def test_every_release_field_the_engine_cannot_honour_is_refused_by_name(surface: dict[str, Any],
                                                                         client: httpx.Client):
    names = [f["name"] for f in surface["generate_fields"] if f["name"] in UNSUPPORTED_FIELDS]
    assert len(names) == len(UNSUPPORTED_FIELDS)
    for name in names:
        resp = client.post("/generate", json={"text": "hi", name: "not-a-default"})
        assert resp.status_code == 400, (name, resp.text)
        assert resp.json()["error"]["message"].startswith(f"{name}: ")


def test_meta_info_has_the_release_keys_it_promises(surface: dict[str, Any],
                                                    client: httpx.Client):
    release = set(surface["meta_info_keys"]) | set(LEGACY_META_INFO_KEYS)
    resp = client.post("/generate", json={
        "text": "def add(a, b):", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 2, "token_ids_logprob": [32]})
    meta = resp.json()["meta_info"]
    assert set(meta) <= release
    promised = {"always", "finished", "first", "logprob", "top_logprobs", "token_ids_logprob"}
    assert {k for k, when in META_INFO_KEYS.items() if when in promised} <= set(meta)


# ---- SGLang's clients, unchanged ---------------------------------------------------------------


def test_the_openai_client_talks_to_the_engine(python: Path, client: httpx.Client,
                                               engine: EngineProcess):
    out = json.loads(run_in_env(python, [str(CLIENTS / "openai_client.py"),
                                         engine.base_url]).stdout)
    served = client.get("/model_info").json()["served_model_name"]
    assert out["models"] == [served]
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    native = client.post("/generate", json={"text": "def add(a, b):\n    return",
                                            "sampling_params": greedy, "return_logprob": True,
                                            "top_logprobs_num": 2}).json()
    comp = out["completion"]
    assert comp["text"] == native["text"] and comp["finish_reason"] == "length"
    assert comp["token_logprobs"] == [e[0] for e in native["meta_info"]["output_token_logprobs"]]
    assert all(len(t) == 2 for t in comp["top_logprobs"])
    assert comp["usage"]["completion_tokens"] == 8
    assert out["completion_stream"]["text"] == native["text"]
    assert 2 <= out["completion_stream"]["chunks"] <= 8  # one per token unless coalesced
    assert out["completion_stream"]["finish_reason"] == "length"
    assert out["completion_stream_usage"]["completion_tokens"] == 8
    chat = out["chat"]
    assert chat["role"] == "assistant" and chat["finish_reason"] == "length"
    assert len(chat["logprobs"]) == 8 and all(n == 2 for *_, n in chat["logprobs"])
    assert chat["usage"]["prompt_tokens"] < 64  # never a cache hit (the comment at the client's CHAT)
    assert out["chat_stream"]["content"] == chat["content"]
    assert out["chat_stream"]["first_role"] == "assistant"
    assert out["chat_stream"]["logprobs"] == [lp for _, _, lp, _ in chat["logprobs"]]
    assert out["chat_stream_finish"] == "length"
    assert out["refused"]["status"] == 400 and "logit_bias" in out["refused"]["message"]


def test_bench_serving_runs_unchanged_against_the_engine(python: Path, engine: EngineProcess,
                                                         tmp_path: Path):
    result = tmp_path / "bench.jsonl"
    prompts, output_len = 16, 32
    run_in_env(python, ["-m", "sglang.bench_serving", "--backend", "sglang", "--host",
                        "127.0.0.1", "--port", str(engine.port), "--dataset-name", "random-ids",
                        "--num-prompts", str(prompts), "--random-input-len", "128",
                        "--random-output-len", str(output_len), "--random-range-ratio", "1",
                        "--seed", "0", "--output-file", str(result)], timeout=900)
    row = json.loads(result.read_text().splitlines()[-1])
    assert row["backend"] == "sglang"
    assert row["completed"] == prompts
    assert row["total_output_tokens"] == prompts * output_len  # ignore_eos: every token came
    assert row["output_throughput"] > 0
    # streamed: the first token came before the whole answer, and tokens came one by one
    assert 0 < row["mean_ttft_ms"] < row["mean_e2e_latency_ms"]
    assert row["mean_itl_ms"] > 0


@pytest.mark.parametrize("chunk", [64, 4096])
def test_multiturn_kl_helpers_pass_with_extra_buffer_and_overlap(python: Path, chunk: int,
                                                                 tmp_path: Path):
    """SGLang's three multi-turn helpers with their Mamba-aware bounds on cached_tokens (a
    prefill hit chunk-aligned, a decode hit at a track-interval multiple), extra_buffer with
    overlap, chunked prefill 64 and 4096; the hits equal a cold replay (float32: KL below 1e-6)."""
    interval = 64
    with engine_process(tmp_path, ["--chunked-prefill-size", str(chunk),
                                   "--mamba-track-interval", str(interval)]) as eng:
        info = httpx.get(eng.base_url + "/server_info", timeout=30).json()
        assert info["mamba_radix_cache_strategy"] == "extra_buffer"
        assert info["disable_overlap_schedule"] is False
        out = json.loads(run_in_env(python, [str(CLIENTS / "multiturn.py"), eng.base_url,
                                             str(info["model"]["vocab_size"]), str(interval),
                                             "1e-6"], timeout=1800).stdout)
    assert out == {"logprobs_match": "pass", "prefill_cache_hit": "pass",
                   "decode_cache_hit": "pass"}
