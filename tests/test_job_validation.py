"""Job validation at submission (``POST /api/v1/jobs`` in process, the runner off): limits on what
one job expands to, the engine flags a matrix may set, identifiers that become paths, local files,
malformed values. Each refusal is a 422 naming the field (and the limit or setting), with nothing
stored; the command builders never take a host from a matrix."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from evalsvc.app import create_app
from evalsvc.engines.base import EngineSpec, engine_command
from evalsvc.engines.sglang_server import build_command
from evalsvc.paths import inside
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.models import Job

FAKE_PYTHON = str(Path(__file__).parent / "data" / "fake-python")
SMOKE_CONFIGS = 9


def make_client(tmp_path: Path, **overrides) -> TestClient:
    s = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                 nightly=False, engine_python=FAKE_PYTHON, **overrides)
    return TestClient(create_app(s, start_runner=False))


@pytest.fixture
def client(tmp_path) -> Iterator[TestClient]:
    with make_client(tmp_path) as c:
        yield c


def jobs_stored(tmp_path: Path) -> int:
    store = Store(f"sqlite:///{tmp_path / 'jobs.db'}")
    try:
        with store.session() as s:
            return s.scalar(select(func.count()).select_from(Job))
    finally:
        store.close()


def inline(**changes) -> dict:
    """A small valid inline matrix (embedded engine, one model, two configs)."""
    m = {"name": "inline", "engine": "embedded",
         "models": {"m": {"path": "hybrid-mamba2-tiny"}},
         "include": [{"model": "m", "strategy": "extra_buffer", "overlap": True},
                     {"model": "m", "strategy": "no_buffer", "overlap": False}],
         "workload": {"num_prompts": 2, "max_new_tokens": 4}}
    m.update(changes)
    return m


def refused(client: TestClient, tmp_path: Path, body: dict | str, *words: str) -> str:
    # JSON as a client may send it: escapes for any character, Infinity and NaN as Python writes
    text = body if isinstance(body, str) else json.dumps(body)
    resp = client.post("/api/v1/jobs", content=text, headers={"content-type": "application/json"})
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, str)
    for word in words:
        assert word in detail, detail
    assert jobs_stored(tmp_path) == 0
    return detail


def test_a_small_inline_matrix_is_accepted(client):
    resp = client.post("/api/v1/jobs", json={"matrix": inline(extra_args={"random_seed": 0})})
    assert resp.status_code == 201, resp.text


# ---- 1. limits ------------------------------------------------------------------------------

def test_configs_per_job_are_limited(tmp_path):
    with make_client(tmp_path, max_configs_per_job=4) as c:
        refused(c, tmp_path, {"matrix": "smoke"}, "configs", "9", "4",
                "EVALSVC_MAX_CONFIGS_PER_JOB")
        # the limit counts every build's configs
        assert c.post("/api/v1/jobs", json={"matrix": "smoke", "configs": [
            "mamba2-eb-ov-c64", "gdn-eb-ov-c64"]}).status_code == 201
        resp = c.post("/api/v1/jobs", json={"matrix": "smoke", "builds": [{}, {}], "configs": [
            "mamba2-eb-ov-c64", "gdn-eb-ov-c64", "mamba2-nb-sync-c64"]})
        assert resp.status_code == 422 and "EVALSVC_MAX_CONFIGS_PER_JOB" in resp.json()["detail"]


def test_a_huge_axis_is_refused_quickly(client, tmp_path):
    t0 = time.monotonic()
    matrix = inline(include=[], axes={"chunked_prefill": list(range(1, 100_001))})
    refused(client, tmp_path, {"matrix": matrix}, "matrix", "EVALSVC_MAX_MATRIX_BYTES")
    matrix = inline(include=[], axes={"chunked_prefill": list(range(1, 3001))})
    refused(client, tmp_path, {"matrix": matrix}, "matrix.axes.chunked_prefill", "3000",
            "EVALSVC_MAX_MATRIX_ENTRIES")
    assert time.monotonic() - t0 < 60


def test_the_cross_product_is_limited_before_it_is_expanded(client, tmp_path):
    axes = {"chunked_prefill": list(range(1, 101)), "strategy": ["no_buffer", "extra_buffer"],
            "overlap": [True, False], "hicache": [True, False], "mtp": [True, False]}
    refused(client, tmp_path, {"matrix": inline(include=[], axes=axes)}, "matrix.axes", "1600",
            "EVALSVC_MAX_MATRIX_ENTRIES")


def test_include_and_exclude_entries_are_limited(client, tmp_path):
    include = [{"model": "m", "chunked_prefill": i} for i in range(1, 1202)]
    refused(client, tmp_path, {"matrix": inline(include=include)}, "matrix.include",
            "EVALSVC_MAX_MATRIX_ENTRIES")
    exclude = [{"chunked_prefill": i} for i in range(1, 1202)]
    refused(client, tmp_path, {"matrix": inline(exclude=exclude)}, "matrix.exclude",
            "EVALSVC_MAX_MATRIX_ENTRIES")
    # a few entries whose listed values make many points
    listed = [{"model": "m", "chunked_prefill": list(range(1, 41)), "overlap": [True, False],
               "hicache": [True, False], "mtp": [True, False]}] * 4
    refused(client, tmp_path, {"matrix": inline(include=listed)}, "matrix.include", "1280",
            "EVALSVC_MAX_MATRIX_ENTRIES")


def test_prompts_and_tokens_per_job_are_limited(client, tmp_path):
    refused(client, tmp_path, {"matrix": "smoke", "workload": {"num_prompts": 100_000}},
            "workload.num_prompts", "EVALSVC_MAX_JOB_PROMPTS")
    refused(client, tmp_path, {"matrix": "smoke", "workload": {"max_new_tokens": 65_536}},
            "workload.max_new_tokens", "EVALSVC_MAX_JOB_TOKENS")


# ---- 2. engine flags ------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["host", "port", "model_path", "tokenizer_path", "download_dir",
                                  "trust_remote_code", "api_key", "dist_init_addr", "nccl_port",
                                  "ho", "inject_defect", "served_model_name",
                                  "disable_radix_cache", "HOST"])
def test_engine_flags_outside_the_allowlist_are_refused(client, tmp_path, flag):
    detail = refused(client, tmp_path, {"matrix": inline(extra_args={flag: "0.0.0.0"})},
                     f"matrix.extra_args.{flag}", "mamba_track_interval")
    assert "random_seed" in detail  # the allowed flags are listed


def test_sglang_flags_follow_their_own_allowlist(client, tmp_path):
    sglang = inline(engine="sglang", models={"m": {"path": "Qwen/Qwen3-Next-80B-A3B-Instruct"}})
    ok = {"attention_backend": "fa3", "cuda_graph_max_bs": 8, "disable_cuda_graph": True,
          "mem_fraction_static": 0.8, "mamba_ssm_dtype": "bfloat16", "random_seed": 1}
    assert client.post("/api/v1/jobs", json={"matrix": {**sglang, "extra_args": ok}}
                       ).status_code == 201
    client.post(f"/api/v1/jobs/{client.get('/api/v1/jobs').json()[0]['id']}/cancel")
    with make_client(tmp_path / "other") as c:
        refused(c, tmp_path / "other", {"matrix": {**sglang, "extra_args": {
            "dist_init_addr": "10.0.0.1:5000"}}}, "matrix.extra_args.dist_init_addr",
            "attention_backend")
        # an embedded-only matrix flag allowed for embedded is judged by the job's engine
        refused(c, tmp_path / "other", {"matrix": inline(extra_args={"attention_backend": "fa3"})},
                "matrix.extra_args.attention_backend")


@pytest.mark.parametrize("value", [[1], {"a": 1}, "../etc", "--host", "a b", "x" * 200])
def test_engine_flag_values_are_plain_scalars(client, tmp_path, value):
    refused(client, tmp_path, {"matrix": inline(extra_args={"random_seed": value})},
            "matrix.extra_args.random_seed")


def test_the_command_builders_bind_loopback_only():
    args = {"model_path": "hybrid-mamba2-tiny", "random_seed": 0}
    for kind in ("embedded", "sglang"):
        with pytest.raises(ValueError, match="host"):
            engine_command(EngineSpec(kind=kind, host="0.0.0.0"), args, port=30000)
        argv = engine_command(EngineSpec(kind=kind), {**args, "host": "0.0.0.0"}, port=30000)
        assert "0.0.0.0" not in argv and argv[argv.index("--host") + 1] == "127.0.0.1"
        with pytest.raises(ValueError, match="ho"):  # argparse would take --ho for --host
            engine_command(EngineSpec(kind=kind), {**args, "ho": "0.0.0.0"}, port=30000)
    with pytest.raises(ValueError, match="host"):
        build_command(args, port=1, python="python", host="0.0.0.0")


@pytest.mark.parametrize(("flag", "value"), [
    ("mamba_track_interval", -5), ("mamba_track_interval", 0), ("mamba_track_interval", 1.5),
    ("mamba_track_interval", True), ("max_running_requests", -1), ("page_size", 0),
    ("mem_fraction_static", 0), ("mem_fraction_static", 1.5), ("random_seed", -1),
    ("hicache_size", -1), ("max_total_tokens", "many")])
def test_numeric_engine_flags_are_in_their_ranges(client, tmp_path, flag, value):
    refused(client, tmp_path, {"matrix": inline(extra_args={flag: value})},
            f"matrix.extra_args.{flag}")


def test_numeric_engine_flags_in_their_ranges_are_accepted(client):
    ok = {"mamba_track_interval": 1, "max_running_requests": 4, "mem_fraction_static": 1.0,
          "random_seed": 0, "hicache_size": 0, "max_total_tokens": 8192}
    resp = client.post("/api/v1/jobs", json={"matrix": inline(extra_args=ok)})
    assert resp.status_code == 201, resp.text


# ---- 2b. thresholds: the ranges of evalsvc/configs/thresholds.yaml --------------------------------------

@pytest.mark.parametrize(("thresholds", "field"), [
    ({"min_hit_coverage": 5}, "matrix.thresholds.min_hit_coverage"),
    ({"min_hit_coverage": -0.1}, "matrix.thresholds.min_hit_coverage"),
    ({"min_hit_coverage": {"prefill_hit": 5}}, "matrix.thresholds.min_hit_coverage: prefill_hit"),
    ({"kl_k3_mean": -1}, "matrix.thresholds.kl_k3_mean.max"),
    ({"kl_k3_mean": {"max": 1e-3, "min_effect": -1}}, "matrix.thresholds.kl_k3_mean.min_effect"),
    ({"extend_kl_k3_mean": {"tail_factor": 0.5}}, "matrix.thresholds.extend_kl_k3_mean"),
    ({"accept_length": {"min": 3, "max": 2}}, "matrix.thresholds.accept_length"),
    # a config's name where the limits' fields go: the limits apply to every config
    ({"kl_k3_mean": {"m-no-such-config": 1e-3}}, "matrix.thresholds.kl_k3_mean.m-no-such-config"),
    ({"min_hit_coverage": {"m-no-such-config": 0.5}}, "matrix.thresholds.min_hit_coverage"),
])
def test_thresholds_out_of_range_are_refused_naming_the_field(client, tmp_path, thresholds,
                                                              field):
    refused(client, tmp_path, {"matrix": inline(thresholds=thresholds)}, field)


def test_a_matrix_and_the_thresholds_file_share_one_definition(client, tmp_path):
    """The thresholds file refuses what a matrix is refused, and a matrix takes what the file
    takes (extend_kl_k3_mean, tail), per scenario for min_hit_coverage; stored as given."""
    from evalsvc.matrix import RuleBody, Thresholds
    from evalsvc.thresholds import ThresholdError, load_thresholds

    assert issubclass(Thresholds, RuleBody)
    path = tmp_path / "t.yaml"
    for body in ("min_hit_coverage: 5", "kl_k3_mean: -1"):
        path.write_text(f"defaults:\n  {body}\n")
        with pytest.raises(ThresholdError, match=f"defaults.{body.split(':')[0]}"):
            load_thresholds(path)
    given = {"kl_k3_mean": 2e-3, "extend_kl_k3_mean": {"max": 1e-3, "tail": True},
             "min_hit_coverage": {"prefill_hit": 0.25}}
    resp = client.post("/api/v1/jobs", json={"matrix": inline(thresholds=given)})
    assert resp.status_code == 201, resp.text
    stored = client.get(f"/api/v1/jobs/{resp.json()['id']}").json()["spec"]["matrix"]
    assert stored["thresholds"]["kl_k3_mean"] == {"max": 2e-3}
    assert stored["thresholds"]["min_hit_coverage"] == {"prefill_hit": 0.25}


def test_a_matrixs_thresholds_apply_per_scenario_over_the_file():
    from evalsvc.matrix import Thresholds
    from evalsvc.thresholds import limits_for

    own = Thresholds.model_validate({"kl_k3_mean": 2e-3,
                                     "min_hit_coverage": {"prefill_hit": 0.25}})
    hit = limits_for(matrix="x", engine="sglang", config="c", model="m", settings={},
                     scenario="prefill_hit", matrix_thresholds=own)
    # the matrix's max, the file's effect floors kept (a rule overrides only what it sets)
    assert (hit.kl_k3_mean.max, hit.kl_k3_mean.min_effect) == (2e-3, 5e-4)
    assert hit.min_hit_coverage == 0.25
    branching = limits_for(matrix="x", engine="sglang", config="c", model="m", settings={},
                           scenario="branching", matrix_thresholds=own)
    assert branching.min_hit_coverage == 0.5  # the file's rule for hit scenarios
    # stored and read back (a job's JSON), the same fields alone are set
    again = Thresholds.model_validate(own.model_dump(mode="json"))
    assert again.kl_k3_mean.model_fields_set == {"max"}


@pytest.mark.parametrize("thresholds", [None, {"kl_k3_mean": 2e-3},
                                        {"min_hit_coverage": {"prefill_hit": 0.25}}])
def test_a_matrix_reads_back_as_it_was_stored(thresholds):
    """A job's matrix as stored (JSON) is what its runner and workers validate again."""
    from evalsvc.matrix import MatrixFile

    matrix = MatrixFile.model_validate(inline(**({"thresholds": thresholds} if thresholds
                                                 else {})))
    again = MatrixFile.model_validate(json.loads(json.dumps(matrix.model_dump(mode="json"))))
    assert again == matrix


# ---- 3. identifiers that become paths --------------------------------------------------------

@pytest.mark.parametrize(("change", "field"), [
    ({"name": "../../outside"}, "matrix.name"),
    ({"name": "n" * 300}, "matrix.name"),
    ({"name": ".hidden"}, "matrix.name"),
    ({"models": {"../../x": {"path": "hybrid-mamba2-tiny"}}, "include": []}, "matrix.models"),
    ({"models": {"m" * 65: {"path": "hybrid-mamba2-tiny"}}, "include": []}, "matrix.models"),
    ({"models": {"a..b": {"path": "hybrid-mamba2-tiny"}}, "include": []}, "matrix.models"),
])
def test_identifiers_that_become_paths_are_refused(client, tmp_path, change, field):
    refused(client, tmp_path, {"matrix": inline(**change)}, field)


def test_config_names_are_checked(client, tmp_path):
    refused(client, tmp_path, {"matrix": "smoke", "configs": ["../../x"]}, "configs")


def test_inside_keeps_paths_under_their_root(tmp_path):
    assert inside(tmp_path, "logs", "job-1", "a.log") == (tmp_path / "logs/job-1/a.log").resolve()
    for parts in (("..", "x"), ("a/../../x",), ("/etc/passwd",), ("a\0b",)):
        with pytest.raises(ValueError):
            inside(tmp_path, *parts)
    (tmp_path / "link").symlink_to("/")
    with pytest.raises(ValueError):
        inside(tmp_path, "link", "etc")


# ---- 4. local files -------------------------------------------------------------------------

@pytest.mark.parametrize("ray", [False, True])
def test_model_paths_are_checked_at_submission(tmp_path, ray):
    """A model path is checked when the job is submitted, by the service, whatever runs it (an
    engine slot here, or a Ray worker): no job is stored, no run reaches a worker with it."""
    from evalsvc.jobs.spec import JobCreate, JobError, validate_job

    empty = tmp_path / "not-a-model"
    empty.mkdir()
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'j.db'}",
                        nightly=False, engine_python=FAKE_PYTHON, models_dir=tmp_path,
                        ray_address="ray://127.0.0.1:10001" if ray else None)
    sglang = {"engine": "sglang"}
    for change, words in (
            ({"models": {"m": {"path": str(empty)}}}, ["models.m.path", "no config.json"]),
            ({"models": {"m": {"path": "/no/such/model"}}, **sglang},
             ["models.m.path", "outside the directories models are served from",
              "EVALSVC_MODELS_DIR="]),
            ({"models": {"m": {"path": "-x"}}, **sglang}, ["models.m.path", "unknown model '-x'"])):
        with pytest.raises(JobError) as exc:
            validate_job(JobCreate(matrix=inline(**change)), settings)
        for word in words:
            assert word in str(exc.value), str(exc.value)
    with pytest.raises(JobError, match=r"model: no model directory .* \(no config\.json\)"):
        validate_job(JobCreate(matrix=inline(), model=str(empty)), settings)


def test_api_jobs_name_matrices_only(client, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(inline()))
    refused(client, tmp_path, {"matrix": str(path)}, "matrix", "name")
    refused(client, tmp_path, {"matrix": "../configs/smoke"}, "matrix")


def test_files_under_configs_that_are_no_matrix_are_not_shown(client, tmp_path):
    detail = refused(client, tmp_path, {"matrix": "thresholds"}, "thresholds", "smoke")
    for key in ("history", "defaults", "rules", "window"):
        assert key not in detail, detail


def test_reading_a_file_under_configs_that_is_no_matrix_shows_none_of_it(client):
    resp = client.get("/api/v1/matrices/thresholds")
    assert resp.status_code == 404 and "not a matrix file" in resp.json()["detail"]
    for key in ("history", "defaults", "rules", "window"):
        assert key not in resp.json()["detail"]


def test_local_datasets_are_off_for_clients_by_default(client, tmp_path):
    data = tmp_path / "prompts"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"text": "secret " * 20}) + "\n")
    for dataset in (str(data), str(data / "train.jsonl"), "/etc/passwd", "./prompts",
                    "../../etc/shadow", "a/b/c"):
        refused(client, tmp_path, {"matrix": "smoke", "workload": {"dataset": dataset}},
                "workload.dataset")
    refused(client, tmp_path, {"matrix": inline(workload={"dataset": str(data)})},
            "workload.dataset")


def test_local_datasets_under_the_datasets_dir(tmp_path):
    root = tmp_path / "datasets"
    (root / "sub").mkdir(parents=True)
    good = root / "sub" / "p.jsonl"
    good.write_text("".join(json.dumps({"text": f"prompt {i} " * 10}) + "\n" for i in range(4)))
    (root / "bad.parquet").write_bytes(b"\x00\x01 not parquet at all")
    (root / "bad.jsonl").write_bytes(b"\xff\xfe\x00 not json\n")
    outside = tmp_path / "outside.jsonl"
    outside.write_text(good.read_text())
    with make_client(tmp_path, datasets_dir=root) as c:
        resp = c.post("/api/v1/jobs", json={"matrix": "smoke",
                                            "workload": {"dataset": "sub/p.jsonl"}})
        assert resp.status_code == 201, resp.text
        spec = c.get(f"/api/v1/jobs/{resp.json()['id']}").json()["spec"]
        assert spec["matrix"]["workload"]["dataset"] == str(good.resolve())
        c.post(f"/api/v1/jobs/{resp.json()['id']}/cancel")
    with make_client(tmp_path / "x", datasets_dir=root) as c:
        t = tmp_path / "x"
        for dataset in (str(outside), "../outside.jsonl", "sub/../../outside.jsonl", "sub",
                        "bad.parquet", "bad.jsonl", "absent.jsonl"):
            refused(c, t, {"matrix": "smoke", "workload": {"dataset": dataset}},
                    "workload.dataset")


# ---- 9. malformed input ---------------------------------------------------------------------

@pytest.mark.parametrize(("change", "field"), [
    ({"include": [{"model": "nope"}]}, "matrix.include[0].model"),
    ({"include": [{"model": "m", "strategy": "fast"}]}, "matrix.include[0].strategy"),
    ({"include": [{"model": "m", "radix_cache": "yes"}]}, "matrix.include[0].radix_cache"),
    ({"include": [{"model": "m", "radix_cache": 1}]}, "matrix.include[0].radix_cache"),
    ({"include": [{"model": "m", "strategy": {"a": 1}}]}, "matrix.include[0].strategy"),
    ({"include": [{"model": "m", "chunked_prefill": "64"}]}, "matrix.include[0].chunked_prefill"),
    ({"include": [{"model": "m", "colour": 1}]}, "matrix.include[0].colour"),
    ({"include": ["m"]}, "matrix.include"),
    ({"exclude": [{"colour": 1}]}, "matrix.exclude[0].colour"),
    ({"exclude": [{"strategy": ["x"]}]}, "matrix.exclude[0].strategy"),
    ({"axes": {"overlap": [1, 0]}, "include": []}, "matrix.axes"),
    ({"axes": {"model": ["nope"]}, "include": []}, "matrix.axes"),
    ({"axes": {"chunked_prefill": [True]}, "include": []}, "matrix.axes"),
    ({"reference": {"kind": "config", "config": {"strategy": "x"}}}, "matrix.reference"),
    ({"description": "x" * 5000}, "matrix.description"),
    ({"models": {"m": {"path": "p" * 5000}}}, "matrix.models.m.path"),
    ({"hicache": {"io_backend": "--host"}}, "matrix.hicache"),
])
def test_malformed_matrix_entries_are_refused(client, tmp_path, change, field):
    refused(client, tmp_path, {"matrix": inline(**change)}, field)


def test_a_matrix_asking_for_a_reference_config_is_refused(client, tmp_path):
    """The service measures against the same server (SGLang's method): a matrix whose reference
    is a config of its own is refused, not stored and run against another reference."""
    body = {"matrix": inline(reference={"kind": "config", "config": {"radix_cache": False}})}
    refused(client, tmp_path, body, "matrix.reference", "evalsvc run")


@pytest.mark.parametrize("text", ["\ud800", "a\x00b"])
def test_strings_both_databases_cannot_store_are_refused(client, tmp_path, text):
    for body in ({"matrix": inline(description=text)}, {"matrix": inline(name=text)},
                 {"matrix": "smoke", "workload": {"text_field": text}},
                 {"matrix": "smoke", "model": text}, {"matrix": {**inline(), text: 1}},
                 {"matrix": "smoke", "configs": [text]}):
        refused(client, tmp_path, body)
    assert client.get("/api/v1/jobs").status_code == 200


def test_non_finite_and_huge_numbers_are_refused(client, tmp_path):
    refused(client, tmp_path, '{"matrix": "smoke", "workload": {"temperature": Infinity}}',
            "temperature")
    refused(client, tmp_path, '{"matrix": "smoke", "workload": {"temperature": NaN}}',
            "temperature")
    body = json.dumps({"matrix": inline(hicache={"ratio": 1e400})}).replace("inf", "Infinity")
    refused(client, tmp_path, body, "ratio")
    refused(client, tmp_path, {"matrix": inline(extra_args={"mem_fraction_static": 10**30})},
            "matrix.extra_args.mem_fraction_static")
    refused(client, tmp_path, {"matrix": inline(include=[{"model": "m", "chunked_prefill":
                                                          10**30}])}, "chunked_prefill")


def test_build_sources_fit_the_store(client, tmp_path):
    refused(client, tmp_path, {"matrix": "mamba-full", "builds": [{"source": "sglang==1" + "0" * 150}]},
            "builds[0].source", "100")
    refused(client, tmp_path, {"matrix": "smoke", "builds": [{"source": "git:" + "r" * 300 + "@a"}]},
            "builds.0.source")


# ---- 11. loose validation -------------------------------------------------------------------

def test_empty_config_lists_and_matrices_without_configs_are_refused(client, tmp_path):
    refused(client, tmp_path, {"matrix": "smoke", "configs": []}, "configs")
    refused(client, tmp_path, {"matrix": inline(include=[])}, "matrix", "no configs")
    refused(client, tmp_path, {"matrix": inline(models={}, include=[])}, "matrix.models")
    everything = inline(include=[], axes={"strategy": ["no_buffer"]},
                        exclude=[{"strategy": "no_buffer"}])
    refused(client, tmp_path, {"matrix": everything}, "matrix", "no configs")


@pytest.mark.parametrize("field", ["seed", "sampling_seed"])
def test_seeds_are_bounded(client, tmp_path, field):
    refused(client, tmp_path, {"matrix": "smoke", "workload": {field: 2**63}},
            f"workload.{field}")
    resp = client.post("/api/v1/jobs", json={"matrix": "smoke", "workload": {field: 2**63 - 1}})
    assert resp.status_code == 201, resp.text


@pytest.mark.parametrize(("source", "ok"), [
    ("sglang==0.5.23", True), ("pypi:sglang==0.5.3.post3", True), ("pypi:0.5.17", True),
    (" sglang==0.5.17rc1 ", True), ("sglang==0.5.17+cpu", True),  # a local wheel in the cache
    ("git:sgl-project/sglang@abc123", True), ("path:/src/sglang", True), (None, True),
    ("sglang==tree-ebeb8633e652", False), ("pypi:sglang==latest", False), ("pypi:", False),
    ("sglang==0.5.23; touch /tmp/x", False), ("sglang==", False),
])
def test_a_release_source_names_a_version_number_in_the_job_model(source, ok):
    """The check is the job model's own (``BuildSpec``), so REST, the dashboard's form and the
    CLI refuse alike, at submission."""
    from pydantic import ValidationError

    from evalsvc.jobs import BuildSpec, JobCreate

    if ok:
        assert BuildSpec(source=source).source == source
        return
    with pytest.raises(ValidationError, match="is not a version number"):
        JobCreate(matrix="smoke", builds=[{"source": source}])
