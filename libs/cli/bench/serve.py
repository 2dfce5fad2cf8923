"""serving: latency and task throughput against raw nats-py, images/s against the bare pipeline.

Starts nats-server, an S3 endpoint (moto), the gateway and inference workers as child
processes on free loopback ports, then, in the same run:

(a) latency: HTTP POST of a no-op task -> its ``gen.result`` arrives (p50/p99), beside
    a raw nats-py JetStream publish -> fetch -> ack round trip and a bare HTTP round
    trip to the same gateway (the "HTTP hop"); goal: p50 <= 3x (raw + HTTP hop). In the
    same rounds, the submit round trip (request -> accepted record) by each door: HTTP
    POST and the NATS job service's ``tandem.jobs.generate``; goal: NATS <= HTTP;
(b) throughput: a pre-filled queue of no-op tasks drained by one worker (first result
    -> last result) beside raw fetch + ack of the same number of messages; goal >= 0.5.
    Beside both, the protocol floor: bare nats-py taking the same durable steps per task
    as the worker (fetch, compare-and-set the record, publish the result once, wait for
    both acks, ack), and the CPU each side cost the worker (or the bench) and nats-server
    per task: how much of the gap is Tandem's code, how much the steps themselves;
(c) pipeline, (d) batching, (e) workers: the compute side, against the bare pipeline
    in a plain loop, batch 8 against batch 1, and 1, 2 and 4 workers on one stream
    (``serve_pipeline`` says how each is measured).

Each of ``--repeat`` repeats is one such run (its own servers), which measures every
part's Tandem side beside its baseline; ``figures`` give each part's min/median/max over
the repeats, goals judged on the median, and each part's section is its median repeat's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from nats.js.api import RetentionPolicy

from tandem.cli.bench import saturation, serve_pipeline, stats
from tandem.cli.bench.children import ServiceProcess, child_env, ms, pct, wait_ready
from tandem.cli.devstack import NatsServer, Process, S3Server, free_port
from tandem.common import streams, subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import (
    GenerationResult,
    GenerationTask,
    TaskRecord,
    TaskState,
    decode,
    encode,
)
from tandem.common.settings import Settings, load

GOAL_LATENCY = 3.0
GOAL_THROUGHPUT = 0.5
SMOKE = ("--requests", "3", "--tasks", "40", "--images", "4", "--steps", "2", "--batch", "2",
         "--workers", "1,2", "--worker-tasks", "40", "--worker-images", "8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=300, help="sequential requests for (a)")
    p.add_argument("--tasks", type=int, default=2000, help="no-op tasks for (b)")
    serve_pipeline.add_arguments(p)
    stats.add_repeat(p, 3, what="repeats, each a whole run of (a) to (e)")


class _Bench:
    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.root = root
        self.args = args
        self.nats = NatsServer(name="bench", log_path=root / "nats.log", store_dir=root / "js")
        self.s3 = S3Server(name="s3", log_path=root / "s3.log")
        self.procs: list[Process] = []
        self.results: dict[str, float] = {}
        self.result_worker: dict[str, str] = {}  # task -> the worker of its result
        self.track_workers = False  # decode results for their worker (costs the bench)
        self.healthz: dict[str, str] = {}  # worker name -> its /healthz URL
        self.procs_by_name: dict[str, Process] = {}
        self.waiters: dict[str, asyncio.Future[float]] = {}
        self.seal_key = secrets.token_hex(16).encode()  # the gateway's and the workers'

    def env(self, **values: str) -> dict[str, str]:
        base = {"nats_url": self.nats.url, "s3_endpoint": self.s3.url, "s3_bucket": "bench",
                "s3_access_key": "tandem", "s3_secret_key": "tandem", "log_level": "warning",
                "log_format": "json", "metrics_port": str(free_port()),
                "task_seal_key": self.seal_key.decode()}
        return child_env(**{**base, **values})

    def spawn(self, name: str, module: str, env: dict[str, str]) -> Process:
        p = ServiceProcess(name=name, log_path=self.root / f"{name}.log").start(module, env)
        self.procs.append(p)
        self.procs_by_name[name] = p
        return p

    async def worker(self, name: str, cluster: str, **values: str) -> Process:
        """A worker ``name`` (its node too, unless ``values`` names one), once ready."""
        env = self.env(**{"cluster": cluster, "node": name, "worker_id": name, **values})
        p = self.spawn(name, "tandem.inference_worker", env)
        self.healthz[name] = f"http://127.0.0.1:{env['TANDEM_METRICS_PORT']}/healthz"
        await wait_ready(self.healthz[name], p,
                         lambda h: h.get("status") == "ok" and h.get("models_loaded"))
        return p

    def stop(self) -> None:
        for p in self.procs:
            p.stop(5)
        self.s3.stop()
        self.nats.stop()

    def on_result(self, msg: Any) -> None:
        task_id = msg.subject.rsplit(".", 1)[-1]
        at = time.perf_counter()
        self.results[task_id] = at
        if self.track_workers:
            self.result_worker[task_id] = decode(msg.data, GenerationResult).worker
        fut = self.waiters.pop(task_id, None)
        if fut is not None and not fut.done():
            fut.set_result(at)

    async def prefill(self, bus: Bus, cluster: str, tasks: list[GenerationTask]) -> None:
        """Record and enqueue ``tasks`` as the gateway would, before any worker pulls."""
        await bus.provision([streams.gen_stream(cluster)])
        kv = await bus.typed(streams.KV_TASKS, TaskRecord)
        revisions = await asyncio.gather(*(kv.create(t.task_id, moves.queued(t, cluster))
                                           for t in tasks))
        sent = []
        for t, rev in zip(tasks, revisions, strict=True):
            data = encode(t)
            sent.append((subjects.gen(cluster, t.lane), data,
                         bus.headers(t.task_id, moves.seal(self.seal_key, rev, data))))
        for i in range(0, len(sent), 256):
            await bus.send(sent[i:i + 256])

    async def drain_rate(self, ids: list[str], per: int, timeout: float = 600,
                         batch: int = 1) -> float:
        """Items/s from the first result to the last of ``ids`` (each worth ``per``).

        Results come a batch at a time, so the window from the first batch's results to
        the last's holds the work of every batch but the first: ``len(ids) - batch``
        tasks, whole batches (counting ``len(ids) - 1`` would credit the window with the
        first batch's other tasks too)."""
        loop = asyncio.get_running_loop()
        pending = [i for i in ids if i not in self.results]
        futs = []
        for i in pending:
            self.waiters[i] = loop.create_future()
            futs.append(self.waiters[i])
        await asyncio.wait_for(asyncio.gather(*futs), timeout)
        stamps = sorted(self.results[i] for i in ids)
        return (len(ids) - batch) * per / (stamps[-1] - stamps[0])


class _Meter:
    """CPU seconds a side's client (a process, or this one) and nats-server used while
    it drained: per task, in microseconds."""

    def __init__(self, server: Process, client: Process | None = None) -> None:
        self.server, self.client = server, client
        self.used: dict[str, float] = {}

    def _now(self) -> tuple[float, float]:
        client = self.client.cpu_seconds() if self.client else time.process_time()
        return client, self.server.cpu_seconds()

    def start(self) -> None:
        self._t0 = self._now()

    def stop(self, n: int) -> None:
        (c0, s0), (c1, s1) = self._t0, self._now()
        self.used = {"client_us": round((c1 - c0) / n * 1e6, 1),
                     "server_us": round((s1 - s0) / n * 1e6, 1)}


# ------------------------------------------------------------------------------- raw sides


async def _raw_round_trips(bus: Bus, n: int) -> list[float]:
    spec = streams.StreamSpec("BENCH_RT", ("bench.rt",), retention=RetentionPolicy.WORK_QUEUE)
    consumer = streams.ConsumerSpec(spec.name, "rt")
    await bus.provision([spec, consumer])
    sub = await bus.js.pull_subscribe_bind(durable="rt", stream=spec.name)
    out = []
    payload = encode(GenerationTask(task_id="t", model="noop"))
    for _ in range(n):
        t0 = time.perf_counter()
        await bus.js.publish("bench.rt", payload)
        [msg] = await sub.fetch(1, timeout=5)
        await msg.ack()
        out.append(time.perf_counter() - t0)
    await sub.unsubscribe()
    await bus.js.delete_stream(spec.name)
    return out


async def _raw_fetch_ack(bus: Bus, n: int, meter: _Meter) -> float:
    spec = streams.StreamSpec("BENCH_TP", ("bench.tp",), retention=RetentionPolicy.WORK_QUEUE)
    consumer = streams.ConsumerSpec(spec.name, "tp", max_ack_pending=100_000)
    await bus.provision([spec, consumer])
    payload = encode(GenerationTask(task_id="t", model="noop"))
    for i in range(0, n, 256):
        futs = [await bus.js.publish_async("bench.tp", payload) for _ in range(min(256, n - i))]
        await asyncio.gather(*futs)
    sub = await bus.js.pull_subscribe_bind(durable="tp", stream=spec.name)
    got = 0
    meter.start()
    t0 = time.perf_counter()
    while got < n:
        for msg in await sub.fetch(64, timeout=5):
            await msg.ack()
            got += 1
    rate = n / (time.perf_counter() - t0)
    meter.stop(n)
    await sub.unsubscribe()
    await bus.js.delete_stream(spec.name)
    return rate


async def _floor(b: _Bench, bus: Bus, n: int, meter: _Meter) -> float:
    """No-op tasks/s through the bare protocol: per task what the worker must do on the
    wire, in plain nats-py, with nothing else (no tracing, metrics, retries or checks).

    Fetch 64; per task, decode it, check the gateway's seal (``tasks.seal``: the record
    at that revision is the one created for this very body, so no read is needed) and
    compare-and-set the record to succeeded at the sealed revision
    (``Nats-Expected-Last-Subject-Sequence``); wait for those acks; publish each result,
    once only (expected last sequence 0); wait for those acks; ack the tasks.
    Publishes are pipelined on one reply inbox (cheaper than ``publish_async``'s future
    per message), so this is the most a nats-py client can get out of these steps.
    """
    cluster = "floor"
    tasks = [GenerationTask(task_id=uuid.uuid4().hex, model="noop", noop=True, steps=1,
                            cluster=cluster) for _ in range(n)]
    await b.prefill(bus, cluster, tasks)
    spec = streams.ConsumerSpec(subjects.gen_stream_name(cluster), "floor",
                                max_ack_pending=100_000)
    await bus.provision([spec])
    sub = await bus.js.pull_subscribe_bind(durable="floor", stream=spec.stream)
    nc, kv_prefix, inbox = bus.nc, f"$KV.{streams.KV_TASKS}.", bus.nc.new_inbox()
    loop = asyncio.get_running_loop()
    waiting: dict[str, list[Any]] = {}  # round -> [acks left, future]

    async def on_ack(msg: Any) -> None:
        key = msg.subject.rsplit(".", 2)[1]
        entry = waiting[key]
        if entry[1].done():
            return
        if b'"error"' in msg.data:  # never expected: every write is the first since queued
            entry[1].set_exception(RuntimeError(f"floor: a write was refused: {msg.data!r}"))
            return
        entry[0] -= 1
        if entry[0] == 0:
            entry[1].set_result(None)

    acks = await nc.subscribe(f"{inbox}.*.*", cb=on_ack)

    async def send(key: str, items: list[tuple[str, bytes, dict[str, str] | None]]) -> None:
        entry = waiting[key] = [len(items), loop.create_future()]
        for i, (subject, data, headers) in enumerate(items):
            await nc.publish(subject, data, reply=f"{inbox}.{key}.{i}", headers=headers)
        await asyncio.wait_for(entry[1], 5)
        del waiting[key]

    got = rounds = 0
    meter.start()
    t0 = time.perf_counter()
    while got < n:
        msgs = await sub.fetch(64, timeout=5)
        records, results = [], []
        rounds += 1
        for msg in msgs:
            task = decode(msg.data, GenerationTask)
            sealed = msg.headers[moves.RECORD_SEAL]
            rev = sealed.partition(".")[0]
            if moves.seal(b.seal_key, int(rev), msg.data) != {moves.RECORD_SEAL: sealed}:
                raise RuntimeError(f"floor: task {task.task_id} is not sealed by the bench")
            record = encode(TaskRecord(task=task, state=TaskState.succeeded, cluster=cluster,
                                       created_at=task.submitted_at, updated_at=time.time()))
            records.append((f"{kv_prefix}{task.task_id}", record,
                            {"Nats-Expected-Last-Subject-Sequence": rev}))
            result = encode(GenerationResult(task_id=task.task_id, images=[], cluster=cluster))
            results.append((subjects.gen_result(task.task_id), result,
                            {"Nats-Expected-Last-Subject-Sequence": "0"}))
        await send(f"r{rounds}", records)
        await send(f"e{rounds}", results)
        for msg in msgs:
            await msg.ack()
        got += len(msgs)
    rate = n / (time.perf_counter() - t0)
    meter.stop(n)
    await acks.unsubscribe()
    await sub.unsubscribe()
    return rate


# ------------------------------------------------------------------------------- the run


async def _latency(b: _Bench, bus: Bus, n: int) -> dict[str, Any]:
    import httpx

    gw_port = free_port()
    # No cluster agents here: static routing (the fleet's is measured by bench failover).
    gw = b.spawn("gateway", "tandem.gateway", b.env(http_port=str(gw_port), clusters="lat",
                                                    cluster="lat", routing="static"))
    base = f"http://127.0.0.1:{gw_port}"
    await wait_ready(f"{base}/healthz", gw)
    await b.worker("w-lat", "lat", serve="noop")
    loop = asyncio.get_running_loop()
    tandem, hop, http_submit, nats_submit = [], [], [], []

    async def result_of(task_id: str) -> float:
        if task_id in b.results:
            return b.results[task_id]
        fut: asyncio.Future[float] = loop.create_future()
        b.waiters[task_id] = fut
        return await asyncio.wait_for(fut, 30)

    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        for i in range(n + 20):  # the first 20 warm up connections and caches
            t0 = time.perf_counter()
            await http.get("/healthz")
            t1 = time.perf_counter()
            r = await http.post("/v1/generations", json={"model": "noop"})
            t2 = time.perf_counter()
            done = await result_of(r.json()["id"])
            # The other door, in the same round: the job service's generate on NATS.
            t3 = time.perf_counter()
            reply = await bus.nc.request(subjects.jobs("generate"), b'{"model":"noop"}',
                                         timeout=30)
            t4 = time.perf_counter()
            await result_of(json.loads(reply.data)["id"])
            if i >= 20:
                hop.append(t1 - t0)
                tandem.append(done - t1)
                http_submit.append(t2 - t1)
                nats_submit.append(t4 - t3)
    raw = (await _raw_round_trips(bus, n + 20))[20:]
    p50 = pct(tandem, 0.5)
    bound = GOAL_LATENCY * (pct(raw, 0.5) + pct(hop, 0.5))
    door_ratio = pct(nats_submit, 0.5) / pct(http_submit, 0.5)
    return {"requests": n, "tandem": ms(tandem), "raw_round_trip": ms(raw),
            "http_hop": ms(hop), "goal_p50_ms": round(bound * 1000, 3),
            "ratio_to_raw_plus_hop": round(p50 / (bound / GOAL_LATENCY), 3),
            "meets_goal": p50 <= bound,
            # Submit round trip (request -> accepted record) by each door, same rounds.
            "doors": {"http_submit": ms(http_submit), "nats_submit": ms(nats_submit),
                      "ratio": round(door_ratio, 3), "meets_goal": door_ratio <= 1.0}}


async def _throughput(b: _Bench, bus: Bus, n: int) -> dict[str, Any]:
    tasks = [GenerationTask(task_id=uuid.uuid4().hex, model="noop", noop=True, steps=1,
                            cluster="tput") for _ in range(n)]
    await b.prefill(bus, "tput", tasks)
    w = await b.worker("w-tput", "tput", serve="noop", max_batch="64")
    meters = {"tandem": _Meter(b.nats, w), "floor": _Meter(b.nats), "raw": _Meter(b.nats)}
    meters["tandem"].start()
    tandem = await b.drain_rate([t.task_id for t in tasks], 1)
    meters["tandem"].stop(n)
    floor = await _floor(b, bus, n, meters["floor"])
    raw = await _raw_fetch_ack(bus, n, meters["raw"])
    cpu = {side: m.used for side, m in meters.items()}
    return {"tasks": n, "tandem_per_s": round(tandem, 1), "raw_per_s": round(raw, 1),
            "ratio": round(tandem / raw, 3), "meets_goal": tandem / raw >= GOAL_THROUGHPUT,
            "floor_per_s": round(floor, 1), "floor_ratio": round(floor / raw, 3),
            "tandem_to_floor": round(tandem / floor, 3), "cpu_per_task": cpu}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` runs of ``_once``; each part's section is its median run's."""
    async def once(r: int) -> dict[str, Any]:
        meter = saturation.Meter({"bench process": saturation.this_process}).start()
        got = await _once(args, r)
        got["round_cpu"] = meter.stop().json()
        return got

    runs = await stats.repeated(args.repeat, once)
    figures = _figures(runs)
    fj = stats.figures_json(figures)
    result: dict[str, Any] = {"repeat": args.repeat, "cpus": os.cpu_count()}
    for part, key in (("latency", "ratio_to_raw_plus_hop"), ("throughput", "ratio"),
                      ("pipeline", "ratio_b8"), ("batching", "ratio")):
        result[part] = stats.median_run(runs, lambda x, p=part, k=key: x[p][k])[part]
    result["workers"] = stats.median_run(
        runs, lambda x: x["workers"]["digits"]["scaling"][max(x["workers"]["digits"][
            "scaling"], key=int)])["workers"]
    result["figures"] = fj
    result["ok"] = True  # goals are reported, not enforced: see figures' met
    return result


def _figures(runs: list[dict[str, Any]]) -> list[stats.Figure]:
    """Each part as a figure over the runs; a goal not met says what was saturated."""
    lat = [x["latency"] for x in runs]
    tput = [x["throughput"] for x in runs]
    latency = stats.Figure(
        "latency", "(a) no-op HTTP in -> result out, p50", "ms",
        [a["tandem"]["p50_ms"] for a in lat],
        [a["raw_round_trip"]["p50_ms"] + a["http_hop"]["p50_ms"] for a in lat],
        "raw JS round trip + HTTP hop", ratio=[a["ratio_to_raw_plus_hop"] for a in lat],
        goal=stats.Goal("<=", GOAL_LATENCY))
    throughput = stats.Figure(
        "throughput", "(b) no-op tasks drained by one worker", "tasks/s",
        [t["tandem_per_s"] for t in tput], [t["raw_per_s"] for t in tput], "raw fetch + ack",
        ratio=[t["ratio"] for t in tput], goal=stats.Goal(">=", GOAL_THROUGHPUT), digits=1)
    floor = stats.Figure(
        "throughput_to_floor", "(b) against the protocol floor", "tasks/s",
        [t["tandem_per_s"] for t in tput], [t["floor_per_s"] for t in tput],
        "bare nats-py, same durable steps", ratio=[t["tandem_to_floor"] for t in tput],
        digits=1)
    if throughput.met is False:
        t = stats.median_run(tput, lambda x: x["ratio"])
        per_task = t["cpu_per_task"]
        # CPU per task times tasks per second: the cores each process used while draining.
        cores = {"inference worker": per_task["tandem"]["client_us"] * 1e-6 * t["tandem_per_s"],
                 "nats-server": per_task["tandem"]["server_us"] * 1e-6 * t["tandem_per_s"]}
        raw = per_task["raw"]
        throughput.why = saturation.why(
            {"cores": cores, "cpus": os.cpu_count() or 1, "machine_busy_cores": None},
            extra=[f"CPU per task: worker {per_task['tandem']['client_us']} us + nats-server "
                   f"{per_task['tandem']['server_us']} us, raw {raw['client_us']} us + "
                   f"{raw['server_us']} us"])
    if latency.met is False:
        latency.why = saturation.why(stats.median_run(
            runs, lambda x: x["latency"]["ratio_to_raw_plus_hop"])["round_cpu"],
            loop="bench process") + " (over the whole run, every part)"
    doors = stats.Figure(
        "doors", "(a) submit round trip p50: NATS job service against HTTP", "ms",
        [a["doors"]["nats_submit"]["p50_ms"] for a in lat],
        [a["doors"]["http_submit"]["p50_ms"] for a in lat], "HTTP POST /v1/generations",
        ratio=[a["doors"]["ratio"] for a in lat], goal=stats.Goal("<=", 1.0))
    return [latency, doors, throughput, floor,
            *serve_pipeline.figures(runs, runs[0]["pipeline"]["batch"])]


async def _once(args: argparse.Namespace, r: int) -> dict[str, Any]:
    from tandem.common import log

    log.configure("console", "warning", stream=sys.stderr)  # stdout: the result
    serve_pipeline.check(args)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-serve-") as tmp:
        b = _Bench(Path(tmp), args)
        b.nats.start()
        b.s3.start()
        try:
            bus = await Bus.connect(load(Settings, nats_url=b.nats.url), "bench")
            await bus.provision(streams.core_streams())
            sub = await bus.nc.subscribe(subjects.GEN_RESULT.wildcard, cb=_sync(b.on_result))
            result = {
                "latency": await _latency(b, bus, args.requests),
                "throughput": await _throughput(b, bus, args.tasks),
                **await serve_pipeline.measure(b, bus, args, r),
                "cpus": os.cpu_count(),
            }
            await sub.unsubscribe()
            await bus.drain()
        finally:
            b.stop()
    return result


def _sync(fn: Any) -> Any:
    async def cb(msg: Any) -> None:
        fn(msg)

    return cb


def render(r: dict[str, Any]) -> str:
    a, t = r["latency"], r["throughput"]
    yes = {True: "yes", False: "NO"}
    return "\n".join([
        f"tandem bench serve ({r['cpus']} CPUs); each part: its median of "
        f"{r.get('repeat', 1)} runs",
        f"(a) no-op latency, HTTP in -> result out, {a['requests']} sequential requests",
        f"    tandem        p50 {a['tandem']['p50_ms']:8.3f} ms   "
        f"p99 {a['tandem']['p99_ms']:8.3f} ms",
        f"    raw JS rtt    p50 {a['raw_round_trip']['p50_ms']:8.3f} ms   "
        f"p99 {a['raw_round_trip']['p99_ms']:8.3f} ms   (publish -> fetch -> ack)",
        f"    HTTP hop      p50 {a['http_hop']['p50_ms']:8.3f} ms   "
        f"p99 {a['http_hop']['p99_ms']:8.3f} ms",
        f"    p50 / (raw + hop) = {a['ratio_to_raw_plus_hop']:.2f}x  "
        f"(goal <= 3x, {a['goal_p50_ms']:.3f} ms)  meets goal: {yes[a['meets_goal']]}",
        f"    submit round trip p50: job service (NATS) "
        f"{a['doors']['nats_submit']['p50_ms']:.3f} ms, HTTP "
        f"{a['doors']['http_submit']['p50_ms']:.3f} ms: ratio {a['doors']['ratio']:.3f} "
        f"(goal <= 1)  meets goal: {yes[a['doors']['meets_goal']]}",
        f"(b) no-op throughput, {t['tasks']} queued tasks",
        f"    tandem {t['tandem_per_s']:>10,.1f}/s   raw fetch+ack {t['raw_per_s']:>10,.1f}/s   "
        f"ratio {t['ratio']:.3f}  (goal >= 0.5)  meets goal: {yes[t['meets_goal']]}",
        f"    protocol floor (bare nats-py, same durable steps) {t['floor_per_s']:,.1f}/s: "
        f"{t['floor_ratio']:.3f} of raw; tandem is {t['tandem_to_floor']:.3f} of the floor",
        *(f"    CPU per task, {side:6s}  client {c['client_us']:6.1f} us   "
          f"nats-server {c['server_us']:6.1f} us" for side, c in t["cpu_per_task"].items()),
        *serve_pipeline.render(r),
    ])
