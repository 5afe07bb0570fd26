"""Bad input and failing engines: a clear error naming the cause, the job's other configs still run,
and no engine process is left behind.

Engines: the embedded one (real flag validation, real port binding) and a fake SGLang server
(``tests/data/fake_sglang.py``, started through ``tests/data/fake-python`` as an SGLang build's
python) that dies at start or mid-run, or answers NaN or malformed logprobs.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from evalsvc import harness
from evalsvc.engines.base import EngineSpec
from evalsvc.engines.client import EngineClient
from evalsvc.evaluate import evaluate, prepare
from evalsvc.harness import RunResult
from evalsvc.matrix import Config, MatrixError, MatrixFile, expand, load_matrix
from evalsvc.paths import MODELS_DIR
from tests.judged import run_judged
from tests.processes import assert_gone, marked_processes, wait_no_processes

DATA = Path(__file__).parent / "data"
FAKE_PYTHON = DATA / "fake-python"
TOKEN_VAR = "EVALSVC_TEST_HARNESS_ERRORS"  # marks the processes this module starts
MISSING_MODEL = "/nonexistent/model"

EMBEDDED = {
    "name": "errors", "engine": "embedded",
    "models": {"m": {"path": "hybrid-mamba2-tiny"}},
    "extra_args": {"mamba_track_interval": 64, "random_seed": 0},
    "workload": {"num_prompts": 3, "max_new_tokens": 8},
    "scenarios": ["cold"],
}
FAKE = {
    "name": "fake", "engine": "sglang",
    "models": {"m": {"path": "/fake/model"}},
    "include": [{"strategy": "extra_buffer", "overlap": True}],
    "workload": {"num_prompts": 3, "max_new_tokens": 8},
    "scenarios": ["cold", "prefill_hit"],
}
# token ids go to run_config directly: no tokenizer for the fake model
PROMPTS = [(f"p{i}", [(i * 37 + j) % 500 + 1 for j in range(100)]) for i in range(3)]


# ---- helpers -----------------------------------------------------------------------------------

def engine_processes(token: str) -> list[str]:
    return marked_processes(TOKEN_VAR, token)


def wait_no_engines(token: str, timeout: float = 5.0) -> list[str]:
    return wait_no_processes(TOKEN_VAR, token, timeout)


def write_matrix(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def load(path: Path, data: dict) -> tuple[MatrixFile, list[Config]]:
    matrix = load_matrix(write_matrix(path, data))
    return matrix, expand(matrix, hardware="gpu" if matrix.engine == "sglang" else "cpu")


def fake_spec(mode: str, tmp_path: Path, **env: str) -> EngineSpec:
    return EngineSpec(kind="sglang", python=str(FAKE_PYTHON), startup_timeout=30, env={
        "FAKE_SGLANG_MODE": mode, "FAKE_SGLANG_PYTHON": sys.executable,
        "FAKE_SGLANG_PIDFILE": str(tmp_path / "pids"), **env})


def fake_pids(tmp_path: Path) -> list[int]:
    return [int(x) for x in (tmp_path / "pids").read_text().split()]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EVALSVC_ENGINE_DEFECTS"}
    env["COLUMNS"] = "250"  # no wrapping of the messages checked below
    return subprocess.run([sys.executable, "-m", "evalsvc.cli", "run", *args], capture_output=True,
                          text=True, timeout=300, env=env, check=False)


def by_name(results: list[RunResult]) -> dict[str, RunResult]:
    return {r.config: r for r in results}


@pytest.fixture(scope="module", autouse=True)
def no_engine_left_behind() -> Iterator[str]:
    """Marks every process this module starts; after the module, none of its engines may remain."""
    assert os.access(FAKE_PYTHON, os.X_OK), f"{FAKE_PYTHON} must be executable (chmod +x)"
    token = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TOKEN_VAR, token)
        yield token
    left = wait_no_engines(token)
    assert not left, "engine processes left behind:\n" + "\n".join(left)


# ---- 1. matrix files the loader refuses ----------------------------------------------------------

HEAD = "name: bad\nengine: embedded\nmodels:\n  m: {path: hybrid-mamba2-tiny}\n"
BAD_MATRICES = {
    "unknown_axis": ("axes: {colour: [red, blue]}", ["axes", "unknown axis 'colour'"]),
    "unknown_top_level_key": ("colour: red", ["colour: unknown key"]),
    "bad_axis_value": ("axes: {strategy: [no_bufer]}", ["axes", "'strategy'", "'no_bufer'"]),
    "exclude_unknown_axis": ("axes: {overlap: [true, false]}\nexclude: [{colour: red}]",
                             ["exclude[0].colour: unknown axis"]),
}


@pytest.mark.parametrize("case", list(BAD_MATRICES))
def test_bad_matrix_is_refused_naming_file_and_key(case, tmp_path):
    body, expected = BAD_MATRICES[case]
    path = write_matrix(tmp_path / f"{case}.yaml", HEAD + body + "\n")
    with pytest.raises(MatrixError) as exc:
        load_matrix(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: ")
    for part in expected:
        assert part in message

    res = run_cli(str(path), "--out", str(tmp_path / "out"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    printed = " ".join(res.stdout.split())
    assert f"error: {path}: " in printed
    for part in expected:
        assert part in printed
    assert not (tmp_path / "out").exists()


# ---- 2 and 3. configs the engine refuses, a missing model: errors, and the good config runs -------

@pytest.fixture(scope="module")
def embedded_job(tmp_path_factory) -> tuple[list[RunResult], Path]:
    """One job: a missing model, an unknown engine flag, a combination SGLang refuses, a good config."""
    root = tmp_path_factory.mktemp("embedded_job")
    matrix, configs = load(root / "main.yaml", {
        **EMBEDDED,
        "models": {"gone": {"path": MISSING_MODEL}, "m": {"path": "hybrid-mamba2-tiny"}},
        "include": [{"model": "gone", "strategy": "extra_buffer"},
                    {"model": "m", "strategy": "no_buffer", "overlap": True},
                    {"model": "m", "strategy": "extra_buffer", "overlap": True}]})
    _, flagged = load(root / "flag.yaml", {
        **EMBEDDED, "extra_args": {**EMBEDDED["extra_args"], "no_such_flag": 1},
        "include": [{"strategy": "auto"}]})
    assert flagged[0].args["no_such_flag"] == 1
    spec = EngineSpec(startup_timeout=120)
    configs, prompts = prepare(matrix, spec)
    configs = [*configs[:1], *flagged, *configs[1:]]  # the good config runs last
    assert [c.name for c in configs] == ["gone-eb-ov", "m-auto-ov", "m-nb-ov", "m-eb-ov"]
    out = root / "out"
    results = evaluate(matrix, configs, prompts, spec, out, Console(file=io.StringIO()))
    return results, out


@pytest.mark.slow
def test_unknown_engine_flag_fails_its_run_naming_the_flag(embedded_job):
    r = by_name(embedded_job[0])["m-auto-ov"]
    assert r.verdict == "error"
    assert r.reason.startswith("engine did not start: engine exited with code 2")
    assert "unrecognized arguments: --no-such-flag 1" in r.reason  # from the engine's log tail
    assert r.scenarios == []


@pytest.mark.slow
def test_refused_combination_fails_its_run_naming_it(embedded_job):
    r = by_name(embedded_job[0])["m-nb-ov"]
    assert r.verdict == "error"
    assert "engine exited with code 2" in r.reason
    assert ("--mamba-radix-cache-strategy no_buffer does not support the overlap schedule"
            in r.reason)
    assert r.scenarios == []


@pytest.mark.slow
def test_missing_model_fails_its_configs_naming_the_path(embedded_job):
    r = by_name(embedded_job[0])["gone-eb-ov"]
    assert r.verdict == "error"
    assert MISSING_MODEL in r.reason
    assert r.command == []  # no engine was started for it
    assert r.scenarios == []


@pytest.mark.slow
def test_good_config_of_the_same_job_still_runs_and_passes(embedded_job):
    results, out = embedded_job
    r = by_name(results)["m-eb-ov"]
    assert r.verdict == "pass", r.reason
    assert [(s.scenario, s.verdict) for s in r.scenarios] == [("cold", "pass")]
    assert r.resolved_args["mamba_radix_cache_strategy"] == "extra_buffer"
    rows = json.loads((out / "summary.json").read_text())
    assert {(row["config"], row["verdict"]) for row in rows} == {
        ("gone-eb-ov", "error"), ("m-auto-ov", "error"), ("m-nb-ov", "error"), ("m-eb-ov", "pass")}
    assert (out / "samples.parquet").is_file()


@pytest.mark.slow
def test_missing_model_path_in_run_config_and_cli(tmp_path, no_engine_left_behind):
    matrix, configs = load(tmp_path / "gone.yaml", {
        **EMBEDDED, "models": {"m": {"path": MISSING_MODEL}}, "include": [{"strategy": "auto"}]})
    # the engine itself refuses the path, naming it
    r = run_judged(configs[0], matrix, EngineSpec(startup_timeout=60), PROMPTS, log_dir=tmp_path)
    assert r.verdict == "error"
    assert f"--model-path {MISSING_MODEL}: no such directory" in r.reason
    assert not wait_no_engines(no_engine_left_behind)

    # the CLI: no traceback, an error row naming the path, exit code 4 (runs errored)
    out = tmp_path / "out"
    res = run_cli(str(tmp_path / "gone.yaml"), "--out", str(out))
    assert res.returncode == 4, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert MISSING_MODEL in res.stdout
    assert "1 of 1 runs errored (no verdict reached)" in res.stdout
    assert re.search(r"recorded as job cli-\S+ \(failed\)", res.stdout)  # its only run errored
    rows = json.loads((out / "summary.json").read_text())
    assert [row["verdict"] for row in rows] == ["error"]
    assert f"model {MISSING_MODEL}: not a local directory" in rows[0]["reason"]
    assert not wait_no_engines(no_engine_left_behind)


@pytest.mark.slow
def test_model_without_its_weights_fails_at_once_naming_the_file(tmp_path, no_engine_left_behind):
    """The engine exits as soon as it cannot load the model (as SGLang's launcher does), so the run
    is an error within seconds, not after the start-up deadline."""
    model = tmp_path / "no-weights"
    shutil.copytree(MODELS_DIR / "hybrid-mamba2-tiny", model,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    matrix, configs = load(tmp_path / "m.yaml", {
        **EMBEDDED, "models": {"m": {"path": str(model)}}, "include": [{"strategy": "auto"}]})
    t0 = time.monotonic()
    r = run_judged(configs[0], matrix, EngineSpec(startup_timeout=120), PROMPTS, log_dir=tmp_path)
    assert time.monotonic() - t0 < 20
    assert r.verdict == "error"
    assert r.reason.startswith("engine did not start: engine exited with code 1 during start-up")
    assert f"{model / 'model.safetensors'}: no such file" in r.reason  # the engine's log tail
    assert r.scenarios == []
    assert not wait_no_engines(no_engine_left_behind)


# ---- 4. engines that die or answer garbage (the fake SGLang server) --------------------------------

@pytest.fixture()
def fake(tmp_path) -> tuple[Config, MatrixFile]:
    """(config, matrix): run_config's first two arguments."""
    matrix, configs = load(tmp_path / "fake.yaml", FAKE)
    return configs[0], matrix


@pytest.mark.slow
def test_fake_server_ok_passes(fake, tmp_path):
    """The fake's answers are consistent, so its failures below are the only cause of errors."""
    r = run_judged(*fake, fake_spec("ok", tmp_path), PROMPTS, log_dir=tmp_path)
    assert r.verdict == "pass", r.reason
    assert [s.verdict for s in r.scenarios] == ["pass", "pass"]
    assert r.resolved_args["mamba_radix_cache_strategy"] == "extra_buffer"
    assert r.command[1:3] == ["-m", "sglang.launch_server"]
    assert_gone(fake_pids(tmp_path))


@pytest.mark.slow
def test_a_cancel_before_the_first_scenario_is_a_cancelled_run(fake, tmp_path, monkeypatch):
    """A cancel that stops the engine while the harness asks for /server_info (after start-up,
    before any scenario) makes the run cancelled, not an error of its own."""
    control = harness.RunControl()
    asked = harness.EngineClient.server_info

    def cancelled_meanwhile(client):
        control.cancel()  # stops the engine's process group, as a job's cancel does
        return asked(client)

    monkeypatch.setattr(harness.EngineClient, "server_info", cancelled_meanwhile)
    r = run_judged(*fake, fake_spec("ok", tmp_path), PROMPTS, log_dir=tmp_path, control=control)
    assert (r.verdict, r.reason) == ("cancelled", "the job was cancelled")
    assert r.scenarios == []
    assert_gone(fake_pids(tmp_path))


@pytest.mark.slow
def test_engine_dying_at_start_is_an_error_with_its_log_tail(fake, tmp_path):
    r = run_judged(*fake, fake_spec("die_at_start", tmp_path), PROMPTS, log_dir=tmp_path)
    assert r.verdict == "error"
    assert r.reason.startswith("engine did not start: engine exited with code 1 during start-up")
    assert "log tail:" in r.reason
    assert "RuntimeError: the model could not be loaded (die_at_start)" in r.reason
    assert r.scenarios == []
    assert r.startup_seconds is None
    assert not (tmp_path / "pids").exists()  # it never got as far as serving


@pytest.mark.slow
def test_engine_dying_mid_run_errors_the_rest_and_its_group_is_gone(fake, tmp_path):
    r = run_judged(*fake, fake_spec("die_mid", tmp_path), PROMPTS, log_dir=tmp_path)
    assert r.verdict == "error"
    assert [s.scenario for s in r.scenarios] == ["cold", "prefill_hit"]
    for s in r.scenarios:
        assert s.verdict == "error"
        assert "the engine exited with code 3" in s.reason
        assert "scheduler crashed (die_mid)" in s.reason  # the log tail
    assert "the engine exited with code 3" in r.reason
    server, child = fake_pids(tmp_path)  # the child outlived the server until the group was killed
    assert_gone([server, child])


@pytest.mark.slow
def test_engine_dying_before_the_first_scenario_is_an_error_saying_it_exited(fake, tmp_path):
    """An engine that dies after start-up, while the harness asks for /server_info, is named as
    exited (with its code and log tail), not only as a broken connection."""
    r = run_judged(*fake, fake_spec("die_at_info", tmp_path), PROMPTS, log_dir=tmp_path)
    assert r.verdict == "error"
    assert r.scenarios == []
    assert "the engine exited with code 3" in r.reason, r.reason
    assert "scheduler crashed (die_at_info)" in r.reason  # the log tail
    assert_gone(fake_pids(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "expected"), [
    ("nan", "meta_info.output_token_logprobs[0]: logprob is nan"),
    ("malformed", "meta_info.output_token_logprobs: expected a list, got dict"),
])
def test_unusable_logprobs_are_scenario_errors_naming_the_field(fake, tmp_path, mode, expected):
    r = run_judged(*fake, fake_spec(mode, tmp_path), PROMPTS, log_dir=tmp_path)
    assert r.verdict == "error"
    assert [s.verdict for s in r.scenarios] == ["error", "error"]  # the engine lives on: each tried
    for s in r.scenarios:
        assert expected in s.reason
        assert "engine exited" not in s.reason
    assert expected in r.reason
    assert_gone(fake_pids(tmp_path))


@pytest.mark.slow
def test_evaluation_goes_on_after_an_engine_dies(tmp_path):
    """Two configs through ``evaluate`` (tokenizer of a shipped model): the first one's engine dies
    mid-run, the second runs and passes."""
    matrix, _ = load(tmp_path / "two.yaml", {
        **FAKE, "models": {"m": {"path": str(MODELS_DIR / "hybrid-mamba2-tiny")}},
        "include": [{"strategy": "no_buffer", "overlap": False},
                    {"strategy": "extra_buffer", "overlap": True}]})
    spec = fake_spec("die_mid", tmp_path, FAKE_SGLANG_WHEN="mamba_radix_cache_strategy=no_buffer")
    configs, prompts = prepare(matrix, spec)
    results = evaluate(matrix, configs, prompts, spec, tmp_path / "out", Console(file=io.StringIO()))
    first, second = results
    assert (first.config, first.verdict) == ("m-nb-sync", "error")
    assert "the engine exited with code 3" in first.reason
    assert (second.config, second.verdict) == ("m-eb-ov", "pass"), second.reason
    assert [s.verdict for s in second.scenarios] == ["pass", "pass"]
    assert_gone(fake_pids(tmp_path))
    logs = sorted(p.name for p in (tmp_path / "out" / "logs").iterdir())
    assert logs == ["m-eb-ov.log", "m-nb-sync.log"]


# ---- 4b. engines that hang: the run's deadline ----------------------------------------------------

class OnEngine:
    """The job's event queue as the harness sees it (its ``put``), calling ``fn(pid)`` with the
    engine's pid as the harness puts it there: at once, in the run's own thread."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def put(self, event) -> None:
        assert event.kind == "engine"
        self.fn(event.pid)


def stop_at_first_batch(monkeypatch: pytest.MonkeyPatch, stopped: threading.Event):
    """A hook (``OnEngine``) that SIGSTOPs the engine's process group as the run sends it its first
    batch of ``/generate`` requests (once it is up, not its warm-up or health checks): mid-scenario,
    with the requests in flight and never answered. Stopped before the batch goes out, not once
    the engine reports a request running: a batch of three 100-token prompts and 8 new tokens ends
    in a tenth of a second, and a watcher polling ``/metrics`` could miss it."""
    engine: list[int] = []  # its pid (the run's one engine)
    original = EngineClient.generate_many

    def generate_many(self: EngineClient, payloads: list[dict]):
        if engine and not stopped.is_set():
            os.killpg(engine[0], signal.SIGSTOP)
            stopped.set()
        return original(self, payloads)

    monkeypatch.setattr(EngineClient, "generate_many", generate_many)
    return engine.append


@pytest.mark.slow
def test_engine_stopped_mid_scenario_is_an_error_within_the_deadline(tmp_path, monkeypatch,
                                                                      no_engine_left_behind):
    """A SIGSTOPped engine answers nothing: the run ends ``error`` at its deadline (not after the
    per-request timeout), says the engine did not answer and was stopped, and its group is killed.
    The deadline leaves start-up ample time, and is far below the first batch's request timeout
    (about 90 s: 3 prompts of 64 tokens)."""
    deadline = 30
    matrix, configs = load(tmp_path / "m.yaml", {
        **EMBEDDED, "run_timeout_s": deadline, "scenarios": ["cold", "prefill_hit"],
        "workload": {"num_prompts": 3, "max_new_tokens": 64}, "include": [{"strategy": "auto"}]})
    stopped, pids = threading.Event(), []
    stop = stop_at_first_batch(monkeypatch, stopped)
    control = harness.RunControl(events=OnEngine(lambda pid: (pids.append(pid), stop(pid))))
    t0 = time.monotonic()
    r = run_judged(configs[0], matrix, EngineSpec(startup_timeout=60), PROMPTS, log_dir=tmp_path,
                   control=control)
    elapsed = time.monotonic() - t0
    assert stopped.is_set(), r.reason  # it was stopped with the scenario's requests sent
    assert r.verdict == "error"
    assert elapsed < deadline + 20
    assert r.reason.startswith("cold: ") and f"the run's deadline of {deadline} s" in r.reason
    assert "the engine did not answer in" in r.reason
    assert "(its process was stopped)" in r.reason
    assert [(s.scenario, s.verdict) for s in r.scenarios] == [("cold", "error"),
                                                              ("prefill_hit", "error")]
    assert_gone(pids)
    assert not wait_no_engines(no_engine_left_behind)


@pytest.mark.slow
def test_engine_stopped_at_start_is_an_error_at_the_deadline(tmp_path, no_engine_left_behind):
    """The deadline bounds start-up too: an engine stopped before it serves is not waited on for
    the whole start-up timeout."""
    matrix, configs = load(tmp_path / "m.yaml", {**EMBEDDED, "run_timeout_s": 5,
                                                 "include": [{"strategy": "auto"}]})
    pids = []

    def freeze(pid: int) -> None:
        pids.append(pid)
        os.killpg(pid, signal.SIGSTOP)

    t0 = time.monotonic()
    r = run_judged(configs[0], matrix, EngineSpec(startup_timeout=120), PROMPTS, log_dir=tmp_path,
                   control=harness.RunControl(events=OnEngine(freeze)))
    assert time.monotonic() - t0 < 5 + 15
    assert r.verdict == "error"
    assert r.reason == ("engine did not start: the run's deadline of 5 s (run_timeout_s) passed: "
                        "the engine did not start in time (its process was stopped)")
    assert r.scenarios == []
    assert_gone(pids)


@pytest.mark.slow
def test_request_timeouts_are_sized_to_the_work(tmp_path, monkeypatch, no_engine_left_behind):
    """A stopped engine under the default deadline: the request it does not answer times out after
    the time its work allows (far below the old 600 s), and the run says so."""
    from evalsvc.engines.client import work_seconds

    matrix, configs = load(tmp_path / "m.yaml", {**EMBEDDED, "include": [{"strategy": "auto"}]})
    frozen, pids = threading.Event(), []
    stop = stop_at_first_batch(monkeypatch, frozen)
    control = harness.RunControl(events=OnEngine(lambda pid: (pids.append(pid), stop(pid))))
    r = run_judged(configs[0], matrix, EngineSpec(startup_timeout=60), PROMPTS, log_dir=tmp_path,
                   control=control, run_timeout_s=1800)
    allowed = work_seconds([{"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}
                            for _, ids in PROMPTS])
    assert frozen.is_set(), r.reason
    assert allowed < 60
    assert r.verdict == "error"
    assert r.reason == (f"cold: EngineTimeout: the engine did not answer /generate in "
                        f"{allowed:.0f} s (its process was stopped); the engine was killed")
    assert [(s.scenario, s.verdict) for s in r.scenarios] == [("cold", "error")]
    assert r.seconds < 1800
    assert_gone(pids)


# ---- 5. a port taken by someone else -------------------------------------------------------------

@pytest.fixture()
def taken_port() -> Iterator[int]:
    """A port held bound and listening by another owner, which drops every connection (else the
    harness's health probe would wait out its 5 s timeout on each attempt)."""
    stop = threading.Event()

    def drop_connections(s: socket.socket) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                s.accept()[0].close()

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        s.settimeout(0.1)
        holder = threading.Thread(target=drop_connections, args=(s,), daemon=True)
        holder.start()
        yield s.getsockname()[1]
        stop.set()
        holder.join()


@pytest.mark.slow
def test_port_taken_on_every_attempt_is_an_error_saying_so(tmp_path, monkeypatch, taken_port):
    """The embedded engine on a port held by another socket: detected, retried once, reported."""
    calls = []
    monkeypatch.setattr(harness, "free_port", lambda: calls.append(taken_port) or taken_port)
    matrix, configs = load(tmp_path / "m.yaml", {**EMBEDDED, "include": [{"strategy": "auto"}]})
    r = run_judged(configs[0], matrix, EngineSpec(startup_timeout=120), PROMPTS, log_dir=tmp_path)
    assert calls == [taken_port, taken_port]  # one retry
    assert r.verdict == "error"
    assert r.reason.startswith(f"engine did not start: port {taken_port} is already in use")
    assert "address already in use" in r.reason.lower()  # the engine's own line, in the log tail
    assert r.scenarios == []


@pytest.mark.slow
def test_port_taken_only_at_the_first_attempt_runs_on_another(fake, tmp_path, monkeypatch,
                                                                taken_port):
    ports = iter([taken_port, harness.free_port()])
    monkeypatch.setattr(harness, "free_port", lambda: next(ports))
    r = run_judged(*fake, fake_spec("ok", tmp_path), PROMPTS, log_dir=tmp_path)
    assert r.verdict == "pass", r.reason
    assert next(ports, None) is None  # both ports were asked for
    port = int(r.command[r.command.index("--port") + 1])
    assert port != taken_port
    assert r.resolved_args["port"] == port
    pids = fake_pids(tmp_path)
    assert len(pids) == 2  # the attempt that could not bind, and the server that ran
    assert_gone(pids)


@pytest.fixture()
def answering_port() -> Iterator[tuple[int, list[str]]]:
    """A port another HTTP server listens on, answering 200 to everything (as an engine of another
    run would), with the paths it was asked for."""
    asked: list[str] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], asked
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.slow
def test_a_port_another_server_answers_on_is_never_taken_for_the_engines(
        fake, tmp_path, monkeypatch, answering_port):
    """Another server bound the port between ``free_port`` and the engine's own bind, and answers
    the health probe: the harness sees that the listening socket is not its engine's, stops the
    engine, and runs on another port; the other server is asked nothing past the probe."""
    port, asked = answering_port
    ports = iter([port, harness.free_port()])
    monkeypatch.setattr(harness, "free_port", lambda: next(ports))
    r = run_judged(*fake, fake_spec("ok", tmp_path), PROMPTS, log_dir=tmp_path)
    assert r.verdict == "pass", r.reason
    assert next(ports, None) is None  # both ports were asked for
    assert int(r.command[r.command.index("--port") + 1]) != port
    assert set(asked) == {"/health_generate"}
    assert_gone(fake_pids(tmp_path))


# ---- the radix-tree core the engine really runs ----------------------------------------------------

FALLBACK = ("Using the Python TreeCore: this installation contains neither the Rust TreeCore "
            "extension nor its sources")


@pytest.mark.slow
def test_tree_core_that_ran_is_recorded_and_a_run_that_got_another_is_invalid(tmp_path):
    """The fake is 0.5.23 (Rust by default), without its Rust core or with it."""
    matrix, configs = load(tmp_path / "core.yaml", {**FAKE, "include": [
        {"strategy": "extra_buffer", "overlap": True, "radix_tree_core": "rust"},
        {"strategy": "extra_buffer", "overlap": True}]})
    rust, default = configs
    assert (rust.name, default.name) == ("m-eb-ov-rustcore", "m-eb-ov")
    absent = fake_spec("ok", tmp_path, FAKE_SGLANG_VERSION="0.5.23",
                       FAKE_SGLANG_RUST_CORE="absent")
    r = run_judged(rust, matrix, absent, PROMPTS, log_dir=tmp_path / "absent")
    assert r.verdict == "invalid" and r.scenarios == []
    assert r.reason == f"radix_tree_core: asked 'rust', server runs 'python' ({FALLBACK})"
    assert r.resolved_args["radix_tree_core"] == "python"
    assert FALLBACK.endswith(r.resolved_args["radix_tree_core_fallback"])
    # asking for nothing: the release's default, recorded with its fallback, and not invalid
    r = run_judged(default, matrix, absent, PROMPTS, log_dir=tmp_path / "absent")
    assert r.verdict == "pass", r.reason
    assert r.resolved_args["radix_tree_core"] == "python"
    assert r.resolved_args["radix_tree_core_fallback"]
    present = fake_spec("ok", tmp_path, FAKE_SGLANG_VERSION="0.5.23")
    for config in (rust, default):
        r = run_judged(config, matrix, present, PROMPTS, log_dir=tmp_path / "present")
        assert r.verdict == "pass", r.reason
        assert (r.resolved_args["radix_tree_core"], r.resolved_args["radix_tree_core_fallback"]) == (
            "rust", None)
    assert_gone(fake_pids(tmp_path))


@pytest.mark.slow
def test_embedded_engine_takes_the_tree_core_variable_and_falls_back_as_sglang(tmp_path):
    matrix, configs = load(tmp_path / "core.yaml", {**EMBEDDED, "axes": {
        "strategy": ["extra_buffer"], "radix_tree_core": ["python", "rust"]}})
    by_core = {c.tree_core: c for c in configs}
    python = run_judged(by_core["python"], matrix, EngineSpec(), PROMPTS, log_dir=tmp_path)
    assert python.verdict == "pass", python.reason
    assert python.resolved_args["radix_tree_core"] == "python"
    rust = run_judged(by_core["rust"], matrix, EngineSpec(), PROMPTS, log_dir=tmp_path)
    assert rust.verdict == "invalid"
    assert rust.reason == ("radix_tree_core: asked 'rust', server runs 'python' (Using the Python "
                           "TreeCore: the embedded engine has no Rust TreeCore)")
    assert "Using the Python TreeCore: the embedded engine has no Rust TreeCore" in Path(
        rust.log_path).read_text()
