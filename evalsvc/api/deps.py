"""What the routes depend on: the running services, a database session, and authentication."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from evalsvc.bisect import Bisector
from evalsvc.dispatch import make_dispatcher
from evalsvc.jobs import JobService, describe
from evalsvc.settings import Settings
from evalsvc.store.db import Store
from evalsvc.store.lock import StoreLock

log = logging.getLogger("evalsvc.api")
DURATION_BUCKETS = (5, 15, 30, 60, 120, 300, 600, 1800, 3600, float("inf"))


@dataclass
class Services:
    settings: Settings
    store: Store
    jobs: JobService
    bisector: Bisector
    nightly: object | None = None

    @classmethod
    def start(cls, settings: Settings, start_runner: bool = True) -> Services:
        """Open the store and start the runner. With the runner: the store's lock first
        (StoreLocked if another service runs on it), before anything is migrated or recovered."""
        lock = None
        if start_runner:
            lock = StoreLock(settings.resolved_database_url())
            lock.acquire()
        try:
            store = Store(settings.resolved_database_url())  # migrates to head
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        services = None
        try:
            jobs = JobService(settings, store, make_dispatcher(settings))
            services = cls(settings, store, jobs, Bisector(store, jobs))
            if start_runner:
                jobs.start(lock)  # the lock is the runner's now: jobs.stop() releases it
                services.bisector.resume()
                if settings.nightly:
                    from evalsvc.nightly import NightlyScheduler

                    services.nightly = NightlyScheduler.start(settings, jobs, store)
        except BaseException:
            if services is not None:
                services.stop()
            else:
                store.close()
            if lock is not None:
                lock.release()
            raise
        return services

    def stop(self) -> None:
        if self.nightly is not None:
            self.nightly.stop()
        self.bisector.stop()
        self.jobs.stop()
        self.store.close()

    def ping(self) -> None:
        with self.store.session() as s:
            s.execute(text("SELECT 1"))

    def health(self) -> str | None:
        """What keeps the service from working (the store unreachable, the runner stopped);
        None when healthy."""
        try:
            self.ping()
        except (SQLAlchemyError, OSError) as exc:
            return f"the store {self.store_shown()} is unreachable: {describe(exc)}"
        return self.jobs.runner_problem()

    def store_shown(self) -> str:
        return make_url(self.store.url).render_as_string(hide_password=True)

    def render_metrics(self) -> bytes:
        registry = CollectorRegistry()
        registry.register(_Collector(self))
        return generate_latest(registry)


class _Collector:
    def __init__(self, services: Services) -> None:
        self.services = services

    def collect(self):
        jobs = self.services.jobs
        c = jobs.counters
        yield GaugeMetricFamily("evalsvc_queue_length", "Jobs waiting to run.",
                                value=jobs.queue_length())
        yield GaugeMetricFamily("evalsvc_running_runs", "Runs executing now.",
                                value=jobs.running_runs())
        outcomes = CounterMetricFamily("evalsvc_job_outcomes", "Finished jobs by status.",
                                       labels=["status"])
        for status, n in sorted(c.outcomes.items()):
            outcomes.add_metric([status], n)
        yield outcomes
        seconds = list(c.run_seconds)
        buckets, acc = [], 0
        for bound in DURATION_BUCKETS:
            acc = sum(1 for x in seconds if x <= bound)
            buckets.append(("+Inf" if bound == float("inf") else str(bound), acc))
        yield HistogramMetricFamily("evalsvc_run_duration_seconds", "Run wall time.",
                                    buckets=buckets, sum_value=float(sum(seconds)))


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_session(services: Annotated[Services, Depends(get_services)]) -> Iterator[Session]:
    with services.store.session() as s:
        yield s


_bearer = HTTPBearer(auto_error=False)


def _check(tokens: list[str | None], creds: HTTPAuthorizationCredentials | None, what: str) -> None:
    wanted = [t for t in tokens if t]
    if not wanted:
        return
    given = creds.credentials.encode() if creds is not None else b""
    if not any(hmac.compare_digest(given, t.encode()) for t in wanted):
        raise HTTPException(status_code=401, detail=f"{what} needs a valid bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


def require_write(request: Request,
                  creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    _check([request.app.state.settings.api_token], creds, "this endpoint")


def require_read(request: Request,
                 creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    settings = request.app.state.settings
    if settings.read_token:  # the write token reads too
        _check([settings.read_token, settings.api_token], creds, "reading")


ServicesDep = Annotated[Services, Depends(get_services)]
SessionDep = Annotated[Session, Depends(get_session)]
