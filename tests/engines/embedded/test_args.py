"""Flag parsing and resolution of the embedded engine (evalsvc/engines/embedded/args.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalsvc.engines.embedded.args import (
    ArgError,
    EngineArgs,
    build_parser,
    parse_args,
    resolve,
)
from evalsvc.engines.embedded.defects import ENV_VAR, Defect
from evalsvc.engines.sglang_server import TREE_CORE_ENV
from evalsvc.paths import MODELS_DIR

MAMBA2 = (MODELS_DIR / "hybrid-mamba2-tiny").resolve()
GDN = (MODELS_DIR / "hybrid-gdn-tiny").resolve()


def res(*argv: str, env: dict[str, str] | None = None) -> EngineArgs:
    """Parse and resolve without exiting (ArgError propagates)."""
    return resolve(build_parser().parse_args(list(argv)), env={} if env is None else env)


def refused(capsys, *argv: str, env: dict[str, str] | None = None) -> str:
    """parse_args must exit with code 2; returns what it wrote to stderr."""
    with pytest.raises(SystemExit) as exc:
        parse_args(list(argv), env={} if env is None else env)
    assert exc.value.code == 2
    return capsys.readouterr().err


def has_warning(args: EngineArgs, text: str) -> bool:
    return any(text in w for w in args.warnings)


# ---- model path ------------------------------------------------------------------------------
def test_default_model_is_the_shipped_mamba2_model():
    args = res()
    assert Path(args.model_path).resolve() == MAMBA2
    assert (Path(args.model_path) / "config.json").is_file()


def test_shipped_model_by_name():
    args = res("--model-path", "hybrid-gdn-tiny")
    assert Path(args.model_path).resolve() == GDN


def test_model_directory_by_path():
    args = res("--model-path", str(GDN))
    assert Path(args.model_path) == GDN


def test_nonexistent_model_path_refused(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    err = refused(capsys, "--model-path", str(missing))
    assert "--model-path" in err
    assert str(missing) in err


def test_model_directory_without_config_refused(capsys, tmp_path):
    err = refused(capsys, "--model-path", str(tmp_path))
    assert "--model-path" in err and "config.json" in err


# ---- Mamba radix-cache strategy ------------------------------------------------------------------
def test_auto_resolves_to_extra_buffer_with_overlap():
    args = res()
    assert args.mamba_radix_cache_strategy == "extra_buffer"
    assert args.disable_overlap_schedule is False


def test_auto_resolves_to_no_buffer_without_overlap():
    args = res("--disable-overlap-schedule")
    assert args.mamba_radix_cache_strategy == "no_buffer"
    assert args.disable_overlap_schedule is True


def test_explicit_auto_is_resolved_too():
    assert res("--mamba-radix-cache-strategy", "auto").mamba_radix_cache_strategy == "extra_buffer"


def test_no_buffer_needs_disable_overlap_schedule(capsys):
    err = refused(capsys, "--mamba-radix-cache-strategy", "no_buffer")
    assert "--mamba-radix-cache-strategy" in err
    assert "--disable-overlap-schedule" in err
    args = res("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule")
    assert args.mamba_radix_cache_strategy == "no_buffer"


def test_extra_buffer_lazy_refused(capsys):
    err = refused(capsys, "--mamba-radix-cache-strategy", "extra_buffer_lazy")
    assert "extra_buffer_lazy" in err


def test_unknown_strategy_refused(capsys):
    err = refused(capsys, "--mamba-radix-cache-strategy", "lazy")
    assert "--mamba-radix-cache-strategy" in err


def test_deprecated_alias_sets_strategy_and_warns():
    args = res("--mamba-scheduler-strategy", "no_buffer", "--disable-overlap-schedule")
    assert args.mamba_radix_cache_strategy == "no_buffer"
    assert has_warning(args, "--mamba-scheduler-strategy is deprecated")


def test_deprecated_alias_agreeing_with_new_flag_is_accepted():
    args = res("--mamba-scheduler-strategy", "extra_buffer",
               "--mamba-radix-cache-strategy", "extra_buffer")
    assert args.mamba_radix_cache_strategy == "extra_buffer"
    assert has_warning(args, "deprecated")


def test_deprecated_alias_conflicting_with_new_flag_refused(capsys):
    err = refused(capsys, "--mamba-scheduler-strategy", "no_buffer",
                  "--mamba-radix-cache-strategy", "extra_buffer", "--disable-overlap-schedule")
    assert "--mamba-scheduler-strategy no_buffer" in err
    assert "--mamba-radix-cache-strategy extra_buffer" in err


def test_disable_radix_cache_leaves_strategy_unresolved():
    args = res("--disable-radix-cache")
    assert args.mamba_radix_cache_strategy == "auto"
    assert args.disable_overlap_schedule is False
    # no_buffer without --disable-overlap-schedule is not checked either: there is no tree
    args = res("--disable-radix-cache", "--mamba-radix-cache-strategy", "no_buffer")
    assert args.mamba_radix_cache_strategy == "no_buffer"


# ---- speculative decoding ---------------------------------------------------------------------
def test_nextn_resolves_to_eagle_defaults():
    args = res("--speculative-algorithm", "NEXTN")
    assert args.speculative_algorithm == "EAGLE"
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (3, 1, 4)
    assert args.max_running_requests == 48
    assert has_warning(args, "Max running requests is reset to 48")
    assert args.disable_overlap_schedule is True
    assert has_warning(args, "Overlap schedule is not implemented")
    # the strategy was resolved before speculative decoding turned the overlap scheduler off
    assert args.mamba_radix_cache_strategy == "extra_buffer"


def test_algorithm_name_is_case_insensitive():
    assert res("--speculative-algorithm", "nextn").speculative_algorithm == "EAGLE"


def test_explicit_max_running_requests_kept_with_speculative():
    args = res("--speculative-algorithm", "NEXTN", "--max-running-requests", "8")
    assert args.max_running_requests == 8
    assert not has_warning(args, "Max running requests")


def test_explicit_num_steps_gives_draft_tokens_steps_plus_one():
    args = res("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2")
    assert args.speculative_num_steps == 2
    assert args.speculative_eagle_topk == 1
    assert args.speculative_num_draft_tokens == 3


def test_consistent_draft_tokens_kept_without_warning():
    args = res("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
               "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3")
    assert args.speculative_num_draft_tokens == 3
    assert not has_warning(args, "speculative_num_draft_tokens is adjusted")


def test_inconsistent_draft_tokens_adjusted_with_warning():
    args = res("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
               "--speculative-num-draft-tokens", "5")
    assert args.speculative_num_draft_tokens == 3
    assert has_warning(args, "speculative_num_draft_tokens is adjusted")


def test_topk_two_refused(capsys):
    err = refused(capsys, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
                  "--speculative-eagle-topk", "2")
    assert "--speculative-eagle-topk 2" in err


def test_eagle3_refused(capsys):
    err = refused(capsys, "--speculative-algorithm", "EAGLE3")
    assert "--speculative-algorithm EAGLE3" in err


def test_unknown_algorithm_refused(capsys):
    err = refused(capsys, "--speculative-algorithm", "MEDUSA")
    assert "--speculative-algorithm" in err


def test_topk_without_num_steps_refused(capsys):
    err = refused(capsys, "--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "1")
    assert "--speculative-eagle-topk" in err
    assert "--speculative-num-steps" in err


def test_speculative_flags_without_algorithm_refused(capsys):
    err = refused(capsys, "--speculative-num-steps", "3")
    assert "--speculative-algorithm" in err


def test_zero_num_steps_refused(capsys):
    err = refused(capsys, "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "0")
    assert "--speculative-num-steps 0" in err


def test_no_speculative_default_max_running_requests():
    args = res()
    assert args.speculative_algorithm is None
    assert args.max_running_requests == 64


# ---- --mamba-track-interval ----------------------------------------------------------------------
def test_track_interval_below_chunk_refused_for_mamba2(capsys):
    err = refused(capsys, "--mamba-radix-cache-strategy", "extra_buffer",
                  "--mamba-track-interval", "32")
    assert "--mamba-track-interval 32" in err
    assert "64" in err


def test_track_interval_below_chunk_refused_for_mamba2_via_auto(capsys):
    err = refused(capsys, "--mamba-track-interval", "32")
    assert "--mamba-track-interval 32" in err


def test_track_interval_64_accepted_for_mamba2():
    assert res("--mamba-track-interval", "64").mamba_track_interval == 64


def test_track_interval_below_chunk_accepted_for_gdn():
    args = res("--model-path", "hybrid-gdn-tiny", "--mamba-radix-cache-strategy", "extra_buffer",
               "--mamba-track-interval", "32")
    assert args.mamba_radix_cache_strategy == "extra_buffer"
    assert args.mamba_track_interval == 32


def test_track_interval_small_accepted_for_mamba2_with_no_buffer():
    args = res("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
               "--mamba-track-interval", "32")
    assert args.mamba_track_interval == 32


def test_track_interval_below_draft_tokens_refused_under_extra_buffer(capsys):
    err = refused(capsys, "--model-path", "hybrid-gdn-tiny", "--mamba-track-interval", "2",
                  "--speculative-algorithm", "NEXTN")
    assert "--mamba-track-interval 2" in err
    assert "--speculative-num-draft-tokens 4" in err
    # the same interval with no_buffer is fine
    args = res("--model-path", "hybrid-gdn-tiny", "--mamba-track-interval", "2",
               "--speculative-algorithm", "NEXTN", "--mamba-radix-cache-strategy", "no_buffer",
               "--disable-overlap-schedule")
    assert args.speculative_num_draft_tokens == 4


def test_track_interval_equal_to_draft_tokens_accepted():
    args = res("--model-path", "hybrid-gdn-tiny", "--mamba-track-interval", "4",
               "--speculative-algorithm", "NEXTN")
    assert args.mamba_track_interval == 4


def test_non_positive_track_interval_refused(capsys):
    err = refused(capsys, "--mamba-track-interval", "0")
    assert "--mamba-track-interval 0" in err


# ---- HiCache ---------------------------------------------------------------------------------
def test_hicache_with_disable_radix_cache_refused_with_sglang_message(capsys):
    err = refused(capsys, "--enable-hierarchical-cache", "--disable-radix-cache")
    assert ("The arguments enable-hierarchical-cache and disable-radix-cache are mutually "
            "exclusive and cannot be used at the same time. Please use only one of them.") in err


def test_hicache_ratio_default():
    args = res("--enable-hierarchical-cache")
    assert args.hicache_ratio == 2.0
    assert args.hicache_write_policy == "write_through"
    assert res().hicache_ratio is None  # HiCache off: nothing resolved


def test_hicache_ratio_below_one_warns_and_non_positive_refused(capsys):
    args = res("--enable-hierarchical-cache", "--hicache-ratio", "0.5")
    assert has_warning(args, "smaller than the device pool")
    err = refused(capsys, "--enable-hierarchical-cache", "--hicache-ratio", "0")
    assert "--hicache-ratio" in err


def test_host_pool_sizes_by_ratio():
    args = res("--enable-hierarchical-cache", "--hicache-ratio", "1.5", "--max-total-tokens",
               "1000", "--max-mamba-cache-size", "100")
    assert args.host_pool_sizes(bytes_per_token=100, bytes_per_slot=3000) == (1500, 150)


def test_host_pool_sizes_by_hicache_size():
    args = res("--enable-hierarchical-cache", "--hicache-size", "1", "--max-total-tokens", "1000",
               "--max-mamba-cache-size", "100")
    # device: 1000 * 100 B of KV and 100 * 3000 B of states: KV is a quarter of it
    tokens, slots = args.host_pool_sizes(bytes_per_token=100, bytes_per_slot=3000)
    assert tokens == (1 << 30) // 4 // 100
    assert slots == (1 << 30) * 3 // 4 // 3000
    assert tokens * 100 + slots * 3000 <= 1 << 30


# ---- platform limits ------------------------------------------------------------------------------
@pytest.mark.parametrize(("flag", "value"), [("--tp-size", "2"), ("--dp-size", "2")])
def test_platform_limits_refused(capsys, flag, value):
    err = refused(capsys, flag, value)
    assert flag in err


def test_page_size_defaults_to_one():
    assert res().page_size == 1
    assert res("--page-size", "1").page_size == 1


def test_page_size_above_one_resolves_auto_to_extra_buffer():
    # SGLang 0.5.23: auto takes extra_buffer when paging, even without the overlap schedule
    args = res("--page-size", "16", "--disable-overlap-schedule")
    assert args.page_size == 16
    assert args.mamba_radix_cache_strategy == "extra_buffer"
    assert args.disable_overlap_schedule
    assert res("--page-size", "1", "--disable-overlap-schedule").mamba_radix_cache_strategy == \
        "no_buffer"
    assert res("--page-size", "128", "--mamba-track-interval", "256").page_size == 128


@pytest.mark.parametrize(("argv", "message"), [
    (("--page-size", "0"), "--page-size 0 must be at least 1"),
    (("--page-size", "16", "--mamba-radix-cache-strategy", "no_buffer",
      "--disable-overlap-schedule"), "no_buffer only supports page_size=1"),
    (("--page-size", "48", "--mamba-track-interval", "192"),
     "either chunk_size or page_size must be divisible by the other"),
    (("--page-size", "128", "--mamba-track-interval", "64"),
     "--mamba-track-interval 64 must be a multiple of --page-size 128"),
    (("--page-size", "16", "--chunked-prefill-size", "100"),
     "chunked_prefill_size must be divisible by page_size"),
])
def test_page_size_combinations_sglang_refuses(capsys, argv, message):
    assert message in refused(capsys, *argv)


def test_page_size_without_radix_cache_needs_no_mamba_checks():
    args = res("--page-size", "16", "--disable-radix-cache", "--disable-overlap-schedule")
    assert args.page_size == 16 and args.disable_radix_cache


def test_mixed_chunk():
    assert not res().enable_mixed_chunk
    args = res("--enable-mixed-chunk", "--chunked-prefill-size", "128")
    assert args.enable_mixed_chunk and args.to_dict()["enable_mixed_chunk"] is True


def test_mixed_chunk_with_speculative_decoding_refused(capsys):
    err = refused(capsys, "--enable-mixed-chunk", "--speculative-algorithm", "NEXTN")
    assert "--enable-mixed-chunk" in err and "NEXTN" in err


# ---- sizes ---------------------------------------------------------------------------------------
def test_mamba_cache_too_small_for_one_request_refused(capsys):
    # extra_buffer with overlap: 2 + 2 state slots per request
    err = refused(capsys, "--max-mamba-cache-size", "3")
    assert "--max-mamba-cache-size 3" in err
    assert "4 state slots" in err
    # without a radix cache one request needs 2
    err = refused(capsys, "--max-mamba-cache-size", "1", "--disable-radix-cache")
    assert "--max-mamba-cache-size 1" in err
    assert res("--max-mamba-cache-size", "2", "--disable-radix-cache").max_running_requests == 1


@pytest.mark.parametrize(("flags", "per_req"), [
    ([], 4),  # extra_buffer, overlap
    (["--disable-overlap-schedule", "--mamba-radix-cache-strategy", "extra_buffer"], 3),
    (["--disable-overlap-schedule"], 2),  # no_buffer
    (["--disable-radix-cache"], 2),
])
def test_max_running_requests_reduced_to_fit_mamba_cache(flags, per_req):
    args = res(*flags, "--max-mamba-cache-size", "40")
    assert args.max_running_requests == 40 // per_req
    assert has_warning(args, f"max_running_requests reduced from 64 to {40 // per_req}")


def test_max_running_requests_kept_when_it_fits():
    args = res("--max-mamba-cache-size", "400", "--max-running-requests", "10")
    assert args.max_running_requests == 10
    assert not has_warning(args, "max_running_requests reduced")


def test_size_defaults():
    args = res()
    assert args.max_total_tokens == 65536
    assert args.max_mamba_cache_size == 512
    assert args.context_length == 8192
    assert isinstance(args.random_seed, int)
    assert res("--random-seed", "7").random_seed == 7


def test_non_positive_sizes_refused(capsys):
    assert "--max-total-tokens 0" in refused(capsys, "--max-total-tokens", "0")
    assert "--max-running-requests 0" in refused(capsys, "--max-running-requests", "0")


@pytest.mark.parametrize(("flags", "expected"), [
    ([], 4096), (["--chunked-prefill-size", "-1"], -1), (["--chunked-prefill-size", "0"], -1),
    (["--chunked-prefill-size", "128"], 128),
])
def test_chunked_prefill_size(flags, expected):
    assert res(*flags).chunked_prefill_size == expected


def numa(tmp_path: Path, monkeypatch, *node_kb: int, total_kb: int = 64 << 20) -> None:
    """A host whose NUMA nodes have ``node_kb`` each (none: no node listed)."""
    from evalsvc.engines.embedded import args as args_module

    for i, kb in enumerate(node_kb):
        (tmp_path / f"node{i}").mkdir()
        (tmp_path / f"node{i}" / "meminfo").write_text(f"Node {i} MemTotal:  {kb} kB\n"
                                                       f"Node {i} MemFree:  1 kB\n")
    (tmp_path / "meminfo").write_text(f"MemTotal:  {total_kb} kB\nMemFree:  1 kB\n")
    monkeypatch.setattr(args_module, "NUMA_NODES", tmp_path)
    monkeypatch.setattr(args_module, "MEMINFO", tmp_path / "meminfo")


@pytest.mark.parametrize(("node_gib", "expected"), [
    ((24,), 2048), ((34,), 2048), ((40,), 4096), ((80, 80), 8192), ((200, 100), 8192),
    ((200,), 16384), ((), 16384)])  # no node listed: the whole machine (200 GiB)
def test_default_chunked_prefill_on_device_cpu_follows_sglang_host_memory(
        tmp_path, monkeypatch, node_gib, expected):
    """SGLang 0.5.17 on ``--device cpu`` sizes the default chunk from the host's memory per NUMA
    node (``get_cpu_memory_capacity``, then ``ServerArgs._handle_gpu_memory_settings``): a 24 GiB
    host serves with 2048, which the differential test against real SGLang found."""
    numa(tmp_path, monkeypatch, *(g << 20 for g in node_gib), total_kb=(200 << 20))
    assert res("--device", "cpu").chunked_prefill_size == expected
    assert res().chunked_prefill_size == 4096  # no device given: SGLang's unknown-memory fallback
    assert res("--device", "cpu", "--chunked-prefill-size", "128").chunked_prefill_size == 128


def test_default_chunked_prefill_with_bound_omp_threads_is_sglangs_fallback(tmp_path, monkeypatch):
    """``SGLANG_CPU_OMP_THREADS_BIND`` makes the capacity unknown to SGLang: 4096."""
    numa(tmp_path, monkeypatch, 24 << 20)
    args = resolve(build_parser().parse_args(["--device", "cpu"]),
                   env={"SGLANG_CPU_OMP_THREADS_BIND": "0-1"})
    assert args.chunked_prefill_size == 4096


def test_small_chunked_prefill_with_extra_buffer_warns():
    args = res("--chunked-prefill-size", "32")
    assert args.chunked_prefill_size == 32
    assert has_warning(args, "--chunked-prefill-size 32")


# ---- defects ---------------------------------------------------------------------------------------
def test_no_defects_by_default():
    assert res().defects == []


def test_defects_from_flag_repeatable():
    args = res("--inject-defect", "snapshot-race", "--inject-defect", "host-load-race")
    assert args.defects == [Defect.SNAPSHOT_RACE, Defect.HOST_LOAD_RACE]
    assert args.to_dict()["defects"] == ["snapshot-race", "host-load-race"]


def test_defects_from_env_whitespace_and_duplicates():
    env = {ENV_VAR: " deferred-ops-dropped , stale-spec-metadata,,deferred-ops-dropped ,"}
    args = res(env=env)
    assert args.defects == [Defect.DEFERRED_OPS_DROPPED, Defect.STALE_SPEC_METADATA]


def test_defects_from_flag_and_env_merged_without_duplicates():
    args = res("--inject-defect", "snapshot-race",
               env={ENV_VAR: "snapshot-race,host-load-race"})
    assert args.defects == [Defect.SNAPSHOT_RACE, Defect.HOST_LOAD_RACE]


def test_parse_args_env_is_not_os_environ(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "snapshot-race")
    assert parse_args([], env={}).defects == []


def test_unknown_defect_from_flag_refused(capsys):
    err = refused(capsys, "--inject-defect", "no-such-defect")
    assert "no-such-defect" in err


def test_unknown_defect_from_env_refused(capsys):
    err = refused(capsys, env={ENV_VAR: "snapshot-race, bogus-defect"})
    assert "bogus-defect" in err
    assert ENV_VAR in err


def test_defect_strengths_from_flag_and_env():
    args = res("--inject-defect", "snapshot-race@0.25",
               env={ENV_VAR: "host-load-race, deferred-ops-dropped@1 ,snapshot-race@.25"})
    assert args.defects == [Defect.SNAPSHOT_RACE, Defect.HOST_LOAD_RACE,
                            Defect.DEFERRED_OPS_DROPPED]
    assert args.defect_strengths == {Defect.SNAPSHOT_RACE: 0.25, Defect.HOST_LOAD_RACE: 1.0,
                                     Defect.DEFERRED_OPS_DROPPED: 1.0}
    assert args.to_dict()["defect_strengths"] == {"snapshot-race": 0.25, "host-load-race": 1.0,
                                                  "deferred-ops-dropped": 1.0}
    assert args.to_dict()["defects"] == ["snapshot-race", "host-load-race", "deferred-ops-dropped"]


def test_no_strength_is_full_strength():
    args = res("--inject-defect", "stale-spec-metadata")
    assert args.defect_strengths == {Defect.STALE_SPEC_METADATA: 1.0}


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "abc", "", "nan", "inf", "1e-400"])
def test_bad_strength_from_flag_refused_naming_defect_value_and_flag(value):
    with pytest.raises(ArgError) as err:
        res("--inject-defect", f"host-load-race@{value}")
    text = str(err.value)
    assert "'host-load-race'" in text and repr(value) in text and "--inject-defect" in text
    assert "(0, 1]" in text


def test_bad_strength_from_env_refused_naming_the_variable(capsys):
    err = refused(capsys, env={ENV_VAR: "snapshot-race@0.5,deferred-ops-dropped@2"})
    assert "'deferred-ops-dropped'" in err and "'2'" in err and ENV_VAR in err


def test_conflicting_strengths_refused_naming_both_origins():
    with pytest.raises(ArgError) as err:
        res("--inject-defect", "snapshot-race@0.5", env={ENV_VAR: "snapshot-race@0.25"})
    text = str(err.value)
    assert "'snapshot-race'" in text and "0.25" in text and "0.5" in text
    assert ENV_VAR in text and "--inject-defect" in text


def test_unknown_defect_with_a_strength_names_the_defect():
    with pytest.raises(ArgError, match=r"unknown defect 'bogus'.*--inject-defect"):
        res("--inject-defect", "bogus@0.5")


def test_resolve_raises_arg_error():
    with pytest.raises(ArgError, match="--page-size 2: no_buffer"):
        res("--page-size", "2", "--mamba-radix-cache-strategy", "no_buffer",
            "--disable-overlap-schedule")


# ---- unknown flags ---------------------------------------------------------------------------------
def test_unknown_flag_exits_2_naming_it(capsys):
    err = refused(capsys, "--no-such-flag")
    assert "--no-such-flag" in err


def test_bad_int_value_exits_2_naming_flag(capsys):
    err = refused(capsys, "--max-total-tokens", "lots")
    assert "--max-total-tokens" in err


def test_accepted_compat_flags():
    args = parse_args(["--tp", "1", "--device", "cpu", "--dtype", "float32", "--trust-remote-code",
                       "--mem-fraction-static", "0.8", "--enable-metrics"], env={})
    assert args.tp_size == 1
    assert args.enable_metrics is True
    assert args.to_dict()["model_path"] == args.model_path


def test_tree_core_variable_python_runs_rust_falls_back_anything_else_refused(capsys):
    assert res("--model-path", str(MAMBA2)).tree_core_fallback is None
    python = res("--model-path", str(MAMBA2), env={TREE_CORE_ENV: "python"})
    assert python.tree_core_fallback is None
    rust = res("--model-path", str(MAMBA2), env={TREE_CORE_ENV: "rust"})
    assert rust.tree_core_fallback == "the embedded engine has no Rust TreeCore"
    assert "tree_core_fallback" not in rust.to_dict()  # not in /server_info, as in SGLang
    message = refused(capsys, "--model-path", str(MAMBA2), env={TREE_CORE_ENV: "cpp"})
    assert f"{TREE_CORE_ENV}='cpp' is not registered" in message
