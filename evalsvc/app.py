"""The service's composition root: one FastAPI app over the store and the job runner
(``create_app(settings)``), with the REST API (``api/``, under ``/api/v1``) and the dashboard
(``dashboard/``) mounted side by side, the guard and session middleware, the error handlers,
``/healthz`` and ``/metrics``. What the two share lives in ``web/``."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.sessions import SessionMiddleware

from evalsvc import __version__
from evalsvc.api import routes
from evalsvc.dashboard import mount_dashboard
from evalsvc.jobs import describe
from evalsvc.settings import Settings
from evalsvc.store.lock import StoreLocked
from evalsvc.validation import describe_errors
from evalsvc.web.auth import Accounts, session_secret
from evalsvc.web.deps import Services, require_read, session_ended
from evalsvc.web.middleware import HttpGuard

log = logging.getLogger("evalsvc.api")
SESSION_COOKIE = "evalsvc_session"


def _unparseable_body(exc: StarletteHTTPException) -> str | None:
    """Why a JSON body could not be decoded, when ``exc`` is FastAPI's bare 400 for it (the body's
    bytes are not UTF-8, an integer has too many digits, the nesting is too deep); else None."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return f"not UTF-8 text ({cause.reason} at byte {cause.start})"
    if isinstance(cause, RecursionError):
        return "nested too deeply"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return f"an integer with too many digits ({cause})"
    return None


def create_app(settings: Settings | None = None, *, start_runner: bool = True) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            services = Services.start(settings, start_runner=start_runner)
        except StoreLocked as exc:
            log.error("error: %s", exc)
            raise
        app.state.services = services
        try:
            yield
        finally:
            services.stop()

    app = FastAPI(title="evalsvc", version=__version__, lifespan=lifespan,
                  description="Accuracy and KL-divergence evaluation of SGLang's Mamba-hybrid "
                              "serving paths: jobs, results, history and comparisons.")
    app.state.settings = settings
    secret = session_secret(settings)
    app.state.accounts = accounts = Accounts(settings, secret)
    # auth, parameters and body size before any route runs; outside it only the session cookie,
    # which the guard reads (a signed, HttpOnly, SameSite cookie of the dashboard's sign-in)
    app.add_middleware(HttpGuard, settings=settings, accounts=accounts,
                       session_ended=lambda session_id: session_ended(app, session_id))
    app.add_middleware(SessionMiddleware, secret_key=secret, session_cookie=SESSION_COOKIE,
                       max_age=settings.session_max_age_s, same_site="lax",
                       https_only=settings.session_https_only)
    app.include_router(routes.router, prefix="/api/v1")
    mount_dashboard(app)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse({"detail": describe_errors(exc)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        why = _unparseable_body(exc)
        if why:
            return JSONResponse({"detail": f"body: not valid JSON: {why}"}, status_code=422)
        return await http_exception_handler(request, exc)

    @app.exception_handler(OperationalError)
    async def store_unavailable(request: Request, exc: OperationalError):
        """The store refused (unreachable, full): a 503 naming the problem; nothing was stored."""
        log.error("%s %s: the store: %s", request.method, request.url.path, describe(exc))
        return JSONResponse({"detail": f"the store cannot be used now: {describe(exc)}"},
                            status_code=503)

    @app.get("/healthz", tags=["service"],
             responses={503: {"description": "the store is unreachable or the runner stopped"}})
    def healthz() -> JSONResponse:
        """Liveness: the service answers, its database is reachable and its job runner runs."""
        services: Services = app.state.services
        problem = services.health()
        if problem is not None:
            return JSONResponse({"status": "unavailable", "detail": problem,
                                 "version": __version__}, status_code=503)
        return JSONResponse({"status": "ok", "version": __version__})

    @app.get("/metrics", tags=["service"], response_class=Response,
             dependencies=[Depends(require_read)])
    def metrics() -> Response:
        """Prometheus text: queue length, running runs, job outcomes, run durations."""
        services: Services = app.state.services
        return Response(services.render_metrics(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
