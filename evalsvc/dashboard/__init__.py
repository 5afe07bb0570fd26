"""The web dashboard: HTML pages over the store (``views``), the forms people act through
(``actions``: sign-in, triage, bisections, jobs), templates and assets under ``evalsvc/dashboard/``, and
Plotly's JavaScript from the installed ``plotly`` package."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from evalsvc.dashboard import actions
from evalsvc.dashboard.views import DASHBOARDS_DIR, router


def plotly_js() -> Path:
    """plotly.min.js inside the installed plotly package (found without importing plotly)."""
    spec = find_spec("plotly")
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise RuntimeError("the dashboard's charts need plotly.min.js from the plotly package "
                           "(pip install 'plotly>=5.20')")
    return path


def mount_dashboard(app: FastAPI) -> None:
    """Add the pages and forms, ``/static`` (evalsvc/dashboard/static) and ``/vendor/plotly.min.js`` to
    ``app``."""
    script = plotly_js()
    app.include_router(actions.sign_in_router)
    app.include_router(actions.router)
    app.include_router(router)
    app.add_exception_handler(actions.FormRefused, actions.form_refused)
    app.mount("/static", StaticFiles(directory=DASHBOARDS_DIR / "static"), name="static")

    @app.get("/vendor/plotly.min.js", include_in_schema=False)
    def read_plotly() -> FileResponse:
        return FileResponse(script, media_type="text/javascript",
                            headers={"Cache-Control": "public, max-age=86400"})
