"""Store.write: a lost or refused server connection is retried for a bounded time; any other error
(SQLite's included) is raised at once. The retry that gets through a real PostgreSQL restart is in
tests/test_faults.py."""

from __future__ import annotations

import logging
import time

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from evalsvc.store.db import Store, transient
from evalsvc.store.models import Commit
from tests.api.conftest import free_port


def test_write_retries_an_unreachable_server_for_its_window_then_raises(caplog):
    store = Store(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres",
                  migrate=False, retry_seconds=2)
    calls = []
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, "evalsvc.store"), \
                pytest.raises(OperationalError) as err:
            store.write(lambda s: calls.append(s.execute(text("SELECT 1"))), "a test write")
        took = time.monotonic() - t0
    finally:
        store.close()
    assert transient(err.value)
    assert 2 <= took < 30, took  # the window, not more than a few pauses past it
    retries = [r for r in caplog.records if "a test write: the database is unreachable" in r.message]
    assert len(retries) >= 2, caplog.text
    assert not calls


def test_write_returns_and_raises_other_errors_at_once(db_url):
    """A duplicate key or a missing table (SQLite: an OperationalError too) is raised on the first
    attempt, within the retry window's first pause."""
    store = Store(db_url, retry_seconds=60)
    attempts = []

    def add(s):
        attempts.append("add")
        s.add(Commit(ref="r@1", repository="r", sha="1"))
        s.flush()
        return "added"

    def missing(s):
        attempts.append("missing")
        s.execute(text("SELECT * FROM no_such_table"))

    try:
        assert store.write(add) == "added"
        t0 = time.monotonic()
        with pytest.raises(IntegrityError) as dup:
            store.write(add)
        with pytest.raises(DBAPIError) as bad:
            store.write(missing)
        assert time.monotonic() - t0 < 10
    finally:
        store.close()
    assert not transient(dup.value) and not transient(bad.value)
    assert attempts == ["add", "add", "missing"]


def test_attempts_run_the_block_again_after_a_lost_connection_and_stop_once_it_commits(db_url):
    """``for attempt in store.attempts(): with attempt as s: ...``: a try that loses its connection
    is rolled back and the block runs again; the loop ends after the try that commits."""
    store = Store(db_url, retry_seconds=60)
    tries = []
    try:
        for attempt in store.attempts("a test write"):
            with attempt as s:
                tries.append(len(tries))
                s.add(Commit(ref=f"r@{len(tries)}", repository="r", sha=str(len(tries))))
                s.flush()
                if len(tries) == 1:  # as psycopg's lost connection reaches SQLAlchemy
                    raise DBAPIError("SELECT 1", {}, Exception("server closed the connection"),
                                     connection_invalidated=True)
        with store.session() as s:
            refs = sorted(c.ref for c in s.query(Commit))
    finally:
        store.close()
    assert tries == [0, 1]
    assert refs == ["r@2"], "the lost try was not rolled back, or the loop went on after a commit"
