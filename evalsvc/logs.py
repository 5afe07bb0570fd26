"""Logging with the job and run a line belongs to.

``log_context(job=..., run=...)`` sets them for the current thread (context variables), and every
line logged through ``setup_logging``'s handler carries ``[job=... run=...]``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_job: ContextVar[str] = ContextVar("evalsvc_job", default="-")
_run: ContextVar[str] = ContextVar("evalsvc_run", default="-")
FORMAT = "%(asctime)s %(levelname)s %(name)s [job=%(job)s run=%(run)s] %(message)s"


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.job = _job.get()
        record.run = _run.get()
        return True


@contextmanager
def log_context(job: str | None = None, run: object | None = None) -> Iterator[None]:
    tokens = []
    if job is not None:
        tokens.append((_job, _job.set(job)))
    if run is not None:
        tokens.append((_run, _run.set(str(run))))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (test runners swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(level: int = logging.INFO) -> None:
    """Root logging to stderr in FORMAT; quiet HTTP client lines."""
    handler = _Stderr()
    handler.addFilter(ContextFilter())
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
