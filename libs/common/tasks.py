"""How a generation task's record (KV ``tasks``) may move: forward only, by CAS.

The record is a task's one source of truth: its state, its result, the reason it
failed. A task costs three durable writes: the gateway creates the record (``queued``)
and enqueues the task; the worker moves the record to its end (``to_succeeded``). A task
that runs longer than the worker's progress interval is also written ``running`` with
its progress (``to_running``), once per interval.

Each function returns an update function for ``TypedKV.update``: it gets the current
record and returns the new one, or None to leave it (the move would go backwards, or the
task is already terminal). The gateway and the worker share these, so the rules of
``events.TASK_ORDER`` are written once, and so is the rule that a task id belongs to the
body first recorded under it (``claim``). A task the gateway enqueued carries its seal
(``seal``): the revision of the record it created and when, keyed by a secret the
workers share, so a worker needs no read before its compare-and-set on the task's first
delivery (``as_sealed`` says when a seal may be trusted: never on a replay).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

from pydantic import Field, SecretStr

from tandem.common.bus.headers import MSG_ID
from tandem.common.errors import TaskConflict
from tandem.common.events import (
    TASK_ORDER,
    GenerationTask,
    TaskRecord,
    TaskState,
    decode,
    now,
    struct_replace,
)
from tandem.common.settings import Settings
from tandem.common.streams import GEN_DEDUPE_WINDOW

Move = Callable[[TaskRecord | None], TaskRecord | None]
_SUCCEEDED = b'"state":"succeeded"'  # as a record's JSON says it (never inside a string)


def says_succeeded(data: bytes) -> bool:
    """Whether a write on ``$KV.tasks.<task>`` may be a success, without decoding it
    (False is certain; True is certain for a record Tandem wrote)."""
    return _SUCCEEDED in data


def succeeded(data: bytes) -> TaskRecord | None:
    """The record a write on ``$KV.tasks.<task>`` holds if it is a success, else None.

    Followers of every task's writes (the dashboard, benches) see three a task; the
    others are skipped without a decode."""
    if not says_succeeded(data):
        return None
    try:
        rec = decode(data, TaskRecord)
    except Exception:
        return None
    return rec if rec.state == TaskState.succeeded else None


def may_move(current: TaskState, new: TaskState) -> bool:
    """True if ``current`` -> ``new`` goes forward (a terminal state never moves)."""
    if current.terminal:
        return False
    return TASK_ORDER[new] > TASK_ORDER[current]


def queued(task: GenerationTask, cluster: str) -> TaskRecord:
    """The record the gateway creates (its times are the submission's)."""
    return TaskRecord(task=task, state=TaskState.queued, cluster=cluster,
                      created_at=task.submitted_at, updated_at=task.submitted_at)


# The gateway's word that the record at a revision is the one it created for these task
# bytes, at a time: "<revision>.<issued at, Unix ms>.<HMAC-SHA256 hex>", keyed by
# TANDEM_TASK_SEAL_KEY.
RECORD_SEAL = "Tandem-Record-Seal"
# A seal is trusted for the gen stream's duplicate window less this: the gateway's and
# a worker's clocks may differ by that much, and a seal must lapse before the stream
# forgets the message's id (a replay then stored, not deduped).
SEAL_CLOCK_SKEW = 60.0
SEAL_WINDOW = GEN_DEDUPE_WINDOW - SEAL_CLOCK_SKEW  # seconds a seal is trusted


class SealSettings(Settings):
    """The key the gateway seals the tasks it enqueues with, and the workers check."""

    task_seal_key: SecretStr | None = Field(
        None, min_length=16, description="Shared secret of the gateway and the workers "
        "(at least 16 characters): a task the gateway sealed needs no record read before "
        "its first move. Unset: no seals; every worker reads each record first.")

    @property
    def seal_key(self) -> bytes | None:
        key = self.task_seal_key
        return key.get_secret_value().encode() if key is not None else None


def _mac(key: bytes, revision: int, issued: int, data: bytes) -> str:
    return hmac.new(key, b"%d\n%d\n" % (revision, issued) + data, hashlib.sha256).hexdigest()


def seal(key: bytes | None, revision: int | None, data: bytes, *,
         at: float | None = None) -> dict[str, str] | None:
    """The ``Tandem-Record-Seal`` header for task bytes ``data`` whose record the gateway
    created at ``revision``, issued now (``at``: another time, for tests); None without a
    key or a revision. Publish it with the task id as ``Nats-Msg-Id``, or it is never
    trusted (``as_sealed``)."""
    if key is None or revision is None:
        return None
    issued = int((time.time() if at is None else at) * 1000)
    return {RECORD_SEAL: f"{revision}.{issued}.{_mac(key, revision, issued, data)}"}


def as_sealed(task: GenerationTask, data: bytes, headers: dict[str, str],
              key: bytes | None, *, now: float | None = None
              ) -> tuple[TaskRecord, int] | None:
    """The record the gateway created for ``task`` and its revision, if the delivery
    carries a valid seal of exactly these bytes that may still be trusted; None
    otherwise (read the record, as for a redelivery).

    A compare-and-set at that revision succeeds only while the record is still the one
    created, so a sealed task's first move needs no read. A publisher without the key
    cannot forge a seal, so it cannot aim the worker's compare-and-set at another task's
    record (its delivery is read and checked by ``claim``). Anyone may copy a sealed
    message off the stream and publish it again, though: its record may have ended (or
    counted crashes) meanwhile, and the sealed record would say it is still queued. So a
    seal is trusted only on a message whose ``Nats-Msg-Id`` is the task id, while it is
    younger than ``SEAL_WINDOW``: within that window the stream stores no second message
    under the id, so a delivery then is the gateway's one message (or its redelivery,
    which is read anyway); a replay under another id, or after the window, is read.
    """
    raw = headers.get(RECORD_SEAL)
    if key is None or not raw or not task.cluster or headers.get(MSG_ID) != task.task_id:
        return None
    rev, _, rest = raw.partition(".")
    issued, _, mac = rest.partition(".")
    if not (rev.isdigit() and issued.isdigit()) or not hmac.compare_digest(
            mac, _mac(key, int(rev), int(issued), data)):
        return None
    age = (time.time() if now is None else now) - int(issued) / 1000
    if not -SEAL_CLOCK_SKEW <= age < SEAL_WINDOW:
        return None
    return queued(task, task.cluster), int(rev)


def claim(task: GenerationTask, rec: TaskRecord | None) -> TaskRecord | None:
    """``rec`` if it is ``task``'s own record (None if there is none yet).

    A task id belongs to the body first recorded under it: a delivery whose body differs
    is another message under a taken id, and raises ``TaskConflict`` before any move, so
    it can never run, nor touch the record and images of the task that owns the id.
    """
    if rec is not None and rec.task != task:
        raise TaskConflict(task.task_id)
    return rec


def to_running(fraction: float, *, cluster: str, worker: str, attempt: int,
               started_at: float) -> Move:
    """queued -> running with ``fraction`` done (or a running record's progress, or a
    redelivery taking it over). The worker writes it only once a task has run for a
    while (``PROGRESS_KV_INTERVAL``), so a short task goes straight from queued to its
    end: one write per task, not two."""

    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if rec is None or rec.state not in (TaskState.queued, TaskState.running):
            return None
        taken_over = rec.worker != worker or rec.attempts < attempt
        if rec.state == TaskState.running and not taken_over and fraction <= rec.progress:
            return None
        return struct_replace(rec, state=TaskState.running, progress=round(fraction, 4),
                              updated_at=now(), started_at=rec.started_at or started_at,
                              cluster=cluster, worker=worker,
                              attempts=max(rec.attempts, attempt))

    return move


def to_succeeded(images: list[str], *, cluster: str, worker: str, attempt: int,
                 started_at: float, checkpoint: str = "", checkpoint_step: int | None = None,
                 timings: dict[str, float] | None = None) -> Move:
    """queued or running -> succeeded with its result: the one write that ends a task
    (a cancelled record never moves, so a cancelled task never succeeds)."""

    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if rec is None or not may_move(rec.state, TaskState.succeeded):
            return None
        t = now()
        return struct_replace(rec, state=TaskState.succeeded, images=images, progress=1.0,
                              reason="",  # a note of hand-backs (to_handed_back) is moot
                              checkpoint=checkpoint, checkpoint_step=checkpoint_step,
                              cluster=cluster, worker=worker, attempts=max(rec.attempts, attempt),
                              started_at=rec.started_at or started_at, timings=timings or {},
                              updated_at=t, finished_at=t)

    return move


def to_crashed(alone: bool) -> Move:
    """A worker process died while the task's pipeline call ran (``alone``: a call of its
    own): counted on a record that has not ended, so the next delivery runs it alone and
    the one after enough deaths alone refuses it. A record that ended is left."""

    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if rec is None or rec.state.terminal:
            return None
        return struct_replace(rec, crashes=rec.crashes + 1,
                              crashes_alone=rec.crashes_alone + int(alone), updated_at=now())

    return move


def deaths(rec: TaskRecord) -> str:
    """What ``rec``'s crash counts (``to_crashed``) say, for a failure's reason; '' if none."""
    if not rec.crashes:
        return ""
    return (f"the worker process died in {rec.crashes} of its pipeline calls "
            f"({rec.crashes_alone} of them its own)")


_HANDED_BACK = "handed back "


def handed_back(rec: TaskRecord) -> str:
    """What ``rec`` says of the workers that handed its task back (``to_handed_back``),
    for a failure's reason; '' if none did."""
    return rec.reason if not rec.state.terminal and rec.reason.startswith(_HANDED_BACK) else ""


def to_handed_back(why: str) -> Move:
    """A worker handed the task back (it does not serve its model), ``why``: noted on a
    record that has not ended, as ``handed back N times: <each distinct why>``, so a task
    that runs out of deliveries this way fails saying so (the bus knows only that it was
    delivered N times). A record that ended is left."""

    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if rec is None or rec.state.terminal:
            return None
        n, whys = 0, []
        if note := handed_back(rec):
            count, _, listed = note[len(_HANDED_BACK):].partition(" times: ")
            n, whys = (int(count), listed.split("; ")) if count.isdigit() else (0, [])
        if why not in whys:
            whys.append(why)
        return struct_replace(rec, reason=f"{_HANDED_BACK}{n + 1} times: {'; '.join(whys)}",
                              updated_at=now())

    return move


def to_resent(older_than: float) -> Move:
    """The gateway sends a still-queued task again (an Idempotency-Key replay whose first
    request may have died between recording and enqueueing): marked by ``updated_at``,
    and only on a queued record not sent (or marked) in the last ``older_than`` seconds,
    so replays in a loop send it once per dedupe window at most. None: leave it."""

    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if rec is None or rec.state != TaskState.queued or now() - rec.updated_at < older_than:
            return None
        return struct_replace(rec, updated_at=now())

    return move


def _to_terminal(state: TaskState, reason: str, body: GenerationTask | None = None) -> Move:
    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if body is not None:
            try:
                rec = claim(body, rec) or TaskRecord(task=body, cluster=body.cluster)
            except TaskConflict:
                return None  # someone else's message: the record is not its to end
        if rec is None or not may_move(rec.state, state):
            return None
        t = now()
        why = reason
        if state == TaskState.failed:  # "exhausted: delivered N times" says not why
            for more in (handed_back(rec), deaths(rec)):
                if more and more not in why:
                    why = f"{why}; {more}"
        return struct_replace(rec, state=state, reason=why, updated_at=t, finished_at=t)

    return move


def to_failed(reason: str, body: GenerationTask | None = None) -> Move:
    """-> failed with ``reason``. With ``body`` (a dead-lettered delivery), only the
    record of that body: a task that was never recorded gets a failed record, so its
    publisher can read why; another body's record is left alone."""
    return _to_terminal(TaskState.failed, reason, body)


def to_cancelled(reason: str = "cancelled by client") -> Move:
    return _to_terminal(TaskState.cancelled, reason)
