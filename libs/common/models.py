"""The model registry: which models Tandem serves, declared as data (no torch here).

The gateway validates requests against it and lists it on ``/v1/models``; the inference
worker builds pipelines from it. Both read the same declaration (``TANDEM_MODELS``: a
JSON list of models, or ``@/path/to/models.json``), so they always agree on what a model
takes.

A model's ``source`` says where its weights come from::

    builtin:class-unet   class-conditional UNet2DModel DDPM from ``config`` (random weights)
    builtin:tiny-text    tiny text-to-image pipeline built in-process (random weights)
    dir:<path>           any local diffusers pipeline directory (from_pretrained, offline)
    run:<run_id>         the newest committed checkpoint of a training run
    noop                 a call that makes no images: the real task path around it (benchmarks)
    fault:<kind>         fault injection for tests (the worker refuses it unless enabled)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tandem.common.settings import Settings
from tandem.common.subjects import token

SOURCE_KINDS = ("builtin", "dir", "run", "noop", "fault")
BUILTINS = ("class-unet", "tiny-text")


# Packages diffusers imports whenever they are installed, though few models use them:
# transformers (its quantizer configs, its LoRA loaders; a text encoder uses it) and scipy
# (its schedulers' module imports ``scipy.stats``, which only a few schedulers use). Each
# costs 1-2 s of CPU of every start of a process that imports diffusers.
OPTIONAL = ("transformers", "scipy")


def leave_out(keep: Iterable[str] = ()) -> None:
    """Leave the ``OPTIONAL`` packages not in ``keep`` out of this process, for one whose
    models never use them (``ModelSpec.optional``; a training rank keeps none): hidden
    (a ``sys.modules`` entry of None), diffusers takes them as not installed. Call before
    diffusers is first imported (what was already imported stays)."""
    for name in OPTIONAL:
        if name not in keep:
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]


class Conditioning(StrEnum):
    text = "text"  # prompt (and negative prompt)
    class_label = "class_label"  # an integer label in [0, num_classes)
    none = "none"  # unconditional


class ModelSpec(BaseModel):
    """One servable model: where it comes from, what it takes, its defaults and bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Name clients ask for; a subject-safe token.")
    source: str = Field(description="builtin:<name>, dir:<path>, run:<run_id>, noop, fault:<kind>.")
    conditioning: Conditioning = Conditioning.none
    num_classes: int = Field(0, ge=0, description="Class labels are 0..num_classes-1.")
    default_width: int = Field(16, ge=8, multiple_of=8)
    default_height: int = Field(16, ge=8, multiple_of=8)
    sizes: tuple[int, ...] = Field(
        (), description="Allowed widths/heights; empty allows any multiple of 8 in bounds.")
    min_size: int = Field(8, ge=8, multiple_of=8)
    max_size: int = Field(1024, ge=8, multiple_of=8)
    default_steps: int = Field(20, ge=1)
    max_steps: int = Field(200, ge=1)
    default_guidance: float = Field(1.0, ge=0)
    max_guidance: float = Field(1.0, ge=0, description="1.0 means no classifier-free guidance.")
    max_prompt_chars: int = Field(1000, ge=1)
    description: str = ""
    config: dict[str, Any] = Field(
        default_factory=dict, description="Builder options (e.g. a UNetConfig for class-unet).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return token(v, "model name")

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        kind, _, arg = v.partition(":")
        if kind not in SOURCE_KINDS:
            raise ValueError(f"source kind {kind!r} is not one of {', '.join(SOURCE_KINDS)}")
        if kind == "builtin" and arg not in BUILTINS:
            raise ValueError(f"builtin {arg!r} is not one of {', '.join(BUILTINS)}")
        if kind == "run":
            token(arg, "run id")
        if kind in ("dir", "fault") and not arg:
            raise ValueError(f"{kind}: needs an argument")
        return v

    @property
    def source_kind(self) -> str:
        return self.source.partition(":")[0]

    @property
    def source_arg(self) -> str:
        return self.source.partition(":")[2]

    @property
    def optional(self) -> frozenset[str]:
        """Which ``OPTIONAL`` packages this model's pipeline may use: a pipeline folder
        any (a text encoder, a scheduler on scipy); the built-in text model transformers
        (its text encoder); a class UNet, a run's checkpoint (a UNet or a DiT), no-op and
        fault models none."""
        kind = self.source_kind
        if kind == "dir":
            return frozenset(OPTIONAL)
        if kind == "builtin" and self.source_arg != "class-unet":
            return frozenset({"transformers"})
        return frozenset()

    def size_error(self, value: int) -> str | None:
        """Why ``value`` is not an allowed width/height for this model, or None."""
        if self.sizes:
            if value not in self.sizes:
                return f"model {self.name} takes sizes {list(self.sizes)}, got {value}"
            return None
        if not self.min_size <= value <= self.max_size:
            return f"model {self.name} takes {self.min_size}..{self.max_size}, got {value}"
        return None

    def public(self) -> dict[str, Any]:
        """What ``/v1/models`` shows (no builder internals)."""
        d = self.model_dump(exclude={"config"})
        d["conditioning"] = str(self.conditioning)
        if self.conditioning == Conditioning.class_label:
            d["class_labels"] = {"min": 0, "max": self.num_classes - 1}
        d["sizes"] = list(self.sizes)
        return d


class Registry:
    """Models by name, in declaration order."""

    def __init__(self, models: list[ModelSpec]) -> None:
        self.models: dict[str, ModelSpec] = {}
        for m in models:
            if m.name in self.models:
                raise ValueError(f"model {m.name!r} is declared twice")
            self.models[m.name] = m

    def get(self, name: str) -> ModelSpec | None:
        return self.models.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.models

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.models.values())

    def names(self) -> list[str]:
        return list(self.models)

    @classmethod
    def parse(cls, value: str | None) -> Registry:
        """The registry from ``TANDEM_MODELS``: empty → the defaults, ``@file`` or JSON.

        Raises ``ValueError`` naming the model and field that is wrong.
        """
        if not value or not value.strip():
            return default_registry()
        text = value.strip()
        if text.startswith("@"):
            path = Path(text[1:])
            try:
                text = path.read_text()
            except OSError as exc:
                raise ValueError(f"cannot read model registry {path}: {exc}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model registry is not JSON: {exc}") from None
        if isinstance(raw, dict):
            raw = [{"name": k, **v} for k, v in raw.items()]
        if not isinstance(raw, list) or not raw:
            raise ValueError("model registry must be a non-empty JSON list (or object)")
        specs = []
        for i, item in enumerate(raw):
            try:
                specs.append(ModelSpec.model_validate(item))
            except ValidationError as exc:
                name = item.get("name", f"#{i}") if isinstance(item, dict) else f"#{i}"
                what = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
                raise ValueError(f"model {name}: {what}") from None
        return cls(specs)


def default_registry() -> Registry:
    """The CPU test models: they need no download and run in seconds on a laptop."""
    return Registry([
        ModelSpec(
            name="digits", source="builtin:class-unet", conditioning=Conditioning.class_label,
            num_classes=10, default_width=16, default_height=16, sizes=(16,),
            default_steps=20, max_steps=1000,
            description="Class-conditional UNet2DModel DDPM, the trainer's digits model "
            "with random weights (untrained: it draws noise). To serve a trained run, list "
            "it in TANDEM_MODELS with source run:<run_id> (docs/local-stack.md).",
        ),
        ModelSpec(
            name="tiny-text", source="builtin:tiny-text", conditioning=Conditioning.text,
            default_width=16, default_height=16, min_size=8, max_size=64,
            default_steps=10, max_steps=200, default_guidance=5.0, max_guidance=20.0,
            max_prompt_chars=500,
            description="Tiny randomly initialised text-to-image pipeline (CLIP, UNet, VAE).",
        ),
        ModelSpec(
            name="noop", source="noop", default_steps=1, max_steps=1,
            description="No pipeline: measures dispatch overhead.",
        ),
    ])


class RegistrySettings(Settings):
    """Settings of a service that reads the registry (the gateway, the worker)."""

    models: str = Field("", description="Model registry: JSON list, or @path to a JSON "
                        "file; empty uses the built-in CPU test models.")

    @field_validator("models")
    @classmethod
    def _registry(cls, v: str) -> str:
        Registry.parse(v)  # a bad registry stops the service at start, naming the field
        return v

    model_root: str = Field(
        ".tandem/models", min_length=1, validate_default=True,
        description="Folder every dir:<path> model must be inside (symlinks resolved); a "
        "path outside it stops the service at start.")

    @field_validator("model_root")
    @classmethod
    def _inside_root(cls, v: str, info: Any) -> str:
        if "models" not in info.data:
            return v
        root = Path(v).resolve()
        for spec in Registry.parse(info.data["models"]):
            if spec.source_kind == "dir" and not Path(spec.source_arg).resolve(
                    ).is_relative_to(root):
                raise ValueError(f"model {spec.name!r}: {spec.source_arg} is outside the "
                                 f"model root {root}")
        return v

    @property
    def registry(self) -> Registry:
        return Registry.parse(self.models)
