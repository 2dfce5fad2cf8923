"""Pipelines the worker runs, built from the model registry.

Every pipeline takes a batch of ``Item`` (one per image, each with its own seed, so a
generator per image makes results independent of batch composition) and returns PNG
bytes per item. ``on_step(step, total)`` is called after each denoising step, from the
thread the pipeline runs in; it raises ``Interrupted`` to stop the call between steps.

torch and diffusers are imported inside the builders: a worker that serves only the
no-op (or fault) models starts without them.
"""

from __future__ import annotations

import inspect
import io
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.common.errors import TandemError
from tandem.common.models import Conditioning, ModelSpec

StepHook = Callable[[int, int], None]


class Interrupted(Exception):
    """Raised by a step hook: every task in the batch was cancelled or handed back."""


class ModelLoadError(TandemError):
    """A model cannot be built or loaded here; ``reason`` says why."""

    def __init__(self, model: str, reason: str) -> None:
        self.model = model
        self.reason = reason
        super().__init__(f"cannot load model {model}: {reason}")


@dataclass(frozen=True, slots=True)
class Item:
    """One image to make."""

    seed: int
    prompt: str | None = None
    negative_prompt: str | None = None
    class_label: int | None = None


@dataclass(frozen=True, slots=True)
class Params:
    """What every image of one pipeline call shares (a task's ``batch_key``)."""

    width: int
    height: int
    steps: int
    guidance: float


class Pipeline:
    """Base: a loaded model that turns items into PNGs."""

    trivial = False  # no compute to amortise: no linger, no thread
    checkpoint = ""
    checkpoint_step: int | None = None

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def generate(self, items: list[Item], params: Params, on_step: StepHook) -> list[bytes]:
        raise NotImplementedError


class NoopPipeline(Pipeline):
    """Dispatch only: no images (benchmarks measure the path around the model)."""

    trivial = True

    def generate(self, items: list[Item], params: Params, on_step: StepHook) -> list[bytes]:
        return []


class FaultPipeline(Pipeline):
    """Fault injection for tests: ``fault:kill`` SIGKILLs the worker at the first step,
    ``fault:raise`` raises. Refused unless the worker enables fault injection."""

    def generate(self, items: list[Item], params: Params, on_step: StepHook) -> list[bytes]:
        on_step(1, params.steps)
        if self.spec.source_arg == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault {self.spec.source_arg!r}")


def _png(array: Any) -> bytes:
    """uint8 HxWxC (C = 1 or 3) to PNG bytes; no metadata, so equal pixels give equal bytes."""
    from PIL import Image

    if array.shape[-1] == 1:
        img = Image.fromarray(array[..., 0], mode="L")
    else:
        img = Image.fromarray(array, mode="RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


class ClassUnetPipeline(Pipeline):
    """A class-conditional UNet2DModel, or a trainer's DiT (``cfg`` a ``DiTConfig``),
    sampled with DDPM: the trainer's model families."""

    def __init__(self, spec: ModelSpec, device: str, dtype: Any, unet: Any = None,
                 scheduler: Any = None, cfg: Any = None) -> None:
        super().__init__(spec)
        from tandem.common.diffusion import UNetConfig, build_scheduler, build_unet

        # A loaded checkpoint brings its own architecture (``cfg``); the registry's
        # config only describes models built here.
        if cfg is None:
            cfg = UNetConfig.from_dict(spec.config) if spec.config else UNetConfig()
        self.cfg = cfg
        self.unet = unet if unet is not None else build_unet(cfg, seed=spec.config.get("seed", 0))
        self.unet = _to(self.unet, device, dtype).eval()
        self.scheduler = scheduler if scheduler is not None else build_scheduler(cfg)
        self.device = device
        self.dtype = dtype

    def predict(self, x: Any, t: Any, labels: Any) -> Any:
        """The model's noise prediction for ``x`` at timestep ``t``."""
        from tandem.common.diffusion import DiTConfig, predict_noise

        return predict_noise(self.unet, x, t, labels, dit=isinstance(self.cfg, DiTConfig))

    def generate(self, items: list[Item], params: Params, on_step: StepHook) -> list[bytes]:
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        # A scheduler per call: set_timesteps mutates it, and calls must not share state.
        sched = type(self.scheduler).from_config(self.scheduler.config)
        sched.set_timesteps(params.steps)
        gens = [torch.Generator("cpu").manual_seed(it.seed) for it in items]
        shape = (len(items), self.cfg.in_channels, params.height, params.width)
        with torch.inference_mode():
            x = randn_tensor(shape, generator=gens, device=torch.device(self.device),
                             dtype=self.dtype)
            labels = None
            if self.cfg.num_classes:
                labels = torch.tensor([it.class_label or 0 for it in items], device=self.device)
            total = len(sched.timesteps)
            for i, t in enumerate(sched.timesteps):
                eps = self.predict(x, t, labels)
                x = sched.step(eps, t, x, generator=gens).prev_sample
                on_step(i + 1, total)
            pixels = ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
            arrays = pixels.permute(0, 2, 3, 1).cpu().numpy()
        return [_png(a) for a in arrays]


class DiffusersPipeline(Pipeline):
    """Any diffusers pipeline object (text-to-image or class-conditional).

    Arguments are matched to the pipeline's ``__call__`` signature, so a Stable Diffusion,
    FLUX or DiT pipeline each get only what they take.
    """

    def __init__(self, spec: ModelSpec, pipe: Any, device: str) -> None:
        super().__init__(spec)
        self.pipe = pipe
        self.device = device
        self.accepts = set(inspect.signature(pipe.__call__).parameters)
        if hasattr(pipe, "set_progress_bar_config"):
            pipe.set_progress_bar_config(disable=True)

    def generate(self, items: list[Item], params: Params, on_step: StepHook) -> list[bytes]:
        import numpy as np
        import torch

        gens = [torch.Generator("cpu").manual_seed(it.seed) for it in items]
        kw: dict[str, Any] = {"generator": gens, "num_inference_steps": params.steps,
                              "output_type": "np"}
        if "height" in self.accepts:
            kw["height"], kw["width"] = params.height, params.width
        if "guidance_scale" in self.accepts:
            kw["guidance_scale"] = params.guidance
        if self.spec.conditioning == Conditioning.text:
            kw["prompt"] = [it.prompt or "" for it in items]
            if "negative_prompt" in self.accepts and any(it.negative_prompt for it in items):
                kw["negative_prompt"] = [it.negative_prompt or "" for it in items]
        elif self.spec.conditioning == Conditioning.class_label:
            kw["class_labels"] = [it.class_label or 0 for it in items]
        elif "batch_size" in self.accepts:
            kw["batch_size"] = len(items)
        if "callback_on_step_end" in self.accepts:
            def hook(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
                on_step(i + 1, params.steps)
                return tensors

            kw["callback_on_step_end"] = hook
        with torch.inference_mode():
            out = self.pipe(**kw)
        images = out.images
        arrays = (np.clip(np.asarray(images, dtype=np.float32), 0, 1) * 255).round()
        return [_png(a.astype(np.uint8)) for a in arrays]


# ----------------------------------------------------------------------------- building


def _to(module: Any, device: str, dtype: Any) -> Any:
    """Move to ``device``; cast only when the dtype changes (built models are float32)."""
    import torch

    module = module.to(device)
    return module if dtype == torch.float32 else module.to(dtype=dtype)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> Any:
    import torch

    if dtype == "auto":
        # bf16 keeps fp32's range (no fp16 VAE overflow) at half the memory.
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def load_run_checkpoint(spec: ModelSpec, device: str, dtype: Any) -> Pipeline:
    """``run:<run_id>``: the run's newest committed checkpoint that verifies.

    Loading, verification and hot-swapping to newer checkpoints live in ``hotswap``.
    """
    from tandem.common.errors import CheckpointError
    from tandem.inference_worker.hotswap import load_run_pipeline

    try:
        return load_run_pipeline(spec, device, dtype)
    except CheckpointError as exc:
        raise ModelLoadError(spec.name, str(exc)) from None


def build(spec: ModelSpec, device: str = "auto", dtype: str = "auto",
          fault_injection: bool = False) -> Pipeline:
    """Build or load the pipeline ``spec`` declares; ``ModelLoadError`` says why not."""
    kind = spec.source_kind
    if kind == "noop":
        return NoopPipeline(spec)
    if kind == "fault":
        if not fault_injection:
            raise ModelLoadError(spec.name, "fault injection is disabled on this worker")
        return FaultPipeline(spec)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        if kind == "builtin" and spec.source_arg == "class-unet":
            return ClassUnetPipeline(spec, dev, dt)
        if kind == "builtin" and spec.source_arg == "tiny-text":
            from tandem.common.diffusion import build_tiny_text_pipeline

            pipe = build_tiny_text_pipeline(seed=spec.config.get("seed", 0))
            return DiffusersPipeline(spec, _to(pipe, dev, dt), dev)
        if kind == "dir":
            from diffusers import DiffusionPipeline

            path = spec.source_arg
            if not os.path.isdir(path):
                raise ModelLoadError(spec.name, f"{path} is not a directory")
            # safetensors only: a folder's pickled .bin weights are refused, not unpickled
            pipe = DiffusionPipeline.from_pretrained(path, torch_dtype=dt, local_files_only=True,
                                                     use_safetensors=True)
            return DiffusersPipeline(spec, pipe.to(dev), dev)
        if kind == "run":
            return load_run_checkpoint(spec, dev, dt)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(spec.name, repr(exc)) from exc
    raise ModelLoadError(spec.name, f"unsupported source {spec.source!r}")
