"""The smoke job through the service on a real Ray cluster (a head and a CPU-only worker with two
``engine_slot``, token authentication on), in a loopback-only network namespace of the test's own:
the same results as the local dispatcher, runs spread over the slots, SGLang builds made on the
worker, a killed Ray worker retried or failed with a clear error, cancel, a killed service
resuming, and nothing left behind.

The steps run in ``tests/dispatch/ray_scenario.py`` under ``unshare --net``, once (one test: a
cluster takes minutes, and pytest-xdist's groups do not hold with pytest 9.2), and each ``check_``
below judges its report. Without ray (the ``ray`` extra) or network namespaces the test is skipped,
and fails when ``CI`` is set.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import in_ci
from tests.dispatch.ray_scenario import CONFIGS, FAKE_PYTHON, KILLED, PATCH, RETRIED, SLOTS
from tests.dispatch.raycluster import is_loopback

# the scenario has a deadline of its own, after which it is stopped and cleans up
SCENARIO_SECONDS = 840
ROOT = Path(__file__).parents[2]
KL_TOLERANCE = 1e-9  # nats; the embedded engine's fixed KL limit is 1e-8


def _unavailable(reason: str) -> None:
    if in_ci():
        pytest.fail(f"CI is set and the Ray dispatch test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def namespace_command() -> list[str]:
    """``unshare --net`` (root), or with a user namespace of its own where that is allowed."""
    for cmd in (["unshare", "--net"], ["unshare", "--net", "--map-root-user"]):
        try:
            ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return cmd
    _unavailable("cannot make a network namespace (`unshare --net` failed): Ray must run in a "
                 "loopback-only namespace here")
    raise AssertionError("unreachable")


def _die_with_the_test() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_scenario(work: Path) -> dict:
    if importlib.util.find_spec("ray") is None:
        _unavailable("ray is not installed (pip install -e '.[ray]')")
    cmd = namespace_command()
    out = work / "report.json"
    with open(work / "scenario.log", "wb") as log:
        proc = subprocess.Popen([*cmd, sys.executable, "-m", "tests.dispatch.ray_scenario",
                                 str(out), str(work / "work")], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=_die_with_the_test)
        try:
            proc.wait(SCENARIO_SECONDS)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the scenario stops the cluster and its services
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    tail = (work / "scenario.log").read_text(errors="replace")[-6000:]
    assert out.exists(), f"the scenario wrote no report (exit {proc.returncode}):\n{tail}"
    data = json.loads(out.read_text())
    data["scenario_log"] = tail
    print("Ray dispatch scenario, seconds:", data.get("seconds"),
          "; Ray connections tried again:", data.get("connect_retries"))
    return data


@pytest.mark.slow
@pytest.mark.timeout(SCENARIO_SECONDS + 300)
def test_the_smoke_job_on_a_ray_cluster(tmp_path):
    """One scenario (a cluster is minutes to start), judged by every check below; all failing
    checks are reported together."""
    report = run_scenario(tmp_path)
    assert "error" not in report, (f"{report['error']}\n--- service log:\n"
                                   f"{report.get('service_log_tail')}\n--- scenario:\n"
                                   f"{report['scenario_log']}")
    failed = []
    for check in CHECKS:
        try:
            check(report)
        except AssertionError as exc:
            failed.append(f"{check.__name__}: {exc}")
    assert not failed, "\n\n".join(failed)


def check_ray_cluster_runs_on_loopback_only(report):
    assert report["interfaces"] == ["lo"]
    assert report["listening"] and all(is_loopback(a) for a in report["listening"]), \
        report["listening"]
    assert report["cluster_resources"]["engine_slot"] == SLOTS


def check_same_results_as_the_local_dispatcher(report):
    """Same fingerprints and verdicts, KL within tolerance, the same cache hits; the engine logs
    and per-sample files came back to the service's data directory."""
    local, ray = report["local"], report["ray"]
    assert local["status"] == ray["status"] == "done"
    assert sorted(local["runs"]) == sorted(ray["runs"]) == sorted(CONFIGS)
    for config in CONFIGS:
        a, b = local["runs"][config], ray["runs"][config]
        assert a["fingerprint"] == b["fingerprint"], config
        assert a["verdict"] == b["verdict"] == "pass", (config, a["reason"], b["reason"])
        assert sorted(a["metrics"]) == sorted(b["metrics"]), config
        for scenario, ma in a["metrics"].items():
            mb = b["metrics"][scenario]
            assert abs(ma["kl_k3_mean"] - mb["kl_k3_mean"]) <= KL_TOLERANCE, (config, scenario)
            assert ma["hit_coverage"] == mb["hit_coverage"], (config, scenario)
            assert ma["cached_tokens_mean"] == mb["cached_tokens_mean"], (config, scenario)
            if "accept_length" in ma:
                assert math.isclose(ma["accept_length"], mb["accept_length"], rel_tol=1e-9)
        assert b["log_bytes"] and b["log_in_data_dir"], (config, b["log_path"])
        assert b["samples"], config


def check_runs_spread_over_the_slots(report):
    """Two runs at once, each engine seeing only the slot Ray assigned to its run, and none of the
    environment Ray gives its workers."""
    seen = report["engines_seen"]
    assert any(len(now) == SLOTS for now in seen), "never two engines at once"
    for now in seen:
        # nothing of Ray's environment reaches the engine: its token, its OMP_NUM_THREADS=1
        assert all(e["ray_env"] == [] and e["omp"] == report["omp"] for e in now), now
        assert all(e["nice"] == 0 for e in now), now  # the nodes run with RAY_worker_niceness=0
        devices = [e["devices"] for e in now]
        assert all(d in ("0", "1") for d in devices), devices
        assert len(set(devices)) == len(devices), f"two engines on one slot: {now}"
    slots = {line[2].rsplit("engine_slot ", 1)[1] for line in report["placements"]}
    assert slots == {"0", "1"}, report["placements"]


def check_sglang_builds_are_made_on_the_workers(report):
    """The service has no SGLang environment: the worker node makes the build over its own (the
    fake SGLang server's python), in its own data directory, and the run executes it; a build that
    cannot be made fails its job naming the patch and the node, with no run planned."""
    s = report["sglang"]
    assert s["status"] == "done", s
    assert [r["verdict"] for r in s["runs"].values()] == ["pass"], s["runs"]
    (build,) = s["builds"]
    assert build["sha"] == s["sha"] and build["manifest"]["commit"] == s["sha"]
    assert build["base_env"]["executable"] == FAKE_PYTHON, build["base_env"]
    assert s["worker_builds"] == [build["manifest"]["key"]]
    assert s["service_builds"] == []
    bad = s["bad"]
    assert bad["status"] == "failed" and bad["runs"] == 0, bad
    assert f"patch '{PATCH}' does not apply" in bad["error"] and "(on node " in bad["error"], bad


def check_a_killed_worker_retries_its_run(report):
    """SIGKILL of the Ray worker mid-run: its engine dies with it, Ray starts the run again, and
    the run's result is the local dispatcher's (above)."""
    retry = report["retry"]
    assert retry["engine_gone_after"] is not None and retry["engine_gone_after"] < 10, retry
    attempts = [int(a) for run, a, _ in report["placements"] if int(run) == retry["run"]]
    assert attempts == [1, 2], report["placements"]
    run = report["ray"]["runs"][RETRIED]
    assert run["status"] == "done" and run["verdict"] == "pass", run


def check_a_run_whose_worker_dies_twice_fails_clearly(report):
    kt = report["kill_twice"]
    assert kt["status"] == "failed"  # its only run errored
    assert all(k["engine_gone_after"] is not None for k in kt["kills"]), kt["kills"]
    run = kt["runs"][KILLED]
    assert run["status"] == "done" and run["verdict"] == "error", run
    assert "failed after 2 attempt(s)" in run["reason"], run["reason"]
    assert "WorkerCrashedError" in run["reason"], run["reason"]


def check_a_run_no_node_can_place_fails_at_once(report):
    """tp_size 4 with two slots on the one worker: an error naming the need and the most a node
    offers, without waiting for a node that will never come."""
    w = report["too_wide"]
    assert w["status"] == "failed", w  # its only run errored
    (run,) = w["runs"]
    assert run["status"] == "done" and run["verdict"] == "error", run
    assert f"offers {2 * SLOTS} engine_slot (the most one node offers: {SLOTS})" in run["reason"], \
        run["reason"]
    assert "dp_size x tp_size x pp_size" in run["reason"], run["reason"]
    assert w["seconds"] < 30, w


def check_cancel_stops_the_jobs_engines(report):
    c = report["cancel"]
    assert c["response"]["status"] == "cancelling" and c["status"] == "cancelled"
    assert all(status == "cancelled" for _, status, _ in c["runs"]), c["runs"]
    assert c["engines_left"] == []


def check_a_killed_service_resumes_its_job(report):
    """SIGKILL of the service: Ray kills its tasks' workers, their engines die with them, and the
    restarted service runs the job to its end."""
    r = report["restart"]
    assert r["engine_gone_after"] is not None, r
    assert r["status"] == "done", r
    assert r["resumed"], "the restarted service's log does not say the job resumes"
    assert sorted(r["runs"]) == sorted(CONFIGS[:2])
    assert all(run["verdict"] == "pass" for run in r["runs"].values()), r["runs"]


def check_nothing_left_behind(report):
    assert report["run_dirs_left"] == []
    assert report["left_behind"] == [], "processes ray start --block did not stop"
    assert report["after_stop"] == []
    assert report.get("cleanup_errors") is None, report.get("cleanup_errors")


CHECKS = [check_ray_cluster_runs_on_loopback_only, check_same_results_as_the_local_dispatcher,
          check_runs_spread_over_the_slots, check_sglang_builds_are_made_on_the_workers,
          check_a_killed_worker_retries_its_run,
          check_a_run_whose_worker_dies_twice_fails_clearly,
          check_a_run_no_node_can_place_fails_at_once, check_cancel_stops_the_jobs_engines,
          check_a_killed_service_resumes_its_job, check_nothing_left_behind]
