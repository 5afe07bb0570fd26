"""One job runner per store: a lock held for the runner's life.

SQLite: an exclusive ``fcntl.flock`` on ``<database>.lock`` beside the database file. PostgreSQL
(or any other server database): ``pg_try_advisory_lock`` on a connection of its own, kept open as
long as the lock is held. The operating system or the server drops the lock when the process dies,
so a killed service leaves nothing to clean up. A SQLite database in memory needs no lock.

A PostgreSQL restart ends the session that held the advisory lock, and the lock with it: the runner
calls ``keep()`` before it takes up each job, which takes the lock again on a new session, or
raises StoreLocked when another service took it meanwhile (the runner then takes no job and says
so on ``/healthz`` until the lock is its own again).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from evalsvc.store import shown_url

# the advisory lock's key, the same in every evalsvc (b"evalsvc\0" as a big-endian int64)
ADVISORY_KEY = 0x6576616C73766300


class StoreLocked(RuntimeError):
    """The store is in use by another service; the message names the store."""


def lock_path(url: str) -> Path | None:
    """The lock file of a SQLite database file; None for other databases and memory."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        return None
    if not u.database or u.database == ":memory:" or u.database.startswith("file::memory:"):
        return None
    return Path(u.database).resolve().with_name(Path(u.database).name + ".lock")


class StoreLock:
    """``acquire()`` or StoreLocked; ``release()`` (idempotent)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.shown = shown_url(url)
        self._fd: int | None = None
        self._engine: Engine | None = None
        self._conn: Connection | None = None
        self._lost = False  # the advisory lock was held, and its session ended

    @property
    def held(self) -> bool:
        return self._fd is not None or self._conn is not None

    def acquire(self) -> None:
        if self.held:
            return
        if make_url(self.url).get_backend_name() == "sqlite":
            self._acquire_file()
        else:
            self._acquire_advisory()

    def _acquire_file(self) -> None:
        path = lock_path(self.url)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLocked(f"the store {self.shown} is in use by another evalsvc service "
                              f"(it holds the lock file {path}); stop it first") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def _acquire_advisory(self) -> None:
        engine = create_engine(self.url, poolclass=NullPool)
        try:
            conn = engine.connect()
        except BaseException:
            engine.dispose()
            raise
        try:
            got = conn.execute(text("SELECT pg_try_advisory_lock(:key)"),
                               {"key": ADVISORY_KEY}).scalar()
            conn.commit()  # the lock is the session's: it outlives the transaction
        except BaseException:
            conn.close()
            engine.dispose()
            raise
        if not got:
            conn.close()
            engine.dispose()
            raise StoreLocked(f"the store {self.shown} is in use by another evalsvc service (it "
                              f"holds the advisory lock {ADVISORY_KEY}); stop it first")
        self._engine, self._conn = engine, conn

    def keep(self) -> None:
        """Make sure the lock is still held (see the module docstring); StoreLocked if another
        service holds it now, the database's error while the server cannot be reached."""
        if self._conn is None and not self._lost:
            return  # a file lock lasts as long as its descriptor
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                self._conn.commit()
                return  # the session is alive, so is its lock
            except SQLAlchemyError:
                pass
            conn, engine = self._conn, self._engine
            self._conn = self._engine = None
            with contextlib.suppress(SQLAlchemyError):
                conn.close()
            engine.dispose()
            self._lost = True
        self._acquire_advisory()
        self._lost = False

    def release(self) -> None:
        self._lost = False
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:  # closing the session drops the lock too, should the unlock fail
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": ADVISORY_KEY})
                conn.commit()
            except SQLAlchemyError:
                pass
            finally:
                conn.close()
                self._engine.dispose()
                self._engine = None
