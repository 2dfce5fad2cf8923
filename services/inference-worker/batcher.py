"""Dynamic batching: compatible tasks share one pipeline call, and the calls never wait.

Tasks are compatible when their ``batch_key`` (model, size, steps, guidance) is equal.
The batcher always starts with the oldest task of the best lane (interactive before
batch), lingers up to ``linger`` seconds for more compatible tasks unless the batch is
already full, then hands one pipeline call for up to ``max_batch`` images, with a
generator per image, to its compute thread. One call runs at a time, in the order the
calls were handed over (``Turns``): the worker owns one accelerator.

The compute threads are the batcher's own (nothing else runs on them), and they are
fed from a queue: while a call runs, the next batch is formed and queued behind it
(``AHEAD`` batches at most), so the pipeline goes from one call straight into the next
without waiting for the event loop. A pipeline takes its calls one at a time, unless it
is ``concurrent`` (``apart``: its child process queues the next call itself, and the
batcher hands it over at once). A job resolves with its images as the pipeline made
them (``Pipeline.images``); PNG encoding, upload and the bus writes happen in the
caller, beside the next call. The price of forming ahead: a task that arrives while a
batch waits in the queue starts one call later than it might have (an interactive task
behind a queued batch-lane call, a task compatible with the queued batch).

A failing call takes only the tasks that fail alone: when a call of several tasks raises
(one task's input can fail the whole call: a prompt the model chokes on, a batch too
big for the device), each of its tasks runs again in a call of its own, so only a task
that fails by itself fails (``tandem_worker_batch_splits_total``). A pipeline apart
(``apart``) fails a call whose child died (a task that crashes the model's process) the
same way. A task that kills the worker's own process takes its call and what the
worker held with it; the call's tasks are known to the next worker (``ledger``): each
of them comes back alone, those that already died alone last in line, and one that
keeps killing its worker alone is refused (the service's ``max_crashes``).

A call that makes no step for ``stall_timeout`` seconds (a hung CUDA call, a driver
deadlock: ``TANDEM_CALL_STALL_TIMEOUT``) is stalled, and its tasks resolve with
``CallStalled``: the worker hands them back rather than keep them alive for ever, and
never blames them (not split, not counted in the ledger). A call apart is watched where
it runs (``apart``: its child is killed, and the next call starts a fresh one); a call
in this process is watched here, from its start (the first step may be slow, never
absent) and then step by step, and since nothing can end it, the batcher is done: every
task it holds goes back, and ``stalled`` says why (the worker turns unhealthy). A
pipeline's warm-up (``warm``: a first load's, a hot-swapped checkpoint's) holds the
accelerator as a call does, and is watched the same way: one that hangs stalls the
batcher too, instead of holding the calls queued behind it for ever.

Cancelling a task that waits removes it; cancelling one that is queued or runs resolves
it at once (the caller sees it stop within one step) and the call stops at the next step
(a queued one before its first) when no task in it is still wanted.

``usage`` sums what the calls took (wall and CPU seconds on the compute thread, calls,
images, first start and last end), so the pipeline's busy fraction is measured where it
happens (``/healthz``).

One module past 600 lines: forming, handing over, watching and ending a call all read and
write the same state (``pending``, ``running``, the room, the turns, ``stalled``) from two
threads; split, the rules that keep it consistent would be read across files.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tandem.common import log, metrics
from tandem.common.events import GenerationTask
from tandem.inference_worker.ledger import CallLedger
from tandem.inference_worker.pipelines import (
    CallStalled,
    CallTime,
    Interrupted,
    Item,
    Params,
    Pipeline,
)

_log = log.get("tandem.inference_worker.batcher")
R = TypeVar("R")
LANE_RANK = {"interactive": 0, "batch": 1}
AHEAD = 1  # batches formed and queued behind the running call
BUSY_SECONDS = metrics.Counter("tandem_worker_pipeline_busy_seconds",
                               "Seconds spent inside pipeline calls (rate: the busy fraction)")
# Per call, where the call is made (observed per task, they counted a batch of 8 eight
# times, and the task's own images as the batch's).
BATCH_IMAGES = metrics.Histogram("tandem_worker_batch_images", "Images per pipeline call",
                                 buckets=(1, 2, 4, 8, 16, 32, 64))
SPLITS = metrics.Counter("tandem_worker_batch_splits", "Calls of several tasks that failed: "
                         "each of their tasks was run again alone")
GEN_SECONDS = metrics.Histogram("tandem_worker_generation_seconds",
                                "Pipeline call duration, seconds")
STALLS = metrics.Counter("tandem_worker_stalled_calls", "Pipeline calls that made no step "
                         "for TANDEM_CALL_STALL_TIMEOUT: their tasks were handed back")


class Turns:
    """One call at a time on the accelerator, in the order the calls were handed over.

    A ``threading.Lock`` is not fair: when the running call releases it, a thread that
    asks after the queued call's may take it first, so a call formed later (a batch-lane
    one) could overtake the queued one (an interactive one). Each call takes a ticket
    where it is handed over, on the event loop, and its thread waits for that number;
    a ticket whose call will never run (its thread's work cancelled) is ``skip``ped.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._serving = 0
        self._skipped: set[int] = set()

    def ticket(self) -> int:
        with self._cond:
            self._issued += 1
            return self._issued - 1

    @contextlib.contextmanager
    def turn(self, ticket: int | None = None) -> Iterator[None]:
        """Wait for ``ticket``'s turn (None: a new ticket, behind every one handed out),
        hold it through the block, then let the next one go."""
        number = self.ticket() if ticket is None else ticket
        with self._cond:
            self._cond.wait_for(lambda: self._serving == number)
        try:
            yield
        finally:
            with self._cond:
                self._next()

    def skip(self, ticket: int) -> None:
        with self._cond:
            if ticket == self._serving:
                self._next()
            else:
                self._skipped.add(ticket)

    def _next(self) -> None:
        self._serving += 1
        while self._serving in self._skipped:
            self._skipped.discard(self._serving)
            self._serving += 1
        self._cond.notify_all()


class JobCancelled(Exception):
    """The task was cancelled before its images were made."""


class HandedBack(Exception):
    """The worker is stopping: the task was not started and goes back to the queue."""


@dataclass(eq=False)
class Job:
    task: GenerationTask
    future: asyncio.Future[list[Any]]  # the images (``Pipeline.images``), or why none
    arrived: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    pipeline: Pipeline | None = None  # what ran it: the checkpoint its images came from
    marks: dict[str, float] = field(default_factory=dict)  # wall-clock phases (phases.py)
    # Runs in a call of its own: its batched call failed, or a worker died in its call.
    alone: bool = False
    suspicion: int = 0  # worker deaths in a call of its own so far: later in its lane
    # Set once (a batch is formed by comparing every waiting job's): what it runs with,
    # and its place in line (interactive before batch, the least suspect, then oldest).
    key: tuple[Any, ...] = field(init=False)
    rank: tuple[int, int, float] = field(init=False)

    def __post_init__(self) -> None:
        self.key = self.task.batch_key()
        self.rank = (LANE_RANK.get(self.task.lane, 1), self.suspicion, self.arrived)

    def items(self) -> list[Item]:
        t = self.task
        return [Item(seed=t.seed + i, prompt=t.prompt, negative_prompt=t.negative_prompt,
                     class_label=t.class_label) for i in range(t.num_images)]

    def resolve(self, value: list[Any] | BaseException) -> None:
        if self.future.done():
            return
        if isinstance(value, BaseException):
            self.future.set_exception(value)
        else:
            self.future.set_result(value)


def _rank(job: Job) -> tuple[int, int, float]:
    return job.rank


def _retrieved(done: asyncio.Future[Any]) -> None:
    """What a call nobody waits for any more ended with, taken so it is not reported."""
    if not done.cancelled():
        done.exception()


@dataclass(eq=False)
class Watch:
    """An in-process call's signs of life, written by its thread: when it began (its turn
    came) and when it last stepped, on the monotonic clock."""

    total: int
    began: float | None = None
    last: float = 0.0
    step: int = 0
    stalled: bool = False  # given up on: a step it makes after all stops it

    def start(self) -> None:
        self.began = self.last = time.monotonic()

    def stepped(self, step: int) -> None:
        self.last, self.step = time.monotonic(), step


ProgressHook = Callable[[list[Job], int, int], None]
PipelineGetter = Callable[[str], Awaitable[Pipeline]]


@dataclass
class Usage:
    """What the pipeline calls took, written by the thread that ran them."""

    calls: int = 0
    images: int = 0
    busy_s: float = 0.0  # wall seconds inside pipeline calls
    cpu_s: float = 0.0  # CPU seconds the compute thread used in them
    first_start: float | None = None  # wall clock (time.time) of the first call's start
    last_end: float | None = None  # and of the last call's end
    # The first call's start since the node was last undrained (``resume``), or since the
    # worker started if it never was: where a backlog let go at once began to be served.
    resumed_start: float | None = None
    _resumed: bool = True  # the next call to end is the first since the last resume
    running_since: float | None = None  # wall clock start of the call running now
    inflight: int = 0  # calls handed over and not ended (two with a concurrent pipeline)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, at: float) -> None:
        """A call was handed over at ``at``; it runs now unless one already does."""
        with self._lock:
            if self.inflight == 0:
                self.running_since = at
            self.inflight += 1

    def add(self, images: int, started: float, wall_s: float, cpu_s: float) -> None:
        with self._lock:
            self.inflight -= 1
            # A call queued behind this one (where the calls run) starts as it ends.
            self.running_since = started + wall_s if self.inflight else None
            self.calls += 1
            self.images += images
            self.busy_s += wall_s
            self.cpu_s += cpu_s
            if self.first_start is None:
                self.first_start = started
            if self._resumed:
                self.resumed_start, self._resumed = started, False
            self.last_end = started + wall_s

    def resume(self) -> None:
        """The node was undrained: the next call starts a new ``resumed_start``."""
        with self._lock:
            self.resumed_start, self._resumed = None, True

    def json(self) -> dict[str, Any]:
        """The sums of the calls that ended, ``running_s`` of the one running now (a
        reader that adds it gets the busy time up to this moment), and ``busy``: busy
        seconds over the span from the first call's start to the last call's end (under
        a backlog, the fraction of wall time the pipeline ran; idle spells between
        backlogs count as not busy too)."""
        span = (self.last_end - self.first_start) if self.first_start is not None \
            and self.last_end is not None else 0.0
        since = self.running_since
        return {"calls": self.calls, "images": self.images, "busy_s": round(self.busy_s, 6),
                "running_s": round(max(time.time() - since, 0.0), 6) if since else 0.0,
                "cpu_s": round(self.cpu_s, 6), "first_start": self.first_start,
                "last_end": self.last_end, "resumed_start": self.resumed_start,
                "busy": round(self.busy_s / span, 6) if span > 0 else None}


class Batcher:
    def __init__(self, get_pipeline: PipelineGetter, *, max_batch: int = 8,
                 linger: float = 0.02, on_step: ProgressHook | None = None,
                 ledger: CallLedger | None = None, stall_timeout: float = 0.0) -> None:
        self.get_pipeline = get_pipeline
        self.ledger = ledger  # told each in-process call's tasks while it runs
        self.stall_timeout = stall_timeout  # seconds without a step; 0: never stalled
        self.stalled: CallStalled | None = None  # an in-process call hangs: nothing runs
        self.max_batch = max_batch
        self.linger = linger
        self.on_step = on_step
        self.pending: list[Job] = []
        self.running: list[Job] = []  # taken: in the running call or the queued ones
        self.batches = 0
        self.usage = Usage()
        self._changed = asyncio.Event()
        self._room = asyncio.Semaphore(1 + AHEAD)
        self._closed = False
        self._abort = False
        self._turns = Turns()  # one accelerator: one call at a time on it, in order

    # ----------------------------------------------------------------------- callers

    def enqueue(self, task: GenerationTask, crashes: int = 0, crashes_alone: int = 0) -> Job:
        """Queue ``task`` now; its ``future`` gets the images or the reason it has none.
        ``crashes``: worker deaths in its calls so far (its record's): it runs alone,
        after the tasks that died alone fewer times (``crashes_alone``)."""
        job = Job(task, asyncio.get_running_loop().create_future(), alone=crashes > 0,
                  suspicion=crashes_alone)
        if self._closed:
            job.resolve(HandedBack())
            return job
        self.pending.append(job)
        self._changed.set()
        return job

    def forget(self, job: Job) -> None:
        """Its caller is gone (cancelled): a job that still waits is never run."""
        if job in self.pending:
            self.pending.remove(job)

    def cancel(self, task_id: str) -> bool:
        """Stop every copy of ``task_id`` that waits, is queued or runs here (a
        redelivery can be here beside the delivery it replaces); True if any was found."""
        found = False
        for job in [j for j in self.pending if j.task.task_id == task_id]:
            job.cancelled = True
            self.pending.remove(job)
            job.resolve(JobCancelled())
            found = True
        for job in self.running:
            if job.task.task_id == task_id:
                job.cancelled = True
                job.resolve(JobCancelled())
                found = True
        return found

    def close(self) -> None:
        """Hand back every waiting task (and the queued calls' tasks, before they start);
        the running call finishes; ``run`` returns."""
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

    def between_calls(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` with no pipeline call running beside it (blocking: call it from a
        thread): it waits for the running call to end, and the next call waits for it."""
        with self._turns.turn():
            return fn(*args)

    async def warm(self, pipeline: Pipeline, max_batch: int) -> None:
        """``pipeline``'s warm-up (``Pipeline.warm``) between two calls, so it never
        shares the accelerator with one; raises what it raises. In this process it is
        watched as a call is: one that makes no step for ``stall_timeout`` seconds once
        its turn came raises ``CallStalled`` and stalls the batcher (``_stalled``)."""
        name = pipeline.spec.name
        watch = Watch(0) if self.stall_timeout and not pipeline.concurrent else None

        def warm_up() -> None:  # its turn came
            if watch is not None:
                watch.start()
            pipeline.warm(max_batch, None if watch is None
                          else lambda step, total: watch.stepped(step))

        work = asyncio.ensure_future(asyncio.to_thread(self.between_calls, warm_up))
        limit = self.stall_timeout
        while watch is not None and not work.done():
            # Queued behind a call (itself watched): looked at again within one limit.
            left = limit if watch.began is None else watch.last + limit - time.monotonic()
            if left <= 0:
                work.add_done_callback(_retrieved)  # if it ever ends, nobody waits
                exc = CallStalled(name, limit, watch.step, watch.total, ended=False)
                self._stalled(exc, [], what="warm-up")
                raise exc
            await asyncio.wait({work}, timeout=left)
        await work

    # ----------------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Form batches and queue them on the compute thread until ``close``; return once
        the calls taken have ended. Cancelled, it stops the running call at its next step."""
        # A thread per call handed over (the running one and AHEAD queued): a pipeline
        # that is not ``concurrent`` takes them one at a time, in order (``Turns``).
        executor = ThreadPoolExecutor(1 + AHEAD, thread_name_prefix="pipeline")
        try:
            async with asyncio.TaskGroup() as calls:
                while not self._closed:
                    await self._room.acquire()  # released when a call taken ends
                    try:
                        formed = await self._form()
                    except BaseException:
                        self._room.release()
                        raise
                    if formed is None:
                        self._room.release()
                        continue
                    pipeline, group = formed
                    if pipeline.trivial:  # nothing to overlap: run it here, now
                        await self._run(pipeline, group, None)
                    else:
                        calls.create_task(self._run(pipeline, group, executor))
        finally:
            # Cancelled: the thread stops at the next step (``_abort``); do not wait for it.
            executor.shutdown(wait=False, cancel_futures=True)

    async def _form(self) -> tuple[Pipeline, list[Job]] | None:
        """The next batch and its pipeline; None when there is none to run (closed, the
        model failed to load, the head was cancelled while lingering)."""
        while not self.pending:
            if self._closed:
                return None
            self._changed.clear()
            await self._changed.wait()
        head = min(self.pending, key=_rank)
        load_start = time.time()
        try:
            pipeline = await self.get_pipeline(head.task.model)
        except Exception as exc:
            # The model cannot load: every task for it fails the same way.
            for job in [j for j in self.pending if j.task.model == head.task.model]:
                self.pending.remove(job)
                job.resolve(exc)
            return None
        load_end = time.time()
        if not pipeline.trivial:
            await self._linger(head)
        group = self._take(head)
        for job in group:
            job.marks.update(load_start=load_start, load_end=load_end)
        return (pipeline, group) if group else None

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
        if head.alone:
            return [head]
        return sorted((j for j in self.pending if j.key == head.key and not j.alone),
                      key=_rank)

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
        self.running += group
        return group

    async def _run(self, pipeline: Pipeline, group: list[Job],
                   executor: ThreadPoolExecutor | None) -> None:
        """One call for ``group`` (on ``executor``'s thread, or here for a trivial
        pipeline); each job resolves with its images or why it has none."""
        self.batches += 1
        for job in group:
            job.pipeline = pipeline
        items = [it for job in group for it in job.items()]
        t = group[0].task
        params = Params(width=t.width, height=t.height, steps=t.steps, guidance=t.guidance)
        loop = asyncio.get_running_loop()

        first = True
        # Watched here: a call on this process's threads (one apart watches itself).
        watch = Watch(params.steps) if self.stall_timeout and executor is not None \
            and not pipeline.concurrent else None

        def on_step(step: int, total: int) -> None:
            # Runs in the pipeline's thread: stop when nobody wants the result any more,
            # and a call handed over ahead (``concurrent``) whose first step comes once
            # the batcher is closed: its tasks go back, as a queued call's do.
            nonlocal first
            if watch is not None:
                watch.stepped(step)
                if watch.stalled:
                    raise Interrupted()
            if self._abort or all(j.cancelled for j in group) or (
                    first and self._closed and pipeline.concurrent):
                raise Interrupted()
            first = False
            if self.on_step is not None:
                loop.call_soon_threadsafe(self.on_step, group, step, total)

        try:
            try:
                # Its place in the accelerator's order is taken here, as it is handed over.
                ticket = None if pipeline.concurrent else self._turns.ticket()
                if executor is None:
                    images = self._call(pipeline, group, items, params, on_step, ticket)
                else:
                    try:
                        work = executor.submit(self._call, pipeline, group, items, params,
                                               on_step, ticket, watch)
                    except BaseException:
                        if ticket is not None:
                            self._turns.skip(ticket)
                        raise
                    if ticket is not None:
                        work.add_done_callback(
                            lambda f, n=ticket: self._turns.skip(n) if f.cancelled() else None)
                    images = await (asyncio.wrap_future(work) if watch is None
                                    else self._watched(work, watch, pipeline.spec.name))
            except asyncio.CancelledError:
                # Cancelled from outside: stop the thread at its next step too, or the
                # process would wait for the whole call before it could exit.
                self._abort = True
                raise
        except Interrupted:
            for job in group:
                job.resolve(JobCancelled() if job.cancelled else HandedBack())
        except CallStalled as exc:
            self._stalled(exc, group)
        except Exception as exc:
            if len(group) > 1 and not self._closed:
                self._split(group, exc)
            else:
                for job in group:
                    job.resolve(exc)
        else:
            at = 0
            for job in group:
                n = job.task.num_images if images else 0
                job.resolve(images[at:at + n])
                at += n
        finally:
            for job in group:
                self.running.remove(job)
            self._room.release()

    async def _watched(self, work: Future[list[Any]], watch: Watch, model: str) -> list[Any]:
        """``work``'s images, unless its call goes ``stall_timeout`` seconds without a step
        (from its start, once its turn came): then ``CallStalled``, and the call is left
        to run on its thread (nothing can stop it between steps it never reaches)."""
        done = asyncio.wrap_future(work)
        limit = self.stall_timeout
        try:
            while not work.done():
                if watch.began is None and self.stalled is not None:
                    # What it queued behind hangs: it can never start (its tasks went
                    # back with ``_stalled``'s).
                    work.cancel()
                    raise Interrupted()
                # Queued behind another call: looked at again within one limit of its start.
                left = limit if watch.began is None else watch.last + limit - time.monotonic()
                if left <= 0:
                    watch.stalled = True
                    done.add_done_callback(_retrieved)  # if it ever ends, nobody waits
                    raise CallStalled(model, limit, watch.step, watch.total, ended=False)
                await asyncio.wait({done}, timeout=left)
        except asyncio.CancelledError:
            done.cancel()  # as awaiting it would: a call not started is never started
            raise
        return await done

    def _stalled(self, exc: CallStalled, group: list[Job], what: str = "call") -> None:
        """A call stalled: its tasks go back (they are not blamed: a hung device is not
        their input). One in this process still holds the accelerator and the call's
        ledger slot: the slot is cleared (a death from now on is the stall's, not theirs),
        and every other task goes back too, for nothing more can run here."""
        STALLS.inc()
        _log.error("worker.call_stalled", model=exc.model, step=exc.step, total=exc.total,
                   stall_timeout=exc.timeout, in_worker_process=not exc.ended, what=what,
                   tasks=[job.task.task_id for job in group])
        for job in group:
            job.resolve(exc)
        if exc.ended:
            return
        self.stalled = exc
        if self.ledger is not None:
            with contextlib.suppress(OSError):
                self.ledger.end()
        self.close()
        for job in self.running:  # the calls queued behind it: never to start
            job.resolve(HandedBack())

    def _split(self, group: list[Job], exc: Exception) -> None:
        """A call of several tasks failed: each task still wanted waits again, at its old
        place in line, to run in a call of its own."""
        again = [job for job in group if not job.future.done()]
        SPLITS.inc()
        _log.warning("worker.batch_split", error=repr(exc),
                     tasks=[job.task.task_id for job in again])
        for job in again:
            job.alone = True
        self.pending += again
        self._changed.set()

    def _call(self, pipeline: Pipeline, group: list[Job], items: list[Item], params: Params,
              on_step: Callable[[int, int], None], ticket: int | None,
              watch: Watch | None = None) -> list[Any]:
        """The pipeline call itself, timed into ``usage`` (on the compute thread). A call
        queued behind one that ran is not started once the batcher is closed (its tasks
        go back) or when every task in it is cancelled."""
        with contextlib.nullcontext() if ticket is None else self._turns.turn(ticket):
            if self._closed or self._abort or all(j.cancelled for j in group):
                raise Interrupted()
            began = CallTime.clocks()
            self.usage.begin(began[0])
            if watch is not None:
                watch.start()
            timing = None
            # A call in this process (not apart, nor trivial) can take the process with it.
            ledger = None if pipeline.concurrent or pipeline.trivial else self.ledger
            if ledger is not None:
                ledger.begin([j.task.task_id for j in group])
            try:
                images, timing = pipeline.call(items, params, on_step)
                return images
            finally:
                if ledger is not None:
                    ledger.end()
                if timing is None:  # it raised: as this thread saw it
                    timing = CallTime.since(began)
                self.usage.add(len(items), timing.started, timing.wall_s, timing.cpu_s)
                BUSY_SECONDS.inc(timing.wall_s)
                GEN_SECONDS.observe(timing.wall_s)
                BATCH_IMAGES.observe(len(items))
                for job in group:
                    job.marks.update(run_start=timing.started, batch_images=len(items),
                                     run_end=timing.started + timing.wall_s)
