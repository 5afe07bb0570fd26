"""Engines, sessions and migrations of the results store."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
RETRY_SECONDS = 60.0  # how long a write is retried while the database server is unreachable
log = logging.getLogger("evalsvc.store")
T = TypeVar("T")

# SQLSTATE classes of a lost or refused server connection: 08 connection exception, 57P01-03
# admin/crash shutdown and "cannot connect now" (the server is starting or stopping)
_TRANSIENT_SQLSTATES = ("08", "57P01", "57P02", "57P03")


def transient(exc: BaseException) -> bool:
    """Whether a database error is a lost or refused connection that a retry may get past (the
    server restarting), not a fault of the statement or the storage. SQLite has no server: its
    OperationalErrors (a full disk, a locked file) are not retried here."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError):
        return False
    orig = exc.orig
    if orig is None or type(orig).__module__.startswith("sqlite3"):
        return False
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if state is None:  # no SQLSTATE: the client could not reach the server at all
        return True
    return state.startswith(_TRANSIENT_SQLSTATES)


def make_engine(url: str, **kwargs) -> Engine:
    """An engine for SQLite (a file, created with its folder) or any other SQLAlchemy URL."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    if not url.startswith("sqlite"):  # a server may have closed pooled connections (restart)
        kwargs.setdefault("pool_pre_ping", True)
    engine = create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record) -> None:  # foreign keys and concurrent readers
            cur = conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()
    return engine


def alembic_config(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()  # else its pooled connection stays open until garbage collection


class Store:
    """A migrated database and a session factory."""

    def __init__(self, url: str, migrate: bool = True,
                 retry_seconds: float = RETRY_SECONDS) -> None:
        self.url = url
        self.retry_seconds = retry_seconds
        if migrate:
            upgrade(url)
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: committed at the end, rolled back on any error."""
        with self._sessions() as s, s.begin():
            yield s

    def attempts(self, what: str = "a write") -> Iterator[AbstractContextManager[Session]]:
        """The tries of a write that is run again while the database server is unreachable (a
        lost or refused connection: ``transient``), with a backoff of 0.5 s doubling to 5 s, for
        up to ``retry_seconds``; then, or on any other error, the error is raised. Each try is a
        transaction of its own, its block the caller's::

            for attempt in store.attempts(f"run {run_id}: its start"):
                with attempt as s:
                    s.get(Run, run_id).status = "running"

        The loop ends once a try has committed. The block must be safe to run again (a failed
        try is rolled back, yet a commit whose answer was lost may have been applied), and must
        not ``return`` from inside the loop: a commit that fails after a ``return`` could not be
        tried again. Assign what the block makes and use it after the loop."""
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.5
        while True:
            lost: list[DBAPIError] = []
            yield self._attempt(lost)
            if not lost:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise lost[0]
            first = (str(lost[0].orig or lost[0]).strip().splitlines()
                     or [type(lost[0]).__name__])[0]
            log.warning("%s: the database is unreachable (%s); retrying in %.1f s", what, first,
                        min(delay, left))
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)

    @contextmanager
    def _attempt(self, lost: list[DBAPIError]) -> Iterator[Session]:
        """One try of ``attempts``: a transaction; a lost connection is kept in ``lost``."""
        try:
            with self.session() as s:
                yield s
        except DBAPIError as exc:
            if not transient(exc):
                raise
            lost.append(exc)

    def write(self, fn: Callable[[Session], T], what: str = "a write") -> T:
        """``fn(session)`` in the tries of ``attempts``; what it returns."""
        for attempt in self.attempts(what):
            with attempt as s:
                value = fn(s)
        return value

    def close(self) -> None:
        self.engine.dispose()
