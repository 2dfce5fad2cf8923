"""Serving a training run: load its newest committed checkpoint, hot-swap to each new one.

A registry model whose source is ``run:<run_id>`` is served from the run's checkpoints
in S3 (``tandem.common.checkpoints``):

- **load** (``pipelines.load_run_pipeline``): every byte is checked against the manifest's checksum;
  the architecture is the checkpoint's own ``model_config.json`` and a field the registry
  declares differently, or a conditioning the checkpoint cannot take, is a
  ``CheckpointError`` naming it; weights come from safetensors only (model, then EMA);
  then one denoising step on one sample must give finite values of the right shape. The
  first load falls back to the previous committed checkpoint when the newest fails.
- **watch** (``HotSwapper``): the newest committed step comes from the checkpointer
  itself: KV ``runs`` (``latest_checkpoint_step``) on start, then each
  ``ckpt.<run>.mirrored`` event, whose step is loaded directly without listing S3. A
  poll of the committed steps every ``checkpoint_poll`` seconds verifies and catches
  what a subscription misses (a reconnect, a worker started after the event).
- **swap**: a newer checkpoint is loaded in a thread while batches go on, verified,
  warmed up between two calls (one step at one image and at a full batch, as a first
  load is), and then replaces the model's entry in the worker's ``pipelines``. The batcher looks a
  model's pipeline up once per batch and every job keeps the pipeline that ran it, so
  the swap happens between batches: a running batch finishes on the old weights and its
  results record the old step; the next batch uses the new one. No task is touched.
- **skip**: a newer checkpoint that fails (corrupt bytes or contents, another
  architecture, non-finite output) is logged (``worker.checkpoint_skipped``), remembered
  so it is not downloaded again, and the worker keeps serving what it has. A failure to
  reach S3 is not a verdict on the checkpoint: it is retried at the next event or poll.
- **lineage**: only checkpoints of the run's current history are served
  (``checkpoints.Lineage``, from the run's record in KV ``runs``, read at every check).
  A ``mirrored`` event names its checkpoint's lineage; one of an abandoned lineage is
  not loaded. The worker hears of a rollback from the record itself (a core
  subscription on the run's KV subject): if what it serves was abandoned, it stops
  serving it at once (a batch looking the model up waits on the model's lock) and loads
  the newest committed checkpoint of the new history, older though it is; with none the
  model stays unserved (its next task loads one when there is one). A load reads the
  record again before what it loaded is served, and one the history abandoned meanwhile
  is dropped for a new look: a rolled-back lineage's weights are never served after the
  worker has learnt of the rollback.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.common import checkpoints as ck
from tandem.common import log, metrics, subjects
from tandem.common.backoff import Backoff
from tandem.common.bus import Bus, TypedKV, describe
from tandem.common.errors import CheckpointError
from tandem.common.events import CheckpointMirrored, RunRecord, decode
from tandem.common.models import ModelSpec
from tandem.common.streams import KV_RUNS
from tandem.inference_worker.loads import detached
from tandem.inference_worker.pipelines import (
    Pipeline,
    load_run_pipeline,
    resolve_device,
    resolve_dtype,
)

_log = log.get("tandem.inference_worker.hotswap")

# A change of the run's record reaches this worker's subscription as the write is
# published, which can be before its stream has stored it: a read right after it can
# still find the record before the change. The read is made again until it shows the
# history the change named, for a while (a change the stream refused never shows).
HEARD_BACKOFF = Backoff(0.01, max_delay=0.2)
HEARD_WITHIN = 5.0

SWAPS = metrics.Counter("tandem_worker_checkpoint_swaps", "Checkpoints hot-swapped in",
                        ["model"])
SKIPPED = metrics.Counter("tandem_worker_checkpoint_skipped",
                          "Newer checkpoints that failed to load and were skipped", ["model"])


# -------------------------------------------------------------------------------- hot-swap


@dataclass
class _Watched:
    spec: ModelSpec
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # checkpoint -> why it was passed over
    skipped: dict[ck.CheckpointId, str] = field(default_factory=dict)
    told: ck.CheckpointId | None = None  # newest a mirrored event said, not yet checked
    line: ck.Lineage = field(default_factory=ck.Lineage)  # the run's history, last read
    heard: tuple[int, ...] | None = None  # forks a record change named, not yet read back

    @property
    def run_id(self) -> str:
        return self.spec.source_arg


class _Abandoned(Exception):
    """What a check loaded left the run's history while it loaded (``HotSwapper.check``
    looks again)."""


def _label(c: ck.CheckpointId) -> str:
    """A checkpoint in /healthz and logs: its step, with its lineage after a rollback."""
    return f"{c.step}-l{c.lineage}" if c.lineage else str(c.step)


def _loaded(pipe: Pipeline | None) -> ck.CheckpointId | None:
    if pipe is None or pipe.checkpoint_step is None:
        return None
    return ck.CheckpointId(pipe.checkpoint_step, pipe.checkpoint_lineage)


class HotSwapper:
    """Keeps every served ``run:`` model on its run's newest good checkpoint.

    ``pipelines`` and ``locks`` are the worker's: a swap replaces ``pipelines[model]``,
    and loads of one model (the worker's first load, a swap) hold ``locks[model]`` so they
    never race. ``poll`` seconds between checks without an event (0: events only).
    ``load_missing``: a model not loaded yet is loaded once a checkpoint exists
    (the worker preloads); otherwise its first task loads it. ``runs``: KV ``runs``
    (``attach``), read on start for the newest committed step of each run. ``warm``
    (the worker's: the pipeline's warm-up between two calls) runs on a loaded pipeline
    before it is served, so the first batch on new weights does not pay the one-time
    costs of a first call; one that fails is logged and the pipeline served all the same.

    S3 is listed only to verify: on start when KV ``runs`` has no record, at each poll,
    after an event that could not be decoded, and when the step an event named fails to
    load (to find an older one that still is newer than the loaded one). A
    ``ckpt.<run>.mirrored`` event names the newest committed step, so it is loaded
    directly.
    """

    def __init__(self, specs: Iterable[ModelSpec], pipelines: dict[str, Pipeline],
                 locks: dict[str, asyncio.Lock], *, device: str, dtype: str, s3: Any,
                 bucket: str, poll: float, load_missing: bool = True,
                 warm: Callable[[Pipeline], Awaitable[None]] | None = None) -> None:
        self.watched = {s.name: _Watched(s) for s in specs if s.source_kind == "run"}
        self.pipelines = pipelines
        self.locks = locks
        self.device = device
        self.dtype = dtype
        self.s3 = s3
        self.bucket = bucket
        self.poll = poll
        self.load_missing = load_missing
        self.warm = warm
        self.runs: TypedKV[RunRecord] | None = None
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
                         "lineage": pipe.checkpoint_lineage if pipe is not None else None,
                         "skipped": {_label(c): r for c, r in w.skipped.items()}}
        return out

    async def attach(self, bus: Bus) -> None:
        """Read KV ``runs`` through ``bus`` from now on; without it (a bus that may not
        read it) every first check lists S3, as a poll does."""
        if not self.watched:
            return
        try:
            self.runs = await bus.typed(KV_RUNS, RunRecord)
        except Exception as exc:
            _log.warning("worker.run_records_unavailable", error=describe(exc))

    async def recorded(self, model: str) -> ck.CheckpointId | None:
        """The newest committed checkpoint KV ``runs`` records for ``model``'s run (and
        the run's history, kept for the checks); None without ``runs``, without a
        record, or when the bus cannot answer (S3 is listed then)."""
        w = self.watched[model]
        rec = await self._record(w)
        if rec is None or rec.latest_checkpoint_step is None:
            return None
        latest = ck.CheckpointId(rec.latest_checkpoint_step, rec.latest_checkpoint_lineage)
        return latest if w.line.holds(*latest) else None

    async def lineage(self, model: str) -> ck.Lineage:
        """``model``'s run's current history, read now (the last one read when the bus
        cannot answer): what a first load of the model must load from."""
        w = self.watched[model]
        await self._record(w)
        return w.line

    async def _record(self, w: _Watched) -> RunRecord | None:
        """The run's record; keeps its history in ``w.line``."""
        if self.runs is None:
            return None
        heard, w.heard = w.heard, None
        got = None
        async for _ in HEARD_BACKOFF.retries(within=HEARD_WITHIN):
            try:
                got = await self.runs.get(w.run_id)
            except Exception as exc:
                _log.warning("worker.run_record_unavailable", model=w.spec.name,
                             run=w.run_id, error=repr(exc))
                return None
            if got is None or heard is None or tuple(got[0].forks) == heard:
                break
        if got is None:
            return None
        w.line = ck.Lineage.of(got[0].forks)
        return got[0]

    async def run(self, nc: Any) -> None:
        """Watch every run model until cancelled."""
        if not self.watched:
            return
        subs = []
        try:
            for w in self.watched.values():
                subs.append(await nc.subscribe(subjects.ckpt(w.run_id, "mirrored"),
                                               cb=self._on_mirrored(w)))
                subs.append(await nc.subscribe(subjects.kv_changes(KV_RUNS, w.run_id),
                                               cb=self._on_record(w)))
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
                if ev.run_id != w.run_id:
                    raise ValueError(f"event for run {ev.run_id!r} on {msg.subject}")
            except Exception as exc:  # a check that lists S3 still finds it
                _log.warning("worker.checkpoint_event_invalid", run=w.run_id, error=repr(exc))
            else:
                _log.info("worker.checkpoint_mirrored", model=w.spec.name, run=ev.run_id,
                          step=ev.step, lineage=ev.lineage)
                told = ck.CheckpointId(ev.step, ev.lineage)
                # The newest wins: of a newer lineage (a rollback's), whatever the step.
                w.told = told if w.told is None else max(
                    w.told, told, key=lambda c: (c.lineage, c.step))
            w.wake.set()

        return cb

    def _on_record(self, w: _Watched) -> Any:
        """The run's record changed: a rollback if its forks moved, else nothing to do."""
        async def cb(msg: Any) -> None:
            try:
                forks = tuple(decode(msg.data, RunRecord).forks)
            except Exception:  # a delete marker or a value that does not decode
                return
            if forks != w.line.forks:
                w.heard = forks  # what the next read must show (HEARD_BACKOFF)
                w.wake.set()

        return cb

    async def _watch(self, w: _Watched) -> None:
        told = await self.recorded(w.spec.name)  # on start: what KV runs says is newest
        while True:
            w.wake.clear()  # before the check: an event during it makes another check
            try:
                await self.check(w.spec.name, told)
            except Exception as exc:  # never let one bad round stop the watcher
                _log.warning("worker.checkpoint_check_failed", model=w.spec.name,
                             error=repr(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.wake.wait(), self.poll or None)
            # An event names the newest step; a poll or an undecodable event lists S3.
            told, w.told = w.told, None

    async def check(self, model: str,
                    told: int | ck.CheckpointId | None = None) -> int | None:
        """Swap ``model`` to its newest committed checkpoint of the run's current history
        newer than the loaded one that loads and verifies; return the step it serves
        afterwards (None: none).

        ``told`` is the newest committed checkpoint as a ``mirrored`` event or KV
        ``runs`` said it (a bare step: the current history's checkpoint of that step):
        loaded without listing S3. Without it, or when it fails to load, the committed
        steps of the history are listed and tried newest first. A loaded checkpoint the
        history has abandoned (a rollback) is replaced by the newest of the history,
        whatever its step, or dropped when the history has none that loads.
        """
        w = self.watched[model]
        async with self.locks.setdefault(model, asyncio.Lock()):
            while True:
                try:
                    return await self._check(w, told)
                except _Abandoned:  # the history moved while it loaded: look again
                    told = None

    async def _check(self, w: _Watched, told: int | ck.CheckpointId | None) -> int | None:
        """``check``, once, under the model's lock; ``_Abandoned`` when the checkpoint it
        loaded left the run's history during the load (a rollback heard meanwhile)."""
        model = w.spec.name
        await self._record(w)  # the history may have moved on: a rollback
        line = w.line
        current = self.pipelines.get(model)
        have = _loaded(current)
        if current is None and not self.load_missing:
            return None
        stale = have is not None and not line.holds(*have)
        if stale:
            # Served no more from now: a batch formed while the replacement loads waits
            # for it (the model's lock: ``pipeline``), never runs on abandoned weights.
            del self.pipelines[model]
            _log.warning("worker.checkpoint_abandoned", model=model, run=w.run_id,
                         serving=_label(have), forks=line.json())  # type: ignore[arg-type]
        floor = None if have is None or stale else have.step  # serve only newer ones
        if isinstance(told, int):
            told = ck.CheckpointId(told, line.owner(told))
        if told is not None and not stale and (
                not line.holds(*told) or told in w.skipped
                or (floor is not None and told.step <= floor)):
            return floor  # nothing newer of the history: no listing
        if told is not None and line.holds(*told) and told not in w.skipped:
            pipe = await self._load(w, told, have)
            if pipe is not None:
                self.pipelines[model] = pipe
                return told.step
            if told not in w.skipped:  # S3 unreachable: the next event or poll retries
                return floor
        try:
            steps = await asyncio.to_thread(ck.committed_steps, self.s3, self.bucket,
                                            w.run_id, line)
        except Exception as exc:
            _log.warning("worker.checkpoint_list_failed", model=model, run=w.run_id,
                         error=repr(exc))
            return floor
        for step in reversed(steps):
            if floor is not None and step <= floor:
                break
            c = ck.CheckpointId(step, line.owner(step))
            if c in w.skipped:
                continue
            pipe = await self._load(w, c, have)
            if pipe is not None:
                self.pipelines[model] = pipe
                return step
        return self._drop(model, have) if stale else floor

    def _drop(self, model: str, have: ck.CheckpointId | None) -> None:
        """An abandoned checkpoint (no longer served) the history has nothing to replace
        with: the model's next task loads one once there is one."""
        if have is not None:
            _log.error("worker.serving_nothing", model=model, dropped=_label(have),
                       reason="its lineage was abandoned and the run's history has no "
                       "committed checkpoint that loads")
        return None

    async def _load(self, w: _Watched, c: ck.CheckpointId,
                    have: ck.CheckpointId | None) -> Pipeline | None:
        model = w.spec.name
        t0 = time.monotonic()
        try:
            dev = resolve_device(self.device)
            pipe = await detached(load_run_pipeline, w.spec, dev, resolve_dtype(self.dtype, dev),
                                  step=c.step, s3=self.s3, bucket=self.bucket, line=w.line)
        except CheckpointError as exc:
            w.skipped[c] = exc.reason
            SKIPPED.labels(model).inc()
            _log.error("worker.checkpoint_skipped", model=model, run=w.run_id, step=c.step,
                       lineage=c.lineage, reason=exc.reason,
                       serving=have.step if have is not None else None)
            return None
        except Exception as exc:  # S3 unreachable and the like: try again next round
            _log.warning("worker.checkpoint_load_failed", model=model, run=w.run_id,
                         step=c.step, lineage=c.lineage, error=repr(exc),
                         serving=have.step if have is not None else None)
            return None
        warmed = self.warm is not None
        if self.warm is not None:
            try:
                await self.warm(pipe)
            except Exception as exc:
                # Logged, not a verdict: the checkpoint loaded and verified; a full batch
                # may fit once the weights it replaces are freed (as on a first load).
                warmed = False
                _log.error("worker.warm_failed", model=model, run=w.run_id, step=c.step,
                           error=repr(exc))
        # The load took a while: a rollback heard meanwhile may have abandoned what it
        # loaded. Read the history again before it is served (nothing awaits after this).
        await self._record(w)
        if not w.line.holds(*c):
            _log.warning("worker.checkpoint_abandoned_while_loading", model=model,
                         run=w.run_id, step=c.step, lineage=c.lineage,
                         forks=w.line.json())
            raise _Abandoned
        if have is not None:
            self.swaps += 1
            SWAPS.labels(model).inc()
        _log.info("worker.checkpoint_swapped" if have is not None else "worker.model_loaded",
                  model=model, run=w.run_id, step=c.step, lineage=c.lineage,
                  previous=have.step if have is not None else None,
                  previous_lineage=have.lineage if have is not None else None,
                  warmed=warmed, seconds=round(time.monotonic() - t0, 3))
        return pipe


__all__ = ["HotSwapper"]
