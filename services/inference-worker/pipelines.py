"""Pipelines the worker runs, built from the model registry.

Every pipeline takes a batch of ``Item`` (one per image, each with its own seed, so a
generator per image makes results independent of batch composition) and returns one
image per item (``images``: the pipeline call alone); ``encode`` makes its PNG apart, so
the worker encodes beside the next call instead of on the compute thread.
``on_step(step, total)`` is called after each denoising step, from the thread the
pipeline runs in; it raises ``Interrupted`` to stop the call between steps. A call whose
steps stop coming is given up on as ``CallStalled`` (``batcher``, ``apart``).

torch and diffusers are imported inside the builders: a worker that serves only the
no-op (or fault) models starts without them. A ``run:<run_id>`` model is loaded here
from the run's committed checkpoint (``load_run_pipeline``); ``hotswap`` keeps it on the
newest one and imports this module, never the other way round.

One module past 450 lines: every kind of model (built-in, folder, run, no-op, fault) is
built behind the one ``Pipeline`` interface here, so the worker and a pipeline process
build them alike.
"""

from __future__ import annotations

import inspect
import io
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.common import checkpoints as ck
from tandem.common import log, metrics
from tandem.common.errors import CheckpointError, TandemError
from tandem.common.models import Conditioning, ModelSpec

_log = log.get("tandem.inference_worker.pipelines")

LOADED_STEP = metrics.Gauge("tandem_worker_checkpoint_step",
                            "Checkpoint step a run model is served from", ["model"])

StepHook = Callable[[int, int], None]


class Interrupted(Exception):
    """Raised by a step hook: every task in the batch was cancelled or handed back."""


class CallStalled(Exception):
    """A pipeline call made no step for ``timeout`` seconds (``TANDEM_CALL_STALL_TIMEOUT``;
    its first step counted from its start, its end from its last step): given up on, its
    tasks handed back for another worker. ``step`` of ``total``: the last step it made (0:
    none). ``ended``: what ran it was ended (its pipeline process, killed: the next call
    starts a fresh one); otherwise it still runs in the worker's own process, where nothing
    can stop it."""

    def __init__(self, model: str, timeout: float, step: int, total: int,
                 ended: bool) -> None:
        self.model = model
        self.timeout = timeout
        self.step = step
        self.total = total
        self.ended = ended
        where = ("its pipeline process was killed" if ended
                 else "it still runs in the worker's own process")
        super().__init__(f"the pipeline call of {model} made no step for {timeout:g} s "
                         f"after step {step} of {total} (TANDEM_CALL_STALL_TIMEOUT): {where}")


class ModelLoadError(TandemError):
    """A model cannot be built or loaded here; ``reason`` says why. ``lasting``: it never
    will be as declared (no such folder, no checkpoint of the run that verifies, a source
    this worker cannot build), so its tasks fail at once; otherwise what failed may not
    fail next time (S3 unreachable, a folder still being copied, memory in use) and its
    tasks are tried again."""

    def __init__(self, model: str, reason: str, lasting: bool = True) -> None:
        self.model = model
        self.reason = reason
        self.lasting = lasting
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


@dataclass(frozen=True, slots=True)
class CallTime:
    """When one pipeline call started (wall clock), its wall and CPU seconds."""

    started: float
    wall_s: float
    cpu_s: float

    @staticmethod
    def clocks() -> tuple[float, float, float]:
        """This thread's clocks now: what ``since`` measures from."""
        return time.time(), time.perf_counter(), time.thread_time()

    @classmethod
    def since(cls, clocks: tuple[float, float, float]) -> CallTime:
        """A call that began at ``clocks`` and ends now, on this thread."""
        started, t0, cpu0 = clocks
        return cls(started, time.perf_counter() - t0, time.thread_time() - cpu0)


class Pipeline:
    """Base: a loaded model that turns items into images, and images into PNGs.

    The two halves are apart so the worker can keep the pipeline call alone on its
    compute thread: ``images`` is the call (one image per item, in the pipeline's own
    form: uint8 HxWxC arrays for the torch pipelines), ``encode`` makes one PNG of one
    image and runs elsewhere, beside the next call. ``generate`` is both, for callers
    that want PNGs in one go.
    """

    trivial = False  # no compute to amortise: no linger, no thread
    # Calls may be handed over while one runs (they queue where they run: ``apart``'s
    # child); otherwise the batcher hands over one call at a time.
    concurrent = False
    checkpoint = ""
    checkpoint_step: int | None = None
    checkpoint_lineage = 0  # with checkpoint_step, which checkpoint (after a rollback)

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def images(self, items: list[Item], params: Params, on_step: StepHook) -> list[Any]:
        """The pipeline call: one image per item (arrays, or PNG bytes already)."""
        raise NotImplementedError

    def encode(self, image: Any) -> bytes:
        """One image as PNG bytes (bytes are taken as a PNG already)."""
        return image if isinstance(image, bytes) else png(image)

    def generate(self, items: list[Item], params: Params, on_step: StepHook) -> list[bytes]:
        """``images`` then ``encode``: the PNG of each item."""
        return [self.encode(image) for image in self.images(items, params, on_step)]

    def call(self, items: list[Item], params: Params,
             on_step: StepHook) -> tuple[list[Any], CallTime]:
        """``images``, timed where the call runs: on this thread here; a pipeline whose
        calls run elsewhere (``apart``) reports that place's clocks."""
        began = CallTime.clocks()
        images = self.images(items, params, on_step)
        return images, CallTime.since(began)

    def close(self) -> None:
        """Free what the pipeline holds outside this process (nothing, here)."""

    def warm(self, max_batch: int, on_step: StepHook | None = None) -> None:
        """One denoising step at the model's default size, for one image and for
        ``max_batch``: the one-time costs of a first call (kernel choice, allocations,
        lazy imports) are paid before the worker is ready, and a full batch that does not
        fit on the device shows before a task needs it (``on_step`` hears each of those
        steps: its watch's signs of life). Raises what the call raises.
        No-op and fault models are not warmed, wherever their calls run (a fault is for
        tasks, not for the start)."""
        spec = self.spec
        if not uses_torch(spec):
            return
        params = Params(width=spec.default_width, height=spec.default_height, steps=1,
                        guidance=spec.default_guidance)
        for n in sorted({1, max_batch}):
            items = [Item(seed=i, prompt="", class_label=0 if spec.num_classes else None)
                     for i in range(n)]
            self.images(items, params, on_step or (lambda step, total: None))


class NoopPipeline(Pipeline):
    """Dispatch only: no images (benchmarks measure the path around the model)."""

    trivial = True

    def images(self, items: list[Item], params: Params, on_step: StepHook) -> list[Any]:
        return []


class FaultPipeline(Pipeline):
    """Fault injection for tests: ``fault:kill`` SIGKILLs the worker at the first step,
    ``fault:raise`` raises. ``fault:kill@<seed>`` and ``fault:raise@<seed>`` do so only
    in a call holding an image of that seed (a poison task; its batch-mates with it),
    and otherwise make blank images. ``fault:gate@<fifo>`` steps only when a test lets
    it (``gated``): a call that hangs, or one that is slow and goes on. Refused unless
    the worker enables fault injection."""

    def images(self, items: list[Item], params: Params, on_step: StepHook) -> list[Any]:
        fault, _, arg = self.spec.source_arg.partition("@")
        if fault == "gate":
            return self.gated(arg, items, params, on_step)
        on_step(1, params.steps)
        if arg and all(str(it.seed) != arg for it in items):
            return blank(items, params)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault {self.spec.source_arg!r}")

    @staticmethod
    def gated(path: str, items: list[Item], params: Params, on_step: StepHook) -> list[Any]:
        """Open the named pipe ``path`` to read (waiting for a writer), then make one step
        per byte read from it; once its writer closes it, the call ends at once with blank
        images. A gate nobody writes to is a call that never returns from its step."""
        with open(path, "rb", buffering=0) as gate:
            for step in range(1, params.steps + 1):
                if not gate.read(1):
                    break
                on_step(step, params.steps)
        return blank(items, params)


def blank(items: list[Item], params: Params) -> list[bytes]:
    """A black PNG per item, of the call's size."""
    from PIL import Image

    return [png_bytes(Image.new("L", (params.width, params.height))) for _ in items]


def png(array: Any) -> bytes:
    """uint8 HxWxC (C = 1 or 3) to PNG bytes; no metadata, so equal pixels give equal bytes."""
    from PIL import Image

    if array.shape[-1] == 1:
        return png_bytes(Image.fromarray(array[..., 0], mode="L"))
    return png_bytes(Image.fromarray(array, mode="RGB"))


def png_bytes(img: Any) -> bytes:
    """A PIL image as PNG bytes, without metadata."""
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

    def images(self, items: list[Item], params: Params, on_step: StepHook) -> list[Any]:
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
        return list(arrays)


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

    def images(self, items: list[Item], params: Params, on_step: StepHook) -> list[Any]:
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
        return list(arrays.astype(np.uint8))


# ----------------------------------------------------------------------------- building


def _to(module: Any, device: str, dtype: Any) -> Any:
    """Move to ``device``; cast only when the dtype changes (built models are float32)."""
    import torch

    module = module.to(device)
    return module if dtype == torch.float32 else module.to(dtype=dtype)


def uses_torch(spec: ModelSpec) -> bool:
    """Whether ``spec``'s pipeline runs on torch (no-op and fault models do not)."""
    return spec.source_kind not in ("noop", "fault")


def set_threads(threads: int) -> int:
    """Set torch's intra-op threads to ``threads`` (0: leave torch's default, one per
    core); the count in force. Process-wide, so it is set once, before the first call."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    return int(torch.get_num_threads())


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


# ------------------------------------------------------------------------- run: models


def _check_conditioning(spec: ModelSpec, run_id: str, step: int, cfg: Any) -> None:
    """What the registry promises clients must be what the checkpoint can do."""
    from tandem.common.diffusion import DiTConfig

    if spec.conditioning == Conditioning.text:
        raise CheckpointError(run_id, step, f"model {spec.name} is declared text-conditioned; "
                              "a trainer checkpoint (UNet2DModel or DiT) takes class labels "
                              "at most")
    if spec.conditioning == Conditioning.class_label and not (
            1 <= spec.num_classes <= cfg.num_classes):
        raise CheckpointError(run_id, step, f"model {spec.name} declares num_classes="
                              f"{spec.num_classes}; the checkpoint has {cfg.num_classes} classes")
    if isinstance(cfg, DiTConfig):  # its positional embedding fixes the image size
        n = cfg.sample_size
        if list(spec.sizes) != [n] or (spec.default_width, spec.default_height) != (n, n):
            raise CheckpointError(run_id, step, f"model {spec.name} must declare sizes [{n}] "
                                  f"and default {n}x{n}: a DiT checkpoint makes {n}x{n} "
                                  f"images only (it declares sizes {list(spec.sizes)}, "
                                  f"default {spec.default_width}x{spec.default_height})")


def verify(pipe: ClassUnetPipeline, run_id: str, step: int) -> None:
    """One denoising step on one sample gives finite values of the input's shape."""
    import torch

    cfg = pipe.cfg
    size = cfg.sample_size
    shape = (1, cfg.in_channels, size, size)
    with torch.inference_mode():
        x = torch.zeros(shape, device=pipe.device, dtype=pipe.dtype)
        t = torch.tensor([cfg.num_train_timesteps // 2], device=pipe.device)
        labels = torch.zeros(1, dtype=torch.long, device=pipe.device) \
            if cfg.num_classes else None
        out = pipe.predict(x, t, labels)
        finite = bool(torch.isfinite(out).all())
    if tuple(out.shape) != shape:
        raise CheckpointError(run_id, step, f"one denoising step gives shape "
                              f"{tuple(out.shape)}, expected {shape}")
    if not finite:
        raise CheckpointError(run_id, step, "one denoising step gives non-finite values "
                              "(NaN or inf in the weights)")


def load_run_pipeline(spec: ModelSpec, device: str, dtype: Any, *, step: int | None = None,
                      s3: Any = None, bucket: str | None = None,
                      line: ck.Lineage | None = None,
                      stop: threading.Event | None = None) -> ClassUnetPipeline:
    """The run's committed checkpoint ``step`` of ``line``'s history (default: the newest
    that verifies, falling back; ``line``: the run's current lineage, lineage 0 without
    it), loaded and verified as a pipeline that records its step and lineage. Blocking.
    With ``step`` nothing is listed in S3 (``checkpoints.restore``): the hot-swapper
    knows it.

    Raises ``CheckpointError`` (naming run, step and what is wrong) when it cannot be
    served; anything else (S3 unreachable) is not about the checkpoint. ``stop`` set, the
    download stops at its next chunk (``checkpoints.Stopped``).
    """
    run_id = spec.source_arg
    m = ck.load_serving(run_id, spec.config, s3=s3, bucket=bucket, step=step,
                        fallback=step is None, line=line, stop=stop)
    from tandem.common.diffusion import architecture

    cfg = architecture(m.config)  # load_serving built the model from this same config
    _check_conditioning(spec, run_id, m.step, cfg)
    pipe = ClassUnetPipeline(spec, device, dtype, unet=m.unet, scheduler=m.scheduler, cfg=cfg)
    pipe.checkpoint, pipe.checkpoint_step, pipe.checkpoint_lineage = m.label, m.step, m.lineage
    verify(pipe, run_id, m.step)
    LOADED_STEP.labels(spec.name).set(m.step)
    for s, reason in m.skipped:
        _log.error("worker.checkpoint_skipped", model=spec.name, run=run_id, step=s,
                   reason=reason, serving=m.step)
    return pipe


def load_run_checkpoint(spec: ModelSpec, device: str, dtype: Any,
                        line: ck.Lineage | None = None,
                        stop: threading.Event | None = None) -> Pipeline:
    """``run:<run_id>``: the run's newest committed checkpoint of ``line``'s history (its
    current lineage) that verifies.

    Hot-swapping to newer checkpoints lives in ``hotswap``.
    """
    try:
        return load_run_pipeline(spec, device, dtype, line=line, stop=stop)
    except CheckpointError as exc:
        raise ModelLoadError(spec.name, str(exc)) from None


def build(spec: ModelSpec, device: str = "auto", dtype: str = "auto",
          fault_injection: bool = False, line: ck.Lineage | None = None,
          stop: threading.Event | None = None) -> Pipeline:
    """Build or load the pipeline ``spec`` declares (a ``run:`` model from ``line``'s
    history, the run's current lineage; ``stop`` stops its download); ``ModelLoadError``
    says why not."""
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
            return load_run_checkpoint(spec, dev, dt, line, stop)
    except ModelLoadError:
        raise
    except Exception as exc:  # not the model's declaration: it may load next time
        raise ModelLoadError(spec.name, repr(exc), lasting=False) from exc
    raise ModelLoadError(spec.name, f"unsupported source {spec.source!r}")

