"""Serving a training run: load its newest committed checkpoint, hot-swap to each new one.

A registry model whose source is ``run:<run_id>`` is served from the run's checkpoints
in S3 (``tandem.common.checkpoints``):

- **load** (``load_run_pipeline``): every byte is checked against the manifest's sha256;
  the architecture is the checkpoint's own ``model_config.json`` and a field the registry
  declares differently, or a conditioning the checkpoint cannot take, is a
  ``CheckpointError`` naming it; weights come from safetensors only (model, then EMA);
  then one denoising step on one sample must give finite values of the right shape. The
  first load falls back to the previous committed checkpoint when the newest fails.
- **watch** (``HotSwapper``): a subscription to ``ckpt.<run>.mirrored`` wakes the
  model's watcher the moment the checkpointer commits; a poll of the committed steps
  every ``checkpoint_poll`` seconds catches what a subscription misses (a reconnect, a
  worker started after the event).
- **swap**: a newer checkpoint is loaded in a thread while batches go on, verified, and
  then replaces the model's entry in the worker's ``pipelines``. The batcher looks a
  model's pipeline up once per batch and every job keeps the pipeline that ran it, so
  the swap happens between batches: a running batch finishes on the old weights and its
  results record the old step; the next batch uses the new one. No task is touched.
- **skip**: a newer checkpoint that fails (corrupt bytes, another architecture, non-finite
  output) is logged (``worker.checkpoint_skipped``), remembered so it is not downloaded
  again, and the worker keeps serving what it has. A failure to reach S3 is not a
  verdict on the checkpoint: it is retried at the next event or poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.common import checkpoints as ck
from tandem.common import log, metrics, subjects
from tandem.common.errors import CheckpointError
from tandem.common.events import CheckpointMirrored, decode
from tandem.common.models import Conditioning, ModelSpec
from tandem.inference_worker.pipelines import (
    ClassUnetPipeline,
    Pipeline,
    resolve_device,
    resolve_dtype,
)

_log = log.get("tandem.inference_worker.hotswap")

LOADED_STEP = metrics.Gauge("tandem_worker_checkpoint_step",
                            "Checkpoint step a run model is served from", ["model"])
SWAPS = metrics.Counter("tandem_worker_checkpoint_swaps", "Checkpoints hot-swapped in",
                        ["model"])
SKIPPED = metrics.Counter("tandem_worker_checkpoint_skipped",
                          "Newer checkpoints that failed to load and were skipped", ["model"])


# ---------------------------------------------------------------------------------- loading


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
                      s3: Any = None, bucket: str | None = None) -> ClassUnetPipeline:
    """The run's committed checkpoint ``step`` (default: the newest that verifies, falling
    back), loaded and verified as a pipeline that records its step. Blocking.

    Raises ``CheckpointError`` (naming run, step and what is wrong) when it cannot be
    served; anything else (S3 unreachable) is not about the checkpoint.
    """
    run_id = spec.source_arg
    m = ck.load_serving(run_id, spec.config, s3=s3, bucket=bucket, step=step,
                        fallback=step is None)
    from tandem.common.diffusion import architecture

    cfg = architecture(m.config)  # load_serving built the model from this same config
    _check_conditioning(spec, run_id, m.step, cfg)
    pipe = ClassUnetPipeline(spec, device, dtype, unet=m.unet, scheduler=m.scheduler, cfg=cfg)
    pipe.checkpoint, pipe.checkpoint_step = m.label, m.step
    verify(pipe, run_id, m.step)
    LOADED_STEP.labels(spec.name).set(m.step)
    for s, reason in m.skipped:
        _log.error("worker.checkpoint_skipped", model=spec.name, run=run_id, step=s,
                   reason=reason, serving=m.step)
    return pipe


# -------------------------------------------------------------------------------- hot-swap


@dataclass
class _Watched:
    spec: ModelSpec
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    skipped: dict[int, str] = field(default_factory=dict)  # step -> why it was passed over

    @property
    def run_id(self) -> str:
        return self.spec.source_arg


class HotSwapper:
    """Keeps every served ``run:`` model on its run's newest good checkpoint.

    ``pipelines`` and ``locks`` are the worker's: a swap replaces ``pipelines[model]``,
    and loads of one model (the worker's first load, a swap) hold ``locks[model]`` so they
    never race. ``poll`` seconds between checks without an event (0: events only).
    ``load_missing``: a model not loaded yet is loaded once a checkpoint exists
    (the worker preloads); otherwise its first task loads it.
    """

    def __init__(self, specs: Iterable[ModelSpec], pipelines: dict[str, Pipeline],
                 locks: dict[str, asyncio.Lock], *, device: str, dtype: str, s3: Any,
                 bucket: str, poll: float, load_missing: bool = True) -> None:
        self.watched = {s.name: _Watched(s) for s in specs if s.source_kind == "run"}
        self.pipelines = pipelines
        self.locks = locks
        self.device = device
        self.dtype = dtype
        self.s3 = s3
        self.bucket = bucket
        self.poll = poll
        self.load_missing = load_missing
        self.swaps = 0

    def serves(self, model: str) -> bool:
        return model in self.watched

    def status(self) -> dict[str, Any]:
        """For /healthz: each run model's loaded step and the steps it skipped."""
        out: dict[str, Any] = {}
        for name, w in self.watched.items():
            pipe = self.pipelines.get(name)
            out[name] = {"run": w.run_id,
                         "step": pipe.checkpoint_step if pipe is not None else None,
                         "skipped": {str(s): r for s, r in w.skipped.items()}}
        return out

    async def run(self, nc: Any) -> None:
        """Watch every run model until cancelled."""
        if not self.watched:
            return
        subs = []
        try:
            for w in self.watched.values():
                subs.append(await nc.subscribe(subjects.ckpt(w.run_id, "mirrored"),
                                               cb=self._on_mirrored(w)))
            async with asyncio.TaskGroup() as tg:
                for w in self.watched.values():
                    tg.create_task(self._watch(w))
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def _on_mirrored(self, w: _Watched) -> Any:
        async def cb(msg: Any) -> None:
            try:
                ev = decode(msg.data, CheckpointMirrored)
            except Exception as exc:  # the poll still finds it; the event is only a hint
                _log.warning("worker.checkpoint_event_invalid", run=w.run_id, error=repr(exc))
            else:
                _log.info("worker.checkpoint_mirrored", model=w.spec.name, run=ev.run_id,
                          step=ev.step)
            w.wake.set()

        return cb

    async def _watch(self, w: _Watched) -> None:
        while True:
            w.wake.clear()  # before the check: an event during it makes another check
            try:
                await self.check(w.spec.name)
            except Exception as exc:  # never let one bad round stop the watcher
                _log.warning("worker.checkpoint_check_failed", model=w.spec.name,
                             error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.wake.wait(), self.poll or None)

    async def check(self, model: str) -> int | None:
        """Swap ``model`` to its newest committed checkpoint newer than the loaded one
        that loads and verifies; return the step it serves afterwards (None: none)."""
        w = self.watched[model]
        async with self.locks.setdefault(model, asyncio.Lock()):
            current = self.pipelines.get(model)
            have = current.checkpoint_step if current is not None else None
            if current is None and not self.load_missing:
                return None
            try:
                steps = await asyncio.to_thread(ck.committed_steps, self.s3, self.bucket,
                                                w.run_id)
            except Exception as exc:
                _log.warning("worker.checkpoint_list_failed", model=model, run=w.run_id,
                             error=repr(exc))
                return have
            for step in reversed(steps):
                if have is not None and step <= have:
                    break
                if step in w.skipped:
                    continue
                pipe = await self._load(w, step, have)
                if pipe is not None:
                    self.pipelines[model] = pipe
                    return step
            return have

    async def _load(self, w: _Watched, step: int, have: int | None) -> Pipeline | None:
        model = w.spec.name
        t0 = time.monotonic()
        try:
            dev = resolve_device(self.device)
            pipe = await asyncio.to_thread(load_run_pipeline, w.spec, dev,
                                           resolve_dtype(self.dtype, dev), step=step,
                                           s3=self.s3, bucket=self.bucket)
        except CheckpointError as exc:
            w.skipped[step] = exc.reason
            SKIPPED.labels(model).inc()
            _log.error("worker.checkpoint_skipped", model=model, run=w.run_id, step=step,
                       reason=exc.reason, serving=have)
            return None
        except Exception as exc:  # S3 unreachable and the like: try again next round
            _log.warning("worker.checkpoint_load_failed", model=model, run=w.run_id,
                         step=step, error=repr(exc), serving=have)
            return None
        if have is not None:
            self.swaps += 1
            SWAPS.labels(model).inc()
        _log.info("worker.checkpoint_swapped" if have is not None else "worker.model_loaded",
                  model=model, run=w.run_id, step=step, previous=have,
                  seconds=round(time.monotonic() - t0, 3))
        return pipe


__all__ = ["HotSwapper", "load_run_pipeline", "verify"]
