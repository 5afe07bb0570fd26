"""One REST job followed from ``api/routes.py:create_job`` to its stored verdicts
(``tests/walk.py``): its call chain never calls back into a module already on its stack below
another, nor up into a higher layer (a callback on another thread). The service's cancel and
shutdown reach the job as events (``RunOptions.cancelled`` and ``stopping``), a transaction tried
again is a loop in its caller (``Store.attempts``), the dispatcher and the harness tell the job of
its runs by values on the job's queue (``RunEvent``: started, the engine's pid, ended), and nothing
hands the job a hook into the service."""

from __future__ import annotations

import pytest

from tests.walk import walk_job

pytestmark = pytest.mark.slow


def test_a_jobs_call_chain_calls_back_into_no_module():
    walk, job = walk_job()
    assert job["status"] == "done" and [r["verdict"] for r in job["runs"]] == ["pass"], job
    modules = {module for module, _ in walk.stops}
    # the walk went the whole way: the route, the runner, a slot, the harness, the record, the judge
    assert {"evalsvc/api/routes.py", "evalsvc/jobs/service.py", "evalsvc/jobs/run.py",
            "evalsvc/dispatch/local.py", "evalsvc/harness.py", "evalsvc/jobs/record.py",
            "evalsvc/judging.py", "evalsvc/store/record.py"} <= modules, sorted(modules)
    assert walk.reentries == {}, "\n".join(
        f"{caller} -> {callee} ({n}x)" for (caller, callee), n in sorted(walk.reentries.items()))
