"""The service: a FastAPI app over the store and the job runner (``create_app(settings)``)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from evalsvc import __version__
from evalsvc.api import routes
from evalsvc.api.deps import Services, require_read
from evalsvc.api.middleware import HttpGuard
from evalsvc.dashboard import mount_dashboard
from evalsvc.settings import Settings

log = logging.getLogger("evalsvc.api")


def create_app(settings: Settings | None = None, *, start_runner: bool = True) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        services = Services.start(settings, start_runner=start_runner)
        app.state.services = services
        try:
            yield
        finally:
            services.stop()

    app = FastAPI(title="evalsvc", version=__version__, lifespan=lifespan,
                  description="Accuracy and KL-divergence evaluation of SGLang's Mamba-hybrid "
                              "serving paths: jobs, results, history and comparisons.")
    app.state.settings = settings
    # outermost of the app's own layers: auth, parameters and body size before any route runs
    app.add_middleware(HttpGuard, settings=settings)
    app.include_router(routes.router, prefix="/api/v1")
    mount_dashboard(app)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        return JSONResponse({"detail": problems}, status_code=422)

    @app.get("/healthz", tags=["service"])
    def healthz() -> dict:
        """Liveness: the service answers and its database is reachable."""
        services: Services = app.state.services
        services.ping()
        return {"status": "ok", "version": __version__}

    @app.get("/metrics", tags=["service"], response_class=Response,
             dependencies=[Depends(require_read)])
    def metrics() -> Response:
        """Prometheus text: queue length, running runs, job outcomes, run durations."""
        services: Services = app.state.services
        return Response(services.render_metrics(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
