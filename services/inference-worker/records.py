"""A task's record on the worker: claimed before it runs, its progress, its end.

The record (KV ``tasks``, ``tandem.common.tasks``) is a task's one source of truth. The
worker writes it once per task: the move to its end (``succeeded`` with the images, or
``failed`` with the reason). Before it runs a task it must know, without writing:

- that the id is the task's own (no hijack): the record of a sealed task at the sealed
  revision is the one the gateway created for these very bytes (``tasks.as_sealed``:
  only on the gateway's own message, the first delivery, while the stream dedupes its
  id; a replay is read);
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

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.common import log, metrics
from tandem.common import tasks as moves
from tandem.common.backoff import Backoff
from tandem.common.bus import (
    Bus,
    Delivery,
    MapWatch,
    TypedKV,
    delivered_count,
    describe,
    no_room,
    retry_transient,
)
from tandem.common.events import CancelNotice, GenerationTask, TaskRecord, decode
from tandem.common.streams import KV_CANCELS

_log = log.get("tandem.inference_worker.records")
# A commit JetStream has no room for waits in place: room comes when something is purged.
NO_ROOM_BACKOFF = Backoff(0.5, max_delay=5.0)
CRASH_WRITE_FOR = 30.0  # seconds a starting worker retries counting a dead call
# Seconds a cancel notice is kept after it was heard (``Cancels``): as long as a seal
# sealed before it could still be trusted, with both clocks' skew.
NOTICE_KEEP = moves.SEAL_WINDOW + 2 * moves.SEAL_CLOCK_SKEW
COMMITS_WAITING = metrics.Gauge(
    "tandem_worker_commits_waiting", "Made tasks whose commit waits for room in JetStream")


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
    its current notices replace what was known (``MapWatch``).

    A notice is kept only while a delivery of its task could skip the record's read:
    ``NOTICE_KEEP`` after it was heard, then forgotten. Only a sealed first delivery
    skips it, and only while its seal is younger than ``SEAL_WINDOW`` (the gateway's
    clock, within ``SEAL_CLOCK_SKEW`` of ours); the task was sealed before it was
    cancelled, so once its notice is that old, any delivery of it is read, and its record
    says cancelled. So a worker holds the notices of the last few minutes, not of the
    bucket's day (about 185 bytes each: 10 cancels a second held 160 MB).
    """

    def __init__(self, bus: Bus, on_cancel: Callable[[str], object],
                 clock: Callable[[], float] = time.monotonic) -> None:
        # task id -> when its notice was heard (``clock``), the oldest first
        self.ids: dict[str, float] = {}
        self.on_cancel = on_cancel
        self.clock = clock
        self.watch = MapWatch(bus, KV_CANCELS, self._apply)

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
        now = self.clock()
        self.ids.pop(notice.task_id, None)  # heard again: now the newest
        self.ids[notice.task_id] = now
        if not initial:
            self.on_cancel(notice.task_id)
        stale = []
        for task_id, at in self.ids.items():  # the oldest first
            if now - at < NOTICE_KEEP:
                break
            stale.append(task_id)
        for task_id in stale:
            del self.ids[task_id]


class Records:
    """The worker's moves of task records (``tandem.common.tasks``), per held task."""

    def __init__(self, kv: TypedKV[TaskRecord], cancels: Cancels, seal_key: bytes | None,
                 worker: str) -> None:
        self.kv = kv
        self.cancels = cancels
        self.seal_key = seal_key
        self.worker = worker
        self.waiting = 0  # made tasks whose commit waits for room (``finish``)

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
        its write raised.

        A write JetStream refused for want of room (``no_room``: its store is full) is
        tried again in place, from 0.5 s up to every 5 s, for as long as it takes: the
        images are made and stored, and the tasks stay held (their keepalive goes on), so
        none is delivered again, run again or dead-lettered for a full store; and a
        worker whose held tasks all wait here fetches nothing new. Cancelled (the worker
        stopping), they are handed back as any held task is. While they wait they are
        counted in ``waiting`` (the worker's ``/healthz`` ``commit_waiting`` and
        ``tandem_worker_commits_waiting``): a fleet stalled on a full JetStream shows it."""
        out: list[TaskRecord | BaseException | None] = [None] * len(ends)
        todo, tries, counted = list(range(len(ends))), 0, 0
        try:
            while True:
                got = await self.kv.move_many([(ends[i].held.task.task_id, moves.to_succeeded(
                    ends[i].images, cluster=ends[i].held.cluster, worker=self.worker,
                    attempt=ends[i].held.attempt, started_at=ends[i].held.taken,
                    checkpoint=ends[i].checkpoint, checkpoint_step=ends[i].checkpoint_step,
                    timings=ends[i].timings), ends[i].held.expect) for i in todo])
                full = []
                for i, one in zip(todo, got, strict=True):
                    if isinstance(one, tuple):
                        ends[i].held.expect = one
                        out[i] = one[0]
                    elif no_room(one):
                        full.append(i)
                    else:
                        out[i] = one
                self._waiting(len(full) - counted)
                counted = len(full)
                if not full:
                    return out
                tries += 1
                _log.warning("worker.commit_no_room", tasks=len(full), tries=tries,
                             error=describe(got[todo.index(full[0])]))
                await asyncio.sleep(NO_ROOM_BACKOFF.delay(tries))
                todo = full
        finally:
            self._waiting(-counted)  # cancelled while waiting: handed back

    def _waiting(self, change: int) -> None:
        if change:
            self.waiting += change
            COMMITS_WAITING.inc(change)

    async def crashed(self, task_ids: list[str], alone: bool) -> None:
        """A worker process died in a call of ``task_ids`` (``alone``: of one task): each
        record that has not ended counts it (``tasks.to_crashed``)."""
        await asyncio.gather(*(retry_transient(
            lambda t=t: self.kv.update(t, moves.to_crashed(alone)), CRASH_WRITE_FOR,
            what=f"crash count of {t}") for t in task_ids))

    async def failed(self, body: GenerationTask, reason: str) -> TaskRecord | None:
        """A dead-lettered task's record ends ``failed`` with ``reason``: its own record
        only (``tasks.to_failed``), created if it had none."""
        return await self.kv.update(body.task_id, moves.to_failed(reason, body))

