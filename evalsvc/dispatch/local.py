"""Runs on this machine: one thread per engine slot."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from evalsvc.dispatch.base import RunTask, execute, prepare_build
from evalsvc.harness import RunControl
from evalsvc.types import EventQueue, RunEvent, RunResult, Verdict


class LocalDispatcher:
    """``slots`` runs at once; SGLang builds made and found in ``builds_dir``. ``execute``: how a
    slot runs a task (default: ``dispatch.base.execute``; ``evalsvc run`` runs its own, with its
    reference servers, kept engines and progress)."""

    def __init__(self, slots: int = 1, builds_dir: Path | None = None,
                 execute: Callable[[RunTask, RunControl], RunResult] | None = None) -> None:
        self.slots = slots
        self.builds_dir = builds_dir
        self._execute = execute
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="engine-slot")
        self._controls: dict[int, tuple[str, RunControl]] = {}
        self._lock = threading.Lock()

    def submit(self, task: RunTask, events: EventQueue | None = None) -> Future:
        control = RunControl(task.run_id, events)
        with self._lock:
            self._controls[task.run_id] = (task.job_id, control)
        return self._pool.submit(self._run, task, control, events)

    def _run(self, task: RunTask, control: RunControl, events: EventQueue | None) -> RunResult:
        try:
            if control.cancelled:  # cancelled while it waited for a slot
                return task.outcome(Verdict.CANCELLED, "the job was cancelled")
            if events is not None:
                events.put(RunEvent(task.run_id, "started"))
            if self._execute is not None:
                return self._execute(task, control)
            return execute(task, control, builds_dir=self.builds_dir)
        finally:
            with self._lock:
                self._controls.pop(task.run_id, None)

    def prepare_build(self, source: str | None, patches: list[str], python: str | None,
                      env_name: str | None = None) -> dict[str, Any]:
        return prepare_build(source, patches, python, self.builds_dir)

    def cancel_job(self, job_id: str) -> None:
        with self._lock:
            controls = [c for j, c in self._controls.values() if j == job_id]
        for control in controls:
            control.cancel()

    def shutdown(self) -> None:
        with self._lock:
            controls = [c for _, c in self._controls.values()]
        for control in controls:
            control.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
