"""Admission, the gateway's part of a generation's trace.

``AdmissionTracing`` wraps ``POST /v1/generations`` in a server span with an
``admission`` child covering validation, routing, the task record and the publish. The
task is published inside that span, so its ``traceparent`` header makes the worker's
spans (queue wait, batching, model load, denoising, upload) children of this trace: one
trace per generation across gateway and worker. Spans are built only when exported
(``TANDEM_OTLP_ENDPOINT``); the admission time always goes to
``tandem_generation_phase_seconds{phase="admission"}``.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import SpanKind

from tandem.common import metrics, tracing

PATH = "/v1/generations"


class AdmissionTracing:
    """Pure ASGI middleware (streaming responses pass through untouched)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or \
                scope["path"].rstrip("/") != PATH:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        if not tracing.recording():
            try:
                await self.app(scope, receive, send)
            finally:
                metrics.PHASE_SECONDS.observe("admission", time.perf_counter() - t0)
            return
        status: dict[str, int] = {}

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        tracer = tracing.tracer("tandem.gateway")
        with tracer.start_as_current_span(
                f"POST {PATH}", kind=SpanKind.SERVER,
                attributes={"http.request.method": "POST", "url.path": PATH}) as server:
            with tracer.start_as_current_span("admission"):
                try:
                    await self.app(scope, receive, send_status)
                finally:
                    metrics.PHASE_SECONDS.observe("admission", time.perf_counter() - t0)
            server.set_attribute("http.response.status_code", status.get("code", 500))
