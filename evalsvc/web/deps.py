"""What the routes depend on: the running services, a database session, and authentication."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from evalsvc.bisect import Bisector
from evalsvc.dispatch import make_dispatcher
from evalsvc.jobs import JobService, describe
from evalsvc.settings import Settings
from evalsvc.store import shown_url
from evalsvc.store.audit import Actor
from evalsvc.store.db import Store
from evalsvc.store.lock import StoreLock
from evalsvc.store.sessions import revoked
from evalsvc.web.auth import OPEN_USER, Accounts, User
from evalsvc.web.middleware import USER_SCOPE_KEY, WRITES_OFF
from evalsvc.web.redact import Shown, for_reader

log = logging.getLogger("evalsvc.api")


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
        return shown_url(self.store.url)

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
        yield from c.collect_run_duration()


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_session(services: Annotated[Services, Depends(get_services)]) -> Iterator[Session]:
    with services.store.session() as s:
        yield s


def session_ended(app, session_id: str | None) -> bool:
    """Whether a dashboard session was ended by signing out (``evalsvc.store.sessions``); with
    no store open yet, no session can be checked: ended."""
    services: Services | None = getattr(app.state, "services", None)
    if services is None or session_id is None:
        return True
    with services.store.session() as s:
        return revoked(s, session_id)


def current_user(request: Request) -> User | None:
    """Who the request is (the guard found it: ``HttpGuard``); None: nobody."""
    if USER_SCOPE_KEY not in request.scope:  # an app without the guard: ask again
        accounts: Accounts = request.app.state.accounts
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip().encode() if scheme.lower() == "bearer" else b""
        headers = {k.lower(): v for k, v in request.scope.get("headers", [])}
        try:
            user = accounts.identify(bearer, request.scope.get("session"), headers)
            if (user is not None and user.how == "session"
                    and session_ended(request.app, user.session_id)):
                request.scope["session"].clear()
                user = accounts.identify(b"", None, headers)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        request.scope[USER_SCOPE_KEY] = user if user or accounts.guarded else OPEN_USER
    return request.scope[USER_SCOPE_KEY]


# the API's bearer scheme in the OpenAPI document (the token itself is read by current_user)
_bearer = HTTPBearer(auto_error=False)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def require_write(request: Request, _creds: BearerDep) -> User:
    """A user who may write through the API: a write account's bearer token (anyone, on a service
    with no accounts)."""
    accounts: Accounts = request.app.state.accounts
    user = current_user(request)
    if not accounts.guarded:
        return user or OPEN_USER
    if not accounts.writable:  # reads closed, so writes are not open
        raise HTTPException(status_code=403, detail=WRITES_OFF)
    if user is None or user.how != "token" or not user.can_write:
        raise HTTPException(status_code=401, detail="this endpoint needs a valid bearer token of "
                            "role write", headers={"WWW-Authenticate": "Bearer"})
    return user


def require_read(request: Request, _creds: BearerDep) -> User | None:
    """Whoever may read: anyone while reads are open, else a known user."""
    user = current_user(request)
    if user is None and request.app.state.accounts.reads_guarded:
        raise HTTPException(status_code=401, detail="reading needs a valid bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
    return user


def get_shown(request: Request) -> Shown:
    """How the request's user sees server paths in errors and reasons (``web.redact``)."""
    return for_reader(current_user(request), request.app.state.settings.data_dir)


def actor(user: User, via: str) -> Actor:
    return Actor(user.name, via)


ServicesDep = Annotated[Services, Depends(get_services)]
SessionDep = Annotated[Session, Depends(get_session)]
WriteUserDep = Annotated[User, Depends(require_write)]
ShownDep = Annotated[Shown, Depends(get_shown)]
