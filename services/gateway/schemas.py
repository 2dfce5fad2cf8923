"""The HTTP API's models (pydantic): what clients send and what they get back.

Static bounds live on the fields, so FastAPI's 422 names the field; bounds that depend on
the model or on settings are checked by ``validate_request`` and reported the same way.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.common.events import TaskRecord
from tandem.common.models import Conditioning, ModelSpec

TOKEN = r"^[A-Za-z0-9_-]{1,64}$"


class GenerationRequest(BaseModel):
    """A request for images. Unset fields take the model's defaults."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "tiny-text", "prompt": "a red fox in the snow", "num_images": 2, "seed": 7},
        {"model": "digits", "class_label": 3, "steps": 50},
    ]})

    model: str = Field(pattern=TOKEN, description="A model from GET /v1/models.")
    prompt: str | None = Field(None, max_length=100_000,
                               description="Text models only; length bounded per model.")
    negative_prompt: str | None = Field(None, max_length=100_000,
                                        description="Text models only.")
    class_label: int | None = Field(None, ge=0, description="Class-conditional models only.")
    width: int | None = Field(None, ge=8, le=8192, multiple_of=8,
                              description="Pixels; a multiple of 8 the model allows.")
    height: int | None = Field(None, ge=8, le=8192, multiple_of=8,
                               description="Pixels; a multiple of 8 the model allows.")
    steps: int | None = Field(None, ge=1, le=10_000, description="Denoising steps.")
    guidance: float | None = Field(None, ge=0, le=100, allow_inf_nan=False,
                                   description="Classifier-free guidance scale.")
    seed: int | None = Field(None, ge=0, le=2**32 - 1,
                             description="Same seed, model and parameters: same images. "
                             "Unset: derived from the task id (and reported).")
    num_images: int = Field(1, ge=1, le=256, description="Images to make.")
    lane: Literal["interactive", "batch"] = Field(
        "interactive", description="interactive runs before batch on every worker.")
    cluster: str | None = Field(None, pattern=TOKEN, description="Pin to one cluster.")


class FieldProblem(BaseModel):
    field: str
    message: str
    value: Any = None


def validate_request(req: GenerationRequest, spec: ModelSpec, *, max_images: int,
                     max_prompt_chars: int, max_size: int) -> list[FieldProblem]:
    """Everything wrong with ``req`` for ``spec`` and the gateway's limits, by field."""
    out: list[FieldProblem] = []

    def bad(field: str, message: str, value: Any = None) -> None:
        out.append(FieldProblem(field=field, message=message, value=value))

    cond = spec.conditioning
    if cond == Conditioning.text:
        if not (req.prompt or "").strip():
            bad("prompt", f"model {spec.name} is text-conditioned: a prompt is required")
        if req.class_label is not None:
            bad("class_label", f"model {spec.name} takes a prompt, not a class label",
                req.class_label)
    elif cond == Conditioning.class_label:
        if req.class_label is None:
            bad("class_label", f"model {spec.name} is class-conditioned: class_label "
                f"0..{spec.num_classes - 1} is required")
        elif req.class_label >= spec.num_classes:
            bad("class_label", f"model {spec.name} takes class labels 0..{spec.num_classes - 1}",
                req.class_label)
    else:
        if req.class_label is not None:
            bad("class_label", f"model {spec.name} is unconditional", req.class_label)
    if cond != Conditioning.text:
        for name in ("prompt", "negative_prompt"):
            if getattr(req, name) is not None:
                bad(name, f"model {spec.name} does not take a {name.replace('_', ' ')}")
    limit = min(spec.max_prompt_chars, max_prompt_chars)
    for name in ("prompt", "negative_prompt"):
        text = getattr(req, name)
        if text is not None and len(text) > limit:
            bad(name, f"{len(text)} characters; at most {limit}")
    for name in ("width", "height"):
        value = getattr(req, name)
        if value is None:
            continue
        if value > max_size:
            bad(name, f"at most {max_size}", value)
        elif (why := spec.size_error(value)) is not None:
            bad(name, why, value)
    if req.steps is not None and req.steps > spec.max_steps:
        bad("steps", f"model {spec.name} takes at most {spec.max_steps} steps", req.steps)
    if req.guidance is not None and req.guidance > spec.max_guidance:
        bad("guidance", f"model {spec.name} takes guidance up to {spec.max_guidance}",
            req.guidance)
    if req.num_images > max_images:
        bad("num_images", f"at most {max_images} images per request", req.num_images)
    return out


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
        id=t.task_id, state=rec.state.value, model=t.model, lane=t.lane, prompt=t.prompt,
        negative_prompt=t.negative_prompt, class_label=t.class_label,
        params=Params(width=t.width, height=t.height, steps=t.steps, guidance=t.guidance,
                      seed=t.seed, num_images=t.num_images),
        progress=rec.progress, cluster=rec.cluster, worker=rec.worker,
        checkpoint=rec.checkpoint, checkpoint_step=rec.checkpoint_step, reason=rec.reason,
        attempts=rec.attempts, created_at=_ts(rec.created_at), updated_at=_ts(rec.updated_at),
        started_at=_ts(rec.started_at), finished_at=_ts(rec.finished_at), images=images,
    )
