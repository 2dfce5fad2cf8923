"""The checkpointer: mirror each written checkpoint to S3, commit it, apply retention.

For every checkpoint written on a node, ``mirror.<cluster>.<node>`` (stream ``MIRROR``;
``scope=node``: durable ``checkpointer-<cluster>-<node>``, only this node's; ``scope=
fleet``: durable ``checkpointer``, every node's, for one checkpointer that sees every
node's folder):

1. validate the event (run, step, a path that is exactly the run's ``step-N`` folder
   under ``checkpoint_root``, file names, the subject it came on) — garbage goes to
   the DLQ;
2. mirror it (``mirror.Mirror``): every file uploaded and verified, ``manifest.json``
   put last with ``If-None-Match: *`` — the commit. Attempts are retried with backoff;
   a local checkpoint that is missing or does not match its manifest is not. A node's
   part of a sharded checkpoint is mirrored and recorded (``Mirror.mirror_part``): it
   is ``ckpt.<run>.part``, and the checkpoint is committed by the checkpointer whose
   part completes it;
3. committed → ``ckpt.<run>.mirrored``, KV ``runs`` ``latest_checkpoint_*`` (by CAS,
   only forward), retention in S3 (``retention.Retention.prune``: ``ckpt.<run>.pruned``),
   then local copies of committed checkpoints beyond ``local_keep`` are deleted
   (``retention.delete_local``: the only service that deletes a whole local checkpoint);
   not committed after ``attempts``: an error that can heal (S3 unreachable, a 5xx,
   throttling) hands the event back to be redelivered (``Retry``; the DLQ after the
   consumer's ``max_deliver``), one that cannot → ``ckpt.<run>.failed`` with the reason;
   the local copy is kept either way. Retention also deletes a checkpoint never committed
   that it has passed (``checkpoints.passed``) and nothing was written to for
   ``stale_upload_age``, and one handed over after retention passed it is not mirrored
   at all (a node's part come after the rest was pruned: never whole).

A redelivered event (a crash between commit and ack) finds the manifest, uploads
nothing, and finishes steps 3 (the event ids make the publishes idempotent); a crash
mid-upload is redelivered and resumes (files stored whole are not sent again).

Lineages (``checkpoints.Lineage``, from the run's record in KV ``runs``): a checkpoint
is named by its step and lineage in S3 and in every event, so a rollback's checkpoint of
a step never meets the abandoned one of the same step (a node's part and its record
too: they live under the checkpoint's own prefix). A checkpoint, or a node's part of
one, that the run's history has abandoned is not mirrored (its event is acked, logged,
and its local copy removed); the latest committed checkpoint in KV moves only along the
current history; retention keeps the newest of that history and deletes every abandoned
checkpoint, in S3 and on local disk, since nothing will ever load one again.

Stopping (``linger``): after SIGTERM it goes on pulling while a checkpoint may still come
(a run claimed, not ended, places ranks on its node: a node going away stops them at the
same moment, and they save their step first), for at most ``stop_linger_s``; then what
it took is mirrored within the drain. With no training on its node it stops at once.

This module is the service and its handling of one event; the rest is where its name
says: ``mirror`` (one attempt and its commit) over ``upload`` (the files, verified),
``errors`` (what fails and whether it heals), ``retention``, ``settings``, ``linger``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from tandem.common import checkpoints as ck
from tandem.common import metrics, storage, subjects
from tandem.common.backoff import Backoff
from tandem.common.bus import Delivery
from tandem.common.errors import EventDecodeError, Reject, Retry
from tandem.common.events import (
    CheckpointFailed,
    CheckpointMirrored,
    CheckpointPartMirrored,
    CheckpointWritten,
    RunRecord,
    decode,
    now,
    struct_replace,
)
from tandem.common.runner import Context, Service
from tandem.common.settings import Settings
from tandem.common.streams import (
    KV_RUNS,
    MIRROR,
    ConsumerSpec,
    Spec,
    checkpointer_consumer,
)

from .errors import MirrorError, heals
from .linger import Linger
from .mirror import Mirror, MirrorResult
from .retention import Retention, committed_history, delete_local
from .settings import CheckpointerSettings

BYTES = metrics.Counter("tandem_checkpoint_uploaded_bytes", "Checkpoint bytes sent to S3")
OUTCOMES = metrics.Counter("tandem_checkpoint_outcomes", "Checkpoint mirror outcomes",
                           ["outcome"])
COMMIT_SECONDS = metrics.Histogram(
    "tandem_checkpoint_commit_seconds", "Checkpoint written -> committed in S3",
    buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))


class Checkpointer(Service):
    name: ClassVar[str] = "checkpointer"
    settings_class: ClassVar[type[Settings]] = CheckpointerSettings
    settings: CheckpointerSettings

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.s3: Any = None
        self.mirror: Mirror | None = None
        self.committed = 0
        self.failed = 0
        # Why each checkpoint handed back last was (run, step, lineage): said when its
        # event runs out of deliveries, whose last is the bus's, not a mirror attempt.
        self._handed_back: dict[tuple[str, int, int], str] = {}
        # Set once it takes no more checkpoints: at SIGTERM, or after its linger.
        self.closing = asyncio.Event()

    @property
    def consumer_spec(self) -> ConsumerSpec:
        s = self.settings
        if s.scope == "node":
            return checkpointer_consumer(s.ack_wait, s.max_deliver, cluster=s.cluster,
                                         node=s.node)
        return checkpointer_consumer(s.ack_wait, s.max_deliver)

    def streams(self) -> Sequence[Spec]:
        return [*super().streams(), self.consumer_spec]

    def health(self) -> dict[str, Any]:
        return {"committed": self.committed, "failed": self.failed}

    async def run(self, ctx: Context) -> None:
        s = self.settings
        self.ctx = ctx
        self.s3 = storage.s3_client(s, max_pool=max(32, s.upload_concurrency * s.concurrency))
        self.mirror = Mirror(self.s3, s.mirror_config(),
                             on_progress=lambda _name, n: BYTES.inc(n))
        self.retention = Retention(self.s3, ctx.bus, s)
        self.runs = await ctx.bus.typed(KV_RUNS, RunRecord)
        try:
            await asyncio.to_thread(storage.ensure_bucket, self.s3, s.s3_bucket)
            aborted = await asyncio.to_thread(self.mirror.abort_uploads, "runs/",
                                              time.time() - s.stale_upload_age)
            ctx.log.info("checkpointer.started", bucket=s.s3_bucket, stale_aborted=aborted,
                         scope=s.scope, durable=self.consumer_spec.durable)
        except Exception as exc:  # S3 down at start: the handler retries per checkpoint
            ctx.log.warning("checkpointer.s3_unavailable", error=repr(exc))
        consumer = ctx.bus.consumer(self.consumer_spec, CheckpointWritten, self.handle,
                                    concurrency=s.concurrency, on_dead=self.on_dead)
        linger = Linger(ctx.bus, self.runs, self.consumer_spec,
                        (s.cluster, s.node) if s.scope == "node" else None,
                        s.linger_window(), ctx.log)
        lingering = asyncio.create_task(linger.run(ctx.stopping, self.closing))
        try:
            await consumer.run(self.closing)
        finally:
            lingering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lingering
            await asyncio.to_thread(self.mirror.close)

    # --------------------------------------------------------------------------- handling

    async def on_dead(self, msg: Any, reason: str) -> None:
        """A checkpoint event out of deliveries (an outage that outlasted them all) is
        dead-lettered by the bus; the run hears of it as of any checkpoint given up on:
        ``ckpt.<run>.failed``, the local copy kept."""
        try:
            ev = decode(msg.data, CheckpointWritten)
        except EventDecodeError:
            return  # not a checkpoint: the letter says so, there is no run to tell
        last = self._handed_back.pop((ev.run_id, ev.step, ev.manifest.lineage),
                                     "not known here (handed back by another checkpointer)")
        await self._failed(ev, f"dead-lettered (dlq.{MIRROR}): {reason}; last: {last}",
                           self.settings.attempts * (self.settings.max_deliver - 1), "dead",
                           self.ctx.log.bind(run_id=ev.run_id, step=ev.step))

    async def _failed(self, ev: CheckpointWritten, reason: str, attempts: int, delivery: str,
                      lg: Any) -> None:
        """``ckpt.<run>.failed``: the checkpoint given up on (its local copy kept); one
        event per ``delivery`` that gave up (its number, or ``dead``)."""
        self.failed += 1
        OUTCOMES.labels("failed").inc()
        lg.error("checkpoint.failed", reason=reason, attempts=attempts)
        lineage = ev.manifest.lineage
        await self.ctx.bus.publish(
            subjects.ckpt(ev.run_id, "failed"),
            CheckpointFailed(run_id=ev.run_id, step=ev.step, reason=reason,
                             attempts=attempts, lineage=lineage),
            msg_id=f"ckpt-{ev.run_id}-{ck.step_name(ev.step, lineage)}-failed-{delivery}",
            retry_for=30.0)

    async def handle(self, d: Delivery[CheckpointWritten]) -> None:
        directory = self._validate(d)
        # Held to the end, not only while mirroring: the listings before it and what
        # follows the commit (events, KV, retention, local copies) can outlast AckWait
        # too, and the message must never be handled twice at once.
        async with d.keepalive():
            await self._handle(d, directory)

    async def _handle(self, d: Delivery[CheckpointWritten], directory: Path) -> None:
        ev = d.event
        lineage = ev.manifest.lineage
        lg = self.ctx.log.bind(run_id=ev.run_id, step=ev.step, lineage=lineage,
                               ckpt_node=ev.node)
        line = await self._lineage(ev.run_id)
        if line.abandoned(ev.step, lineage):
            # A rollback left it behind while it waited: nothing will ever load it.
            lg.info("checkpoint.abandoned", forks=line.json())
            await asyncio.to_thread(delete_local, directory.parent, set(), 0, lg, line)
            return
        if await self.retention.passed(ev, line, lg):
            # Retention has kept newer checkpoints since it was written (a node's part
            # come late, a redelivery after a long outage): committed, it would be
            # deleted at once; a part of it would never be whole. Nothing goes to S3.
            await asyncio.to_thread(delete_local, directory.parent, set(), 0, lg, line,
                                    {ev.step})
            return
        result, error, attempts = await self._mirror(ev, directory, lg)
        if result is not None and ev.manifest.part:
            await self._part_mirrored(ev, directory, result, lg)
            if result.lacks:
                return
        if result is None:
            await self._failed(ev, error, attempts, str(d.num_delivered),
                               lg.bind(kept=str(directory)))
            return
        await self._committed(ev, directory, result, lg)

    def _validate(self, d: Delivery[CheckpointWritten]) -> Path:
        ev = d.event
        try:
            subjects.token(ev.run_id, "run id")
            if d.subject != subjects.mirror(ev.cluster, ev.node):
                raise ValueError(f"a checkpoint of {ev.cluster!r}/{ev.node!r} published on "
                                 f"{d.subject!r}")
            ck.validate_manifest(ev.manifest, ev.run_id, ev.step)
            directory = Path(ev.path)
            name = ck.step_name(ev.step, ev.manifest.lineage)
            if not directory.is_absolute() or directory.name != name:
                raise ValueError(f"path {ev.path!r} is not an absolute .../{name}")
            root = Path(self.settings.checkpoint_root).resolve()
            if not directory.resolve().is_relative_to(root):
                raise ValueError(f"path {ev.path!r} is outside the checkpoint root {root}")
            # NOTE: inside the root is not enough: another run's folder (or a link to
            # it) would be uploaded as this run's, and local retention, which works on
            # the folder's parent, would then delete that run's unmirrored checkpoints.
            expected = ck.step_dir(root, ev.run_id, ev.step, ev.manifest.lineage)
            if directory.resolve() != expected:
                raise ValueError(f"path {ev.path!r} is not run {ev.run_id!r}'s folder of "
                                 f"{name}: expected {str(expected)!r}")
            directory = expected
            for f in ev.manifest.files:  # a file linked out of the root is not read either
                if not (directory / f.name).resolve().is_relative_to(root):
                    raise ValueError(f"file {f.name!r} of {ev.path!r} is outside the "
                                     f"checkpoint root {root}")
        except ValueError as exc:
            raise Reject(f"invalid checkpoint event: {exc}") from None
        return directory

    async def _mirror(self, ev: CheckpointWritten, directory: Path,
                      lg: Any) -> tuple[MirrorResult | None, str, int]:
        assert self.mirror is not None
        backoff = Backoff(self.settings.retry_backoff, max_delay=30.0)
        retries = backoff.retries(attempts=self.settings.attempts, stop=self.closing)
        reason, can_heal = "", True
        async for attempt in retries:
            try:
                await asyncio.to_thread(storage.ensure_bucket, self.s3, self.settings.s3_bucket)
                if ev.manifest.part:
                    result = await asyncio.to_thread(self.mirror.mirror_part, directory,
                                                     ev.manifest, ev.attempt)
                else:
                    result = await asyncio.to_thread(self.mirror.mirror, directory, ev.manifest)
                self._handed_back.pop((ev.run_id, ev.step, ev.manifest.lineage), None)
                return result, "", attempt
            except MirrorError as exc:
                reason, can_heal = str(exc), exc.retryable
                if not exc.retryable:
                    return None, reason, attempt
            except Exception as exc:  # S3 unreachable, 5xx after boto3's own retries, ...
                reason, can_heal = f"{type(exc).__name__}: {exc}", heals(exc)
            OUTCOMES.labels("retried").inc()
            lg.warning("checkpoint.attempt_failed", attempt=attempt, error=reason)
        if retries.stopped:
            raise Retry("checkpointer stopping", delay=1.0)  # handed back, not lost
        reason = f"gave up after {self.settings.attempts} attempts: {reason}"
        if can_heal:
            # An outage, not a verdict: handed back to be redelivered (dead-lettered as
            # any message after the consumer's max_deliver), the local copy kept.
            delay = backoff.delay(self.settings.attempts)
            lg.warning("checkpoint.retry_later", error=reason, delay=delay)
            key = (ev.run_id, ev.step, ev.manifest.lineage)
            self._handed_back.pop(key, None)
            self._handed_back[key] = reason  # newest last; the oldest go past 256
            while len(self._handed_back) > 256:
                del self._handed_back[next(iter(self._handed_back))]
            raise Retry(reason, delay=delay)
        return None, reason, self.settings.attempts

    async def _part_mirrored(self, ev: CheckpointWritten, directory: Path,
                             result: MirrorResult, lg: Any) -> None:
        """A node's part is in S3 and recorded: say so; if the checkpoint still lacks other
        nodes' parts, this node's committed older copies may still go."""
        lineage = ev.manifest.lineage
        lg.info("checkpoint.part_mirrored", dir=str(directory), attempt=ev.attempt,
                lacks=result.lacks, uploaded=len(result.uploaded), skipped=len(result.skipped),
                bytes=result.bytes_uploaded, mirror_s=round(result.seconds, 3))
        await self.ctx.bus.publish(
            subjects.ckpt(ev.run_id, "part"),
            CheckpointPartMirrored(run_id=ev.run_id, step=ev.step, node=ev.node,
                                   attempt=ev.attempt, files=len(ev.manifest.files),
                                   bytes=sum(f.size for f in ev.manifest.files),
                                   lacks=result.lacks, lineage=lineage),
            msg_id=f"ckpt-{ev.run_id}-{ck.step_name(ev.step, lineage)}-part-a{ev.attempt}-"
            f"{ev.node}", retry_for=30.0)
        if result.lacks:
            line = await self._lineage(ev.run_id)
            committed = await asyncio.to_thread(ck.committed_steps, self.s3,
                                                self.settings.s3_bucket, ev.run_id, line)
            await asyncio.to_thread(delete_local, directory.parent, set(committed),
                                    self.settings.local_keep, lg, line)

    async def _lineage(self, run: str) -> ck.Lineage:
        """The run's current history, from its record (lineage 0 without one)."""
        got = await self.runs.get(run)
        return ck.Lineage.of(got[0].forks) if got is not None else ck.Lineage()

    async def _committed(self, ev: CheckpointWritten, directory: Path, result: MirrorResult,
                         lg: Any) -> None:
        s = self.settings
        bucket, run, lineage = s.s3_bucket, ev.run_id, ev.manifest.lineage
        name = ck.step_name(ev.step, lineage)
        uri = ck.checkpoint_uri(bucket, run, ev.step, lineage)
        seconds = max(0.0, now() - ev.at)
        if result.committed:
            self.committed += 1
            OUTCOMES.labels("committed").inc()
            COMMIT_SECONDS.observe(seconds)
        lg.info("checkpoint.committed", uri=uri, now=result.committed, dir=str(directory),
                uploaded=len(result.uploaded), skipped=len(result.skipped),
                bytes=result.bytes_uploaded, mirror_s=round(result.seconds, 3),
                aborted_uploads=result.aborted_uploads)
        await self.ctx.bus.publish(
            subjects.ckpt(run, "mirrored"),
            CheckpointMirrored(run_id=run, step=ev.step, uri=uri, seconds=seconds,
                               bytes=sum(f.size for f in (result.manifest or ev.manifest).files),
                               lineage=lineage),
            msg_id=f"ckpt-{run}-{name}-mirrored", retry_for=30.0)
        rec = await self.runs.update(
            run, lambda rec: _record_latest(rec, run, ev.step, lineage, uri))
        line = ck.Lineage.of(rec.forks) if rec is not None else ck.Lineage()
        written: dict[ck.CheckpointId, float] = {}
        listed = await asyncio.to_thread(ck.list_checkpoints, self.s3, bucket, run, written)
        await self.retention.prune(run, listed, written, line, lg)
        await asyncio.to_thread(delete_local, directory.parent, committed_history(listed, line),
                                s.local_keep, lg, line)


def _record_latest(rec: RunRecord | None, run: str, step: int, lineage: int,
                   uri: str) -> RunRecord | None:
    """Move the run's latest committed checkpoint forward along its current history;
    touch no other field. A checkpoint the history does not hold (abandoned by a
    rollback) is never the latest; one the record names that the history has abandoned
    is replaced whatever its step."""
    latest = {"latest_checkpoint_step": step, "latest_checkpoint_uri": uri,
              "latest_checkpoint_lineage": lineage}
    if rec is None:
        return RunRecord(run_id=run, **latest) if lineage == 0 else None
    line = ck.Lineage.of(rec.forks)
    if not line.holds(step, lineage):
        return None
    have = rec.latest_checkpoint_step
    if have is not None and have >= step and line.holds(have, rec.latest_checkpoint_lineage):
        return None
    return struct_replace(rec, **latest, updated_at=now())
