"""``Batcher.cancel`` stops every copy of a task here, not only the first it finds: a
redelivery can wait on the worker beside the delivery it replaces."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.common.events import GenerationTask
from tandem.inference_worker.batcher import Batcher, HandedBack, JobCancelled
from tandem.inference_worker.pipelines import Item, Params, Pipeline

WAIT = 60.0  # deadline on an event, not a timing threshold


class Gated(Pipeline):
    """Blocks its first step in the batcher's thread until the test opens ``go``."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        self.calls = 0

    def images(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
        self.calls += 1
        self.reached.set()
        assert self.go.wait(WAIT)
        on_step(1, params.steps)
        return [b"done" for _ in items]


def _task(task_id: str) -> GenerationTask:
    return GenerationTask(task_id=task_id, model="m", seed=1, steps=2)


async def test_cancel_stops_every_waiting_copy_of_a_task_and_only_that_task() -> None:
    pipe = Gated()

    async def get_pipeline(model: str) -> Pipeline:
        return pipe

    batcher = Batcher(get_pipeline, max_batch=1, linger=0)
    first, second = batcher.enqueue(_task("dup")), batcher.enqueue(_task("dup"))
    other = batcher.enqueue(_task("other"))
    assert batcher.cancel("dup")
    for job in (first, second):
        assert job.cancelled and isinstance(job.future.exception(), JobCancelled)
    assert [j.task.task_id for j in batcher.pending] == ["other"]
    assert not other.future.done()
    assert not batcher.cancel("dup")  # nothing left of it
    batcher.close()
    with pytest.raises(HandedBack):  # the worker stopping
        await other.future
    assert pipe.calls == 0


async def test_cancel_stops_a_running_copy_and_a_waiting_copy_of_the_same_task() -> None:
    pipe = Gated()

    async def get_pipeline(model: str) -> Pipeline:
        return pipe

    batcher = Batcher(get_pipeline, max_batch=1, linger=0)
    running = batcher.enqueue(_task("dup"))
    loop = asyncio.create_task(batcher.run())
    try:
        assert await asyncio.to_thread(pipe.reached.wait, WAIT)  # the first copy runs
        waiting = batcher.enqueue(_task("dup"))  # a redelivery arrives meanwhile
        assert batcher.cancel("dup")
        for job in (running, waiting):
            assert job.cancelled
            with pytest.raises(JobCancelled):
                await asyncio.wait_for(asyncio.shield(job.future), WAIT)
        assert not batcher.pending
    finally:
        pipe.go.set()
        batcher.close()
        await loop
    assert pipe.calls == 1  # the waiting copy never ran
