"""What the HTTP door tells of each request: a generation's admission, and every answer.

``AdmissionTracing`` wraps ``POST /v1/generations`` in an ``admission`` span covering
validation, routing, the task record and the publish. The task is published inside that
span, so its ``traceparent`` header makes the worker's spans (queue wait, batching, model
load, denoising, upload) children of this trace: one trace per generation across gateway
and worker. The request has one server span: FastAPI's own where FastAPI builds one (its
native telemetry, 0.165+, while spans are exported), else this middleware's. Spans are
built only when exported (``TANDEM_OTLP_ENDPOINT``). The admission time goes to
``tandem_generation_phase_seconds{phase="admission"}`` for an accepted request (202)
only: a refusal (409, 413, 422, 503) admitted nothing, and its time would pull the
admission percentiles toward the cost of saying no.

``Answers`` counts what the app answers: ``tandem_gateway_requests_total{route, status}``,
``route`` the matched route's template (``/v1/generations/{task_id}``, never the path: the
label stays a bounded set), ``other`` where no route template applies (the body limit's
413, sent before routing; a 404; the static files). The API-key guard sits outside the
app and counts its own refusals (401, 403, 429) in ``tandem_gateway_auth_total{outcome}``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tandem.common import metrics, tracing

PATH = "/v1/generations"
ACCEPTED = 202

REQUESTS = metrics.Counter("tandem_gateway_requests", "HTTP answers by route template and "
                           "status", ["route", "status"])


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
        status: dict[str, int] = {}

        async def send_status(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if not tracing.recording():
                await self.app(scope, receive, send_status)
                return
            with _server_span(status), \
                    tracing.tracer("tandem.gateway").start_as_current_span("admission"):
                await self.app(scope, receive, send_status)
        finally:
            if status.get("code") == ACCEPTED:
                metrics.PHASE_SECONDS.observe("admission", time.perf_counter() - t0)


@contextlib.contextmanager
def _server_span(status: dict[str, int]) -> Iterator[None]:
    """The request's server span: FastAPI's when it made one (current here), else one of
    its own, an error for a 5xx as HTTP's semantic conventions have it."""
    current = trace.get_current_span()
    if current.is_recording() and getattr(current, "kind", None) == SpanKind.SERVER:
        yield
        return
    with tracing.tracer("tandem.gateway").start_as_current_span(
            f"POST {PATH}", kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": PATH}) as server:
        try:
            yield
        finally:
            code = status.get("code", 500)
            server.set_attribute("http.response.status_code", code)
            if code >= 500:
                server.set_status(Status(StatusCode.ERROR))


class Answers:
    """Pure ASGI middleware: each HTTP answer counted by route template and status (an
    answer never started, the app having failed, counts as the server's 500)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counted(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            # Routing writes the matched route into this same scope (FastAPI's APIRoute).
            route = getattr(scope.get("route"), "path", None) or "other"
            REQUESTS.labels(route, str(status)).inc()
