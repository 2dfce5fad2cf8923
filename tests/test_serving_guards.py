"""What a worker does with deliveries it must not simply run: a task too large for its
dead letter, a sealed task published again, a task for a model it does not serve. Real
nats-server, S3 and worker processes; each task is published as the gateway would (a
``queued`` record, then the task sealed with its revision, ``Nats-Msg-Id`` its id)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tandem.cli.devstack import S3Server
from tandem.common import subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import GenerationTask, TaskRecord, TaskState, encode
from tandem.common.streams import KV_TASKS
from tests.serving_stack import (
    DEADLINE,
    Progress,
    ServingStack,
    Writes,
    count_on,
    dead_letters,
    terminal,
    worker,
)

MAIN, MIXED = "guards", "mixed"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[ServingStack]:
    st = ServingStack(tmp_path_factory.mktemp("guards"), s3_server, "guards")
    st.nats.start()
    try:
        w = worker(st.root, "w-guards", **st.env(cluster=MAIN, node="w-guards",
                                                 serve="digits,tiny-text", ack_wait="10"))
        st.children.append(w.start())
        w.wait_healthy()
        yield st
    finally:
        st.stop()


@pytest.fixture
async def bus(stack: ServingStack) -> AsyncIterator[Bus]:
    async with stack.bus() as b:
        yield b


def _task(cluster: str = MAIN, **fields: Any) -> GenerationTask:
    base: dict[str, Any] = dict(task_id=uuid.uuid4().hex, model="digits", class_label=3,
                                steps=2, width=16, height=16, cluster=cluster)
    return GenerationTask(**{**base, **fields})


async def _enqueue(stack: ServingStack, bus: Bus, task: GenerationTask
                   ) -> tuple[bytes, dict[str, str]]:
    """As the gateway does: the record, then the task sealed with its revision; the
    bytes and the seal header, for a replay."""
    rev = await (await bus.typed(KV_TASKS, TaskRecord)).create(
        task.task_id, moves.queued(task, task.cluster))
    data = encode(task)
    seal = moves.seal(stack.seal_key.encode(), rev, data)
    assert seal is not None
    await bus.publish(subjects.gen(task.cluster, task.lane), data, msg_id=task.task_id,
                      headers=seal)
    return data, seal


async def _queue_empty(bus: Bus, cluster: str, lane: str) -> None:
    """Until the cluster's work queue holds nothing on ``lane`` (a message leaves it when
    acked or terminated): polling the server's own count, with a deadline."""
    async with asyncio.timeout(DEADLINE):
        while await count_on(bus, subjects.gen_stream_name(cluster), subjects.gen(cluster, lane)):
            pass


# ------------------------------------------------------------------ too large to dead-letter


async def test_a_refused_task_too_large_for_its_dead_letter_is_dead_lettered_cut_and_fails(
        bus: Bus) -> None:
    """A task whose whole body, base64 in its letter, would exceed max_payload: its letter
    keeps the start of the body with the body's length and sha256, and the task ends
    ``failed`` (before, the letter's publish failed as "DLQ unreachable" and the task
    was naked forever)."""
    task = _task(model="tiny-text", class_label=None, prompt="x" * 800_000)
    data = encode(task)
    assert len(data) * 4 // 3 > bus.nc.max_payload > len(data)
    await bus.publish(subjects.gen(MAIN, task.lane), data, msg_id=task.task_id)
    rec = await terminal(bus, task.task_id)
    assert rec.state == TaskState.failed and rec.reason.startswith("rejected: invalid task")
    [letter] = [d for d in await dead_letters(bus, f"GEN_{MAIN.upper()}", lambda ls: any(
        task.task_id.encode() in d.data for d in ls)) if task.task_id.encode() in d.data]
    assert letter.reason.startswith("rejected: invalid task")
    assert (f"of the body's {len(data)} bytes (sha256 {hashlib.sha256(data).hexdigest()})"
            in letter.reason)
    assert data.startswith(letter.data) and 0 < len(letter.data) < len(data)
    await _queue_empty(bus, MAIN, task.lane)


async def test_a_payload_too_large_for_its_dead_letter_that_is_not_json_is_dead_lettered(
        bus: Bus) -> None:
    marker = uuid.uuid4().hex.encode()
    data = b"{" + marker + b"!" * 790_000
    await bus.publish(subjects.gen(MAIN, "batch"), data, msg_id=marker.decode())
    [letter] = [d for d in await dead_letters(bus, f"GEN_{MAIN.upper()}", lambda ls: any(
        marker in d.data for d in ls)) if marker in d.data]
    assert letter.reason.startswith("undecodable")
    assert f"sha256 {hashlib.sha256(data).hexdigest()}" in letter.reason
    await _queue_empty(bus, MAIN, "batch")


# ------------------------------------------------------------------------ sealed replays


async def test_a_sealed_task_published_again_after_it_succeeded_is_not_run_again(
        stack: ServingStack, bus: Bus) -> None:
    """The gateway's very message (its seal too) copied and published under another
    ``Nats-Msg-Id``: the seal is not trusted, the record is read, and the task, ended,
    is not run again (no step, no write)."""
    task = _task()
    data, seal = await _enqueue(stack, bus, task)
    assert (await terminal(bus, task.task_id)).state == TaskState.succeeded
    progress = await Progress().start(bus, task.task_id)
    writes = await Writes().start(bus)
    try:
        await bus.publish(subjects.gen(MAIN, task.lane), data, msg_id=uuid.uuid4().hex,
                          headers=seal)
        await _queue_empty(bus, MAIN, task.lane)
        await bus.synced()
        assert progress.steps == [] and writes.states(task.task_id) == []
    finally:
        await progress.stop()
        await writes.stop()


async def test_a_sealed_task_published_again_after_deaths_of_its_worker_meets_the_crash_limit(
        stack: ServingStack, bus: Bus) -> None:
    """A sealed task whose record counts MAX_CRASHES deaths in calls of its own, published
    again: it is refused naming them, not run on the strength of its seal."""
    task = _task()
    kv = await bus.typed(KV_TASKS, TaskRecord)
    rev = await kv.create(task.task_id, moves.queued(task, MAIN))
    data = encode(task)
    for _ in range(2):
        await kv.update(task.task_id, moves.to_crashed(True))
    await bus.publish(subjects.gen(MAIN, task.lane), data, msg_id=uuid.uuid4().hex,
                      headers=moves.seal(stack.seal_key.encode(), rev, data))
    rec = await terminal(bus, task.task_id)
    assert rec.state == TaskState.failed, rec
    assert "refused after TANDEM_MAX_CRASHES=2" in rec.reason, rec.reason


# -------------------------------------------------------------------------- hand-backs


async def test_a_task_no_worker_of_its_cluster_serves_fails_naming_who_handed_it_back(
        stack: ServingStack, bus: Bus) -> None:
    w = worker(stack.root, "w-noop", **stack.env(cluster=MIXED, node="w-noop", serve="noop"))
    stack.children.append(w.start())
    w.wait_healthy()
    try:
        task = _task(MIXED)
        await _enqueue(stack, bus, task)
        rec = await terminal(bus, task.task_id)
        want = ("exhausted: delivered 5 times; handed back 4 times: model 'digits' is not "
                "served by w-noop")
        assert rec.state == TaskState.failed and rec.reason == want, rec.reason
        await dead_letters(bus, f"GEN_{MIXED.upper()}", lambda ls: any(
            task.task_id.encode() in d.data and d.reason == want for d in ls))
    finally:
        w.kill()

