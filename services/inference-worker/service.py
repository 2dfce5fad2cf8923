"""The inference worker: pull generation tasks, run them in batches, deliver the images.

One worker per accelerator. It pulls from its cluster's per-lane consumers (interactive
before batch; ``pull_clusters`` names whose queues it takes, the seam failover uses),
batches compatible tasks, runs one pipeline call, and for each task, in this order:

1. the task is checked (``jobs.check_task``) and claimed (``records.Records.claim``: its
   id is its own, it was not cancelled, no earlier delivery finished it), with no read
   of its record for a task the gateway sealed;
2. images to S3 under ``images/<task_id>/<i>.png`` (retried while S3 is unreachable);
3. the task record moved to ``succeeded`` with the images by compare-and-set: the
   commit point and the task's result, written once (a cancelled task never becomes
   succeeded; a redelivery whose record already ended does not run again);
4. only then the message is acked. In-progress acks keep it while it runs, unless its
   call stalls (``call_stall_timeout``): then it is handed back for another worker.

One ``bus.Poller`` pulls every lane (the bus's one consumer loop: priority, room, drain
pause, hand-back on stop); each fetch is handled as a whole (``handle``: the steps run
for its tasks together, a pipeline call's tasks ending together), and each task is
settled as it ends; acks, naks and the DLQ are decided by the bus's ack policy;
``on_dead`` marks a dead-lettered task ``failed`` with the reason.

The steps above are the worker's commit protocol and stay in this file so their order
can be read in one place; the record's moves are in ``records``, batching in
``batcher``, pipelines in ``pipelines``, checkpoint swaps in ``hotswap``, failover in
``failover``. That is why this module is longer than 600 lines: its settings, start-up
and the fetch handler's steps are one protocol; split, its order would be read across
files (a split of the settings alone is the next candidate).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from nats.aio.msg import Msg
from pydantic import Field, field_validator, model_validator

from tandem.common import log, metrics, subjects
from tandem.common import tasks as moves
from tandem.common.backoff import Backoff
from tandem.common.bus import Consumer, Delivery, Poller, TypedKV, describe
from tandem.common.bus.consumer import Outcome
from tandem.common.errors import InvalidTask, Reject, Retry
from tandem.common.events import (
    GenerationProgress,
    GenerationTask,
    ModelsLoaded,
    TaskRecord,
    TaskState,
    decode,
)
from tandem.common.jobs import JobLimitSettings, Problem, check_task
from tandem.common.models import RegistrySettings, leave_out
from tandem.common.runner import Context, Service
from tandem.common.storage import ensure_bucket, s3_client
from tandem.common.streams import (
    KV_TASKS,
    ConsumerSpec,
    Spec,
    core_streams,
    gen_consumers,
    gen_stream,
)
from tandem.common.tasks import SealSettings
from tandem.inference_worker import apart, ledger, phases
from tandem.inference_worker.batcher import Batcher, HandedBack, Job, JobCancelled
from tandem.inference_worker.drain import Drain
from tandem.inference_worker.failover import Failover, FailoverSettings
from tandem.inference_worker.hotswap import HotSwapper
from tandem.inference_worker.loads import detached
from tandem.inference_worker.pipelines import (
    CallStalled,
    ModelLoadError,
    Pipeline,
    build,
    set_threads,
    uses_torch,
)
from tandem.inference_worker.records import Cancels, End, Held, Records

_log = log.get("tandem.inference_worker")
UPLOAD_BACKOFF = Backoff(0.2, max_delay=5.0)  # between image uploads while S3 is down

TASKS_DONE = metrics.Counter("tandem_worker_tasks", "Tasks finished by outcome", ["outcome"])
# Each outcome's series from the start, at 0: a series born at 1 has no rate() until
# its second increase, so the dashboard showed no failed task (observability red team).
SUCCEEDED, CANCELLED, FAILED = (TASKS_DONE.labels(o) for o in ("succeeded", "cancelled",
                                                               "failed"))


class WorkerSettings(FailoverSettings, JobLimitSettings, SealSettings, RegistrySettings):
    """``TANDEM_*`` settings of the inference worker (see README.md)."""

    serve: str = Field("", description="Comma-separated models this worker serves; "
                       "empty serves every model in the registry.")
    worker_id: str = Field("", description="This worker's id; empty: <node>-<pid>.")
    pull_clusters: str = Field("", description="Comma-separated clusters whose queues this "
                               "worker pulls, in order; empty: its own cluster.")
    device: str = Field("auto", description="torch device: auto (cuda if present), cpu, cuda:N.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 on CUDA, float32 on CPU.")
    max_batch: int = Field(8, ge=1, le=256, description="Most images per pipeline call.")
    linger: float = Field(0.02, ge=0, le=5, description="Seconds to wait for compatible tasks.")
    prefetch: int = Field(0, ge=0, le=1024, description="Tasks held beyond the running "
                          "call's max_batch (the next call, queued on the compute thread, "
                          "and the last one's uploads and commits); 0: 2 x max_batch.")
    torch_threads: int = Field(0, ge=0, le=1024, description="torch intra-op threads of the "
                               "pipeline calls; 0: torch's default (one per core).")
    pipeline_process: bool = Field(False, description="Run each registry model's pipeline "
                                   "calls in a child process of their own (apart.py): the "
                                   "worker's encoding, uploads and bus I/O then never wait "
                                   "for the call's interpreter lock. run: models stay in the "
                                   "worker's process.")
    pipeline_cpus: str = Field("", description="CPUs (a Linux CPU list: 0-3,8) the pipeline "
                               "processes run on, and the worker's own threads on the other "
                               "CPUs it may use, so its encoding, uploads and bus I/O never "
                               "take a core from a call; needs pipeline_process. Empty: no "
                               "pinning.")
    pipeline_cpu_count: int = Field(0, ge=0, le=4096, description="Pin the pipeline "
                                    "processes to the last N CPUs this worker may use, where "
                                    "their ids are not known in advance (a Kubernetes pod's "
                                    "exclusive CPUs); or name them in pipeline_cpus. 0: no "
                                    "pinning.")
    ack_wait: float = Field(30.0, gt=0, description="Seconds before an unacked task is "
                            "redelivered; in-progress acks extend it while a task runs.")
    max_deliver: int = Field(5, ge=2, le=100, description="Deliveries before the DLQ.")
    upload_retry_for: float = Field(30.0, ge=0, description="Seconds to retry image uploads "
                                    "before the attempt fails.")
    progress_kv_interval: float = Field(1.0, gt=0, description="Seconds between progress "
                                        "writes to the task record (SSE gets every step).")
    idle_poll: float = Field(0.5, gt=0, le=30, description="Long-poll of the interactive "
                             "lane when idle; bounds the batch lane's pickup delay.")
    preload: bool = Field(True, description="Load served models before pulling tasks.")
    fault_injection: bool = Field(False, description="Allow fault: models (tests only).")
    calls_dir: str = Field("", description="The call ledger's folder (ledger.py); it must "
                           "outlive the process. Empty: one of this user's in the temp dir.")
    max_crashes: int = Field(2, ge=1, le=100, description="Deaths of the worker process in a "
                             "task's own pipeline call before the task is refused (failed "
                             "naming them, dead-lettered).")
    call_stall_timeout: float = Field(300.0, ge=0, description="Seconds a pipeline call may "
                                      "go without a denoising step (the first counted from "
                                      "its start, its end from its last) before it is "
                                      "declared stalled: its tasks are handed back, a "
                                      "pipeline process running it is killed, and a worker "
                                      "whose own process runs it turns unhealthy and pulls "
                                      "nothing more. 0: never.")
    announce_interval: float = Field(2.0, gt=0, description="Seconds between ModelsLoaded.")
    checkpoint_poll: float = Field(30.0, ge=0, le=3600, description="Seconds between checks "
                                   "for a newer committed checkpoint of a run: model when no "
                                   "ckpt.<run>.mirrored event came; 0: events only.")

    @field_validator("pull_clusters", "serve")
    @classmethod
    def _tokens(cls, v: str, info) -> str:  # type: ignore[no-untyped-def]
        subjects.token_list(v, info.field_name)
        return v

    @field_validator("pipeline_cpus")
    @classmethod
    def _cpu_list(cls, v: str) -> str:
        apart.cpu_list(v, "TANDEM_PIPELINE_CPUS")
        return v

    @model_validator(mode="after")
    def _pinned_apart(self) -> WorkerSettings:
        self.pinning()
        return self

    def pinning(self) -> tuple[frozenset[int], frozenset[int]] | None:
        """The pipeline processes' CPUs and the worker's own, when pinned (``apart.pinning``)."""
        return apart.pinning(self.pipeline_cpus, self.pipeline_cpu_count, self.pipeline_process)

    @property
    def clusters(self) -> list[str]:
        return subjects.token_list(self.pull_clusters, "cluster") or [self.cluster]


class _TaskId(msgspec.Struct):
    task_id: str


def _body(data: bytes) -> GenerationTask | None:
    """The task a dead-lettered message holds, or None if it holds none."""
    try:
        return decode(data, GenerationTask)
    except Exception:
        return None


class InferenceWorker(Service):
    name = "inference-worker"
    settings_class = WorkerSettings

    def __init__(self, settings: WorkerSettings) -> None:  # type: ignore[override]
        super().__init__(settings)
        self.s: WorkerSettings = settings
        self.registry = settings.registry
        self.limits = settings.job_limits
        self.seal_key = settings.seal_key
        served = subjects.token_list(settings.serve, "model") or self.registry.names()
        unknown = [m for m in served if m not in self.registry]
        if unknown:
            raise ValueError(f"TANDEM_SERVE names models not in the registry: {unknown}")
        self.served = served
        # Before diffusers is first imported (a pipeline load): what no served model uses.
        leave_out(set().union(*(spec.optional for m in served
                                if (spec := self.registry.get(m)) is not None)))
        # Pinned (TANDEM_PIPELINE_CPUS or _CPU_COUNT): the calls on these CPUs, this
        # process on the rest.
        pinned = settings.pinning()
        self.pipeline_cpus, self.own_cpus = pinned if pinned else (frozenset(), None)
        self.worker_id = subjects.token(settings.worker_id or f"{settings.node}-{os.getpid()}",
                                        "worker id")
        self.pipelines: dict[str, Pipeline] = {}
        self._loading: dict[str, asyncio.Lock] = {}
        self.batcher = Batcher(self.pipeline, max_batch=settings.max_batch,
                               linger=settings.linger, on_step=self._on_step,
                               stall_timeout=settings.call_stall_timeout)
        self._progress: asyncio.Queue[tuple[list[Job], int, int]] = asyncio.Queue()
        self._s3: Any = None
        self._bucket_ready = False
        self.tasks: TypedKV[TaskRecord] | None = None
        self.records: Records | None = None  # the tasks' records (run)
        self.held: dict[str, Held] = {}  # task id -> its record, while this worker holds it
        self.poller: Poller | None = None  # the pull loop over every consumer (run)
        self.steps_run = 0  # denoising steps of every pipeline call, for /healthz
        self.drain: Drain | None = None  # while drained, pull nothing new
        self.failover: Failover | None = None  # other clusters' stranded queues
        self._pulling = False  # ready: served models loaded (preload), consumers made
        self.torch_threads: int | None = None  # set in run when a served model uses torch
        # run: models follow their run's newest good checkpoint (hotswap.py); S3 is set in run.
        self.hotswap = HotSwapper(
            [s for m in served if (s := self.registry.get(m)) is not None], self.pipelines,
            self._loading, device=settings.device, dtype=settings.dtype, s3=None,
            bucket=settings.s3_bucket, poll=settings.checkpoint_poll,
            load_missing=settings.preload, warm=self._warm)

    def streams(self) -> Sequence[Spec]:
        out: list[Spec] = list(core_streams(self.s.stream_replicas))
        for c in self.s.clusters:
            out += [gen_stream(c, self.s.stream_replicas),
                    *gen_consumers(c, self.s.ack_wait, self.s.max_deliver)]
        return out

    @property
    def inflight(self) -> int:
        """Tasks taken and not yet settled."""
        return self.poller.inflight if self.poller is not None else 0

    def ready(self) -> bool:
        """Not until the served models are loaded (with ``preload``) and pulling starts:
        a worker that answered ready while loading would be sent traffic it cannot take.
        Never again once a call hangs in this process (``Batcher.stalled``): it can run
        nothing more, and only a restart frees the accelerator."""
        return self._pulling and self.batcher.stalled is None

    def live(self) -> str | None:
        """A call hung in this process (``Batcher.stalled``): only a restart frees it."""
        stalled = self.batcher.stalled
        return f"a pipeline call stalled in this process: {stalled}" if stalled else None

    def health(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "models_loaded": sorted(self.pipelines),
                "loading": sorted(m for m, lock in self._loading.items() if lock.locked()),
                "inflight": self.inflight, "batches": self.batcher.batches,
                "commit_waiting": self.records.waiting if self.records else 0,
                "pipeline": {**self.batcher.usage.json(), "torch_threads": self._threads(),
                             "processes": {m: p.pid for m, p in self.pipelines.items()
                                           if isinstance(p, apart.ProcessPipeline)},
                             "cpus": sorted(self.pipeline_cpus) or None,
                             "worker_cpus": sorted(self.own_cpus) if self.own_cpus else None},
                "steps_run": self.steps_run, "running": self.batcher.task_ids(),
                "stalled": str(self.batcher.stalled) if self.batcher.stalled else None,
                "checkpoints": self.hotswap.status(), "drained": self._drained(),
                "failover": self.failover.describe() if self.failover else None}

    # ------------------------------------------------------------------------- models

    async def pipeline(self, model: str) -> Pipeline:
        """The loaded pipeline of ``model``, loading it (once, in a thread) if needed."""
        if model in self.pipelines:
            return self.pipelines[model]
        lock = self._loading.setdefault(model, asyncio.Lock())
        async with lock:
            while model not in self.pipelines:
                spec = self.registry.get(model)
                if spec is None:
                    raise ModelLoadError(model, "not in the registry")
                t0 = time.monotonic()
                # A run's model loads from the run's current history (its lineage).
                line = (await self.hotswap.lineage(model) if self.hotswap.serves(model)
                        else None)
                if self.s.pipeline_process and apart.eligible(spec, self.s.fault_injection):
                    pipe = await asyncio.to_thread(apart.ProcessPipeline, spec, self.s.device,
                                                   self.s.dtype, self.s.torch_threads,
                                                   cpus=self.pipeline_cpus,
                                                   fault_injection=self.s.fault_injection,
                                                   stall_timeout=self.s.call_stall_timeout)
                else:  # a thread the process does not wait for if it stops meanwhile
                    pipe = await detached(build, spec, self.s.device, self.s.dtype,
                                          self.s.fault_injection, line)
                try:
                    await self._warm(pipe)
                except Exception as exc:
                    # Logged, not fatal: the registry's default size may be one tasks never
                    # use, and a task's own call reports its own error.
                    _log.error("worker.warm_failed", model=model, max_batch=self.s.max_batch,
                               error=repr(exc))
                if line is not None and pipe.checkpoint_step is not None:
                    # A rollback heard during the load may have abandoned what it loaded:
                    # the history read again, it is served only if it is still of it.
                    now = await self.hotswap.lineage(model)
                    if not now.holds(pipe.checkpoint_step, pipe.checkpoint_lineage):
                        _log.warning("worker.checkpoint_abandoned_while_loading",
                                     model=model, step=pipe.checkpoint_step,
                                     lineage=pipe.checkpoint_lineage, forks=now.json())
                        continue
                self.pipelines[model] = pipe
                _log.info("worker.model_loaded", model=model, source=spec.source,
                          seconds=round(time.monotonic() - t0, 3))
        return self.pipelines[model]

    async def _warm(self, pipe: Pipeline) -> None:
        """A new pipeline's first-call costs, paid between two calls of the running ones,
        so a warm-up never shares the accelerator with a call (``Batcher.warm``: one that
        hangs stalls the worker, as a hung call does)."""
        await self.batcher.warm(pipe, self.s.max_batch)

    # ---------------------------------------------------------------------------- life

    def _torch_here(self) -> list[str]:
        """The served models whose torch calls are made in this process (not apart)."""
        return [m for m in self.served if (spec := self.registry.get(m)) and uses_torch(spec)
                and not (self.s.pipeline_process
                         and apart.eligible(spec, self.s.fault_injection))]

    def _threads(self) -> int | None:
        """The torch threads calls run with: this process's, else its children's."""
        if self.torch_threads is not None:
            return self.torch_threads
        return next((p.threads for p in self.pipelines.values()
                     if isinstance(p, apart.ProcessPipeline) and p.threads is not None), None)

    async def run(self, ctx: Context) -> None:
        if self.own_cpus:
            apart.pin(self.own_cpus)
            # Models whose calls stay in this process (run:) compute on its own CPUs.
            here = self._torch_here()
            _log.info("worker.pinned", pipeline_cpus=sorted(self.pipeline_cpus),
                      worker_cpus=sorted(self.own_cpus), in_worker_models=here)
            if here:
                _log.warning("worker.pinned_in_process", models=here,
                             detail="their calls stay in the worker's process, on the "
                             f"worker's own CPUs {sorted(self.own_cpus)}, not the pinned ones")
        bus = ctx.bus
        self.bus = bus
        self.tasks = await bus.typed(KV_TASKS, TaskRecord)
        # Before the first pull: a task cancelled while this worker was down is known.
        cancels = Cancels(bus, self._on_cancel)
        await cancels.start()
        self.records = Records(self.tasks, cancels, self.seal_key, self.worker_id)
        # Before the first pull: the tasks a dead worker on this host was running.
        self.batcher.ledger = await ledger.start(self.s.calls_dir, self.records.crashed)
        self._s3 = s3_client(self.s, connect_timeout=2.0, read_timeout=30.0)
        self.hotswap.s3 = s3_client(self.s)  # default timeouts: checkpoints are large
        # torch in this process only for calls made here: a worker whose models all run
        # apart leaves it to their children (its start and its memory).
        if self._torch_here():
            self.torch_threads = await asyncio.to_thread(set_threads, self.s.torch_threads)
        await self.hotswap.attach(bus)  # KV runs: the newest committed step of each run
        if self.s.preload:
            for model in self.served:
                if self.hotswap.serves(model):
                    # A run without a good checkpoint yet must not stop the worker: the
                    # hot-swapper loads the first one the checkpointer commits.
                    await self.hotswap.check(model, await self.hotswap.recorded(model))
                else:
                    await self.pipeline(model)

        def consumer(spec: ConsumerSpec) -> Consumer[GenerationTask]:
            return bus.consumer(spec, GenerationTask, fetch_handler=self.handle,
                                on_dead=self.on_dead, explain=self.explain,
                                span_name="gen process")

        consumers = [consumer(spec) for spec in self._consumer_specs()]
        # One loop over every lane (and, on failover, other clusters' lanes, which
        # Failover puts into ``consumers``): tasks up to max_batch + prefetch at a time.
        # The default prefetch holds three calls' worth: the running one, the next one
        # (queued on the compute thread: it starts without waiting for the loop), and the
        # last one's uploads and commits, so the pipeline is fed while those finish.
        # A failing fetch waits from 10 ms up to idle_poll, so a reconnect costs little.
        limit = self.s.max_batch + (self.s.prefetch or 2 * self.s.max_batch)
        self.poller = Poller(consumers, batch=limit, concurrency=limit,
                             idle_poll=self.s.idle_poll, paused=self._paused,
                             backoff=Backoff(0.01, max_delay=self.s.idle_poll),
                             on_stop=self._finish)
        self.drain = Drain(bus, self.s.cluster, self.s.node, on_undrain=self._undrained)
        await self.drain.start()
        self.failover = Failover.for_worker(bus, self.s, consumers, consumer,
                                            drained=self._paused)
        self._pulling = True
        _log.info("worker.started", worker=self.worker_id, serve=self.served,
                  clusters=self.s.clusters, max_batch=self.s.max_batch)
        try:
            async with asyncio.TaskGroup() as tg:
                batcher = tg.create_task(self.batcher.run())
                pump = tg.create_task(self._pump_progress())
                failover = tg.create_task(self.failover.run(ctx.stopping))
                announce = tg.create_task(self._announce(ctx))
                swaps = tg.create_task(self.hotswap.run(bus.nc))
                await self.poller.run(ctx.stopping)
                batcher.cancel()
                pump.cancel()
                failover.cancel()
                announce.cancel()
                swaps.cancel()
        finally:
            await cancels.stop()
            for c in consumers:
                await c.close()
            await self.failover.close()
            await self.drain.stop()
            for pipe in self.pipelines.values():
                await asyncio.to_thread(pipe.close)  # a child process ends with its worker
            if self.batcher.ledger is not None:
                self.batcher.ledger.close()
        _log.info("worker.stopped", batches=self.batcher.batches)

    def _consumer_specs(self) -> list[ConsumerSpec]:
        # Priority order: every cluster's interactive lane, then every batch lane.
        by_cluster = [gen_consumers(c, self.s.ack_wait, self.s.max_deliver)
                      for c in self.s.clusters]
        return [lanes[0] for lanes in by_cluster] + [lanes[1] for lanes in by_cluster]

    async def _finish(self) -> None:
        """Stopping (the pull loop stopped fetching): hand back what waits; let the
        running call finish if it can within most of the drain timeout, else stop it and
        hand its tasks back too."""
        assert self.poller is not None
        self.batcher.close()
        grace = self.s.drain_timeout - min(5.0, 0.3 * self.s.drain_timeout)
        if not await self.poller.idle(grace):
            _log.warning("worker.drain_abort", running=self.batcher.task_ids())
            self.batcher.abort()

    def _drained(self) -> bool:
        return self.drain is not None and self.drain.drained

    def _undrained(self) -> None:
        """The node was undrained: usage counts again, and the loop pulls at once."""
        self.batcher.usage.resume()
        if self.poller is not None:
            self.poller.resume()

    def _paused(self) -> bool:
        """Pull nothing: the node is drained, or a call hangs in this process."""
        return self._drained() or self.batcher.stalled is not None

    async def _announce(self, ctx: Context) -> None:
        """Tell the node's agent which models this worker has loaded (core NATS); without
        ``preload``, every model it serves (it loads one on its first task): the router
        and failover take a cluster's announced models as what it can run."""
        subject = subjects.models(self.s.cluster, self.s.node)
        while True:
            models = self.pipelines if self.s.preload else {*self.pipelines, *self.served}
            event = ModelsLoaded(cluster=self.s.cluster, node=self.s.node,
                                 worker=self.worker_id, models=sorted(models))
            with contextlib.suppress(Exception):
                await ctx.bus.emit(subject, event)
            await asyncio.sleep(self.s.announce_interval)  # periodic announcement

    # ------------------------------------------------------------------------ handling

    async def handle(self, ds: list[Delivery[GenerationTask]]
                     ) -> AsyncIterator[Outcome[GenerationTask]]:
        """Take one fetch of tasks through the steps above; yield each with its outcome
        as it ends (the bus settles it: ``None`` acks it, an exception is settled by the
        ack policy, as if the task's own handler had raised it).

        The fetch is handled as a whole, not a task per message: its tasks are checked
        and claimed in one pass (a read only for those not sealed, side by side), go to
        the batcher together, and each pipeline call's tasks end together, beside the
        other calls' ends: their uploads side by side, their records in one pipelined
        compare-and-set, their acks in one flush. On a bus full of small tasks that is
        what a task costs the worker's one event loop; with a real model, a call's tasks
        end together anyway."""
        assert self.records is not None
        taken: list[tuple[Delivery[GenerationTask], Held]] = []
        unread: list[tuple[Delivery[GenerationTask], Held]] = []
        handed: list[tuple[Delivery[GenerationTask], NotServed]] = []
        for d in ds:
            try:
                held = self._take(d)
            except NotServed as exc:
                handed.append((d, exc))
                continue
            except Exception as exc:
                yield d, exc
                continue
            if held is None:
                yield d, None  # cancelled, or ended by an earlier delivery: never run
            else:
                (taken if held.expect is not None else unread).append((d, held))
        if handed:
            # Noted on each record before its nak, so a task that runs out of deliveries
            # this way fails naming the workers that handed it back (``explain``).
            await asyncio.gather(*(self._hand_back(d, exc) for d, exc in handed))
            for d, exc in handed:
                yield d, exc
        if unread:
            claims = await asyncio.gather(*(self._claim(d, held) for d, held in unread),
                                          return_exceptions=True)
            for (d, _), got in zip(unread, claims, strict=True):
                if isinstance(got, BaseException) or got is None:
                    yield d, got
                else:
                    taken.append((d, got))
        # A job whose call ended, or the outcomes of the tasks of one that was ended.
        events: asyncio.Queue[Job | list[Outcome[GenerationTask]]] = asyncio.Queue()
        running: dict[int, Running] = {}
        ending: set[asyncio.Task[None]] = set()  # each call's end runs on its own
        unsettled = 0  # calls being ended whose outcomes have not come
        try:
            for d, held in taken:
                assert held.expect is not None  # claimed: its record is known
                rec = held.expect[0]  # a task in a dead worker's call runs alone
                run = Running(d, held, self.batcher.enqueue(
                    held.task, rec.crashes, rec.crashes_alone), d.keepalive())
                run.kept.enter()
                self.held[held.task.task_id] = held
                running[id(run.job)] = run
                run.job.future.add_done_callback(lambda _, j=run.job: events.put_nowait(j))
            while running or unsettled:
                got = [await events.get()]
                while not events.empty():
                    got.append(events.get_nowait())
                call = [running.pop(id(x)) for x in got if isinstance(x, Job)]
                if call:
                    end = asyncio.ensure_future(self._end_into(call, events))
                    ending.add(end)
                    end.add_done_callback(ending.discard)
                    unsettled += 1
                for x in got:
                    if not isinstance(x, Job):
                        unsettled -= 1
                        for outcome in x:
                            yield outcome
        finally:
            for end in ending:  # cut short: their tasks are handed back by the bus
                end.cancel()
            for run in running.values():  # never run: handed back by the bus
                run.kept.exit()
                self.batcher.forget(run.job)
                self.held.pop(run.held.task.task_id, None)

    async def _end_into(self, call: list[Running],
                        events: asyncio.Queue[Job | list[Outcome[GenerationTask]]]) -> None:
        """``_end`` for one call's tasks, beside the other calls' ends (a later call's
        uploads never wait for an earlier one's); its outcomes go to ``events``."""
        outcomes: list[Outcome[GenerationTask]] = []
        try:
            outcomes = await self._end(call)
        except Exception as exc:  # not the tasks' own: each is settled by it (a nak)
            outcomes = [(run.d, exc) for run in call]
        finally:
            for run in call:  # held through its upload and commit
                run.kept.exit()
            events.put_nowait(outcomes)  # cancelled: nobody waits for them

    def _take(self, d: Delivery[GenerationTask]) -> Held | None:
        """Step 1 without a read: checked, then claimed (``Records.claim_now``)."""
        assert self.records is not None
        self._check(d)
        if d.event.model not in self.served:
            raise NotServed(f"model {d.event.model!r} is not served by {self.worker_id}")
        # A body that is not the one recorded under its id raises TaskConflict
        # (dead-lettered, never run); None: cancelled, never run.
        return self.records.claim_now(d, self._cluster_of(d))

    async def _hand_back(self, d: Delivery[GenerationTask], exc: Retry) -> None:
        """Note on the task's record that this worker handed it back, and why
        (``tasks.to_handed_back``); best effort: the hand-back itself is the nak."""
        assert self.tasks is not None
        try:
            await self.tasks.update(d.event.task_id, moves.to_handed_back(exc.reason))
        except Exception as err:
            _log.warning("worker.hand_back_note_failed", task_id=d.event.task_id,
                         error=describe(err))

    async def explain(self, msg: Msg, reason: str) -> str:
        """A dead letter's ``reason``, with what the task's record says the bus does not
        know: the workers that handed it back (``tasks.handed_back``), when its
        deliveries ran out."""
        body = _body(msg.data)
        if body is None or self.tasks is None or not reason.startswith("exhausted"):
            return reason
        got = await self.tasks.get(body.task_id)
        note = moves.handed_back(got[0]) if got is not None and got[0].task == body else ""
        return f"{reason}; {note}" if note and note not in reason else reason

    async def _claim(self, d: Delivery[GenerationTask], held: Held) -> Held | None:
        """Step 1 for a task that was not sealed (a redelivery, a bare publish): its
        record read, and created if it has none."""
        assert self.records is not None
        with log.bound(task_id=d.event.task_id, model=d.event.model), d.context():
            got = await self.records.claim(d, held.cluster, held)
        rec = got.expect[0] if got is not None and got.expect is not None else None
        if rec is not None and rec.crashes_alone >= self.s.max_crashes:
            raise Reject(f"{moves.deaths(rec)}: refused after TANDEM_MAX_CRASHES="
                         f"{self.s.max_crashes} in a call of its own")
        return got

    async def _end(self, call: list[Running]) -> list[Outcome[GenerationTask]]:
        """Steps 2 to 4 for tasks whose pipeline call ended (one call, or more that ended
        in one turn): images stored, records moved to ``succeeded`` in one write, and
        each task's outcome for the bus to settle."""
        assert self.records is not None
        out: list[Outcome[GenerationTask]] = []
        made: list[Running] = []
        stalled: list[tuple[Delivery[GenerationTask], Stalled]] = []
        for run in call:
            self.held.pop(run.held.task.task_id, None)
            try:
                run.images = self._images(run)
            except JobCancelled:
                CANCELLED.inc()
                out.append((run.d, None))
                continue
            except Stalled as exc:
                stalled.append((run.d, exc))
                out.append((run.d, exc))
                continue
            except Exception as exc:
                out.append((run.d, exc))
                continue
            made.append(run)
        if stalled:
            # Noted before the nak, so a task that stalls every worker it meets fails
            # saying so when its deliveries run out (``explain``).
            await asyncio.gather(*(self._hand_back(d, exc) for d, exc in stalled))
        if not made:
            return out
        # PNG encoding and upload here, beside the next call: never on the compute thread.
        uploads = [run for run in made if run.images]
        stored: dict[int, list[str] | BaseException] = {}
        if uploads:
            got = await asyncio.gather(*(self._store(run) for run in uploads),
                                       return_exceptions=True)
            stored = {id(run): keys for run, keys in zip(uploads, got, strict=True)}
        ends: list[End] = []
        committing: list[Running] = []
        now = time.time()
        for run in made:
            keys = stored.get(id(run), [])
            if isinstance(keys, BaseException):
                out.append((run.d, keys))
                continue
            run.keys = keys
            if not run.images:
                run.upload = (now, now)  # a no-op task: nothing to store
            pipe = run.job.pipeline  # the one that made the images, even if swapped out
            if run.d.span is not None:
                with run.d.context():
                    self._phases(run)
            else:
                self._phases(run)
            ends.append(End(run.held, keys, pipe.checkpoint if pipe else "",
                            pipe.checkpoint_step if pipe else None, {"generate_s": run.gen_s}))
            committing.append(run)
        succeeded = 0
        cancelled: list[Running] = []
        for run, rec in zip(committing, await self.records.finish(ends), strict=True):
            if isinstance(rec, BaseException):
                out.append((run.d, rec))
                continue
            out.append((run.d, None))
            if rec is not None and rec.state == TaskState.succeeded:
                succeeded += 1
                continue
            CANCELLED.inc()
            if rec is not None and rec.state == TaskState.cancelled:
                # Cancelled while it ran, and the cancel never stopped the call (it came
                # after the last step, or its notice was never written: a gateway that
                # died between the two): the record decides, and no image outlives it.
                cancelled.append(run)
        if cancelled:
            await asyncio.gather(*(self._delete_images(run.held.task.task_id, run.keys)
                                   for run in cancelled))
        SUCCEEDED.inc(succeeded)
        return out

    def _images(self, run: Running) -> list[Any]:
        """What the task's pipeline call made; raises what the bus should settle it by
        (``JobCancelled`` when it was cancelled: acked, never finished)."""
        run.gen_s = round(time.monotonic() - run.job.arrived, 6)
        try:
            return run.job.future.result()
        except CallStalled as exc:
            # Not the task's fault as far as anyone can tell (a hung device, a driver
            # deadlock): handed back at once for another worker, never blamed.
            raise Stalled(f"its pipeline call stalled on {self.worker_id}: made no step "
                          f"for {exc.timeout:g} s (TANDEM_CALL_STALL_TIMEOUT)") from None
        except HandedBack:
            raise Retry("worker stopping; task handed back", delay=0.0) from None
        except apart.PipelineProcessDied as exc:
            # Its call was its own (a call of several is split: batcher), yet the cause
            # may be outside it (the host short of memory): delivered again after the
            # bus's backoff, and failed naming the crash after max_deliver.
            _log.error("worker.pipeline_process_died", task_id=run.held.task.task_id,
                       error=str(exc))
            raise
        except ModelLoadError as exc:
            if exc.lasting:
                raise Reject(str(exc)) from None
            # It may load next time (S3 back, the folder complete): the task is delivered
            # again after a backoff, and fails with this error after max_deliver.
            raise

    async def _store(self, run: Running) -> list[str]:
        """Step 2 for one task: its images in S3."""
        run.upload = (time.time(), 0.0)
        task = run.held.task
        with log.bound(task_id=task.task_id, model=task.model), run.d.context():
            keys = await self._upload(task.task_id, run.images, run.job.pipeline)
        run.upload = (run.upload[0], time.time())
        return keys

    def _phases(self, run: Running) -> None:
        marks = run.job.marks
        marks["taken"] = run.held.taken
        marks["upload_start"], marks["upload_end"] = run.upload
        phases.record(run.held.task, marks, **{"tandem.worker": self.worker_id})

    def _check(self, d: Delivery[GenerationTask]) -> None:
        """Refuse (dead-letter, never run) a task the gateway would have refused, one
        bigger than this worker's pipeline call, or one on another cluster's subject.
        Whatever door a task came in by, this runs before anything else."""
        task = d.event
        problems = check_task(task, self.registry, self.limits)
        if task.num_images > self.s.max_batch:
            problems.append(Problem("num_images", f"at most {self.s.max_batch} images per "
                                    "task on this worker (TANDEM_MAX_BATCH)", task.num_images))
        _, routed, lane = d.subject.split(".", 2)
        if task.cluster and task.cluster != routed:
            problems.append(Problem("cluster", f"task for cluster {task.cluster} published "
                                    f"on {d.subject}", task.cluster))
        if lane != task.lane:
            problems.append(Problem("lane", f"task for lane {task.lane} published on "
                                    f"{d.subject}", task.lane))
        if problems:
            raise InvalidTask(task.task_id, problems)

    def _cluster_of(self, d: Delivery[GenerationTask]) -> str:
        # The stream says whose queue it came from; the task says where it was routed.
        return d.event.cluster or self.s.cluster

    # ---------------------------------------------------------------------------- S3

    async def _upload(self, task_id: str, images: list[Any], pipe: Pipeline | None
                      ) -> list[str]:
        """Store each image as a PNG (``pipe.encode``) under ``images/<task_id>/<i>.png``,
        in a thread of its own; retry while S3 is down. Raises ``ImageUploadError`` when
        it cannot: the task is then not acked (redelivered, or dead-lettered at last)."""
        if not images:
            return []
        task_id = subjects.token(task_id, "task id")
        keys = [f"images/{task_id}/{i}.png" for i in range(len(images))]
        retries = UPLOAD_BACKOFF.retries(within=self.s.upload_retry_for)
        error = ""
        async for attempt in retries:
            try:
                await asyncio.to_thread(self._put_all, keys, images, pipe)
                return keys
            except Exception as exc:
                error = repr(exc)
                if retries.more():
                    _log.warning("worker.upload_retry", attempt=attempt, error=error)
        raise ImageUploadError(task_id, retries.attempt, error)

    async def _delete_images(self, task_id: str, keys: list[str]) -> None:
        """Best effort: a cancelled task's images; what stays is logged, not raised."""
        if not keys:
            return
        try:
            await asyncio.to_thread(self._s3.delete_objects, Bucket=self.s.s3_bucket,
                                    Delete={"Objects": [{"Key": k} for k in keys],
                                            "Quiet": True})
        except Exception as exc:
            _log.warning("worker.cancelled_images_left", task_id=task_id, keys=keys,
                         error=repr(exc))

    def _put_all(self, keys: list[str], images: list[Any], pipe: Pipeline | None) -> None:
        if not self._bucket_ready:
            ensure_bucket(self._s3, self.s.s3_bucket)
            self._bucket_ready = True
        for key, image in zip(keys, images, strict=True):
            png = pipe.encode(image) if pipe is not None else image
            self._s3.put_object(Bucket=self.s.s3_bucket, Key=key, Body=png,
                                ContentType="image/png")

    # ---------------------------------------------------------------------- dead letters

    async def on_dead(self, msg: Msg, reason: str) -> None:
        """A dead-lettered task is ``failed`` with the reason: its own record only (a
        conflicting body under a taken id leaves the owner's record alone), created if the
        task was never recorded (a bare publish), so its publisher can read why."""
        body = _body(msg.data)
        try:
            task_id = body.task_id if body is not None else subjects.token(
                msgspec.json.decode(msg.data, type=_TaskId).task_id, "task id")
        except Exception:
            _log.warning("worker.dead_without_task_id", reason=reason)
            return
        assert self.records is not None
        if body is None:  # undecodable: never a recorded task's body; nothing to end
            _log.warning("worker.dead_undecodable", task_id=task_id, reason=reason)
            return
        await self.records.failed(body, reason)
        FAILED.inc()

    # -------------------------------------------------------------- progress and cancel

    def _on_step(self, jobs: list[Job], step: int, total: int) -> None:
        self.steps_run += 1
        self._progress.put_nowait((jobs, step, total))

    async def _pump_progress(self) -> None:
        """Emit one progress event per step and task (core NATS: SSE and clients follow
        every step). A task that has run for ``progress_kv_interval`` is written
        ``running`` with its progress, then once per interval; a shorter one is not
        written until its end, so it costs one write."""
        assert self.records is not None
        interval = self.s.progress_kv_interval
        while True:
            jobs, step, total = await self._progress.get()
            now = time.monotonic()
            for job in jobs:
                if job.cancelled or job.future.done():
                    continue
                task_id = job.task.task_id
                with contextlib.suppress(Exception):
                    await self.bus.emit(subjects.gen_progress(task_id), GenerationProgress(
                        task_id=task_id, step=step, total=total))
                held = self.held.get(task_id)
                if held is None or step == total:
                    continue  # the last step: its end is written next
                held.run_at = held.run_at or now
                if now - (held.progress_at or held.run_at) < interval:
                    continue
                held.progress_at = now
                try:
                    rec = await self.records.progress(held, step / total)
                except Exception as exc:
                    _log.warning("worker.progress_write_failed", error=describe(exc))
                    continue
                if rec is not None and rec.state == TaskState.cancelled:
                    self.batcher.cancel(task_id)  # its notice may not have come yet

    def _on_cancel(self, task_id: str) -> None:
        """The gateway cancelled ``task_id`` (``Cancels``): stop it if it waits or runs."""
        if self.batcher.cancel(task_id):
            _log.info("worker.cancelled", task_id=task_id)


@dataclass(slots=True, eq=False)
class Running:
    """A task of a fetch (``InferenceWorker.handle``) from its claim to its end."""

    d: Delivery[GenerationTask]
    held: Held
    job: Job
    kept: Any  # its delivery's keep-alive, held while it waits and runs
    images: list[Any] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    gen_s: float = 0.0  # from its batcher entry to its call's end
    upload: tuple[float, float] = (0.0, 0.0)  # wall clock: its upload's start and end


class NotServed(Retry):
    """A task for a model this worker does not serve: handed back (nak after a delay)
    for a worker that does, noted on its record first (``InferenceWorker._hand_back``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, delay=1.0)


class Stalled(Retry):
    """A task whose pipeline call stalled (``CallStalled``): handed back at once (nak),
    noted on its record first, like ``NotServed``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, delay=0.0)


class ImageUploadError(Exception):
    """Images could not be stored in S3 within ``upload_retry_for``."""

    def __init__(self, task_id: str, attempts: int, reason: str) -> None:
        self.task_id = task_id
        self.attempts = attempts
        self.reason = reason
        super().__init__(f"image upload failed after {attempts} attempts: {reason}")


__all__ = ["ImageUploadError", "InferenceWorker", "WorkerSettings"]
