"""The gateway's generation logic, apart from HTTP: submit, look up, cancel, follow.

All state lives on the bus (KV ``tasks``, KV ``idempotency``, ``GEN_*`` streams), never
in this process, so a restarted gateway serves every earlier task as before. A task's
record (KV ``tasks``) is its one source of truth: status, SSE and the job service read it
(checking its owner). Each write of it is a message on ``$KV.tasks.<task>`` (services
only: it is the whole record, every tenant's) and, once stored, a headers-only one on
``tasks.written.<task>`` that programs outside Tandem follow.

One module past 450 lines: submit, look up, cancel and follow are one task's life, and
both doors (HTTP, the job service) call them through ``Gateway``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from tandem.common import log, metrics, subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus, TypedKV, describe, retry_transient
from tandem.common.clusters import ClusterBoard
from tandem.common.events import (
    CancelNotice,
    GenerationTask,
    IdempotencyRecord,
    TaskRecord,
    TaskState,
    encode,
)
from tandem.common.jobs import (
    OPEN,
    Caller,
    GenerationRequest,
    JobLimits,
    JobRefused,
    Problem,
    build_task,
    check_request,
)
from tandem.common.models import Registry
from tandem.common.streams import HEARTBEAT_TTL, KV_CANCELS, KV_IDEMPOTENCY, KV_TASKS
from tandem.gateway.routing import Router, RoutingError, choose_cluster
from tandem.gateway.schemas import ImageRef, view

_log = log.get("tandem.gateway")

SUBMITTED = metrics.Counter("tandem_gateway_submitted", "Tasks accepted", ["lane", "outcome"])
# Fine buckets: routing must cost microseconds whatever the fleet size (bench scale).
ROUTING_SECONDS = metrics.Histogram(
    "tandem_gateway_routing_seconds", "Time to choose a cluster for a new task",
    buckets=(1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2,
             2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0))
DUPLICATE_WINDOW = 9 * 60.0  # under the GEN_* streams' 10 min dedupe window
# How the reason of a task this gateway recorded but could not enqueue begins.
NOT_ENQUEUED = "could not enqueue on cluster"
T = TypeVar("T")


def not_enqueued(rec: TaskRecord) -> bool:
    """Whether ``rec`` is of a task the gateway failed because it could not enqueue it,
    which no worker ever took: its Idempotency-Key may name a new task (``submit``)."""
    return (rec.state == TaskState.failed and rec.reason.startswith(NOT_ENQUEUED)
            and rec.attempts == 0 and not rec.worker and rec.started_at is None)


class Conflict(Exception):
    """The request cannot be done in the task's current state; ``status`` for HTTP."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        self.status = status
        self.message = message
        self.field = field
        super().__init__(message)


@dataclass
class Submitted:
    task: GenerationTask
    record: TaskRecord
    replayed: bool  # an Idempotency-Key replay: nothing new was enqueued

    def accepted(self) -> dict[str, Any]:
        """What every door answers: the record as accepted and where to follow it: each
        stored write of its record (``record_subject``, ``tasks.written.<task>``: headers
        only, a wake-up to read the record through a door that checks its owner) and each
        denoising step (``progress_subject``)."""
        tid = self.task.task_id
        return {"id": tid, "state": self.record.state.value, "model": self.task.model,
                "cluster": self.record.cluster, "lane": self.task.lane, "seed": self.task.seed,
                "record_subject": subjects.task_written(tid),
                "progress_subject": subjects.gen_progress(tid)}


def fingerprint(req: GenerationRequest) -> str:
    body = json.dumps(req.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


class Gateway:
    """What the HTTP routes call. One per process, bound to a connected bus."""

    def __init__(self, bus: Bus, registry: Registry, clusters: list[str], *, s3: Any,
                 bucket: str, url_ttl: float, publish_retry_for: float,
                 sse_ping: float = 15.0, router: Router | None = None,
                 limits: JobLimits = JobLimits(), seal_key: bytes | None = None,
                 heartbeat_ttl: float = HEARTBEAT_TTL) -> None:
        self.bus = bus
        self.limits = limits
        self.seal_key = seal_key  # tasks.seal: spares each worker a record read
        self.router = router  # None: static routing (pin, else the first cluster)
        self.registry = registry
        self.clusters = clusters
        self.s3 = s3
        self.bucket = bucket
        self.url_ttl = url_ttl
        self.publish_retry_for = publish_retry_for
        self.sse_ping = sse_ping
        self.tasks: TypedKV[TaskRecord] | None = None
        self.cancels: TypedKV[CancelNotice] | None = None
        self.idem: TypedKV[IdempotencyRecord] | None = None
        # Where each model is loaded (``models()``): the router's live board, or one of
        # this gateway's own under static routing.
        self.board = router.board if router is not None else ClusterBoard(bus, heartbeat_ttl)
        self._own_board = router is None

    async def start(self) -> None:
        self.tasks = await self.bus.typed(KV_TASKS, TaskRecord)
        self.cancels = await self.bus.typed(KV_CANCELS, CancelNotice)
        self.idem = await self.bus.typed(KV_IDEMPOTENCY, IdempotencyRecord)
        if self._own_board:
            await self.board.start()

    async def stop(self) -> None:
        if self._own_board:
            await self.board.stop()

    # -------------------------------------------------------------------------- submit

    async def accept(self, req: GenerationRequest, idempotency_key: str | None,
                     caller: Caller = OPEN) -> Submitted:
        """A request from any door: checked (``jobs.check_request``), then submitted.
        Raises ``JobRefused`` saying why, the same way for HTTP and the job service."""
        problems = check_request(req, self.registry, self.limits)
        if problems:
            raise JobRefused.invalid(problems)
        try:
            return await self.submit(req, idempotency_key, caller)
        except RoutingError as exc:
            if exc.field:
                raise JobRefused.invalid([Problem(exc.field, exc.message, getattr(
                    req, exc.field, None))]) from None
            raise JobRefused(exc.status, exc.message, exc.retry_after or 1) from None
        except Conflict as exc:
            if exc.field:
                raise JobRefused.invalid([Problem(exc.field, exc.message)], "header") from None
            raise JobRefused(exc.status, exc.message,
                             1 if exc.status == 503 else None) from None

    async def submit(self, req: GenerationRequest, idempotency_key: str | None,
                     caller: Caller = OPEN) -> Submitted:
        """Record and enqueue a task for ``caller``; with an idempotency key (scoped to
        the caller's API key), the key's task instead of a new one.

        A key is kept only for a request that was recorded: one refused before its record
        (no such cluster, none up, the bus failing) leaves the key as it found it, so the
        corrected or retried request with the same key is served. A key whose task this
        gateway failed to enqueue (``NOT_ENQUEUED``: never delivered to a worker) is
        moved to a new task, so a retry after that 503 really enqueues the work.

        Raises ``RoutingError`` (no cluster) or ``Conflict`` (key reused for another
        request, or the bus refused the task).
        """
        assert self.tasks is not None
        task_id = uuid.uuid4().hex
        key, key_rev = None, None
        if idempotency_key is not None:
            key = caller.scoped(idempotency_key)
            task_id, key_rev, existing = await self._claim(key, fingerprint(req), task_id)
            if existing is not None:
                rec = await self._resend(existing)
                SUBMITTED.labels(req.lane, "replayed").inc()
                return Submitted(rec.task, rec, replayed=True)
        try:
            t0 = time.perf_counter()
            cluster = await choose_cluster(self.clusters, req.cluster, req.model, self.router)
            ROUTING_SECONDS.observe(time.perf_counter() - t0)
            spec = self.registry.get(req.model)
            assert spec is not None  # checked (check_request) before submit
            task = build_task(req, spec, task_id, cluster, owner=caller.key)
            rec = moves.queued(task, cluster)
            revision = await self._record(task_id, rec)
        except Exception:
            await self._release(key, key_rev)
            raise
        if revision is None:
            got_rec = await self.tasks.get(task_id)
            if got_rec is not None:
                rec = got_rec[0]
        try:
            await self._publish(task, cluster, revision)
        except Exception as exc:
            reason = f"{NOT_ENQUEUED} {cluster}: {describe(exc)}"
            try:
                await self.tasks.update(task_id, moves.to_failed(reason))
            except Exception as again:  # the bus that refused the task refuses this too
                _log.warning("gateway.record_not_failed", task_id=task_id,
                             reason=reason, error=describe(again))
            # Best effort: if the key stays (the bus refuses this too), the retry finds
            # the failed record and moves the key on (``_claim``).
            await self._release(key, key_rev)
            SUBMITTED.labels(req.lane, "enqueue_failed").inc()
            raise Conflict(503, reason) from exc
        SUBMITTED.labels(req.lane, "accepted").inc()
        return Submitted(task, rec, replayed=False)

    async def _claim(self, key: str, fp: str, task_id: str
                     ) -> tuple[str, int | None, TaskRecord | None]:
        """The idempotency key ``key`` for a request of fingerprint ``fp``: ``(task id,
        the key's revision if this call wrote it, the task's record to replay)``.

        ``task_id`` is taken if the key is new; the key's own task if it names one not
        recorded yet (an earlier attempt died before recording it: this one finishes
        it, not a replay). A key naming a task this gateway failed to enqueue is moved
        to ``task_id`` by compare-and-set (that record stays failed); if another request
        moved it first, its task is this one's too.

        Raises ``Conflict``: 422 if the key was used for a different request, 503 if the
        bus does not answer (after ``publish_retry_for`` seconds).
        """
        idem, tasks = self.idem, self.tasks
        assert idem is not None and tasks is not None
        mine = IdempotencyRecord(task_id=task_id, fingerprint=fp)
        for _ in range(3):
            rev = await self._idem(lambda: idem.create(key, mine), "store")
            if rev is not None:
                return task_id, rev, None
            got = await self._idem(lambda: idem.get(key), "read")
            if got is None:  # expired between create and get: try again
                continue
            held = got[0]
            if held.fingerprint != fp:
                raise Conflict(422, "this Idempotency-Key was used for a different request",
                               field="Idempotency-Key")
            try:
                found = await retry_transient(lambda tid=held.task_id: tasks.get(tid),
                                              self.publish_retry_for,
                                              what=f"record {held.task_id}")
            except Exception as exc:
                raise Conflict(503, f"could not read the task of this Idempotency-Key: "
                                    f"{describe(exc)}") from exc
            if found is None:  # not recorded yet: the key's own request may be in flight,
                return held.task_id, None, None  # so this one never releases the key
            if not not_enqueued(found[0]):
                return held.task_id, None, found[0]

            def move(cur: IdempotencyRecord | None, stale: str = held.task_id
                     ) -> IdempotencyRecord | None:
                return mine if cur is not None and cur.task_id == stale else None

            moved = await self._idem(lambda got=got: idem.move(key, move, expect=got),
                                     "move")
            if moved is not None and moved[0].task_id == task_id:
                _log.info("gateway.idempotency_key_moved", failed_task=held.task_id,
                          task_id=task_id, reason=found[0].reason)
                return task_id, moved[1], None
            # Moved to another retry's task, or gone: look again.
        raise Conflict(503, "this Idempotency-Key kept changing under the request")

    async def _idem(self, op: Callable[[], Awaitable[T]], doing: str) -> T:
        """An operation on KV ``idempotency``, retried like ``_record``; then
        ``Conflict(503)`` naming it."""
        try:
            return await retry_transient(op, self.publish_retry_for,
                                         what=f"idempotency key ({doing})")
        except Exception as exc:
            raise Conflict(503, f"could not {doing} the Idempotency-Key: "
                                f"{describe(exc)}") from exc

    async def _release(self, key: str | None, rev: int | None) -> None:
        """Delete idempotency key ``key`` if it still is revision ``rev`` (the one this
        request wrote or took): its request was not recorded or not enqueued, so the
        key must not keep answering for it. Best effort: the bus may be what failed."""
        if key is None or rev is None:
            return
        assert self.idem is not None
        try:
            await self.idem.delete(key, last=rev)
        except Exception as exc:
            _log.warning("gateway.idempotency_key_kept", error=describe(exc))

    async def _resend(self, rec: TaskRecord) -> TaskRecord:
        """A replayed key's task, sent again while its record says queued: the first
        request may have died between recording and enqueueing it, and then nothing else
        ever would. Sent within ``DUPLICATE_WINDOW`` of its last send, the stream drops
        the copy by msg id; later (the task may still wait in a long queue), the record is
        marked first (``to_resent``), so one replay in a window sends it, and the copy is
        unsealed: a worker reads the record before running it, so it runs once."""
        if rec.state != TaskState.queued:
            return rec
        if time.time() - rec.updated_at >= DUPLICATE_WINDOW:
            assert self.tasks is not None
            marked = await self.tasks.applied(rec.task.task_id,
                                              moves.to_resent(DUPLICATE_WINDOW))
            if marked is None:  # moved on meanwhile (running, ended), or another replay's
                got = await self.tasks.get(rec.task.task_id)
                return got[0] if got else rec
            rec = marked
        await self._publish(rec.task, rec.cluster)
        return rec

    async def _record(self, task_id: str, rec: TaskRecord) -> int | None:
        """Create the task's record (None: it exists), retrying through a leader election
        or a reconnect for ``publish_retry_for`` seconds; then ``Conflict(503)``."""
        tasks = self.tasks
        assert tasks is not None
        try:
            return await retry_transient(lambda: tasks.create(task_id, rec),
                                         self.publish_retry_for, what=f"record {task_id}")
        except Exception as exc:
            SUBMITTED.labels(rec.task.lane, "record_failed").inc()
            raise Conflict(503, f"could not record the task: {describe(exc)}") from exc

    async def _publish(self, task: GenerationTask, cluster: str,
                       revision: int | None = None) -> None:
        """Enqueue ``task``; sealed with the revision of the record just created for it
        (``tasks.seal``), so the worker's first move needs no read."""
        data = encode(task)
        await self.bus.publish(subjects.gen(cluster, task.lane), data, msg_id=task.task_id,
                               headers=moves.seal(self.seal_key, revision, data),
                               retry_for=self.publish_retry_for)

    # ------------------------------------------------------------------------- look up

    async def record(self, task_id: str, caller: Caller = OPEN) -> TaskRecord | None:
        """The task's record; None if there is none or ``caller`` may not see it (another
        key's task reads as absent: no 403 telling that the id exists)."""
        assert self.tasks is not None
        try:
            subjects.token(task_id, "task id")
        except ValueError:
            return None
        tasks = self.tasks
        # Bus errors after the retry window go up as they are: each door answers 503.
        got = await retry_transient(lambda: tasks.get(task_id), self.publish_retry_for,
                                    what=f"record {task_id}")
        return got[0] if got and caller.sees(got[0].task.owner) else None

    def image_refs(self, rec: TaskRecord) -> list[ImageRef]:
        if rec.state != TaskState.succeeded:
            return []
        from datetime import UTC, datetime

        expires = datetime.fromtimestamp(time.time() + self.url_ttl, UTC)
        return [ImageRef(index=i, key=key, expires_at=expires, url=self.s3.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key},
            ExpiresIn=int(self.url_ttl))) for i, key in enumerate(rec.images)]

    def view(self, rec: TaskRecord) -> dict[str, Any]:
        return view(rec, self.image_refs(rec)).model_dump(mode="json")

    # -------------------------------------------------------------------------- cancel

    async def cancel(self, task_id: str, caller: Caller = OPEN) -> TaskRecord:
        """Cancel a queued or running task (again: the same answer). ``JobRefused``: 404
        if unknown (or another key's), 409 if it finished otherwise; both doors say so."""
        assert self.tasks is not None
        if await self.record(task_id, caller) is None:
            raise JobRefused(404, f"no task {task_id!r}")
        tasks = self.tasks
        rec = await retry_transient(lambda: tasks.update(task_id, moves.to_cancelled()),
                                    self.publish_retry_for, what=f"cancel {task_id}")
        if rec is None:
            raise JobRefused(404, f"no task {task_id!r}")
        if rec.state != TaskState.cancelled:
            raise JobRefused(409, f"task {task_id} already {rec.state.value}")
        # The record decides (a cancelled task never succeeds); the notice, written after
        # it, tells every worker: one running the task stops it, one that pulls it later
        # never runs it, without reading the record of every task it takes.
        cancels = self.cancels
        assert cancels is not None
        await retry_transient(lambda: cancels.put(task_id, CancelNotice(
            task_id=task_id, reason=rec.reason)), self.publish_retry_for,
            what=f"cancel notice {task_id}")
        return rec

    # ------------------------------------------------------------------------- follow

    async def follow(self, task_id: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """``(event, data)`` pairs: the state now, each step's progress, each state change,
        and the final state, after which it ends. ``("ping", {})`` while nothing happens.

        A task's first progress says it runs: the record is written ``running`` only
        once a task has run for the worker's progress interval, so a queued record
        followed by progress is reported ``running`` at once.

        It follows as programs outside Tandem do: core subscriptions to the task's
        progress and to ``tasks.written.<task>`` (each stored write, headers only), and a
        read of the record after each write, not a JetStream consumer per stream (an
        open event stream used to hold one on the bucket's stream, created and deleted
        with it). A write announced while the connection was away is not heard: the
        record is read again at each ping, so a stream never outlives its task by more.
        """
        assert self.tasks is not None
        tasks = self.tasks
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(maxsize=10_000)

        def heard(kind: str) -> Callable[[Any], Awaitable[None]]:
            async def on(msg: Any) -> None:
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait((kind, msg.data))
            return on

        subs: list[Any] = []
        state: str | None = None
        try:  # from the first subscribe: a client gone during the set-up leaves none
            # Subscribed before the record is read: no write can fall between the two.
            for subject, kind in ((subjects.gen_progress(task_id), "progress"),
                                  (subjects.task_written(task_id), "written")):
                subs.append(await self.bus.nc.subscribe(subject, cb=heard(kind)))
            kind = "written"
            while True:
                if kind == "written":
                    got = await retry_transient(lambda: tasks.get(task_id),
                                                self.publish_retry_for,
                                                what=f"record {task_id}")
                    if got is None:  # gone (its TTL) while followed: nothing more to say
                        return
                    rec = got[0]
                    if rec.state.terminal:
                        yield "final", self.view(rec)
                        return
                    if rec.state.value != state and not (
                            state == TaskState.running.value
                            and rec.state == TaskState.queued):
                        state = rec.state.value
                        yield "state", {"id": task_id, "state": state,
                                        "cluster": rec.cluster, "worker": rec.worker}
                try:
                    kind, data = await asyncio.wait_for(queue.get(), self.sse_ping)
                except TimeoutError:
                    yield "ping", {}
                    kind = "written"  # read again: a write may have gone unheard
                    continue
                if kind == "progress":
                    if state == TaskState.queued.value:
                        state = TaskState.running.value
                        yield "state", {"id": task_id, "state": state,
                                        "cluster": "", "worker": ""}
                    if state in (None, TaskState.running.value):
                        yield "progress", msgspec.json.decode(data)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    # -------------------------------------------------------------------------- models

    async def models(self) -> list[dict[str, Any]]:
        """The registry, each model with the nodes it is loaded on (``loaded_on``), as the
        board last heard from them: no read of KV ``nodes`` per request."""
        placed = self.board.placements()
        return [{**spec.public(), "loaded_on": placed.get(spec.name, [])}
                for spec in self.registry]
