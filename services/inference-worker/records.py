"""A task's record on the worker: claimed before it runs, its progress, its end.

The record (KV ``tasks``, ``tandem.common.tasks``) is a task's one source of truth. The
worker writes it once per task: the move to its end (``succeeded`` with the images, or
``failed`` with the reason). Before it runs a task it must know, without writing:

- that the id is the task's own (no hijack): the record of a sealed task at the sealed
  revision is the one the gateway created for these very bytes (``tasks.as_sealed``);
  any other delivery reads the record and ``claim``-s it (a different body under the id
  is a conflict, dead-lettered, never run), and a bare publish that has no record gets
  one now, so its id is taken before anything runs;
- that it was not cancelled: the gateway leaves a notice in KV ``cancels`` after it
  moved the record, and every worker watches that bucket (``Cancels``);
- that an earlier delivery did not finish it: a redelivery reads the record.

So a sealed first delivery costs no read and one write. A task that runs longer than the
progress interval is written ``running`` with its progress once per interval
(``progress``); each write's revision is kept (``Held.expect``), so the final write needs
no read either. A compare-and-set that finds the record moved (a cancel, a redelivery
elsewhere) reads it and decides again on what is stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.common import log
from tandem.common import tasks as moves
from tandem.common.bus import Bus, Delivery, MapWatch, TypedKV, delivered_count
from tandem.common.events import CancelNotice, GenerationTask, TaskRecord, decode
from tandem.common.streams import DAY, KV_CANCELS

_log = log.get("tandem.inference_worker.records")


@dataclass(slots=True)
class Held:
    """What the worker knows of one task's record while it holds the task."""

    task: GenerationTask
    cluster: str
    attempt: int  # this delivery's number
    taken: float  # wall clock: when this worker took it (the record's ``started_at``)
    # The record as last read or written, with its revision: the next compare-and-set's
    # guess, so it needs no read.
    expect: tuple[TaskRecord, int] | None = None
    run_at: float = 0.0  # monotonic: its first denoising step
    progress_at: float = 0.0  # monotonic: its last progress write


@dataclass(slots=True)
class End:
    """A task's success, to be written (``Records.finish``)."""

    held: Held
    images: list[str]  # the S3 keys of its images
    checkpoint: str = ""
    checkpoint_step: int | None = None
    timings: dict[str, float] | None = None


class Cancels:
    """The gateway's cancel notices (KV ``cancels``), as this worker has heard them.

    ``start`` returns once the current notices are loaded, so a worker that starts after
    a cancel knows of it before it pulls. Each new notice is passed to ``on_cancel`` (the
    batcher stops the task if it waits or runs here). A lost watch is watched again and
    its current notices replace what was known (``MapWatch``). Notices older than the
    bucket's TTL are forgotten here as the server forgets them.
    """

    def __init__(self, bus: Bus, on_cancel: Callable[[str], object]) -> None:
        self.ids: dict[str, float] = {}  # task id -> when its notice was heard (monotonic)
        self.on_cancel = on_cancel
        self.watch = MapWatch(bus, KV_CANCELS, self._apply)
        self._pruned_at = time.monotonic()

    async def start(self) -> None:
        await self.watch.start()

    async def stop(self) -> None:
        await self.watch.stop()

    def cancelled(self, task_id: str) -> bool:
        return task_id in self.ids

    def _apply(self, key: str, value: bytes | None, initial: bool) -> None:
        if value is None:
            self.ids.pop(key, None)
            return
        try:
            notice = decode(value, CancelNotice)
        except Exception as exc:
            _log.warning("worker.cancel_notice_unreadable", key=key, error=repr(exc))
            return
        now = time.monotonic()
        self.ids[notice.task_id] = now
        if not initial:
            self.on_cancel(notice.task_id)
        if now - self._pruned_at > 3600:
            self._pruned_at = now
            self.ids = {k: at for k, at in self.ids.items() if now - at < DAY}


class Records:
    """The worker's moves of task records (``tandem.common.tasks``), per held task."""

    def __init__(self, kv: TypedKV[TaskRecord], cancels: Cancels, seal_key: bytes | None,
                 worker: str) -> None:
        self.kv = kv
        self.cancels = cancels
        self.seal_key = seal_key
        self.worker = worker

    def claim_now(self, d: Delivery[GenerationTask], cluster: str) -> Held | None:
        """``claim`` as far as it goes without a read: None if a cancel notice came; a
        sealed first delivery's ``Held`` with its record (``expect``); else a ``Held``
        with no ``expect``, which only ``claim``'s read can decide."""
        task = d.event
        if self.cancels.cancelled(task.task_id):
            return None  # the gateway moved the record to cancelled before the notice
        held = Held(task, cluster, delivered_count(d.msg), time.time())
        if held.attempt == 1:
            held.expect = moves.as_sealed(task, d.msg.data, d.headers, self.seal_key)
        return held

    async def claim(self, d: Delivery[GenerationTask], cluster: str,
                    held: Held | None = None) -> Held | None:
        """The task to run, with what is known of its record; None if it must not run
        (cancelled, or ended by an earlier delivery): the delivery is then acked.
        ``held``: what ``claim_now`` found, when it was asked first.

        Raises ``TaskConflict`` when another body owns the id (``tasks.claim``)."""
        task = d.event
        held = held or self.claim_now(d, cluster)
        if held is None or held.expect is not None:
            return held
        for _ in range(3):
            got = await self.kv.get(task.task_id)
            rec = moves.claim(task, got[0] if got is not None else None)
            if rec is None:
                # A bare publish with no record: take the id before anything runs, so a
                # second body under it meets this one and is refused.
                new = moves.queued(task, cluster)
                rev = await self.kv.create(task.task_id, new)
                if rev is None:
                    continue  # created meanwhile (the same body again?): read it
                held.expect = (new, rev)
                return held
            if rec.state.terminal:
                return None  # cancelled before it started, or done by an earlier delivery
            held.expect = got
            return held
        raise RuntimeError(f"task {task.task_id}: its record kept changing while claimed")

    async def progress(self, held: Held, fraction: float) -> TaskRecord | None:
        """Write ``running`` with ``fraction`` done; the record as it now stands."""
        got = await self.kv.move(held.task.task_id, moves.to_running(
            fraction, cluster=held.cluster, worker=self.worker, attempt=held.attempt,
            started_at=held.taken), expect=held.expect)
        if got is not None:
            held.expect = got
        return got[0] if got is not None else None

    async def finish(self, ends: list[End]) -> list[TaskRecord | BaseException | None]:
        """Move each record to ``succeeded`` with its images: the commit point, for many
        tasks in one pipelined write (``TypedKV.move_many``). Each task's outcome is its
        own: the record as it now stands (``cancelled`` if a cancel came first), or what
        its write raised."""
        got = await self.kv.move_many([(e.held.task.task_id, moves.to_succeeded(
            e.images, cluster=e.held.cluster, worker=self.worker, attempt=e.held.attempt,
            started_at=e.held.taken, checkpoint=e.checkpoint,
            checkpoint_step=e.checkpoint_step, timings=e.timings), e.held.expect)
            for e in ends])
        out: list[TaskRecord | BaseException | None] = []
        for e, one in zip(ends, got, strict=True):
            if isinstance(one, tuple):
                e.held.expect = one
                out.append(one[0])
            else:
                out.append(one)
        return out

    async def failed(self, body: GenerationTask, reason: str) -> TaskRecord | None:
        """A dead-lettered task's record ends ``failed`` with ``reason``: its own record
        only (``tasks.to_failed``), created if it had none."""
        return await self.kv.update(body.task_id, moves.to_failed(reason, body))

