"""How a generation task's record (KV ``tasks``) may move: forward only, by CAS.

Each function returns an update function for ``TypedKV.update``: it gets the current
record and returns the new one, or None to leave it (the move would go backwards, or the
task is already terminal). The gateway and the worker share these, so the rules of
``events.TASK_ORDER`` are written once.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.common.events import (
    TASK_ORDER,
    GenerationTask,
    TaskRecord,
    TaskState,
    now,
    struct_replace,
)

Move = Callable[[TaskRecord | None], TaskRecord | None]


def may_move(current: TaskState, new: TaskState) -> bool:
    """True if ``current`` -> ``new`` goes forward (a terminal state never moves)."""
    if current.terminal:
        return False
    return TASK_ORDER[new] > TASK_ORDER[current]


def queued(task: GenerationTask, cluster: str) -> TaskRecord:
    """The record the gateway creates. A function of ``task`` and ``cluster`` alone (its
    times are the submission's), so a worker can rebuild it from the task: see
    ``as_created``."""
    return TaskRecord(task=task, state=TaskState.queued, cluster=cluster,
                      created_at=task.submitted_at, updated_at=task.submitted_at)


# The revision of a task's record when the gateway enqueued it, as a header of the task.
RECORD_REVISION = "Tandem-Record-Revision"


def revision_header(revision: int | None) -> dict[str, str] | None:
    return None if revision is None else {RECORD_REVISION: str(revision)}


def as_created(task: GenerationTask, headers: dict[str, str]) -> tuple[TaskRecord, int] | None:
    """The task's record as the gateway created it, and that revision, from the task and
    its ``Tandem-Record-Revision`` header; None without one.

    A compare-and-set against that revision succeeds only while the record is still
    exactly that one, so a worker's first move needs no read; after any other write it
    fails and the worker reads the record as usual.
    """
    raw = headers.get(RECORD_REVISION)
    if not raw or not raw.isdigit() or not task.cluster:
        return None
    return queued(task, task.cluster), int(raw)


def to_running(task: GenerationTask, cluster: str, worker: str, attempt: int) -> Move:
    """queued -> running (or running again on a redelivery, by another worker)."""

    def move(rec: TaskRecord | None) -> TaskRecord | None:
        t = now()
        if rec is None:  # published without a gateway (tools, tests): adopt it
            rec = TaskRecord(task=task, cluster=cluster)
        if rec.state.terminal:
            return None
        return struct_replace(rec, state=TaskState.running, updated_at=t,
                              started_at=rec.started_at or t, cluster=cluster, worker=worker,
                              attempts=max(rec.attempts, attempt))

    return move


def to_succeeded(images: list[str], checkpoint: str = "",
                 checkpoint_step: int | None = None, *, adopt: GenerationTask | None = None,
                 cluster: str = "", worker: str = "") -> Move:
    """-> succeeded with its images. ``adopt`` (with ``cluster``, ``worker``) also takes a
    queued or unrecorded task straight there: dispatch-only tasks have nothing to run."""

    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if rec is None and adopt is not None:
            rec = TaskRecord(task=adopt, cluster=cluster)
        if rec is None or not may_move(rec.state, TaskState.succeeded):
            return None
        t = now()
        extra = {"cluster": cluster, "worker": worker, "started_at": rec.started_at or t} \
            if adopt is not None else {}
        return struct_replace(rec, state=TaskState.succeeded, images=images, progress=1.0,
                              checkpoint=checkpoint, checkpoint_step=checkpoint_step,
                              updated_at=t, finished_at=t, **extra)

    return move


def _to_terminal(state: TaskState, reason: str) -> Move:
    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if rec is None or not may_move(rec.state, state):
            return None
        t = now()
        return struct_replace(rec, state=state, reason=reason, updated_at=t, finished_at=t)

    return move


def to_failed(reason: str) -> Move:
    return _to_terminal(TaskState.failed, reason)


def to_cancelled(reason: str = "cancelled by client") -> Move:
    return _to_terminal(TaskState.cancelled, reason)


def with_progress(fraction: float) -> Move:
    """Record progress of a running task; never touches a terminal one."""

    def move(rec: TaskRecord | None) -> TaskRecord | None:
        if rec is None or rec.state != TaskState.running or fraction <= rec.progress:
            return None
        return struct_replace(rec, progress=round(fraction, 4), updated_at=now())

    return move
