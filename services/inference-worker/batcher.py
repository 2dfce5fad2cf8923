"""Dynamic batching: compatible tasks share one pipeline call.

Tasks are compatible when their ``batch_key`` (model, size, steps, guidance) is equal.
The batcher always starts with the oldest task of the best lane (interactive before
batch), lingers up to ``linger`` seconds for more compatible tasks unless the batch is
already full, then runs one pipeline call for up to ``max_batch`` images, with a
generator per image. One call runs at a time: the worker owns one accelerator.

Cancelling a task that waits removes it; cancelling one that runs resolves it at once
(the caller sees it stop within one step) and the call stops at the next step when no
task in it is still wanted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tandem.common.events import GenerationTask
from tandem.inference_worker.pipelines import Interrupted, Item, Params, Pipeline

LANE_RANK = {"interactive": 0, "batch": 1}


class JobCancelled(Exception):
    """The task was cancelled before its images were made."""


class HandedBack(Exception):
    """The worker is stopping: the task was not started and goes back to the queue."""


@dataclass(eq=False)
class Job:
    task: GenerationTask
    future: asyncio.Future[list[bytes]]
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    running: bool = False
    pipeline: Pipeline | None = None  # what ran it: the checkpoint its images came from
    marks: dict[str, float] = field(default_factory=dict)  # wall-clock phases (phases.py)

    @property
    def rank(self) -> tuple[int, float]:
        return LANE_RANK.get(self.task.lane, 1), self.arrived

    def items(self) -> list[Item]:
        t = self.task
        return [Item(seed=t.seed + i, prompt=t.prompt, negative_prompt=t.negative_prompt,
                     class_label=t.class_label) for i in range(t.num_images)]

    def resolve(self, value: list[bytes] | BaseException) -> None:
        if self.future.done():
            return
        if isinstance(value, BaseException):
            self.future.set_exception(value)
        else:
            self.future.set_result(value)


ProgressHook = Callable[[list[Job], int, int], None]
PipelineGetter = Callable[[str], Awaitable[Pipeline]]


class Batcher:
    def __init__(self, get_pipeline: PipelineGetter, *, max_batch: int = 8,
                 linger: float = 0.02, on_step: ProgressHook | None = None) -> None:
        self.get_pipeline = get_pipeline
        self.max_batch = max_batch
        self.linger = linger
        self.on_step = on_step
        self.pending: list[Job] = []
        self.running: list[Job] = []
        self.batches = 0
        self._changed = asyncio.Event()
        self._closed = False
        self._abort = False

    # ----------------------------------------------------------------------- callers

    def enqueue(self, task: GenerationTask) -> Job:
        """Queue ``task`` now; its ``future`` gets the PNGs or the reason it has none."""
        job = Job(task, asyncio.get_running_loop().create_future())
        if self._closed:
            job.resolve(HandedBack())
            return job
        self.pending.append(job)
        self._changed.set()
        return job

    async def submit(self, task: GenerationTask) -> list[bytes]:
        """Queue ``task``; return its PNGs, or raise JobCancelled / HandedBack / the error."""
        return (await self.submit_job(task)).future.result()

    async def submit_job(self, task: GenerationTask) -> Job:
        """``submit``, returning the finished job: its ``pipeline`` is the one that made
        the images (a hot-swap between batches never relabels a finished batch)."""
        job = self.enqueue(task)
        try:
            await job.future
            return job
        finally:
            if job in self.pending:
                self.pending.remove(job)

    def cancel(self, task_id: str) -> bool:
        """Stop ``task_id`` if it waits or runs here; True if it was found."""
        for job in self.pending:
            if job.task.task_id == task_id:
                job.cancelled = True
                self.pending.remove(job)
                job.resolve(JobCancelled())
                return True
        for job in self.running:
            if job.task.task_id == task_id:
                job.cancelled = True
                job.resolve(JobCancelled())
                return True
        return False

    def close(self) -> None:
        """Hand back every waiting task; the running call finishes; ``run`` returns."""
        self._closed = True
        for job in self.pending:
            job.resolve(HandedBack())
        self.pending.clear()
        self._changed.set()

    def abort(self) -> None:
        """Stop the running call at its next step and hand its tasks back (drain timeout)."""
        self.close()
        self._abort = True

    def task_ids(self) -> list[str]:
        return [j.task.task_id for j in self.running + self.pending]

    # ----------------------------------------------------------------------- the loop

    async def run(self) -> None:
        while not self._closed:
            if not self.pending:
                self._changed.clear()
                await self._changed.wait()
                continue
            head = min(self.pending, key=lambda j: j.rank)
            load_start = time.time()
            try:
                pipeline = await self.get_pipeline(head.task.model)
            except Exception as exc:
                # The model cannot load: every task for it fails the same way.
                for job in [j for j in self.pending if j.task.model == head.task.model]:
                    self.pending.remove(job)
                    job.resolve(exc)
                continue
            load_end = time.time()
            if not pipeline.trivial:
                await self._linger(head)
            group = self._take(head)
            for job in group:
                job.marks.update(load_start=load_start, load_end=load_end)
            if group:
                await self._run(pipeline, group)

    async def _linger(self, head: Job) -> None:
        deadline = head.arrived + self.linger
        while not self._closed and head in self.pending:
            if self._images(self._compatible(head)) >= self.max_batch:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def _compatible(self, head: Job) -> list[Job]:
        key = head.task.batch_key()
        return sorted((j for j in self.pending if j.task.batch_key() == key),
                      key=lambda j: j.rank)

    @staticmethod
    def _images(jobs: list[Job]) -> int:
        return sum(j.task.num_images for j in jobs)

    def _take(self, head: Job) -> list[Job]:
        if head not in self.pending:  # cancelled while lingering
            return []
        group: list[Job] = []
        n = 0
        for job in self._compatible(head):
            if group and n + job.task.num_images > self.max_batch:
                break
            group.append(job)
            n += job.task.num_images
        for job in group:
            self.pending.remove(job)
            job.running = True
        return group

    async def _run(self, pipeline: Pipeline, group: list[Job]) -> None:
        self.running = group
        self.batches += 1
        for job in group:
            job.pipeline = pipeline
        items = [it for job in group for it in job.items()]
        started = time.time()
        for job in group:
            job.marks.update(run_start=started, batch_images=len(items))
        t = group[0].task
        params = Params(width=t.width, height=t.height, steps=t.steps, guidance=t.guidance)
        loop = asyncio.get_running_loop()

        def on_step(step: int, total: int) -> None:
            # Runs in the pipeline's thread: stop when nobody wants the result any more.
            if self._abort or all(j.cancelled for j in group):
                raise Interrupted()
            if self.on_step is not None:
                loop.call_soon_threadsafe(self.on_step, group, step, total)

        try:
            if pipeline.trivial:
                images = pipeline.generate(items, params, on_step)
            else:
                try:
                    images = await asyncio.to_thread(pipeline.generate, items, params, on_step)
                except asyncio.CancelledError:
                    # Cancelled from outside: stop the thread at its next step too, or the
                    # process would wait for the whole call before it could exit.
                    self._abort = True
                    raise
        except Interrupted:
            for job in group:
                job.resolve(JobCancelled() if job.cancelled else HandedBack())
        except Exception as exc:
            for job in group:
                job.resolve(exc)
        else:
            at = 0
            finished = time.time()
            for job in group:
                job.marks["run_end"] = finished
                n = job.task.num_images if images else 0
                job.resolve(images[at:at + n])
                at += n
        finally:
            self.running = []
