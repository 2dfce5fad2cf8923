"""The HTTP API's response models (pydantic) and its refusals: what clients get back
(the job service's replies are the same views, as JSON).

What clients send, ``GenerationRequest``, and its checks live in ``tandem.common.jobs``:
the job service and the worker validate with the same code.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from tandem.common.events import RunState, TaskRecord
from tandem.common.jobs import JobRefused


def refused(exc: JobRefused) -> JSONResponse:
    """A refusal as HTTP: its status, ``{"detail": ...}`` (a 422's in FastAPI's own shape,
    so every validation error reads the same), Retry-After when it has one."""
    headers = {"Retry-After": str(max(1, int(exc.retry_after)))} if exc.retry_after else None
    return JSONResponse(status_code=exc.status, content=json_safe(exc.body()),
                        headers=headers)


def json_safe(value: Any) -> Any:
    """``value`` (decoded JSON) as strict JSON can carry it: a refusal echoes what was
    sent (``input``), and Python's JSON reader takes what no JSON writer may write back:
    ``NaN``, ``Infinity`` and ``1e999`` become the strings ``"nan"``, ``"inf"``,
    ``"-inf"``; a lone surrogate (``"\\ud800"``) is written backslash-escaped."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode()
        return value
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


class Accepted(BaseModel):
    id: str
    state: str
    model: str
    cluster: str
    lane: str
    seed: int
    status_url: str
    events_url: str


class ImageRef(BaseModel):
    index: int
    key: str
    url: str
    expires_at: datetime


class Params(BaseModel):
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    num_images: int


class GenerationView(BaseModel):
    """A task's state as GET /v1/generations/{id} shows it."""

    id: str
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    owner: str = ""  # the API key (its name) that created it; empty: an open gateway
    model: str
    lane: str
    prompt: str | None = None
    negative_prompt: str | None = None
    class_label: int | None = None
    params: Params
    progress: float
    cluster: str
    worker: str
    checkpoint: str
    checkpoint_step: int | None
    reason: str
    attempts: int
    # Worker processes that died while its pipeline call ran (a call of its own: _alone);
    # a task with one runs alone, and one that keeps killing its worker alone is refused.
    crashes: int = 0
    crashes_alone: int = 0
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    images: list[ImageRef] = []


def _ts(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, UTC)


def view(rec: TaskRecord, images: list[ImageRef]) -> GenerationView:
    t = rec.task
    return GenerationView(
        id=t.task_id, state=rec.state.value, owner=t.owner, model=t.model, lane=t.lane,
        prompt=t.prompt,
        negative_prompt=t.negative_prompt, class_label=t.class_label,
        params=Params(width=t.width, height=t.height, steps=t.steps, guidance=t.guidance,
                      seed=t.seed, num_images=t.num_images),
        progress=rec.progress, cluster=rec.cluster, worker=rec.worker,
        checkpoint=rec.checkpoint, checkpoint_step=rec.checkpoint_step, reason=rec.reason,
        attempts=rec.attempts, crashes=rec.crashes, crashes_alone=rec.crashes_alone,
        created_at=_ts(rec.created_at), updated_at=_ts(rec.updated_at),
        started_at=_ts(rec.started_at), finished_at=_ts(rec.finished_at), images=images,
    )


class RunView(BaseModel):
    """A training run as every door shows it (GET, DELETE /v1/training-runs/{id}; the job
    service's ``train``, ``status`` and ``cancel``). Times are Unix seconds, as in the
    run's record (a task's view gives ISO-8601 strings)."""

    run_id: str
    state: RunState
    cancel_requested: bool = Field(description=(
        "A cancel was taken. A pending run is cancelled at once; a running one stays "
        "running (or restarting) until its coordinator has stopped its ranks, then ends "
        "cancelled."))
    cancel_reason: str = Field(description="Why it was cancelled; empty: no cancel.")
    restarts: int
    latest_step: int
    latest_checkpoint_step: int | None
    latest_checkpoint_uri: str
    goodput: dict[str, float]
    incidents: list[dict[str, Any]]
    nodes: list[str]
    config: dict[str, Any]
    created_at: float
    updated_at: float
    owner: str  # the API key (its name) that submitted it; empty: an open gateway
    status_subject: str  # train.<run>.status: its state changes, on the bus
    waiting: str = Field("", description=(
        "Why a pending run has not started: the trainer coordinator it waits for and, when "
        "its cluster has never had one, that it stays pending until one starts there. "
        "Empty once a coordinator has claimed it."))


class RunSubmitted(RunView):
    """POST /v1/training-runs: the run's view and where to read it (``Location``)."""

    status_url: str
