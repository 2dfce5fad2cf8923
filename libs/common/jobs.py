"""What a generation job may ask for: one validation path, whatever door it came in by.

A job comes in by HTTP (the gateway), by the NATS job service, or by a bare publish of a
``GenerationTask`` on ``gen.<cluster>.<lane>``. Each door ends here:

- ``GenerationRequest`` is the body a client sends (static bounds on its fields);
- ``check_request`` adds what depends on the model (the registry's sizes, steps, guidance,
  conditioning) and on the deployment's ``JobLimits``, including the hard cap on work
  (pixels x steps x images) that holds even when a model's declared bounds are wrong;
- ``check_task`` runs a delivered ``GenerationTask`` through the same two steps, so the
  inference worker refuses on the bus exactly what the gateway refuses on HTTP, with the
  same messages; a task with nothing wrong is told apart first by its model's screen
  (the same bounds as plain values, about 0.8 us where the two steps take 3);
- ``build_task`` fills a request's defaults into the task that is enqueued.

Problems are reported per field (``Problem``): the HTTP API turns them into a 422, the
job service into an error reply, the worker into a dead-letter reason.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.common.errors import TandemError
from tandem.common.events import GenerationTask
from tandem.common.models import Conditioning, ModelSpec, Registry
from tandem.common.settings import Settings

TOKEN = r"^[A-Za-z0-9_-]{1,64}$"


class GenerationRequest(BaseModel):
    """A request for images. Unset fields take the model's defaults.

    Its integer fields are strict: ``true``, ``"5"`` and ``5.0`` are refused (422 naming
    the field), not read as 1 and 5, as the schema says ``integer``; ``guidance`` (a
    number) takes ``5`` as well as ``5.0``."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"model": "tiny-text", "prompt": "a red fox in the snow", "num_images": 2, "seed": 7},
        {"model": "digits", "class_label": 3, "steps": 50},
    ]})

    model: str = Field(pattern=TOKEN, description="A model from GET /v1/models.")
    prompt: str | None = Field(None, max_length=100_000,
                               description="Text models only; length bounded per model.")
    negative_prompt: str | None = Field(None, max_length=100_000,
                                        description="Text models only.")
    class_label: int | None = Field(None, ge=0, strict=True,
                                    description="Class-conditional models only.")
    width: int | None = Field(None, ge=8, le=8192, multiple_of=8, strict=True,
                              description="Pixels; a multiple of 8 the model allows.")
    height: int | None = Field(None, ge=8, le=8192, multiple_of=8, strict=True,
                               description="Pixels; a multiple of 8 the model allows.")
    steps: int | None = Field(None, ge=1, le=10_000, strict=True,
                              description="Denoising steps.")
    guidance: float | None = Field(None, ge=0, le=100, allow_inf_nan=False,
                                   description="Classifier-free guidance scale.")
    seed: int | None = Field(None, ge=0, le=2**32 - 1, strict=True,
                             description="Same seed, model and parameters: same images. "
                             "Unset: derived from the task id (and reported).")
    num_images: int = Field(1, ge=1, le=256, strict=True, description="Images to make.")
    lane: Literal["interactive", "batch"] = Field(
        "interactive", description="interactive runs before batch on every worker.")
    cluster: str | None = Field(None, pattern=TOKEN, description="Pin to one cluster.")


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a job: the field, why, and the value given (if any)."""

    field: str
    message: str
    value: Any = None

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def describe(problems: list[Problem]) -> str:
    """The problems as one line (a dead-letter reason, a log field)."""
    return "; ".join(str(p) for p in problems)


class JobRefused(TandemError):
    """A door refused a job request; every door reports it the same way.

    ``status`` is the HTTP status (the job service's error code too): 400 not JSON, 401 /
    403 no key or scope, 404 no such job (or another key's), 409 a conflict with the
    job's state or id, 422 invalid fields, 429 over a limit, 503 nowhere to run it now
    (``retry_after`` seconds). ``detail`` is a message, or for 422 FastAPI's own list of
    ``{type, loc, msg, input}``, one per bad field, so both doors read alike.
    """

    def __init__(self, status: int, detail: str | list[dict[str, Any]],
                 retry_after: float | None = None) -> None:
        self.status = status
        self.detail = detail
        self.retry_after = retry_after
        super().__init__(detail if isinstance(detail, str) else "; ".join(
            _named(d["loc"][1:], d["msg"]) for d in detail))

    @classmethod
    def invalid(cls, problems: list[Problem], where: str = "body") -> JobRefused:
        return cls(422, [{"type": "value_error", "loc": [where, *p.field.split(".")],
                          "msg": p.message, "input": p.value} for p in problems])

    def body(self) -> dict[str, Any]:
        return {"detail": self.detail}


def _named(path: list[Any], msg: str) -> str:
    """One problem as a line: ``field.path: why``, or ``why`` for the body as a whole."""
    return f"{'.'.join(str(p) for p in path)}: {msg}" if path else msg


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks, as every door sees it: the API key's name (never its secret) and
    whether it holds the ``admin`` scope. A job records the key that created it; reads,
    cancels and idempotency keys are scoped to it. ``OPEN`` is the caller of a door
    with no keys configured (a single-tenant dev stack): it owns nothing and sees all."""

    key: str = ""
    admin: bool = False

    def sees(self, owner: str) -> bool:
        """May this caller read or cancel a job created by ``owner``?"""
        return self.admin or not self.key or owner == self.key

    def scoped(self, idempotency_key: str) -> str:
        """The idempotency key as stored: per API key, so two keys never share one."""
        return "k" + hashlib.sha256(f"{self.key}\0{idempotency_key}".encode()).hexdigest()


OPEN = Caller()


@dataclass(frozen=True, slots=True)
class JobLimits:
    """The deployment's bounds on one job, on top of each model's own."""

    max_images: int = 8
    max_prompt_chars: int = 2000
    max_size: int = 2048
    max_work: float = 1000.0  # megapixel-steps: width * height / 1e6 * steps * images


class JobLimitSettings(Settings):
    """Settings of a service that validates jobs (the gateway, the worker): both must
    hold the same values, so a job the gateway accepts is one the worker runs."""

    max_images: int = Field(8, ge=1, le=256, description="Most images per request.")
    max_prompt_chars: int = Field(2000, ge=1, description="Longest prompt (and negative "
                                  "prompt), in characters; models may allow fewer.")
    max_size: int = Field(2048, ge=8, le=8192, description="Largest width or height.")
    max_work: float = Field(
        1000.0, gt=0, description="Hard cap on one job's work in megapixel-steps "
        "(width x height / 1e6 x steps x images), whatever a model's spec allows: "
        "1024x1024 at 50 steps x 8 images is 419.")

    @property
    def job_limits(self) -> JobLimits:
        return JobLimits(max_images=self.max_images, max_prompt_chars=self.max_prompt_chars,
                         max_size=self.max_size, max_work=self.max_work)


def work(width: int, height: int, steps: int, num_images: int) -> float:
    """A job's work in megapixel-steps."""
    return width * height / 1e6 * steps * num_images


def check_request(req: GenerationRequest, registry: Registry,
                  limits: JobLimits) -> list[Problem]:
    """Everything wrong with ``req`` for its model and ``limits``, by field.

    Plain comparisons of locals, and a message is only built for a problem found (the
    worker reaches it only for a task its model's screen did not pass)."""
    spec = registry.get(req.model)
    if spec is None:
        return [Problem("model", f"unknown model {req.model!r}; known: "
                        f"{', '.join(registry.names())}", req.model)]
    out = _check_conditioning(req, spec)
    prompt, negative = req.prompt, req.negative_prompt
    if prompt is not None or negative is not None:
        limit = min(spec.max_prompt_chars, limits.max_prompt_chars)
        for name, text in (("prompt", prompt), ("negative_prompt", negative)):
            if text is not None and len(text) > limit:
                out.append(Problem(name, f"{len(text)} characters; at most {limit}"))
    width, height, steps, images = req.width, req.height, req.steps, req.num_images
    for name, value in (("width", width), ("height", height)):
        if value is None:
            continue
        if value > limits.max_size:
            out.append(Problem(name, f"at most {limits.max_size}", value))
        elif (why := spec.size_error(value)) is not None:
            out.append(Problem(name, why, value))
    if steps is not None and steps > spec.max_steps:
        out.append(Problem("steps", f"model {spec.name} takes at most {spec.max_steps} steps",
                           steps))
    if req.guidance is not None and req.guidance > spec.max_guidance:
        out.append(Problem("guidance", f"model {spec.name} takes guidance up to "
                           f"{spec.max_guidance}", req.guidance))
    if images > limits.max_images:
        out.append(Problem("num_images", f"at most {limits.max_images} images per request",
                           images))
    if not out:
        w, h, s = (width or spec.default_width, height or spec.default_height,
                   steps or spec.default_steps)
        if (cost := work(w, h, s, images)) > limits.max_work:
            out.append(Problem("num_images", f"{w}x{h} at {s} steps x {images} "
                               f"images is {cost:.0f} megapixel-steps; at most "
                               f"{limits.max_work:g} per request", images))
    return out


def _check_conditioning(req: GenerationRequest, spec: ModelSpec) -> list[Problem]:
    out: list[Problem] = []
    cond, label = spec.conditioning, req.class_label
    if cond == Conditioning.text:
        if not (req.prompt or "").strip():
            out.append(Problem("prompt", f"model {spec.name} is text-conditioned: a prompt "
                               "is required"))
        if label is not None:
            out.append(Problem("class_label", f"model {spec.name} takes a prompt, not a "
                               "class label", label))
        return out
    if cond == Conditioning.class_label:
        if label is None:
            out.append(Problem("class_label", f"model {spec.name} is class-conditioned: "
                               f"class_label 0..{spec.num_classes - 1} is required"))
        elif label >= spec.num_classes:
            out.append(Problem("class_label", f"model {spec.name} takes class labels "
                               f"0..{spec.num_classes - 1}", label))
    elif label is not None:
        out.append(Problem("class_label", f"model {spec.name} is unconditional", label))
    if req.prompt is not None:
        out.append(Problem("prompt", f"model {spec.name} does not take a prompt"))
    if req.negative_prompt is not None:
        out.append(Problem("negative_prompt", f"model {spec.name} does not take a "
                           "negative prompt"))
    return out


def pydantic_problems(exc: ValidationError) -> list[Problem]:
    """A pydantic error as problems, each named by its field path."""
    return [Problem(".".join(str(p) for p in e["loc"]) or "body", e["msg"], e.get("input"))
            for e in exc.errors()]


class _Delivered(GenerationRequest):
    """The request a delivered task stands for, read from its attributes (no dict of
    kwargs built per task): the request's own field bounds; the task's other fields are
    not the request's. ``cluster`` may be empty on the bus (a bare publish, not pinned):
    decoding checked it is a token when set, and the worker checks it against the
    subject it came by."""

    model_config = ConfigDict(extra="ignore", from_attributes=True)

    cluster: str = ""  # type: ignore[assignment]


_DELIVERED = _Delivered.__pydantic_validator__.validate_python


def check_task(task: GenerationTask, registry: Registry, limits: JobLimits) -> list[Problem]:
    """Everything wrong with a delivered task: the request it stands for must pass
    ``check_request``, and its filled-in values must be ones the gateway could have made.

    A task its model's screen passes has nothing wrong (the common case, well under a
    microsecond); any other is judged by the full path, which names each problem."""
    spec = registry.get(task.model)
    if spec is not None and _screen(spec, limits).passes(task):
        return []
    try:
        req = _DELIVERED(task, from_attributes=True)
    except ValidationError as exc:
        return pydantic_problems(exc)
    out = check_request(req, registry, limits)
    if spec is not None and task.noop != (spec.source_kind == "noop"):
        out.append(Problem("noop", f"model {spec.name} is "
                           f"{'' if spec.source_kind == 'noop' else 'not '}a no-op model",
                           task.noop))
    return out


def _bound(name: str, kind: str) -> Any:
    """A bound of ``GenerationRequest``'s field ``name`` (``ge``, ``le``, ``multiple_of``,
    ``max_length``, ``pattern``), read from the field itself so a screen cannot drift."""
    for meta in GenerationRequest.model_fields[name].metadata:
        if (value := getattr(meta, kind, None)) is not None:
            return value
    raise LookupError(f"GenerationRequest.{name} has no {kind}")


@dataclass(frozen=True, slots=True)
class _Screen:
    """What one model accepts under one set of limits, as plain values: a task it passes
    is one ``_DELIVERED`` and ``check_request`` accept (the fields' static bounds, the
    model's and the deployment's, all at once). It is strict about types (``type(x) is
    int``), so what it does not pass goes to the full path, which decides and explains;
    tests/test_jobs.py shows both agree on every task they try."""

    conditioning: Conditioning
    sizes: frozenset[int]
    max_steps: int
    max_guidance: float
    max_images: int
    max_prompt: int
    classes: int
    noop: bool
    max_work: float

    @classmethod
    def of(cls, spec: ModelSpec, limits: JobLimits) -> _Screen:
        if not re.fullmatch(_bound("model", "pattern"), spec.name):
            raise ValueError(f"model name {spec.name!r} is not one a request can name")
        lo, hi, step = (_bound("width", k) for k in ("ge", "le", "multiple_of"))
        assert (lo, hi, step) == tuple(_bound("height", k) for k in ("ge", "le", "multiple_of"))
        return cls(
            conditioning=spec.conditioning,
            sizes=frozenset(v for v in range(lo, hi + 1, step)
                            if v <= limits.max_size and spec.size_error(v) is None),
            max_steps=min(_bound("steps", "le"), spec.max_steps),
            max_guidance=min(_bound("guidance", "le"), spec.max_guidance),
            max_images=min(_bound("num_images", "le"), limits.max_images),
            max_prompt=min(_bound("prompt", "max_length"), _bound("negative_prompt",
                           "max_length"), spec.max_prompt_chars, limits.max_prompt_chars),
            classes=spec.num_classes, noop=spec.source_kind == "noop",
            max_work=limits.max_work)

    def passes(self, t: GenerationTask) -> bool:
        width, height, steps, images = t.width, t.height, t.steps, t.num_images
        if not (type(width) is int and width in self.sizes
                and type(height) is int and height in self.sizes
                and type(steps) is int and _STEPS_GE <= steps <= self.max_steps
                and type(t.guidance) is float
                and _GUIDANCE_GE <= t.guidance <= self.max_guidance  # NaN fails both
                and type(t.seed) is int and _SEED_GE <= t.seed <= _SEED_LE
                and type(images) is int and _IMAGES_GE <= images <= self.max_images
                and t.lane in _LANES and type(t.cluster) is str
                and t.noop == self.noop
                and work(width, height, steps, images) <= self.max_work):
            return False
        prompt, negative, label = t.prompt, t.negative_prompt, t.class_label
        if self.conditioning == Conditioning.text:
            return (label is None and type(prompt) is str
                    and len(prompt) <= self.max_prompt and bool(prompt.strip())
                    and (negative is None
                         or (type(negative) is str and len(negative) <= self.max_prompt)))
        if prompt is not None or negative is not None:
            return False
        if self.conditioning == Conditioning.class_label:
            return type(label) is int and _LABEL_GE <= label < self.classes
        return label is None


_STEPS_GE, _GUIDANCE_GE = _bound("steps", "ge"), _bound("guidance", "ge")
_SEED_GE, _SEED_LE = _bound("seed", "ge"), _bound("seed", "le")
_IMAGES_GE, _LABEL_GE = _bound("num_images", "ge"), _bound("class_label", "ge")
_LANES = frozenset(get_args(GenerationRequest.model_fields["lane"].annotation))
_SCREENS: dict[int, tuple[ModelSpec, JobLimits, _Screen]] = {}


def _screen(spec: ModelSpec, limits: JobLimits) -> _Screen:
    """The screen of ``spec`` under ``limits``, made once per spec object (a reloaded
    registry makes new specs, so new screens; the entry holds its spec, so that id is not
    reused while it lives) and kept while the limits are the same object or an equal one."""
    hit = _SCREENS.get(id(spec))
    if hit is not None and (hit[1] is limits or hit[1] == limits):
        return hit[2]
    if len(_SCREENS) >= 256:
        _SCREENS.clear()
    screen = _Screen.of(spec, limits)
    _SCREENS[id(spec)] = (spec, limits, screen)
    return screen


def default_seed(task_id: str) -> int:
    """A seed derived from the task id: an idempotent replay regenerates the same one."""
    return int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:4], "big")


def build_task(req: GenerationRequest, spec: ModelSpec, task_id: str, cluster: str,
               owner: str = "") -> GenerationTask:
    """The task enqueued for a checked ``req`` by ``owner``: its unset fields take the
    model's defaults."""
    return GenerationTask(
        task_id=task_id, model=req.model, prompt=req.prompt,
        negative_prompt=req.negative_prompt, class_label=req.class_label,
        width=req.width or spec.default_width, height=req.height or spec.default_height,
        steps=req.steps or spec.default_steps,
        guidance=spec.default_guidance if req.guidance is None else req.guidance,
        seed=default_seed(task_id) if req.seed is None else req.seed,
        num_images=req.num_images, lane=req.lane, cluster=cluster,
        noop=spec.source_kind == "noop", owner=owner,
    )
