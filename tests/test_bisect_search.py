"""The bisection's search on its own (the first bad candidate, in few questions), and the job
service waking a step that waits on its job."""

from __future__ import annotations

import math
import threading
import time

import pytest

from evalsvc.bisect import first_bad
from evalsvc.jobs import JobCreate, JobService
from evalsvc.settings import Settings
from evalsvc.store.db import Store


def asked(candidates, first):
    """first_bad over candidates whose index ``first`` on are bad (None: all good)."""
    questions = []

    def is_bad(c):
        questions.append(c)
        return first is not None and c >= first

    return first_bad(candidates, is_bad), questions


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16, 33])
def test_it_finds_the_first_bad_candidate_in_few_questions(n):
    candidates = list(range(n))
    for first in range(n):
        found, questions = asked(candidates, first)
        assert found == first
        assert questions[0] == n - 1  # the bad end first
        assert len(questions) == len(set(questions)) <= math.ceil(math.log2(n)) + 1


def test_a_good_last_candidate_has_nothing_to_bisect():
    found, questions = asked(list(range(5)), None)
    assert found is None and questions == [4]
    assert first_bad([], lambda c: True) is None


def test_who_waits_on_a_job_is_woken_when_the_service_ends_one(tmp_path):
    """``JobService.wait_end``: at once for an end written after the count was taken, and after
    its timeout when none was."""
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'j.db'}")
    store = Store(settings.resolved_database_url())
    jobs = JobService(settings, store, dispatcher=None)
    try:
        job_id = jobs.submit(JobCreate(matrix="smoke"))
        seen = jobs.ends()
        t0 = time.monotonic()
        assert jobs.wait_end(seen, timeout=0.2) == seen and time.monotonic() - t0 >= 0.2
        woken = threading.Event()
        waiter = threading.Thread(target=lambda: (jobs.wait_end(seen, timeout=60), woken.set()))
        waiter.start()
        assert jobs.cancel(job_id) == "cancelled"
        assert woken.wait(10) and jobs.ends() == seen + 1
        waiter.join()
    finally:
        store.close()
