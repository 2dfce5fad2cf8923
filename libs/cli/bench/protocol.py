"""The serve bench's protocol part: what the bus costs a task, Tandem's worker against
the protocol floor, in the same run.

Each side drains ``n`` no-op tasks that were recorded and enqueued first, as the gateway
does (a ``queued`` record, then the task sealed with its revision):

- **tandem**: the inference worker, a child process, through the real task path (claim,
  the batcher's call of the ``noop`` model, the final compare-and-set, the ack). It is
  held between rounds by draining its node (KV ``drains``), so the tasks are all queued
  before it pulls one; released, it drains them.
- **floor**: bare nats-py in this process doing the same durable steps and nothing else
  (no poller, batcher, tracing, metrics, retries): fetch 64 (the bus's ``Pull``, one
  inbox and one timer per fetch: the cheapest fetch nats-py allows), per task decode it,
  check it as the worker does (``jobs.check_task``), check the seal (no read) and the
  cancel notices, write the record ``succeeded`` by compare-and-set at the sealed
  revision, pipelined on one reply inbox; wait for those acks; ack the tasks. Two
  fetches are handled at once (``FLOOR_OVERLAP``): the next is taken while one waits on
  its writes, as the worker holds more than a call's worth of tasks.
- **tandem_unchecked**: the same worker with its task checks left out
  (``unchecked_worker``: ``check_task``, the per-call image cap, the subject checks),
  held and released the same way on a cluster of its own: issue 19's cost of
  validating on the worker is **tandem** against it. Nothing in the worker as shipped
  can turn its checks off; this one exists only in the bench.
- **floor_unchecked**: the floor without ``check_task`` and the subject checks: the same
  pair on the bare protocol, where the checks are a larger share of a task.
- **raw**: fetch + ack of as many plain messages (no record, no seal): context only.

Every rate is ``n`` over one window counted the same way on both sides: from the moment
the first task was taken (the records' ``started_at``; the floor's first fetch) to the
moment the n-th success was written, as seen by one observer process for both
(``seen.py``: its work is neither side's). CPU per task is the side's client process
(``/proc`` of the worker; this process for the floor) plus nats-server over the drain.
Durable writes are counted by the streams themselves (the sum of their last sequences),
wire messages by the worker connection's counters (``/connz``; the floor's ``nc.stats``).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from nats.js.api import RetentionPolicy

from tandem.cli import http
from tandem.cli.bench.children import child_env
from tandem.cli.devstack import NatsServer, Process
from tandem.common import streams, subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus, delivered_count, synced
from tandem.common.bus.pull import Pull
from tandem.common.events import DrainRecord, GenerationTask, TaskRecord, decode, encode
from tandem.common.jobs import JobLimits, check_task
from tandem.common.models import Registry

FETCH = 64  # the floor's fetch; the worker's call takes up to 64 (TANDEM_BATCH)
# Fetches the floor handles at once: the next is taken while one waits on its writes,
# as the worker holds more than one call's worth (64 + its prefetch of 128). One at a
# time was 3-27% slower on 2 cores; three at once no faster than two (0.9-1.1x).
FLOOR_OVERLAP = 2
TANDEM_BATCH = "64"


def noop_tasks(n: int, cluster: str) -> list[GenerationTask]:
    return [GenerationTask(task_id=uuid.uuid4().hex, model="noop", noop=True, steps=1,
                           cluster=cluster) for _ in range(n)]


async def stored(bus: Bus, but: tuple[str, ...] = ()) -> int:
    """Messages ever stored by every stream (KV buckets too) but those named in ``but``:
    the sum of their last sequences."""
    return sum(si.state.last_seq for si in await bus.js.streams_info()
               if si.config.name not in but)


def wire_messages(nats: NatsServer, name: str) -> int:
    """Messages in and out of the connection named ``name`` (nats-server's ``/connz``)."""
    connz = http.get_json(f"http://127.0.0.1:{nats.monitor_port}/connz?limit=4096", timeout=5)
    for c in (connz or {}).get("connections", []):
        if c.get("name") == name:
            return int(c["in_msgs"]) + int(c["out_msgs"])
    raise RuntimeError(f"no connection named {name} on nats-server")


class Seen:
    """The observer child (``seen.py``): ``at()`` is the wall-clock time at which it saw
    the n-th success written."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n = url, n
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Seen:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tandem.cli.bench.seen", self.url, str(self.n),
            stdout=asyncio.subprocess.PIPE, env=child_env())
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), 60)
        if line.strip() != b"ready":
            raise RuntimeError(f"bench observer did not start: {line!r}")
        return self

    async def at(self, timeout: float = 600) -> float:
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise RuntimeError("bench observer exited before the last success")
        return float(line)

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


class Held:
    """The Tandem worker held between rounds: its node drained (KV ``drains``), so it
    pulls nothing while a round's tasks are enqueued."""

    def __init__(self, bus: Bus, cluster: str, node: str, health_url: str) -> None:
        self.bus, self.cluster, self.node = bus, cluster, node
        self.health_url = health_url
        self.key = subjects.node_key(cluster, node)

    async def hold(self) -> None:
        """Drain the node, then wait until the worker says it is drained and none of its
        fetches is still waiting on the server (one that returned later would hand its
        tasks back, and their redelivery would read their records)."""
        drains = await self.bus.typed(streams.KV_DRAINS, DrainRecord)
        await drains.put(self.key, DrainRecord(cluster=self.cluster, node=self.node,
                                               reason="bench: between rounds"))
        deadline = time.monotonic() + 60
        while True:
            health = await asyncio.to_thread(http.get_json, self.health_url)
            waiting = 0
            for spec in streams.gen_consumers(self.cluster):
                info = await self.bus.js.consumer_info(spec.stream, spec.durable)
                waiting += info.num_waiting or 0
            if health and health.get("drained") and not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.node} never held: {health}")
            await asyncio.sleep(0.05)  # polling the worker's /healthz and its consumers

    async def release(self) -> None:
        await (await self.bus.kv(streams.KV_DRAINS)).delete(self.key)

    async def settled(self) -> None:
        """Until the worker has acked every task it took (its consumers hold none)."""
        deadline = time.monotonic() + 60
        while True:
            left = 0
            for spec in streams.gen_consumers(self.cluster):
                info = await self.bus.js.consumer_info(spec.stream, spec.durable)
                left += (info.num_pending or 0) + (info.num_ack_pending or 0)
            if not left:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.node} left {left} tasks unacked")
            await asyncio.sleep(0.01)  # polling the consumers' own counts


async def tandem_round(bus: Bus, nats: NatsServer, worker: Process, held: Held, n: int,
                       prefill: Callable[[Bus, str, list[GenerationTask]], Any]
                       ) -> dict[str, float]:
    """One drain of ``n`` tasks by the held worker."""
    tasks = noop_tasks(n, held.cluster)
    await held.hold()
    await prefill(bus, held.cluster, tasks)
    name = f"tandem-inference-worker-{held.cluster}-{held.node}"
    async with Seen(nats.url, n) as seen:
        # The bench's own hold and release of the worker (KV drains) are not the task's.
        drains = (f"KV_{streams.KV_DRAINS}",)
        writes0, wire0 = await stored(bus, drains), wire_messages(nats, name)
        cpu0 = (worker.cpu_seconds(), nats.cpu_seconds())
        await held.release()
        end = await seen.at()
        await held.settled()
        cpu1 = (worker.cpu_seconds(), nats.cpu_seconds())
        writes1, wire1 = await stored(bus, drains), wire_messages(nats, name)
    # The first fetch takes the oldest tasks: the earliest start is among them.
    kv = await bus.typed(streams.KV_TASKS, TaskRecord)
    starts = [got[0].started_at for t in tasks[:2 * FETCH]
              if (got := await kv.get(t.task_id)) is not None and got[0].started_at]
    return _side(n, min(starts), end, cpu0, cpu1, writes1 - writes0, wire1 - wire0)


async def floor_round(bus: Bus, nats: NatsServer, n: int, seal_key: bytes, check: bool,
                      prefill: Callable[[Bus, str, list[GenerationTask]], Any],
                      overlap: int = FLOOR_OVERLAP) -> dict[str, float]:
    """One drain of ``n`` tasks by the protocol floor (``check``: with validation;
    ``overlap``: fetches handled at once)."""
    import nats as nats_py

    cluster = "floor" if check else "floorx"
    spec = streams.ConsumerSpec(subjects.gen_stream_name(cluster), "floor",
                                max_ack_pending=100_000)
    await bus.provision([streams.gen_stream(cluster), spec])
    await prefill(bus, cluster, noop_tasks(n, cluster))
    nc = await nats_py.connect(nats.url, name="tandem-bench-floor")
    try:
        async with Seen(nats.url, n) as seen:
            writes0, wire0 = await stored(bus), nc.stats["in_msgs"] + nc.stats["out_msgs"]
            cpu0 = (time.process_time(), nats.cpu_seconds())
            first = await _floor_drain(nc, spec, n, seal_key, check, overlap)
            end = await seen.at()
            cpu1 = (time.process_time(), nats.cpu_seconds())
            writes1 = await stored(bus)
            wire1 = nc.stats["in_msgs"] + nc.stats["out_msgs"]
    finally:
        await nc.close()
    return _side(n, first, end, cpu0, cpu1, writes1 - writes0, wire1 - wire0)


async def _floor_drain(nc: Any, spec: streams.ConsumerSpec, n: int, seal_key: bytes,
                       check: bool, overlap: int) -> float:
    """The floor's loop; returns the wall-clock time its first fetch returned.
    ``overlap``: fetches handled at once (1: fetch, write, wait, ack, then the next
    fetch; 2: the next fetch is taken while one is handled)."""
    registry, limits = Registry.parse(""), JobLimits()
    cancelled: dict[str, float] = {}  # the worker's cancel notices (none come here)
    kv_prefix, inbox = f"$KV.{streams.KV_TASKS}.", nc.new_inbox()
    loop = asyncio.get_running_loop()
    waiting: dict[str, list[Any]] = {}  # round -> [acks left, future]

    async def on_ack(msg: Any) -> None:
        entry = waiting.get(msg.subject.rsplit(".", 2)[1])
        if entry is None or entry[1].done():
            return
        if b'"error"' in msg.data:  # never expected: each write is the first since queued
            entry[1].set_exception(RuntimeError(f"floor: a write was refused: {msg.data!r}"))
            return
        entry[0] -= 1
        if entry[0] == 0:
            entry[1].set_result(None)

    async def handle(msgs: list[Any], key: str, started: float) -> None:
        entry = waiting[key] = [len(msgs), loop.create_future()]
        for i, msg in enumerate(msgs):
            task = decode(msg.data, GenerationTask)
            if check:
                _, routed, lane = msg.subject.split(".", 2)
                if (check_task(task, registry, limits) or task.num_images > FETCH
                        or task.cluster != routed or task.lane != lane):
                    raise RuntimeError(f"floor: task {task.task_id} is invalid")
            sealed = (moves.as_sealed(task, msg.data, msg.headers or {}, seal_key)
                      if delivered_count(msg) == 1 else None)
            if sealed is None or task.task_id in cancelled:
                raise RuntimeError(f"floor: task {task.task_id} is not sealed as queued")
            rec, rev = sealed
            end = moves.to_succeeded([], cluster=task.cluster, worker="floor", attempt=1,
                                     started_at=started)(rec)
            await nc.publish(kv_prefix + task.task_id, encode(end),
                             reply=f"{inbox}.{key}.{i}",
                             headers={"Nats-Expected-Last-Subject-Sequence": str(rev)})
        await asyncio.wait_for(entry[1], 10)
        del waiting[key]
        for msg in msgs:
            await msg.ack()

    acks = await nc.subscribe(f"{inbox}.*.*", cb=on_ack)
    pull = await Pull.open(nc, "$JS.API", spec.stream, spec.durable)
    room = asyncio.Semaphore(overlap)
    handling: set[asyncio.Task[None]] = set()
    got = rounds = 0
    first = 0.0
    try:
        while got < n:
            await room.acquire()
            for t in [t for t in handling if t.done()]:
                handling.discard(t)
                t.result()  # a failed fetch's handling stops the floor
            msgs = await pull.fetch(FETCH, 5.0)
            if not msgs:
                raise RuntimeError(f"floor: the queue ran dry after {got} of {n} tasks")
            first = first or time.time()
            rounds += 1
            got += len(msgs)
            t = asyncio.ensure_future(handle(msgs, str(rounds), first))
            t.add_done_callback(lambda _: room.release())
            handling.add(t)
        for t in handling:
            await t
    finally:
        for t in handling:
            t.cancel()
        await pull.close()
        with contextlib.suppress(Exception):
            await acks.unsubscribe()
    return first


async def raw_round(bus: Bus, nats: NatsServer, n: int) -> dict[str, float]:
    """Fetch + ack of ``n`` plain messages (no record, no seal), the same fetch."""
    import nats as nats_py

    spec = streams.StreamSpec("BENCH_RAW", ("bench.raw",), retention=RetentionPolicy.WORK_QUEUE)
    consumer = streams.ConsumerSpec(spec.name, "raw", max_ack_pending=100_000)
    await bus.provision([spec, consumer])
    payload = encode(GenerationTask(task_id="t", model="noop"))
    for i in range(0, n, 256):
        await bus.send([("bench.raw", payload, None)] * min(256, n - i), timeout=30)
    nc = await nats_py.connect(nats.url, name="tandem-bench-raw")
    pull = await Pull.open(nc, "$JS.API", spec.name, consumer.durable)
    try:
        wire0 = nc.stats["in_msgs"] + nc.stats["out_msgs"]
        cpu0 = (time.process_time(), nats.cpu_seconds())
        t0, got = time.time(), 0
        while got < n:
            msgs = await pull.fetch(FETCH, 5.0)
            for msg in msgs:
                await msg.ack()
            got += len(msgs)
        await synced(nc)  # the acks reached the server (flush alone may not say so)
        end = time.time()
        cpu1 = (time.process_time(), nats.cpu_seconds())
        wire1 = nc.stats["in_msgs"] + nc.stats["out_msgs"]
    finally:
        await pull.close()
        await nc.close()
        await bus.js.delete_stream(spec.name)
    return _side(n, t0, end, cpu0, cpu1, 0, wire1 - wire0)


def _side(n: int, start: float, end: float, cpu0: tuple[float, float],
          cpu1: tuple[float, float], writes: int, wire: int) -> dict[str, float]:
    client, server = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return {"per_s": round(n / max(end - start, 1e-9), 1), "wall_s": round(end - start, 4),
            "client_us": round(client / n * 1e6, 1), "server_us": round(server / n * 1e6, 1),
            "cpu_us": round((client + server) / n * 1e6, 1),
            "client_cores": round(client / max(end - start, 1e-9), 3),
            "writes_per_task": round(writes / n, 3), "wire_per_task": round(wire / n, 3)}


def summary(rounds: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Each side's median over its rounds, and the figures made of them."""
    med = {side: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
           for side, runs in rounds.items()}
    t, f = med["tandem"], med["floor"]

    def noise(side: str) -> float:  # spread of a side's own rounds, relative to its median
        rates = [r["per_s"] for r in rounds[side]]
        return (max(rates) - min(rates)) / statistics.median(rates)

    def validation(checked: str, unchecked: str) -> dict[str, Any]:
        """What the checks cost ``checked`` against the same side without them: the drop
        of its rate, against the larger spread of the two sides' own rounds (one round
        has no spread to judge the drop against: no noise, no verdict)."""
        drop = 1 - med[checked]["per_s"] / med[unchecked]["per_s"]
        spread = (max(noise(checked), noise(unchecked)) if len(rounds[checked]) > 1
                  else None)
        return {"checked_per_s": med[checked]["per_s"],
                "unchecked_per_s": med[unchecked]["per_s"], "drop": round(drop, 4),
                "noise": None if spread is None else round(spread, 4),
                "within_noise": None if spread is None else drop <= spread}

    return {
        "ratio": round(t["per_s"] / f["per_s"], 3),
        "cpu_us_per_task": t["cpu_us"],
        "worker_writes_per_task": t["writes_per_task"],
        "worker_wire_per_task": t["wire_per_task"],
        "sides": med, "per_round": rounds,
        # Issue 19: the worker's throughput with its checks against the same worker
        # without them; beside it, the same pair on the floor (the checks are a larger
        # share of a task there: the floor does nothing else).
        "validation": {**validation("tandem", "tandem_unchecked"),
                       "floor": validation("floor", "floor_unchecked")},
    }


def check_task_us(repeat: int = 20_000) -> float:
    """CPU microseconds of one ``check_task`` of a no-op task, as the worker calls it."""
    return _us_per_call(lambda: check_task(TASK, REGISTRY, LIMITS), repeat)


TASK = GenerationTask(task_id="t" * 32, model="noop", noop=True, steps=1, cluster="c")
REGISTRY, LIMITS = Registry.parse(""), JobLimits()


def _us_per_call(fn: Callable[[], object], repeat: int) -> float:
    t0 = time.process_time()
    for _ in range(repeat):
        fn()
    return round((time.process_time() - t0) / repeat * 1e6, 2)


async def overheads(repeat: int = 20_000) -> dict[str, float]:
    """CPU microseconds a task costs the worker, this process measured, for each thing
    it does per task that the floor does not: what explains the gap between them.

    - ``metrics``: the histogram observations of a task (its phases, five at most; the
      call's time and size are observed once per call) and its ack counter;
    - ``keepalive``: holding its message for in-progress acks while it waits and runs;
    - ``job``: its batcher job, the job's future and the callback that queues it for its
      call's end (the worker handles a fetch at a time, as the floor does: no task,
      log or trace context of its own per message since 21d5d4a).
    """
    from tandem.common import metrics
    from tandem.common.bus import Consumer, Delivery
    from tandem.inference_worker.batcher import Job

    phases = [("bench", 0.001)] * 5
    counter = metrics.CONSUMED.labels("bench", "bench")

    def observe() -> None:
        metrics.PHASE_SECONDS.observe_many(phases)
        counter.inc()

    # A consumer that never fetches: its keeper holds what the worker's deliveries do.
    spec = streams.ConsumerSpec("BENCH", "bench", ack_wait=3600)
    consumer: Consumer[GenerationTask] = Consumer(None, spec, GenerationTask,  # type: ignore[arg-type]
                                                  fetch_handler=_no_fetch)
    delivery = Delivery(TASK, object(), consumer)  # type: ignore[arg-type]

    def kept() -> None:
        hold = delivery.keepalive()
        hold.enter()
        hold.exit()

    loop = asyncio.get_running_loop()
    keep_us = _us_per_call(kept, repeat)
    await consumer.close()
    t0 = time.process_time()
    ended: asyncio.Queue[Job] = asyncio.Queue()
    for _ in range(repeat // 64):
        jobs = [Job(TASK, loop.create_future()) for _ in range(64)]
        for job in jobs:
            job.future.add_done_callback(lambda _, j=job: ended.put_nowait(j))
        for job in jobs:
            job.resolve([])
        await asyncio.sleep(0)  # the callbacks run
        while not ended.empty():
            ended.get_nowait()
    job_us = (time.process_time() - t0) / (repeat // 64 * 64) * 1e6
    return {"metrics": _us_per_call(observe, repeat), "keepalive": keep_us,
            "job": round(job_us, 2), "check_task": check_task_us(repeat)}


async def _no_fetch(ds: list[Any]) -> Any:  # a consumer's handler that is never called
    for d in ds:
        yield d, None
