"""The live dashboard at ``/``: a static page that polls ``GET /v1/dashboard``.

``install(app, observer)`` adds three routes to the gateway's FastAPI app:

- ``GET /`` — the page (``static/index.html``), plain HTML and JavaScript, no build step
  and nothing fetched from the internet;
- ``GET /dashboard/static/<file>`` — its script and style sheet;
- ``GET /v1/dashboard`` — the observer's snapshot as JSON: clusters and nodes with health
  and GPU metrics, queue depth and oldest task age per cluster and lane, training runs
  with their loss curves and checkpoints, and the latest generations with image URLs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from tandem.gateway.observe import Observer

STATIC = Path(__file__).with_name("static")


def install(app: FastAPI, observer: Observer) -> None:
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")

    @app.get("/", include_in_schema=False)
    async def dashboard_page() -> Any:
        return FileResponse(STATIC / "index.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    @app.get("/v1/dashboard", tags=["operations"])
    async def dashboard_state() -> Any:
        """Everything the dashboard shows, refreshed about every second."""
        return JSONResponse(observer.snapshot(), headers={"Cache-Control": "no-store"})
