"""The HTTP API (FastAPI). OpenAPI at ``/docs`` and ``/openapi.json``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Header, Path, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from nats.errors import Error as NatsError

from tandem.common import metrics
from tandem.common.bus import describe
from tandem.common.jobs import OPEN, TOKEN, Caller, GenerationRequest, JobRefused
from tandem.gateway.auth import Limits
from tandem.gateway.generations import Gateway
from tandem.gateway.limits import BodyLimit
from tandem.gateway.schemas import Accepted, GenerationView, json_safe, refused
from tandem.gateway.traces import Answers
from tandem.gateway.training import add_fleet_routes, add_training_routes

# A token, as every task id: "a.b" is a 422 naming it, not a 404 for a task that cannot exist.
TASK_ID = Path(description="The task id returned by POST /v1/generations.", pattern=TOKEN)


def caller(request: Request) -> Caller:
    """Who sent ``request``: the Guard's verdict, or the open caller without keys."""
    return request.scope.get("state", {}).get("caller", OPEN)


def _not_found(task_id: str) -> JSONResponse:
    return JSONResponse(status_code=404, content={"detail": f"no task {task_id!r}"})


def _native_telemetry() -> dict[str, Any]:
    """FastAPI's own request spans (0.165+) only while spans are exported.

    The process always has an SDK tracer provider (so trace context is carried), which
    FastAPI takes as a cue to build a server span and an operation span for every
    request; unexported, they cost a third of the gateway's CPU per request.
    """
    import inspect

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    from tandem.common import tracing

    return {} if tracing.recording() else {"telemetry": {"tracing": False}}


def create_app(gw: Gateway, *, max_body_bytes: int, nats_connected: Any = None,
               limits: Limits | None = None, train_clusters: Sequence[str] = ()) -> Any:
    """The HTTP API of ``gw``; ``train_clusters``: the clusters a training run may name
    (empty: any)."""
    app = FastAPI(
        title="Tandem gateway",
        version="1",
        description="Generate images on Tandem's GPU clusters. Accepted requests are never "
        "lost: they are queued on NATS JetStream and delivered at least once, with "
        "effectively-once results.",
        **_native_telemetry(),
    )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's own 422, with each ``input`` made writable: the body may hold what
        Python's JSON reader takes and no JSON writer gives back (``NaN``, ``1e999``, a
        lone surrogate), and FastAPI's handler would fail on it with a bare 500."""
        return JSONResponse(status_code=422,
                            content={"detail": json_safe(jsonable_encoder(exc.errors()))})

    @app.exception_handler(NatsError)
    async def bus_failed(request: Request, exc: NatsError) -> JSONResponse:
        """A bus error no route turned into an answer of its own (a timeout or no
        servers past the retry window, a JetStream refusal such as a full store): the
        request could not be served now, not a fault of the gateway's: 503, try again."""
        return JSONResponse(status_code=503, headers={"Retry-After": "1"}, content={
            "detail": f"the message bus (NATS) failed to serve {request.method} "
                      f"{request.url.path}: {describe(exc)}; try again"})

    @app.post("/v1/generations", status_code=202, response_model=Accepted,
              responses={409: {}, 413: {}, 422: {}, 503: {}})
    async def create_generation(req: GenerationRequest, request: Request,
                                idempotency_key: str | None = Header(
                                    None, alias="Idempotency-Key", min_length=1,
                                    max_length=255)) -> Any:
        """Queue a generation; 202 with the task id and where to follow it.

        The same ``Idempotency-Key`` returns the same task and never enqueues twice.
        """
        try:
            sub = await gw.accept(req, idempotency_key, caller(request))
        except JobRefused as exc:
            return refused(exc)
        status_url = f"{request.scope.get('root_path', '')}/v1/generations/{sub.task.task_id}"
        headers = {"Location": status_url}
        if sub.replayed:
            headers["Idempotent-Replayed"] = "true"
        # Built here rather than validated again through ``response_model`` (which
        # documents it): this is the hot path of every submission.
        return JSONResponse(status_code=202, headers=headers, content={
            **sub.accepted(), "status_url": status_url, "events_url": f"{status_url}/events"})

    @app.get("/v1/generations/{task_id}", response_model=GenerationView,
             responses={404: {}})
    async def get_generation(request: Request, task_id: str = TASK_ID) -> Any:
        """State, timestamps, progress, where it ran, and presigned image URLs on success.
        Another API key's task is 404 (unless the key is admin)."""
        rec = await gw.record(task_id, caller(request))
        if rec is None:
            return _not_found(task_id)
        return gw.view(rec)

    @app.get("/v1/generations/{task_id}/events", responses={
        200: {"content": {"text/event-stream": {}}}, 404: {}})
    async def generation_events(request: Request, task_id: str = TASK_ID) -> Any:
        """Server-Sent Events: ``state``, one ``progress`` per denoising step, then
        ``final`` (the same body as GET) and the stream ends. A late client gets
        ``final`` at once."""
        if await gw.record(task_id, caller(request)) is None:
            return _not_found(task_id)

        async def stream() -> AsyncIterator[bytes]:
            async for event, data in gw.follow(task_id):
                if event == "ping":
                    yield b": ping\n\n"
                else:
                    yield f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @app.delete("/v1/generations/{task_id}", response_model=GenerationView,
                responses={404: {}, 409: {}})
    async def cancel_generation(request: Request, task_id: str = TASK_ID) -> Any:
        """Cancel: a queued task never runs, a running one stops within one step."""
        try:
            return gw.view(await gw.cancel(task_id, caller(request)))
        except JobRefused as exc:
            return refused(exc)

    @app.get("/v1/models")
    async def list_models() -> Any:
        """The model registry: conditioning, sizes, steps, guidance, and where loaded."""
        return {"models": await gw.models()}

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Any:
        ok = gw.bus.nc.is_connected
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ok" if ok else "unavailable",
                                     "nats": "connected" if ok else "disconnected"})

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Any:
        body, ctype = metrics.exposition()
        return Response(content=body, media_type=ctype)

    add_training_routes(app, gw.bus, caller, limits, train_clusters)
    add_fleet_routes(app, gw.bus, gw.board.ttl)  # as its routing judges
    # Counted outside the body limit, so its 413s (answered before the app) count too.
    return Answers(BodyLimit(app, max_body_bytes)), app
