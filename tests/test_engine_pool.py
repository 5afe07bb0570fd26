"""``harness.EnginePool`` on the fake SGLang server: a second run of the same engine takes the one
the first left (no start-up), another engine is started for another config or environment, an
engine whose run did not end serving is stopped, and ``close`` stops the rest."""

from __future__ import annotations

import pytest

from evalsvc import harness
from evalsvc.harness import EnginePool
from tests.judged import run_judged
from tests.processes import exists
from tests.test_harness_errors import FAKE, PROMPTS, fake_pids, fake_spec, load

pytestmark = pytest.mark.slow


def test_runs_of_one_engine_share_it_and_others_do_not(tmp_path):
    matrix, configs = load(tmp_path / "fake.yaml", {
        **FAKE, "include": [{"strategy": "extra_buffer", "overlap": True},
                            {"strategy": "no_buffer", "overlap": False}]})
    spec = fake_spec("ok", tmp_path)
    with EnginePool() as engines:
        first = run_judged(configs[0], matrix, spec, PROMPTS, log_dir=tmp_path, engines=engines)
        again = run_judged(configs[0], matrix, spec, PROMPTS, log_dir=tmp_path, engines=engines)
        other = run_judged(configs[1], matrix, spec, PROMPTS, log_dir=tmp_path, engines=engines)
        env = run_judged(configs[0], matrix, spec.with_env({"FAKE_SGLANG_X": "1"}), PROMPTS,
                         log_dir=tmp_path, engines=engines)
        assert [r.verdict for r in (first, again, other, env)] == ["pass"] * 4
        assert first.startup_seconds > 0 and again.startup_seconds == 0.0
        assert other.startup_seconds > 0 and env.startup_seconds > 0
        assert again.command == first.command and again.log_path == first.log_path
        pids = fake_pids(tmp_path)
        assert len(set(pids)) == len(pids) >= 3  # three engines started, the first one reused
        assert all(exists(pid) for pid in pids)  # all three kept
    assert not any(exists(pid) for pid in pids)  # close stopped them


def test_an_engine_whose_run_failed_is_not_kept(tmp_path, monkeypatch):
    matrix, configs = load(tmp_path / "fake.yaml", FAKE)
    spec = fake_spec("ok", tmp_path)
    with EnginePool() as engines:
        control = harness.RunControl()
        asked = harness.EngineClient.server_info

        def cancelled_meanwhile(client):
            control.cancel()
            return asked(client)

        monkeypatch.setattr(harness.EngineClient, "server_info", cancelled_meanwhile)
        r = run_judged(configs[0], matrix, spec, PROMPTS, log_dir=tmp_path, control=control,
                       engines=engines)
        assert r.verdict == "cancelled"
        monkeypatch.setattr(harness.EngineClient, "server_info", asked)
        second = run_judged(configs[0], matrix, spec, PROMPTS, log_dir=tmp_path, engines=engines)
        assert second.verdict == "pass" and second.startup_seconds > 0  # a new engine
        first, *_ = fake_pids(tmp_path)
        assert not exists(first)
