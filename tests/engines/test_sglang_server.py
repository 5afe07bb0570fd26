"""Command lines, payloads and response parsers for SGLang's API (no server needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from evalsvc.engines.sglang_server import (
    ResponseError,
    build_command,
    build_flags,
    build_generate_payload,
    build_reference_payload,
    flag_name,
    parse_completion,
    parse_server_info,
    parse_spec_counters,
    parse_tree_core,
    parse_version,
    resolved_mismatches,
    tree_core_mismatch,
)
from evalsvc.metrics import sglang_accept_length, sglang_accept_rate

DATA = Path(__file__).resolve().parent.parent / "data" / "sglang" / "responses"


def load(name: str):
    return json.loads((DATA / name).read_text())


def test_versions_parse_including_dev_builds():
    assert parse_version("0.5.23") == (0, 5, 23)
    assert parse_version("0.5.8.dev20260129+gf959851eb") == (0, 5, 8)
    assert parse_version(None) > parse_version("99.0")


@pytest.mark.parametrize(("version", "flag"), [
    ("0.5.13", "--mamba-scheduler-strategy"), ("0.5.14", "--mamba-scheduler-strategy"),
    ("0.5.15", "--mamba-radix-cache-strategy"), ("0.5.23", "--mamba-radix-cache-strategy"),
    (None, "--mamba-radix-cache-strategy")])
def test_strategy_flag_is_spelled_for_the_release(version, flag):
    assert flag_name("mamba_radix_cache_strategy", version) == flag
    assert flag_name("chunked_prefill_size", version) == "--chunked-prefill-size"


def test_command_is_an_argument_list_with_booleans_as_switches():
    args = {"model_path": "org/model", "mamba_radix_cache_strategy": "extra_buffer",
            "disable_overlap_schedule": True, "enable_hierarchical_cache": False,
            "chunked_prefill_size": 512, "hicache_ratio": 4.0, "speculative_algorithm": None}
    argv = build_command(args, port=31000, python="/env/bin/python", version="0.5.23")
    assert argv[:9] == ["/env/bin/python", "-m", "sglang.launch_server", "--model-path", "org/model",
                        "--host", "127.0.0.1", "--port", "31000"]
    rest = argv[9:]
    assert "--disable-overlap-schedule" in rest
    assert "--enable-hierarchical-cache" not in rest  # False: left out
    assert "--speculative-algorithm" not in rest  # None: left out
    assert rest[rest.index("--chunked-prefill-size") + 1] == "512"
    assert rest[rest.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    old = build_flags({"mamba_radix_cache_strategy": "no_buffer"}, "0.5.13")
    assert old == ["--mamba-scheduler-strategy", "no_buffer"]


def test_generate_and_reference_payloads():
    gen = build_generate_payload([1, 2, 3], max_new_tokens=8, temperature=1.0, seed=7,
                                 top_logprobs_num=5)
    assert gen == {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": -1,
                   "top_logprobs_num": 5,
                   "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                                       "sampling_seed": 7}}
    ref = build_reference_payload([1, 2, 3], [4, 5])
    assert ref["input_ids"] == [1, 2, 3, 4, 5]
    assert ref["sampling_params"]["max_new_tokens"] == 0
    assert ref["logprob_start_len"] == 0


def test_parse_newest_response_with_speculative_counters():
    c = parse_completion(load("generate_v0.5.23_spec.json"), draft_tokens=4)
    assert c.token_ids == [471, 257, 489, 293]
    assert c.logprobs == [-0.31, -1.25, -0.02, -0.9]
    assert c.input_logprobs[0] is None and c.input_logprobs[1] == -3.1
    assert (c.prompt_tokens, c.cached_tokens, c.host_cached_tokens) == (6, 3, 0)
    s = c.spec
    assert (s.verify_ct, s.correct_drafts, s.proposed_drafts) == (2, 2, 6)
    assert s.histogram == [1, 0, 1, 0]
    assert sglang_accept_length([s]) == 2.0  # the server's own spec_accept_length
    assert sglang_accept_rate([s]) == pytest.approx(1 / 3)


def test_parse_release_with_alias_names_and_top_logprobs():
    resp = load("generate_v0.5.13_spec.json")
    c = parse_completion(resp)
    assert c.spec.correct_drafts == 3 and c.spec.proposed_drafts == 9
    assert c.spec.histogram == [1, 1, 0, 1]
    assert c.top.positions[1] == [(257, -1.25), (88, -0.4)]
    assert sglang_accept_length([c.spec]) == pytest.approx(resp["meta_info"]["spec_accept_length"])
    # only the aliases present: the same counters
    meta = dict(resp["meta_info"])
    for k in ("spec_num_correct_drafts", "spec_num_proposed_drafts",
              "spec_correct_drafts_histogram"):
        meta.pop(k)
    assert parse_spec_counters(meta) == c.spec


def test_parse_oldest_spec_names():
    resp = load("generate_old_spec.json")
    c = parse_completion(resp)
    assert (c.spec.verify_ct, c.spec.correct_drafts, c.spec.proposed_drafts) == (2, 1, 6)
    assert sglang_accept_rate([c.spec]) == pytest.approx(resp["meta_info"]["spec_accept_rate"])
    assert sglang_accept_length([c.spec]) == pytest.approx(resp["meta_info"]["spec_accept_length"])


def test_parse_batch_items_and_host_hits():
    items = [parse_completion(x) for x in load("generate_batch_v0.5.23.json")]
    assert [c.token_ids for c in items] == [[120], [121]]
    assert items[1].host_cached_tokens == 1
    assert items[0].spec is None


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda m: m["output_token_logprobs"][1].__setitem__(0, math.nan), "output_token_logprobs[1]"),
    (lambda m: m["output_token_logprobs"][0].__setitem__(0, None), "output_token_logprobs[0]"),
    (lambda m: m.__setitem__("output_token_logprobs", {"bad": 1}), "expected a list"),
    (lambda m: m["output_token_logprobs"].__setitem__(2, [0.5]), "output_token_logprobs[2]"),
    (lambda m: m["output_token_logprobs"][3].__setitem__(1, "x"), "token id"),
    (lambda m: m["input_token_logprobs"][2].__setitem__(0, math.inf), "input_token_logprobs[2]"),
])
def test_bad_logprobs_are_refused_naming_the_field(mutate, message):
    resp = load("generate_v0.5.23_spec.json")
    mutate(resp["meta_info"])
    with pytest.raises(ResponseError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_completion(resp)


def test_response_without_meta_info_is_refused():
    with pytest.raises(ResponseError, match="meta_info"):
        parse_completion({"text": "x"})


def test_server_info_of_either_generation():
    new = parse_server_info(load("server_info_v0.5.23.json"))
    assert new["mamba_radix_cache_strategy"] == "extra_buffer"
    assert new["avg_spec_accept_length"] == 2.91
    old = parse_server_info(load("get_server_info_v0.5.13.json"))
    assert old["mamba_radix_cache_strategy"] == "no_buffer"
    assert old["avg_spec_accept_length"] is None


def test_resolved_mismatches():
    asked = {"model_path": "m", "mamba_radix_cache_strategy": "extra_buffer",
             "chunked_prefill_size": 512, "speculative_algorithm": "NEXTN"}
    ran = {"mamba_radix_cache_strategy": "extra_buffer", "chunked_prefill_size": 512,
           "speculative_algorithm": "EAGLE", "disable_overlap_schedule": False}
    assert resolved_mismatches(asked, ran) == []
    ran_other = dict(ran, mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True)
    problems = resolved_mismatches(asked, ran_other)
    assert any("mamba_radix_cache_strategy" in p for p in problems)
    assert any("overlap" in p for p in problems)
    # auto may resolve to anything
    assert resolved_mismatches({"mamba_radix_cache_strategy": "auto"},
                               {"mamba_radix_cache_strategy": "no_buffer"}) == []


# ---- the radix-tree core, read from the engine's log ---------------------------------------------

# SGLang's own lines: ``logger.info("Using the Python TreeCore: %s", reason)`` in
# ``mem_cache/unified_cache/tree_core_registry.py`` (0.5.21 to 0.5.23), with the reasons of
# ``_rust_fallback_reason`` there, under SGLang's log format ``[%(asctime)s TP<rank>] %(message)s``.
FALLBACK_LINES = {
    "[2026-12-05 13:00:00 TP0] Using the Python TreeCore: this installation contains neither the "
    "Rust TreeCore extension nor its sources":
        "this installation contains neither the Rust TreeCore extension nor its sources",
    "[2026-12-05 13:00:00.123 TP3] Using the Python TreeCore: PyTorch 2.9.1+cu128 is outside the "
    "Rust TreeCore support range": "PyTorch 2.9.1+cu128 is outside the Rust TreeCore support range",
    "[2026-12-05 13:00:00] Using the Python TreeCore: session-aware caching requires the Python "
    "TreeCore": "session-aware caching requires the Python TreeCore",
}
START = "[2026-12-05 12:59:58] server_args=ServerArgs(model_path='Qwen/Qwen3-Next-80B-A3B')\n"


@pytest.mark.parametrize("line", sorted(FALLBACK_LINES))
def test_tree_core_fallback_read_from_sglangs_log_line(line):
    log = START + line + "\n[2026-12-05 13:00:01 TP0] Load weight end.\n"
    for asked in ("rust", None):
        assert parse_tree_core(log, asked=asked, version="0.5.23") == {
            "radix_tree_core": "python", "radix_tree_core_fallback": FALLBACK_LINES[line]}
    mismatch = tree_core_mismatch("rust", parse_tree_core(log, asked="rust", version="0.5.22"))
    assert mismatch.startswith("radix_tree_core: asked 'rust', server runs 'python' (Using the "
                               "Python TreeCore: ") and FALLBACK_LINES[line] in mismatch


@pytest.mark.parametrize(("version", "asked", "core"), [
    ("0.5.23", None, "rust"), ("0.5.21", "rust", "rust"), ("0.5.23", "python", "python"),
    ("0.5.20", None, "python"), ("0.5.19", "rust", "rust"), ("0.5.19", "python", "python"),
    ("0.5.18", None, "python"), ("0.5.13", None, "python"),
])
def test_tree_core_without_a_fallback_line_is_the_asked_or_the_releases_default(version, asked,
                                                                                  core):
    found = parse_tree_core(START, asked=asked, version=version)
    assert found == {"radix_tree_core": core, "radix_tree_core_fallback": None}
    assert tree_core_mismatch(asked, found) is None


def test_rust_asked_of_a_release_without_it_runs_python():
    found = parse_tree_core(START, asked="rust", version="0.5.13")
    assert found["radix_tree_core"] == "python" and "0.5.19" in found["radix_tree_core_fallback"]
    assert tree_core_mismatch("rust", found).startswith(
        "radix_tree_core: asked 'rust', server runs 'python'")
    embedded = parse_tree_core("", asked="rust", version="0.1.0+evalsvc.embedded", embedded=True)
    assert embedded["radix_tree_core"] == "python"


def test_tree_core_unknown_without_a_log_where_sglang_could_fall_back():
    assert parse_tree_core(None, asked="rust", version="0.5.23")["radix_tree_core"] is None
    assert parse_tree_core(None, asked=None, version="0.5.23")["radix_tree_core"] is None
    assert parse_tree_core(None, asked="python", version="0.5.23")["radix_tree_core"] == "python"
    assert parse_tree_core(None, asked="rust", version="0.5.20")["radix_tree_core"] == "rust"
    problem = tree_core_mismatch("rust", {"radix_tree_core": None}, "the engine has no log")
    assert problem == ("radix_tree_core: asked 'rust', and which core the server runs cannot be "
                       "told (the engine has no log)")
