"""Matrix files: validation, expansion, names and fingerprints."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from evalsvc.matrix import (
    AXES,
    CHUNKED_HIT_MAX_CHUNK,
    ENGINE_FLAGS,
    SCENARIOS,
    TREE_CORE_ENV,
    MatrixError,
    MatrixFile,
    check_extra_args,
    expand,
    iter_points,
    load_matrix,
    make_config,
)

BASE = {"name": "t", "models": {"m": {"path": "hybrid-mamba2-tiny"}},
        "axes": {"strategy": ["no_buffer", "extra_buffer"], "overlap": [True, False]}}


def write(tmp_path, data) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_matrices_load_and_expand():
    smoke = load_matrix("smoke")
    configs = expand(smoke)
    assert len(configs) >= 8
    assert {c.model for c in configs} == {"mamba2", "gdn"}
    full = expand(load_matrix("mamba-full"))
    assert len(full) == 57
    assert not any(c.settings["strategy"] == "no_buffer" and c.settings["overlap"] for c in full)


def test_smoke_covers_every_axis_both_ways():
    configs = expand(load_matrix("smoke"))
    for axis in ("strategy", "overlap", "hicache", "mtp", "radix_cache", "mixed_chunk", "page_size"):
        values = {c.settings[axis] for c in configs if axis != "strategy" or c.settings["radix_cache"]}
        assert len(values) >= 2, f"smoke leaves axis {axis} at {values}"
    chunk = {c.settings["chunked_prefill"] for c in configs}
    assert any(v > 0 for v in chunk) and any(v <= 0 for v in chunk)
    scenarios = {s for c in configs for s in c.scenarios}
    assert scenarios == set(SCENARIOS)


def test_version_conditional_exclusion():
    full = load_matrix("mamba-full")
    new = {c.name for c in expand(full, sglang_version="0.5.23")}
    old = {c.name for c in expand(full, sglang_version="0.5.13")}
    assert old < new
    assert all(("-nb-" in n and n.endswith("mtp-pycore")) or n.endswith("-rustcore")
               or re.search(r"-(pcgfull|ms2|int8ckpt)$|-mtp(-mixed)?$", n) for n in new - old), (
        new - old)
    assert not any(n.endswith("-rustcore") for n in old)  # no Rust tree core before 0.5.19


@pytest.mark.parametrize(("change", "key"), [
    (lambda d: d["axes"].__setitem__("colour", [1]), "colour"),
    (lambda d: d.__setitem__("workloads", {}), "workloads"),
    (lambda d: d["axes"].__setitem__("strategy", ["fast_buffer"]), "fast_buffer"),
    (lambda d: d.__setitem__("exclude", [{"colour": 1}]), "exclude[0].colour"),
    (lambda d: d["models"]["m"].__setitem__("paht", "x"), "paht"),
    (lambda d: d.__setitem__("workload", {"num_prompt": 3}), "num_prompt"),
    (lambda d: d["axes"].__setitem__("model", ["nope"]), "nope"),
    (lambda d: d.__setitem__("exclude", [{"strategy": "no_buffer", "sglang_version": "soon"}]),
     "sglang_version"),
])
def test_bad_matrix_names_file_and_key(tmp_path, change, key):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    change(data)
    path = write(tmp_path, data)
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    assert str(path) in str(err.value) and key in str(err.value)


def test_unknown_matrix_name_lists_known_ones():
    with pytest.raises(MatrixError, match="smoke"):
        load_matrix("no-such-matrix")


def test_fingerprints_are_stable_and_track_what_matters(tmp_path):
    m = load_matrix(write(tmp_path, BASE))
    a = expand(m, workload_version="w1")
    b = expand(m, workload_version="w1")
    assert [c.fingerprint for c in a] == [c.fingerprint for c in b]
    assert len({c.fingerprint for c in a}) == len(a)
    other_workload = expand(m, workload_version="w2")
    assert {c.fingerprint for c in a}.isdisjoint({c.fingerprint for c in other_workload})
    gpu = expand(m, hardware="gpu", workload_version="w1")
    assert {c.fingerprint for c in a}.isdisjoint({c.fingerprint for c in gpu})
    point = {"model": "m", "strategy": "extra_buffer", "overlap": True}
    assert make_config(m, point, workload_version="w1").fingerprint in {c.fingerprint for c in a}


def test_config_args_are_sglang_server_args():
    m = load_matrix("mamba-full")
    cfg = next(c for c in expand(m) if c.settings["hicache"] and c.settings["mtp"])
    assert cfg.args["enable_hierarchical_cache"] is True
    assert cfg.args["hicache_io_backend"] == "direct"
    assert cfg.args["speculative_num_draft_tokens"] == 4
    assert cfg.args["tp_size"] == 4
    assert cfg.settings["chunked_prefill"] == 512  # chunked_hit's largest chunk
    assert set(cfg.scenarios) == {"cold", "prefill_hit", "decode_hit", "branching", "host_tier",
                                  "speculative", "chunked_hit"}
    assert cfg.accept_floor is None  # floors live in evalsvc/configs/thresholds.yaml
    assert set(AXES) >= set(cfg.settings)


def test_expand_is_linear_in_its_points():
    """20,000 include entries, each twice: one config each, in time linear in the entries (a list
    membership test per entry took about a minute here)."""
    n = 20_000
    m = MatrixFile.model_validate({**BASE, "axes": {}, "include": [
        {"model": "m", "chunked_prefill": i} for i in range(1, n + 1)] * 2})
    t0 = time.monotonic()
    configs = expand(m)
    assert len(configs) == n and len({c.name for c in configs}) == n
    assert time.monotonic() - t0 < 20


def test_strings_name_matrices_and_paths_need_the_caller_to_allow_them(tmp_path):
    path = write(tmp_path, BASE)
    with pytest.raises(MatrixError, match="by name"):
        load_matrix(str(path))
    assert load_matrix(str(path), allow_path=True).name == "t"
    assert load_matrix(path).name == "t"  # a Path is the operator's own code
    with pytest.raises(MatrixError):
        load_matrix("../configs/smoke")


def test_a_file_that_is_no_matrix_is_named_but_not_shown(tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"password": "hunter2", "history": {"window": 3}}))
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    assert "not a matrix file" in str(err.value)
    assert "password" not in str(err.value) and "history" not in str(err.value)
    with pytest.raises(MatrixError) as err:
        load_matrix("thresholds")
    assert "not a matrix file" in str(err.value) and "rules" not in str(err.value)


def test_mixed_chunk_and_page_size_axes():
    m = MatrixFile.model_validate({**BASE, "axes": {**BASE["axes"], "mixed_chunk": [False, True],
                                                    "page_size": [None, 16]}})
    configs = {c.name: c for c in expand(m)}
    assert len(configs) == 16
    cfg = configs["m-eb-sync-mixed-p16"]
    assert cfg.args["enable_mixed_chunk"] is True and cfg.args["page_size"] == 16
    assert "mixed_hit" in cfg.scenarios
    plain = configs["m-eb-sync"]
    assert "enable_mixed_chunk" not in plain.args and "page_size" not in plain.args
    assert "mixed_hit" not in plain.scenarios
    # configs without the new axes keep the arguments, and so the fingerprints, they had
    assert plain.settings["mixed_chunk"] is False and plain.settings["page_size"] is None
    smoke = {c.name for c in expand(load_matrix("smoke"))}
    assert "mamba2-eb-sync-c128-mixed-p16" in smoke and "mamba2-eb-ov-c64" in smoke


@pytest.mark.parametrize(("entry", "key"), [
    ({"page_size": 0}, "include[0].page_size"),
    ({"page_size": "16"}, "include[0].page_size"),
    ({"page_size": True}, "include[0].page_size"),
    ({"mixed_chunk": "yes"}, "include[0].mixed_chunk"),
])
def test_mixed_chunk_and_page_size_values_are_checked(entry, key):
    with pytest.raises(ValidationError, match=re.escape(key)):
        MatrixFile.model_validate({**BASE, "include": [entry]})


def test_page_size_is_set_by_its_axis_or_extra_args_not_both():
    with pytest.raises(ValidationError, match=re.escape("extra_args.page_size")):
        MatrixFile.model_validate({**BASE, "extra_args": {"page_size": 16},
                                   "include": [{"page_size": 32}]})
    m = MatrixFile.model_validate({**BASE, "extra_args": {"page_size": 16}})
    assert all(c.args["page_size"] == 16 for c in expand(m))


@pytest.mark.parametrize(("section", "entry", "key"), [
    ("include", {"model": "nope"}, "include[0].model"),
    ("include", {"strategy": "fast"}, "include[0].strategy"),
    ("include", {"overlap": 1}, "include[0].overlap"),
    ("include", {"strategy": {"a": 1}}, "include[0].strategy"),
    ("exclude", {"chunked_prefill": "64"}, "exclude[0].chunked_prefill"),
    ("exclude", {"colour": 1}, "exclude[0].colour"),
])
def test_include_and_exclude_entries_are_checked_like_axes(section, entry, key):
    with pytest.raises(ValidationError, match=re.escape(key)):
        MatrixFile.model_validate({**BASE, section: [entry]})


def test_a_matrix_needs_configs_and_safe_names():
    for data in ({**BASE, "axes": {}}, {**BASE, "models": {}}, {**BASE, "name": "../x"},
                 {**BASE, "models": {"a/b": {"path": "hybrid-mamba2-tiny"}}}):
        with pytest.raises(ValidationError):
            MatrixFile.model_validate(data)


def test_shipped_matrices_keep_to_the_engine_flag_allowlist():
    for name in ("smoke", "mamba-full", "sglang-cpu"):
        m = load_matrix(name)
        m.check_engine_flags()
        assert set(m.extra_args) <= ENGINE_FLAGS[m.engine]
    with pytest.raises(ValueError, match=r"extra_args\.host"):
        check_extra_args({"host": "0.0.0.0"}, "sglang")


def test_engine_env_keeps_to_its_allowlist_and_makes_its_own_fingerprint():
    cpu = MatrixFile.model_validate({**BASE, "engine": "sglang",
                                     "engine_env": {"SGLANG_USE_CPU_ENGINE": "1"}})
    cpu.check_engine_flags()
    plain = MatrixFile.model_validate({**BASE, "engine": "sglang"})
    assert ({c.name for c in expand(cpu)} == {c.name for c in expand(plain)}
            and {c.fingerprint for c in expand(cpu)}.isdisjoint(c.fingerprint for c in expand(plain)))
    for env, problem in [({"LD_PRELOAD": "/tmp/x.so"}, r"engine_env\.LD_PRELOAD: not a variable"),
                         ({"SGLANG_USE_CPU_ENGINE": "1; rm -rf /"}, "not a plain value")]:
        bad = MatrixFile.model_validate({**BASE, "engine": "sglang", "engine_env": env})
        with pytest.raises(ValueError, match=problem):
            bad.check_engine_flags()
    with pytest.raises(ValueError, match=r"engine_env\.SGLANG_USE_CPU_ENGINE"):
        cpu.check_engine_flags("embedded")


def test_the_inkling_engines_variables_take_only_their_one_value_and_multi_layer_mtp_is_sglangs():
    """Triton's interpreter and the environment's model package are each one value; a matrix's
    ``mtp.multi_layer`` is SGLang's multi-layer EAGLE worker flag, set on its MTP configs only."""
    env = {"TRITON_INTERPRET": "1", "SGLANG_EXTERNAL_MODEL_PACKAGE": "evalsvc_sglang_models"}
    MatrixFile.model_validate({**BASE, "engine": "sglang", "engine_env": env}).check_engine_flags()
    for name, value in [("TRITON_INTERPRET", "0"), ("SGLANG_EXTERNAL_MODEL_PACKAGE", "os")]:
        bad = MatrixFile.model_validate({**BASE, "engine": "sglang",
                                         "engine_env": {**env, name: value}})
        with pytest.raises(ValueError, match=rf"engine_env\.{name}: .* not in"):
            bad.check_engine_flags()
    m = MatrixFile.model_validate({**BASE, "engine": "sglang", "axes": {"mtp": [False, True]},
                                   "mtp": {"num_steps": 1, "multi_layer": True}})
    args = {c.settings["mtp"]: c.args for c in expand(m)}
    assert args[True]["enable_multi_layer_eagle"] is True
    assert "enable_multi_layer_eagle" not in args[False]
    with pytest.raises(ValueError, match=r"mtp\.multi_layer: .*engine: sglang"):
        MatrixFile.model_validate({**BASE, "mtp": {"multi_layer": True}})


def test_exclude_entries_match_as_before_and_in_linear_time():
    m = MatrixFile.model_validate({**BASE, "axes": {
        "strategy": ["no_buffer", "extra_buffer"], "overlap": [True, False],
        "chunked_prefill": [None, 64, -1]}, "exclude": [
        {"strategy": "no_buffer", "overlap": True}, {"chunked_prefill": -1, "overlap": False},
        {"chunked_prefill": None, "strategy": "extra_buffer", "overlap": True},
        {"hicache": True}, {"strategy": "extra_buffer", "sglang_version": "<0.5.14"}]})
    names = {c.name for c in expand(m)}
    assert names == {"m-nb-sync", "m-nb-sync-c64", "m-eb-ov-c64", "m-eb-ov-nochunk",
                     "m-eb-sync", "m-eb-sync-c64"}
    assert {c.name for c in expand(m, sglang_version="0.5.13")} == {"m-nb-sync", "m-nb-sync-c64"}
    # 1,000 points against 3,000 entries: a set lookup per point, not a comparison per entry (about
    # 18 s here when every point was compared with every entry)
    big = MatrixFile.model_validate({**BASE, "axes": {"chunked_prefill": list(range(1, 1001))},
                                     "exclude": [{"chunked_prefill": -i} for i in range(3000)]
                                     + [{"chunked_prefill": 7}]})
    t0 = time.monotonic()
    configs = expand(big)
    assert len(configs) == 999 and "m-auto-ov-c7" not in {c.name for c in configs}
    assert time.monotonic() - t0 < 8


def test_radix_tree_core_axis_sets_the_engine_variable_names_and_fingerprints():
    m = MatrixFile.model_validate({**BASE, "engine": "sglang", "axes": {
        "strategy": ["extra_buffer"], "radix_tree_core": [None, "python", "rust"]}})
    m.check_engine_flags()
    by_core = {c.settings["radix_tree_core"]: c for c in expand(m, hardware="gpu")}
    assert {k: c.name for k, c in by_core.items()} == {
        None: "m-eb-ov", "python": "m-eb-ov-pycore", "rust": "m-eb-ov-rustcore"}
    assert by_core[None].env == {} and by_core[None].tree_core is None
    assert by_core["rust"].env == {TREE_CORE_ENV: "rust"} and by_core["rust"].tree_core == "rust"
    assert len({c.fingerprint for c in by_core.values()}) == 3
    assert all(c.args == by_core[None].args for c in by_core.values())  # no flag: an env variable
    # asking by engine_env is the same config as asking by the axis
    env = MatrixFile.model_validate({**BASE, "engine": "sglang", "axes": {
        "strategy": ["extra_buffer"]}, "engine_env": {TREE_CORE_ENV: "rust"}})
    env.check_engine_flags()
    assert expand(env, hardware="gpu")[0].fingerprint == by_core["rust"].fingerprint
    # the plain config's fingerprint is what it was before the axis existed
    plain = MatrixFile.model_validate({**BASE, "engine": "sglang", "axes": {
        "strategy": ["extra_buffer"]}})
    assert expand(plain, hardware="gpu")[0].fingerprint == by_core[None].fingerprint


def test_radix_tree_core_values_are_python_or_rust_only():
    with pytest.raises(ValidationError, match=r"radix_tree_core.*'cpp' not in \['python', 'rust'\]"):
        MatrixFile.model_validate({**BASE, "axes": {"radix_tree_core": ["cpp"]}})
    for engine in ("sglang", "embedded"):
        bad = MatrixFile.model_validate({**BASE, "engine": engine,
                                         "engine_env": {TREE_CORE_ENV: "cpp"}})
        with pytest.raises(ValueError, match=rf"engine_env\.{TREE_CORE_ENV}: 'cpp' not in "
                                             r"\['python', 'rust'\]"):
            bad.check_engine_flags()
    with pytest.raises(ValidationError, match=rf"engine_env\.{TREE_CORE_ENV}: the radix_tree_core "
                                              "axis sets it per config"):
        MatrixFile.model_validate({**BASE, "engine_env": {TREE_CORE_ENV: "rust"},
                                   "include": [{"radix_tree_core": "python"}]})


def test_include_entries_list_values_and_excludes_apply_to_them():
    m = MatrixFile.model_validate({**BASE, "axes": {}, "include": [
        {"strategy": ["no_buffer", "extra_buffer"], "overlap": [True, False], "hicache": True},
        {"strategy": "extra_buffer", "overlap": True, "hicache": True}],  # the same point again
        "exclude": [{"strategy": "no_buffer", "overlap": True, "reason": "refused"},
                    {"strategy": ["extra_buffer"], "overlap": False, "sglang_version": "<0.5.14",
                     "reason": "refused before 0.5.14"}]})
    assert [c.name for c in expand(m)] == ["m-nb-sync-hicache", "m-eb-ov-hicache",
                                           "m-eb-sync-hicache"]
    assert [c.name for c in expand(m, sglang_version="0.5.13")] == ["m-nb-sync-hicache",
                                                                    "m-eb-ov-hicache"]
    dropped = [(p["strategy"], p["overlap"], [e["reason"] for e in entries])
               for p, entries in iter_points(m, "0.5.13") if entries]
    assert dropped == [("no_buffer", True, ["refused"]),
                       ("extra_buffer", False, ["refused before 0.5.14"])]
    for entry, problem in [({"include": [{"strategy": []}]}, r"include\[0\]\.strategy: an empty"),
                           ({"include": [{"strategy": ["fast"]}]}, r"include\[0\]\.strategy"),
                           ({"include": [{"reason": "x"}]}, r"include\[0\]\.reason: unknown"),
                           ({"exclude": [{"hicache": True, "reason": ""}]},
                            r"exclude\[0\]\.reason: a reason is a text")]:
        with pytest.raises(ValidationError, match=problem):
            MatrixFile.model_validate({**BASE, **entry})


def test_the_2026_axes_are_sglang_server_args_and_name_their_configs():
    m = load_matrix("mamba-full")
    args = {c.name: c.args for c in expand(m, sglang_version="0.5.23")}
    assert args["qwen3-next-eb-ov-c512-mtp-mixed"]["enable_mixed_chunk"] is True
    assert args["qwen3-next-ebl-ov-c512"]["mamba_radix_cache_strategy"] == "extra_buffer_lazy"
    assert args["qwen3-next-eb-ov-c512-pcgfull"]["cuda_graph_backend_prefill"] == "full"
    assert args["qwen3-next-eb-ov-c512-ms2"]["mamba_max_states_per_path"] == 2
    assert args["qwen3-next-eb-ov-c512-int8ckpt"]["enable_int8_mamba_checkpoint"] is True
    paged = args["qwen3-next-eb-sync-c512-p64-t128"]
    assert (paged["page_size"], paged["mamba_track_interval"]) == (64, 128)
    # refused combinations stay out: int8 checkpoints with HiCache, no_buffer with pages
    assert "qwen3-next-eb-ov-c512-hicache-int8ckpt" not in args
    assert "qwen3-next-nb-sync-c512-p64-t128" not in args
    assert all(e.get("reason") for e in m.exclude)
    # a config that sets none of them keeps the fingerprint it had
    plain = MatrixFile.model_validate({**BASE, "axes": {"strategy": ["extra_buffer"]}})
    point = {"model": "m", "strategy": "extra_buffer", "mixed_chunk": False, "page_size": None,
             "prefill_cuda_graph": None, "int8_mamba_checkpoint": False}
    assert make_config(plain, point).fingerprint == expand(plain)[0].fingerprint
    for axis, value in [("page_size", 0), ("track_interval", "x"), ("prefill_cuda_graph", "eager"),
                        ("mamba_max_states_per_path", -1), ("mixed_chunk", "yes")]:
        with pytest.raises(ValidationError, match=axis):
            MatrixFile.model_validate({**BASE, "include": [{axis: value}]})


def test_chunked_hit_applies_where_a_hits_prefill_can_be_split():
    """chunked_hit needs the radix cache and a chunk size it can exceed with the workload's
    prompts: 1 to CHUNKED_HIT_MAX_CHUNK tokens."""
    m = MatrixFile.model_validate({**BASE, "axes": {**BASE["axes"], "radix_cache": [True, False],
                                                    "chunked_prefill": [None, -1, 64, 512, 4096]}})
    got = {(c.settings["radix_cache"], c.settings["chunked_prefill"]) for c in expand(m)
           if "chunked_hit" in c.scenarios}
    assert got == {(True, 64), (True, CHUNKED_HIT_MAX_CHUNK)} and CHUNKED_HIT_MAX_CHUNK == 512
