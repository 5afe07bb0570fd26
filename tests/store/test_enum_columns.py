"""Statuses and verdicts are stored as their strings and read back as the enums' members."""

from __future__ import annotations

from sqlalchemy import select, text

from evalsvc.store.models import Job
from evalsvc.types import JobStatus


def test_a_status_reads_back_as_its_enum_member(store):
    with store.session() as s:
        s.add(Job(id="j1", trigger="api", status=JobStatus.QUEUED, spec={}))
        s.add(Job(id="j2", trigger="api", status="running", spec={}))
    with store.session() as s:
        assert s.execute(text("SELECT status FROM jobs ORDER BY id")).scalars().all() == [
            "queued", "running"]
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
        assert [j.status for j in jobs] == [JobStatus.QUEUED, JobStatus.RUNNING]
        assert all(type(j.status) is JobStatus for j in jobs)
        assert s.scalars(select(Job.id).where(Job.status == JobStatus.RUNNING)).all() == ["j2"]
        assert s.scalars(select(Job.id).where(Job.status == "queued")).all() == ["j1"]
        assert s.scalars(select(Job.id).where(Job.status == "no-such")).all() == []


def test_a_value_the_enum_lacks_reads_back_as_it_is(store):
    with store.session() as s:
        s.execute(text("INSERT INTO jobs (id, trigger, status, priority, spec, created_at, "
                       "attempts) VALUES ('old', 'api', 'paused', 0, '{}', CURRENT_TIMESTAMP, 0)"))
    with store.session() as s:
        assert s.get(Job, "old").status == "paused"
