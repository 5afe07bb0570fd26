"""One run: launch a config's engine, check it runs what was asked, drive its scenarios, score them.

No store and no web here: a run is a function of plain data (a config, an engine spec, prompts) and
returns plain data (``RunResult``): measurements, not judgements (a scenario it measured is
``measured``; ``judging.judge_run`` judges the run where it is recorded or printed). A failing
scenario marks that scenario ``error`` and the rest go on; an engine that dies fails what is left
of the run with its log tail; an engine that does not answer a request in the time its work
allows, or a run past its deadline (``run_timeout``, engine start-up included), fails it the same
way and the engine is killed; the engine's whole process group is always taken down.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from evalsvc import metrics
from evalsvc.engines.base import EngineSpec, spawn
from evalsvc.engines.client import EngineClient, ScenarioError
from evalsvc.engines.launch import EngineProcess, EngineStartError, PortInUseError, free_port
from evalsvc.engines.registry import engine_kind
from evalsvc.engines.sglang_server import (
    QUIET_LOG_LEVELS,
    TREE_CORE_ENV,
    host_tier_size,
    parse_defect_events,
    parse_server_info,
    parse_tree_core,
    resolved_mismatches,
    tree_core_mismatch,
)
from evalsvc.matrix import Config, MatrixFile
from evalsvc.paths import inside
from evalsvc.scenarios import SCENARIO_RUNNERS, Context, Sample
from evalsvc.types import (
    EventQueue,
    RunEvent,
    RunResult,
    SampleFields,
    ScenarioResult,
    TopLogprobs,
    Verdict,
    worst,
)

log = logging.getLogger("evalsvc.harness")
DIVERGENCE_TOL = 1e-4  # |logprob difference| that counts as the first divergence


class RunControl:
    """Lets another thread watch a run's engine and stop the run (cancel): the engine's process
    group is stopped at once, and no further scenario starts. As soon as the run's engine process
    exists, a ``RunEvent(run_id, "engine", pid)`` goes on ``events`` (the job's queue: the job
    records the pid)."""

    def __init__(self, run_id: int = 0, events: EventQueue | None = None) -> None:
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._run_id = run_id
        self._events = events
        self.proc: EngineProcess | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def engine_started(self, proc: EngineProcess) -> None:
        with self._lock:
            self.proc = proc
            if self._events is not None:
                self._events.put(RunEvent(self._run_id, "engine", proc.proc.pid))
            if self.cancelled:
                proc.stop()

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            if self.proc is not None:
                self.proc.stop(grace=5)


class EnginePool:
    """Engines kept from one run to the next run of the same engine: the same command line (but
    the port) and environment, as a series of evaluations of one config has them (the false-alarm
    benchmark and its test). A run takes the engine a run before it left, or starts one; it leaves
    its engine when it ended with its engine serving (verdict measured or invalid),
    and stops it otherwise (an error, a cancel, a passed deadline). Every scenario starts from a
    flushed cache, so a run on a kept engine measures what one on a fresh engine does; it skips the
    start-up, and the server's own running totals (``avg_spec_accept_length`` in /server_info)
    count the runs before it too. ``close`` stops the engines left."""

    def __init__(self) -> None:
        self._idle: dict[str, EngineProcess] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(spec: EngineSpec, args: dict[str, Any]) -> str:
        fields = {k: v for k, v in spec.__dict__.items() if k != "startup_timeout"}
        return json.dumps([fields, args], sort_keys=True, default=str)

    def take(self, key: str) -> EngineProcess | None:
        with self._lock:
            proc = self._idle.pop(key, None)
        if proc is not None and not proc.alive():
            proc.stop()
            return None
        return proc

    def leave(self, key: str, proc: EngineProcess) -> None:
        with self._lock:
            other = self._idle.pop(key, None)
            self._idle[key] = proc
        if other is not None:
            other.stop()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle.values()), {}
        for proc in idle:
            proc.stop()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_timeout(matrix: MatrixFile, default: float | None = None) -> float:
    """A run's deadline in seconds: the matrix's ``run_timeout_s``, else ``default``, else the
    service setting (``EVALSVC_RUN_TIMEOUT_S``)."""
    if matrix.run_timeout_s is not None:
        return matrix.run_timeout_s
    if default is not None:
        return default
    from evalsvc.settings import Settings

    return Settings().run_timeout_s


class Watchdog:
    """The run's deadline: when it passes, the engine's process group is killed (SIGKILL, which a
    stopped process obeys too), so whatever waits on the engine fails at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.proc: EngineProcess | None = None
        self.client: EngineClient | None = None
        self.reason: str | None = None  # set when the deadline passed
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def engine(self, proc: EngineProcess) -> None:
        with self._lock:
            self.proc = proc
            if self.reason is not None:
                proc.kill()

    def _expire(self) -> None:
        with self._lock:
            proc = self.proc
            deadline = f"the run's deadline of {self.seconds:g} s (run_timeout_s) passed"
            if proc is None or proc.startup_seconds is None:
                self.reason = f"{deadline}: the engine did not start in time"
            elif self.client is not None:
                silent = time.monotonic() - self.client.last_answer
                self.reason = f"{deadline}: the engine did not answer in {silent:.0f} s"
            else:
                self.reason = f"{deadline}: the engine did not answer"
            if proc is not None:
                if proc.stopped():
                    self.reason += " (its process was stopped)"
                proc.kill()
        log.error("%s; the engine was killed", self.reason)


def hung_state(proc: EngineProcess) -> str:
    """Kills an engine that did not answer a request in time (it hangs: nothing more can run on
    it); what its state was, for the reason."""
    state = " (its process was stopped)" if proc.stopped() else ""
    proc.kill()
    return f"{state}; the engine was killed"


def run_config(config: Config, matrix: MatrixFile, spec: EngineSpec,
               prompts: list[tuple[str, list[int]]], log_dir: Path | None = None,
               reference: EngineClient | None = None, on_scenario=None,
               control: RunControl | None = None, run_timeout_s: float | None = None,
               engines: EnginePool | None = None) -> RunResult:
    """Run every scenario of one config on a fresh engine (or one ``engines`` kept), within the
    run's deadline (``run_timeout``: engine start-up included)."""
    t0 = time.monotonic()
    spec = spec.with_env({**matrix.engine_env, **config.env})
    result = config.unrun("error")  # until it has scored
    log_path = inside(log_dir, f"{config.name}.log") if log_dir else None
    result.log_path = str(log_path) if log_path else None
    proc: EngineProcess | None = None
    client: EngineClient | None = None
    watchdog = Watchdog(run_timeout(matrix, run_timeout_s))

    def spawned(p: EngineProcess) -> None:
        watchdog.engine(p)
        if control is not None:
            control.engine_started(p)

    key = EnginePool.key(spec, dict(config.args)) if engines is not None else ""
    kept = engines.take(key) if engines is not None else None
    try:
        with watchdog:
            if kept is not None:  # a run before this one left its engine: no start-up
                proc = kept
                spawned(proc)
                result.startup_seconds = 0.0
                result.log_path = str(proc.log_path) if proc.log_path else None
            else:
                # the deadline bounds start-up too (the watchdog ends it, a moment before this
                # would)
                proc = start_engine(config, replace(spec, startup_timeout=min(
                    spec.startup_timeout, watchdog.left() + 5)), log_path, on_spawn=spawned)
                result.startup_seconds = proc.startup_seconds
            result.command = proc.argv
            draft = config.args.get("speculative_num_draft_tokens")
            client = watchdog.client = EngineClient(
                proc.base_url, draft_tokens=draft, concurrency=matrix.workload.concurrency)
            _drive(result, proc, client, config, matrix, spec.kind, prompts, reference,
                   on_scenario, control, watchdog)
    except EngineStartError as exc:
        if control is not None and control.cancelled:
            result.verdict, result.reason = "cancelled", "the job was cancelled"
        elif watchdog.reason is not None:
            result.reason = f"engine did not start: {watchdog.reason}"
        else:
            result.reason = f"engine did not start: {exc}"
        if result.verdict != Verdict.CANCELLED:
            log.error("run %s: %s", config.name, result.reason)
    except Exception as exc:
        if control is not None and control.cancelled:  # its engine stopped by the cancel
            result.verdict, result.reason = "cancelled", "the job was cancelled"
        elif watchdog.reason is not None:
            result.verdict, result.reason = "error", watchdog.reason
        elif proc is not None and exited(proc):  # it died between scenarios (at /server_info)
            result.reason = f"{type(exc).__name__}: {exc}; {exit_reason(proc)}"
        else:
            result.reason = f"{type(exc).__name__}: {exc}"
        if result.verdict != Verdict.CANCELLED:
            log.exception("run %s failed", config.name)
    finally:
        if client is not None:
            client.close()
        if proc is not None:
            serving = (result.verdict in (Verdict.MEASURED, Verdict.INVALID)
                       and watchdog.reason is None and proc.alive()
                       and (client is None or client.timed_out is None)
                       and not (control is not None and control.cancelled))
            if engines is not None and serving:
                engines.leave(key, proc)
            else:
                proc.stop()
        result.seconds = time.monotonic() - t0
    return result


def _drive(result: RunResult, proc: EngineProcess, client: EngineClient, config: Config,
           matrix: MatrixFile, engine: str, prompts: list[tuple[str, list[int]]],
           reference: EngineClient | None, on_scenario, control: RunControl | None,
           watchdog: Watchdog) -> None:
    """The scenarios of a run on its started engine (of kind ``engine``); fills ``result``."""
    resolved = parse_server_info(client.server_info())
    result.resolved_args = {k: v for k, v in resolved.items() if not isinstance(v, dict | list)}
    problems = resolved_mismatches(config.args, resolved)
    if not config.args.get("disable_radix_cache"):  # no radix tree, no tree core
        asked = {**matrix.engine_env, **config.env}.get(TREE_CORE_ENV)
        core, why_unknown = tree_core(proc, config, engine, resolved.get("version"))
        result.resolved_args.update(core)
        mismatch = tree_core_mismatch(asked, core, why_unknown)
        if mismatch:
            problems.append(mismatch)
    if problems:
        result.verdict, result.reason = "invalid", "; ".join(problems)
        log.warning("run %s invalid: %s", config.name, result.reason)
        return
    host_tokens, host_states = host_tier_size(resolved)
    ctx = Context(client=client, reference=reference or client, prompts=prompts,
                  max_new_tokens=matrix.workload.max_new_tokens,
                  temperature=matrix.workload.temperature,
                  seed=(matrix.workload.seed if matrix.workload.sampling_seed is None
                        else matrix.workload.sampling_seed),
                  track_interval=int(resolved.get("mamba_track_interval") or 256),
                  max_total_tokens=resolved.get("max_total_tokens")
                  or resolved.get("max_total_num_tokens"),
                  host_tokens=host_tokens, host_states=host_states,
                  device_states=resolved.get("max_mamba_cache_size"),
                  chunk_size=resolved.get("chunked_prefill_size"),
                  rid_prefix=f"{uuid.uuid4().hex[:8]}-", log_path=proc.log_path)
    for name in config.scenarios:
        if control is not None and control.cancelled:
            break
        scen = run_scenario(name, ctx, config, matrix, resolved)
        reason = None
        if scen.verdict == Verdict.ERROR:
            if watchdog.reason is not None:  # the deadline passed: the engine was killed
                reason = watchdog.reason
                scen.reason = f"{scen.reason}; {reason}"
            elif client.timed_out is not None:  # a hung engine: killed, nothing more to run
                state = hung_state(proc)
                reason = f"{client.timed_out}{state}"
                scen.reason = (f"{scen.reason}{state}" if str(client.timed_out) in scen.reason
                               else f"{scen.reason}; {reason}")
            elif exited(proc):
                reason = exit_reason(proc)
                # say so in this scenario's reason too, not only in the ones it skips
                scen.reason = f"{scen.reason}; {reason}"
        result.scenarios.append(scen)
        if on_scenario is not None:
            on_scenario(config, scen)
        if reason is not None:
            for rest in config.scenarios[len(result.scenarios):]:
                result.scenarios.append(ScenarioResult(rest, "error", reason))
            break
    if control is not None and control.cancelled:
        result.verdict, result.reason = "cancelled", "the job was cancelled"
        return
    result.verdict, reason = worst((s.scenario, s.verdict, s.reason) for s in result.scenarios)
    if reason is not None:  # the first scenario that decided it, named
        result.reason = reason


TREE_CORE_LOG_BYTES = 8 << 20  # the fallback line comes at start-up, before the server serves


def tree_core(proc: EngineProcess, config: Config, engine: str,
              version: str | None) -> tuple[dict[str, Any], str]:
    """The radix-tree core the engine runs, read from the start of its log with the variable its
    environment really had (``parse_tree_core``); and why the log cannot tell, if it cannot."""
    why = ""
    log_text = None
    level = str(config.args.get("log_level") or "info").lower()
    if proc.log_path is None:
        why = "the engine has no log"
    elif level in QUIET_LOG_LEVELS:
        why = f"--log-level {level} hides SGLang's 'Using the Python TreeCore' line"
    else:
        try:
            with open(proc.log_path, "rb") as f:
                log_text = f.read(TREE_CORE_LOG_BYTES).decode(errors="replace")
        except OSError as exc:
            why = f"its log cannot be read: {exc}"
    core = parse_tree_core(log_text, asked=proc.env.get(TREE_CORE_ENV), version=version,
                           embedded=not engine_kind(engine).rust_tree_core)
    return core, why


def exit_reason(proc: EngineProcess) -> str:
    return f"the engine exited with code {proc.proc.poll()}{proc._tail()}"


def exited(proc: EngineProcess, wait: float = 0.5) -> bool:
    """Whether the engine has exited. Waits up to ``wait`` seconds: a server that dies closes its
    connections (failing the scenario) a moment before it can be reaped."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.proc.wait(wait)
    return not proc.alive()


def start_engine(config: Config, spec: EngineSpec, log_path: Path | None, attempts: int = 2,
                 on_spawn=None) -> EngineProcess:
    """Launch on a free port (another port if the one picked was taken meanwhile) and wait until
    it is healthy; ``on_spawn(proc)`` as soon as its process exists (a stop during start-up kills
    it). A start that fails stops its process."""
    for attempt in range(attempts):
        port = free_port()
        log.info("run %s: starting engine on port %d", config.name, port)
        proc = spawn(spec, config.args, port, log_path)
        try:
            if on_spawn is not None:
                on_spawn(proc)
            proc.wait_ready()
            return proc
        except PortInUseError as exc:
            proc.stop()
            if attempt == attempts - 1:
                raise
            log.warning("run %s: %s; trying another port", config.name, str(exc).split(":")[0])
        except BaseException:
            proc.stop()
            raise
    raise AssertionError("unreachable")


def run_scenario(name: str, ctx: Context, config: Config, matrix: MatrixFile,
                 resolved: dict[str, Any]) -> ScenarioResult:
    """One scenario, measured (``score``: verdict ``measured``, or ``error``)."""
    t0 = time.monotonic()
    start = log_size(ctx.log_path)
    try:
        samples = SCENARIO_RUNNERS[name](ctx)
        result = score(name, samples, config, matrix, resolved)
        note_defect_events(result, read_defect_events(ctx.log_path, start), ctx.rid_prefix)
    except (ScenarioError, ValueError, OSError) as exc:
        log.warning("run %s scenario %s: %s", config.name, name, exc)
        result = ScenarioResult(name, "error", f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        log.exception("run %s scenario %s", config.name, name)
        result = ScenarioResult(name, "error", f"{type(exc).__name__}: {exc}")
    result.seconds = time.monotonic() - t0
    return result


def log_size(path: Path | None) -> int:
    try:
        return os.path.getsize(path) if path is not None else 0
    except OSError:
        return 0


def read_defect_events(path: Path | None, start: int) -> list[tuple[str, str]]:
    """The defect events (``parse_defect_events``) a server logged from byte ``start`` on."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return parse_defect_events(f.read().decode(errors="replace"))
    except OSError:
        return []


def note_defect_events(result: ScenarioResult, events: list[tuple[str, str]],
                       rid_prefix: str) -> None:
    """Lay what a planted defect logged beside the samples: each sample row says which defects
    reached its request (``defect_acted``), the metric ``defect_acted`` counts those samples, and
    the reason names them, so a run shows where the bug really acted."""
    if not events:
        return
    ids = [row["sample_id"] for row in result.samples]
    reached: dict[str, set[str]] = {}
    others: dict[str, int] = {}
    for defect, rid in events:
        sample = rid.removeprefix(rid_prefix) if rid.startswith(rid_prefix) else None
        if sample in ids:
            reached.setdefault(defect, set()).add(sample)
        else:
            reached.setdefault(defect, set())
            others[defect] = others.get(defect, 0) + 1
    for row in result.samples:
        row["defect_acted"] = sorted(d for d, got in reached.items() if row["sample_id"] in got)
    notes = []
    for defect, got in reached.items():
        named = [i for i in ids if i in got]
        text = f"{defect} acted on {len(named)} of {len(ids)} measured requests"
        if named:
            text += f" ({', '.join(named)})"
        if others.get(defect):
            text += f" and on {others[defect]} other requests"
        notes.append(text)
    result.metrics["defect_acted"] = sum(bool(row["defect_acted"]) for row in result.samples)
    result.reason = "; ".join(r for r in (result.reason, *notes) if r)


def score(name: str, samples: list[Sample], config: Config, matrix: MatrixFile,
          resolved: dict[str, Any]) -> ScenarioResult:
    """KL estimators, hit coverage and acceptance of one scenario: measured, not judged (verdict
    ``measured``; ``judging.judge_run`` judges it, where the run is recorded or printed).

    Every sample's tokens are scored in one pass (``metrics.token_kl_by_sample``), decode and
    extend apart; per-sample values equal those of the sample's own arrays, bit for bit."""
    try:
        kl = metrics.token_kl_by_sample([s.completion.logprobs for s in samples],
                                        [s.reference for s in samples], DIVERGENCE_TOL)
        ext = metrics.token_kl_by_sample([s.extend for s in samples],
                                         [s.extend_reference for s in samples])
    except ValueError:
        for s in samples:  # the first bad sample's error, in the order the samples are read
            metrics.token_kl(s.completion.logprobs, s.reference)
            metrics.token_kl(s.extend, s.extend_reference)
            if (s.completion.top is not None and s.reference_top is not None
                    and len(s.completion.logprobs)):
                metrics.topk_kl_and_same_top(s.completion.top.positions,
                                             s.reference_top.positions)
        raise
    rows: list[SampleFields] = []
    topk_vals, same_top = [], []
    per_sample = zip(kl.lengths.tolist(), kl.k1_mean.tolist(), kl.k2_mean.tolist(),
                     kl.k3_mean.tolist(), kl.k3_max.tolist(), kl.first_above.tolist(),
                     ext.lengths.tolist(), ext.k3_mean.tolist(), ext.k3_max.tolist(), strict=True)
    with collections_held():
        for s, values in zip(samples, per_sample, strict=True):
            dec_top, ref_top = _top_arrays(s.completion.top), _top_arrays(s.reference_top)
            row = sample_row(s, *values, top_arrays=(dec_top, ref_top))
            if s.completion.top is not None and s.reference_top is not None and values[0]:
                tk, st = metrics.topk_kl_and_same_top(s.completion.top.positions,
                                                      s.reference_top.positions, dec_top, ref_top)
                topk_vals.append(tk)
                same_top.append(st)
                row["topk_kl_mean"] = float(tk.mean())
                row["same_top_rate"] = float(st.mean())
            rows.append(row)
    m: dict[str, Any] = {}
    if kl.k3.size:
        nonempty = kl.lengths > 0
        kl_summary = metrics.summarize_pooled_kl(kl.k3, kl.k3_mean[nonempty],
                                                 int((~nonempty).sum()), seed=0)
        m.update({f"kl_k3_{k}": v for k, v in kl_summary.items()})
        for est in ("k1", "k2"):
            m[f"kl_{est}_mean"] = float(np.mean([r[f"kl_{est}_mean"] for r in rows]))
    if ext.k3.size:
        nonempty = ext.lengths > 0
        summary = metrics.summarize_pooled_kl(ext.k3, ext.k3_mean[nonempty],
                                              int((~nonempty).sum()), seed=0)
        m.update({f"extend_kl_k3_{k}": summary[k] for k in (
            "mean", "ci_low", "ci_high", "n_samples", "n_tokens", "p99", "max")})
    if topk_vals:
        m["topk_kl_mean"] = float(np.concatenate(topk_vals).mean())
        m["same_top_rate"] = float(np.concatenate(same_top).mean())
    if kl.k3.size:  # the mean of one boolean per token: the count of equal ones over all
        m["bit_exact_fraction"] = kl.equal / kl.k3.size
    divergences = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    m["first_divergence_min"] = min(divergences) if divergences else None
    m["samples_diverged"] = len(divergences)
    hits = sum(s.hit for s in samples)
    m["hit_coverage"] = hits / len(samples) if samples else 0.0
    m["cached_tokens_mean"] = float(np.mean([s.completion.cached_tokens for s in samples]))
    counters = [s.completion.spec for s in samples if s.completion.spec is not None]
    if counters:
        m.update({f"accept_{k}": v for k, v in metrics.summarize_acceptance(
            counters, resolved.get("avg_spec_accept_length")).items()})
        m["accept_length"] = metrics.sglang_accept_length(counters)
    return ScenarioResult(name, "measured", "", m, rows)


@contextlib.contextmanager
def collections_held():
    """Holds off Python's cyclic garbage collector (as it was, after): building a row per sample
    allocates enough containers to start a full collection now and then, and with a scenario's
    sample lists in memory (10 million floats) that one walks them all: 0.65 s measured, longer
    than the scoring. Nothing built here is cyclic."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def sample_row(s: Sample, n: int, k1_mean: float, k2_mean: float, k3_mean: float,
               k3_max: float, first_divergence: int, n_extend: int, extend_mean: float,
               extend_max: float, top_arrays: tuple[Any, Any] = (None, None)) -> SampleFields:
    """One sample's row: its ``n`` generated tokens' mean k1/k2/k3 and max k3 (nats), the index of
    the first whose logprobs differ by more than DIVERGENCE_TOL (-1: none), the same of its
    ``n_extend`` extend tokens, and both sides' logprobs and the output ids: the sample's own
    lists (Python floats, as ``parse_completion`` and ``add_reference`` make them), not copies:
    a copy of ten million floats takes longer than all of the scoring. ``top_arrays``: the
    ``metrics.top_arrays`` of both sides' top-k lists, when made."""
    return {
        "sample_id": s.sample_id, "prompt_id": s.prompt_id, "prompt_tokens": len(s.prompt_ids),
        "cached_tokens": s.completion.cached_tokens,
        "host_cached_tokens": s.completion.host_cached_tokens, "hit": s.hit,
        "completion_tokens": n,
        "kl_k1_mean": float(k1_mean) if n else 0.0,
        "kl_k2_mean": float(k2_mean) if n else 0.0,
        "kl_k3_mean": float(k3_mean) if n else 0.0,
        "kl_k3_max": float(k3_max) if n else 0.0,
        "first_divergence": first_divergence if first_divergence >= 0 else None,
        # the extend: prompt tokens prefilled on the cached prefix, against the cold reference
        "extend_tokens": n_extend,
        "extend_kl_k3_mean": float(extend_mean) if n_extend else None,
        "extend_kl_k3_max": float(extend_max) if n_extend else None,
        "extend_ids": _as_list(s.extend_ids),
        "extend_logprobs": _as_list(s.extend),
        "extend_reference_logprobs": _as_list(s.extend_reference),
        "output_ids": _as_list(s.completion.token_ids),
        "decode_logprobs": _floats(s.completion.logprobs),
        "reference_logprobs": _floats(s.reference),
        "accept_length": (s.completion.spec.completion_tokens / s.completion.spec.verify_ct
                          if s.completion.spec else None),
        # both sides' top-k candidates per generated token, for the drill-down
        **_top_columns("decode", s.completion.top, top_arrays[0]),
        **_top_columns("reference", s.reference_top, top_arrays[1]),
    }


def _as_list(values: Sequence[Any]) -> list[Any]:
    return values if type(values) is list else list(values)


def _floats(values: Sequence[float] | np.ndarray) -> list[float]:
    """``values`` as a list of Python floats: a list as it is (its items are floats), anything
    else converted."""
    if type(values) is list:
        return values
    return np.asarray(values, dtype=np.float64).tolist()


def _top_arrays(top: TopLogprobs | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``metrics.top_arrays`` of a side's lists; None without them or when they do not convert
    (the lists are then read as they are, and their errors named where they are read)."""
    if top is None or None in top.positions:
        return None
    try:
        return metrics.top_arrays(top.positions)
    except (TypeError, ValueError):
        return None


def _top_columns(side: str, top: TopLogprobs | None,
                 arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> dict[str, Any]:
    """Both columns of a side's top-k lists: per position, the ids (ints) and logprobs (floats,
    None for a missing one)."""
    if top is None:
        return {f"{side}_top_ids": None, f"{side}_top_logprobs": None}
    if arrays is not None and not np.isnan(arrays[1][arrays[2]]).any():
        ids, lps, valid = arrays
        id_rows, lp_rows = ids.tolist(), lps.tolist()
        if not valid.all():  # shorter lists: each position's own entries
            lengths = valid.sum(axis=1).tolist()
            id_rows = [row[:k] for row, k in zip(id_rows, lengths, strict=True)]
            lp_rows = [row[:k] for row, k in zip(lp_rows, lengths, strict=True)]
        return {f"{side}_top_ids": id_rows, f"{side}_top_logprobs": lp_rows}
    positions = [pos or [] for pos in top.positions]
    return {f"{side}_top_ids": [[int(t) for t, _ in pos] for pos in positions],
            f"{side}_top_logprobs": [[None if lp is None else float(lp) for _, lp in pos]
                                     for pos in positions]}
