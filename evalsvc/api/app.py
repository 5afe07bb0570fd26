"""The service: a FastAPI app over the store and the job runner (``create_app(settings)``)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError

from evalsvc import __version__
from evalsvc.api import routes
from evalsvc.api.deps import Services
from evalsvc.dashboard import mount_dashboard
from evalsvc.jobs import describe
from evalsvc.settings import Settings
from evalsvc.store.lock import StoreLocked

log = logging.getLogger("evalsvc.api")


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
    app.include_router(routes.router, prefix="/api/v1")
    mount_dashboard(app)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        return JSONResponse({"detail": problems}, status_code=422)

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

    @app.get("/metrics", tags=["service"], response_class=Response)
    def metrics() -> Response:
        """Prometheus text: queue length, running runs, job outcomes, run durations."""
        services: Services = app.state.services
        return Response(services.render_metrics(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
