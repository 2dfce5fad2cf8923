"""A worker's cancel notices (``records.Cancels``) are held only as long as they can
matter: a delivery that could skip its record's read is a sealed first delivery, trusted
only while its seal is young (``tasks.as_sealed``). Before, a worker held every notice
of the bucket's day."""

from __future__ import annotations

import math
import uuid

from tandem.common import tasks as moves
from tandem.common.events import CancelNotice, GenerationTask, encode
from tandem.inference_worker.records import NOTICE_KEEP, Cancels

KEY = b"k" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _notice(task_id: str) -> bytes:
    return encode(CancelNotice(task_id=task_id))


def test_notices_are_held_while_they_matter_then_forgotten_oldest_first() -> None:
    clock, heard = Clock(), []
    cancels = Cancels(None, heard.append, clock=clock)  # type: ignore[arg-type]  # never started
    # A day of cancels at one a second: what is held stays one NOTICE_KEEP's worth.
    held_most = 0
    ids = [uuid.uuid4().hex for _ in range(24 * 3600 // 60)]
    for task_id in ids:
        cancels._apply(task_id, _notice(task_id), initial=False)
        held_most = max(held_most, len(cancels.ids))
        clock.now += 60.0  # one a minute, to keep the test short: the bound is the same
    assert heard == ids  # each stopped where it waits or runs, as it came
    assert held_most == math.ceil(NOTICE_KEEP / 60), held_most  # 11, of a day's 1,440
    last = ids[-1]
    assert cancels.cancelled(last) and not cancels.cancelled(ids[0])
    # Heard again (a re-watch): it counts from now, and outlives those heard after it.
    cancels._apply(ids[-2], _notice(ids[-2]), initial=True)
    clock.now += NOTICE_KEEP - 1
    cancels._apply("x", _notice("x"), initial=False)
    assert cancels.cancelled(ids[-2]) and not cancels.cancelled(last)


def test_a_task_whose_notice_was_forgotten_is_read_not_trusted() -> None:
    """What makes forgetting safe: the task was sealed before it was cancelled, and the
    notice heard at the earliest a clock skew before the seal's time; once the notice is
    NOTICE_KEEP old, the seal is too old to be trusted, so the worker reads the record
    (which says cancelled) instead of running the task."""
    task = GenerationTask(task_id=uuid.uuid4().hex, model="noop", noop=True, cluster="c")
    data = encode(task)
    issued = 5_000_000.0  # the gateway's clock
    headers = {**(moves.seal(KEY, 3, data, at=issued) or {}), "Nats-Msg-Id": task.task_id}
    assert moves.as_sealed(task, data, headers, KEY, now=issued) is not None  # trusted
    heard = issued - moves.SEAL_CLOCK_SKEW  # the worker's clock, as early as it can be
    assert moves.as_sealed(task, data, headers, KEY, now=heard + NOTICE_KEEP) is None
