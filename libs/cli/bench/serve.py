"""serving: latency and the bus's cost per task against nats-py, images/s against the bare pipeline.

Starts nats-server, an S3 endpoint (moto), the gateway and inference workers as child
processes on free loopback ports, then, in the same run:

(a) latency: HTTP POST of a no-op task -> its record written ``succeeded`` (p50/p99),
    through the real task path (the ``noop`` model's call makes no images), beside a
    raw nats-py JetStream publish -> fetch -> ack round trip and a bare HTTP round trip
    to the same gateway (the "HTTP hop"); goal: p50 <= 3x (raw + HTTP hop). In the same
    rounds, the submit round trip (request -> accepted record) by each door: HTTP POST
    and the NATS job service's ``tandem.jobs.generate``; goal: NATS <= HTTP. The durable
    writes every stream stored over these rounds, per task, are the whole path's
    (gateway and worker): ``protocol.messages_per_task``, goal <= 3;
(b) protocol (``protocol.py``): no-op tasks drained by one worker through the real path
    against the protocol floor, bare nats-py doing the same durable steps (two fetches
    at once, as the worker holds more than one), in ``--rounds`` rounds interleaved ABAB within the
    run; goal >= 0.95. Beside them, CPU
    per task of client and nats-server (goal <= 50 us for Tandem), durable writes and
    wire messages per task, the worker without its validation (issue 19: the worker's
    drop with it, against the noise of the two sides' own rounds; the floor's the same
    way, as context) and raw fetch + ack (context);
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
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.js.api import RetentionPolicy

from tandem.cli import http
from tandem.cli.bench import protocol, saturation, serve_pipeline, stats
from tandem.cli.bench.children import ServiceProcess, child_env, ms, pct, wait_ready
from tandem.cli.devstack import NatsServer, Process, S3Server, free_port
from tandem.common import fleet, streams, subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import DrainRecord, GenerationTask, TaskRecord, encode
from tandem.common.settings import Settings, load

GOAL_LATENCY = 3.0
GOAL_PROTOCOL = 0.95
GOAL_WRITES = 3.0
GOAL_CPU_US = 50.0
# Proposed for (b) in place of the two goals above (issue 21, item 4): what the worker's
# CPU per task beyond the floor's costs a real task, as a share of the bare pipeline's
# time per digits image at the batched size (the cheapest real image here).
GOAL_SHARE_PCT = 1.0
SMOKE = ("--requests", "3", "--tasks", "200", "--rounds", "1", "--images", "8", "--steps",
         "2", "--batch", "2", "--workers", "1,2", "--worker-tasks", "40", "--worker-images",
         "8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=stats.positive_int, default=300,
                   help="sequential requests for (a)")
    p.add_argument("--tasks", type=stats.positive_int, default=5000,
                   help="no-op tasks per side and round "
                   "of (b)")
    p.add_argument("--rounds", type=stats.positive_int, default=4,
                   help="rounds of (b) per repeat, the sides "
                   "interleaved (A B C D, D C B A, ...); each side's median round is its "
                   "figure, and the spread of its rounds the noise issue 19 is judged by")
    serve_pipeline.add_arguments(p)
    stats.add_repeat(p, 3, what="repeats, each a whole run of (a) to (e)")


class Bench:
    """One run's servers and children (nats-server, S3, gateway, workers), the successes
    its observer saw (``on_result``: when, and by which worker) and the moves every part
    shares (``prefill``, ``drain_rate``, ``health``, ``hold``); ``serve_pipeline``'s parts
    take it too."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.root = root
        self.args = args
        self.nats = NatsServer(name="bench", log_path=root / "nats.log", store_dir=root / "js")
        self.s3 = S3Server(name="s3", log_path=root / "s3.log")
        self.procs: list[Process] = []
        self.results: dict[str, float] = {}
        self.result_worker: dict[str, str] = {}  # task -> the worker of its success
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

    async def worker(self, name: str, cluster: str, module: str = "tandem.inference_worker",
                     **values: str) -> Process:
        """A worker ``name`` (its node too, unless ``values`` names one), once its models
        are loaded; its /healthz URL in ``healthz`` (a held worker is loaded but pulls
        nothing). ``module``: what runs it (the bench's ``unchecked_worker`` for the
        cost of validation)."""
        env = self.env(**{"cluster": cluster, "node": name, "worker_id": name, **values})
        p = self.spawn(name, module, env)
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
        rec = moves.succeeded(msg.data)
        if rec is None:
            return
        task_id = msg.subject.rsplit(".", 1)[-1]
        at = time.perf_counter()
        self.results[task_id] = at
        self.result_worker[task_id] = rec.worker
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

    async def health(self, name: str) -> dict[str, Any]:
        """Worker ``name``'s /healthz."""
        got = await asyncio.to_thread(http.get_json, self.healthz[name], timeout=10.0)
        if not isinstance(got, dict):
            raise RuntimeError(f"{name}: no /healthz answer")
        return got

    async def hold(self, bus: Bus, cluster: str, node: str, names: list[str],
                   reason: str) -> None:
        """Drain ``node``, and return once each running worker of ``names`` on it says it
        is drained (/healthz): from then on it fetches nothing (what a fetch already
        waiting returns is handed back), so a queue can be filled and its counters read
        before it is let go."""
        await fleet.drain(bus, cluster, node, reason=reason)
        deadline = time.monotonic() + 30
        for name in names:
            while not (await self.health(name)).get("drained"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: not drained 30 s after its node's drain")
                await asyncio.sleep(0.02)  # polling the worker's /healthz for the drain

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


# ------------------------------------------------------------------------------- the run


async def _latency(b: Bench, bus: Bus, n: int) -> dict[str, Any]:
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

    writes0 = await protocol.stored(bus)
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
    # Two tasks a round (one by each door), each to its end through gateway and worker.
    writes = (await protocol.stored(bus) - writes0) / (2 * (n + 20))
    raw = (await _raw_round_trips(bus, n + 20))[20:]
    p50 = pct(tandem, 0.5)
    bound = GOAL_LATENCY * (pct(raw, 0.5) + pct(hop, 0.5))
    door_ratio = pct(nats_submit, 0.5) / pct(http_submit, 0.5)
    return {"requests": n, "tandem": ms(tandem), "raw_round_trip": ms(raw),
            "http_hop": ms(hop), "goal_p50_ms": round(bound * 1000, 3),
            "ratio_to_raw_plus_hop": round(p50 / (bound / GOAL_LATENCY), 3),
            "meets_goal": p50 <= bound, "writes_per_task": round(writes, 3),
            # Submit round trip (request -> accepted record) by each door, same rounds.
            "doors": {"http_submit": ms(http_submit), "nats_submit": ms(nats_submit),
                      "ratio": round(door_ratio, 3), "meets_goal": door_ratio <= 1.0}}


async def _held_worker(b: Bench, bus: Bus, cluster: str,
                       module: str = "tandem.inference_worker") -> tuple[Process, protocol.Held]:
    """A no-op worker on a cluster of its own, held from its start: its node is drained
    before it starts, so it pulls nothing until a round releases it."""
    node = f"w-{cluster}"
    await bus.provision([streams.gen_stream(cluster), *streams.gen_consumers(cluster)])
    held = protocol.Held(bus, cluster, node, "")
    await (await bus.typed(streams.KV_DRAINS, DrainRecord)).put(
        held.key, DrainRecord(cluster=cluster, node=node, reason="bench: held"))
    w = await b.worker(node, cluster, module, serve="noop", max_batch=protocol.TANDEM_BATCH)
    held.health_url = b.healthz[node]
    return w, held


async def _protocol(b: Bench, bus: Bus, n: int, rounds: int) -> dict[str, Any]:
    """(b): the sides of ``protocol.py``, interleaved over ``rounds``, then raw once."""
    w, held = await _held_worker(b, bus, "tput")
    wx, heldx = await _held_worker(b, bus, "tputx", "tandem.cli.bench.unchecked_worker")
    sides = {
        "tandem": lambda r: protocol.tandem_round(bus, b.nats, w, held, n, b.prefill),
        "tandem_unchecked": lambda r: protocol.tandem_round(bus, b.nats, wx, heldx, n,
                                                            b.prefill),
        "floor": lambda r: protocol.floor_round(bus, b.nats, n, b.seal_key, True, b.prefill),
        "floor_unchecked": lambda r: protocol.floor_round(bus, b.nats, n, b.seal_key, False,
                                                          b.prefill),
    }
    got = protocol.summary(await stats.interleaved(rounds, sides))
    w.stop(10)
    wx.stop(10)
    got["raw"] = await protocol.raw_round(bus, b.nats, n)
    got["overheads"] = await protocol.overheads()
    got["validation"]["check_task_us"] = got["overheads"]["check_task"]
    return {"tasks": n, "rounds": rounds, **got}


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
    for part, key in (("latency", "ratio_to_raw_plus_hop"), ("protocol", "ratio"),
                      ("pipeline", "ratio_b8"), ("batching", "ratio")):
        result[part] = stats.median_run(runs, lambda x, p=part, k=key: x[p][k])[part]
    result["workers"] = stats.median_run(
        runs, lambda x: x["workers"]["digits"]["scaling"][max(x["workers"]["digits"][
            "scaling"], key=int)])["workers"]
    result["validation"] = _validation([x["protocol"] for x in runs])
    result["figures"] = fj
    result["ok"] = True  # goals are reported, not enforced: see figures' met
    return result


def _figures(runs: list[dict[str, Any]]) -> list[stats.Figure]:
    """Each part as a figure over the runs; a goal not met says why, measured."""
    lat = [x["latency"] for x in runs]
    pro = [x["protocol"] for x in runs]
    latency = stats.Figure(
        "latency", "(a) no-op HTTP in -> result out, p50", "ms",
        [a["tandem"]["p50_ms"] for a in lat],
        [a["raw_round_trip"]["p50_ms"] + a["http_hop"]["p50_ms"] for a in lat],
        "raw JS round trip + HTTP hop", ratio=[a["ratio_to_raw_plus_hop"] for a in lat],
        goal=stats.Goal("<=", GOAL_LATENCY))
    doors = stats.Figure(
        "doors", "(a) submit round trip p50: NATS job service against HTTP", "ms",
        [a["doors"]["nats_submit"]["p50_ms"] for a in lat],
        [a["doors"]["http_submit"]["p50_ms"] for a in lat], "HTTP POST /v1/generations",
        ratio=[a["doors"]["ratio"] for a in lat], goal=stats.Goal("<=", 1.0))
    sides = [x["sides"] for x in pro]
    ratio = stats.Figure(
        "protocol", "(b) no-op tasks drained by one worker, real path", "tasks/s",
        [s["tandem"]["per_s"] for s in sides], [s["floor"]["per_s"] for s in sides],
        "protocol floor: bare nats-py, same durable steps", ratio=[x["ratio"] for x in pro],
        goal=stats.Goal(">=", GOAL_PROTOCOL), digits=1)
    writes = stats.Figure(
        "protocol_messages", "(a) durable writes per task, gateway and worker", "writes",
        [x["messages_per_task"] for x in pro], goal=stats.Goal("<=", GOAL_WRITES, on="tandem"),
        notes=[f"the worker's share: {x['worker_writes_per_task']:g} writes and "
               f"{x['worker_wire_per_task']:g} wire messages per task (floor "
               f"{x['sides']['floor']['wire_per_task']:g}, raw fetch + ack "
               f"{x['raw']['wire_per_task']:g})" for x in pro[:1]])
    cpu = stats.Figure(
        "protocol_cpu", "(b) CPU per no-op task, worker + nats-server", "us",
        [x["cpu_us_per_task"] for x in pro], [s["floor"]["cpu_us"] for s in sides],
        "protocol floor, client + nats-server", goal=stats.Goal("<=", GOAL_CPU_US, on="tandem"),
        digits=1)
    share = _share_figure(runs)
    val = [x["validation"] for x in pro]
    validation = stats.Figure(
        "validation", "(b) no-op tasks/s of the worker with its validation against without",
        "tasks/s", [v["checked_per_s"] for v in val], [v["unchecked_per_s"] for v in val],
        "the same worker without its task checks", digits=1,
        notes=[_validation_line(_validation(pro))])
    raw = stats.Figure(
        "protocol_raw", "(b) the same worker against raw fetch + ack (context)", "tasks/s",
        [s["tandem"]["per_s"] for s in sides], [x["raw"]["per_s"] for x in pro],
        "raw fetch + ack, no record", digits=1)
    median = stats.median_run(pro, lambda x: x["ratio"])
    if ratio.met is False or cpu.met is False:
        why = saturation.per_task(median["sides"], median["raw"], GOAL_CPU_US,
                                  median["overheads"])
        if ratio.met is False:
            t = median["sides"]["tandem"]
            ratio.why = saturation.why(
                {"cores": {"inference worker": t["client_cores"]},
                 "cpus": os.cpu_count() or 1, "machine_busy_cores": None}, extra=why)
        if cpu.met is False:
            cpu.why = "; ".join(why)
    if latency.met is False:
        latency.why = saturation.why(stats.median_run(
            runs, lambda x: x["latency"]["ratio_to_raw_plus_hop"])["round_cpu"],
            loop="bench process") + " (over the whole run, every part)"
    return [latency, doors, ratio, writes, cpu, share, validation, raw,
            *serve_pipeline.figures(runs, runs[0]["pipeline"]["batch"])]


def _share_figure(runs: list[dict[str, Any]]) -> stats.Figure:
    """(b)'s proposed measure, in percent: the worker's CPU per no-op task (client +
    nats-server) beyond the protocol floor's, against the bare pipeline's wall time per
    digits image at the batched size, both from the same repeat."""
    batch = runs[0]["pipeline"]["batch"]
    extra = [x["protocol"]["cpu_us_per_task"] - x["protocol"]["sides"]["floor"]["cpu_us"]
             for x in runs]
    image = [x["pipeline"]["models"]["digits"][f"b{batch}"]["bare"]["wall_per_image_ms"] * 1e3
             for x in runs]
    return stats.Figure(
        "protocol_share", f"(b) the worker's CPU per task beyond the floor's, as a share of "
        f"one digits image (bare pipeline, batch {batch})", "%",
        [e / i * 100 for e, i in zip(extra, image, strict=True)],
        goal=stats.Goal("<=", GOAL_SHARE_PCT, on="tandem"), digits=4,
        notes=["proposed in place of (b)'s rate and CPU goals (issue 21, item 4): what "
               "the bus's extra work costs the cheapest real task here",
               f"beyond the floor {[round(e, 1) for e in extra]} us a task, a digits image "
               f"{[round(i, 1) for i in image]} us (each repeat)"])


async def _once(args: argparse.Namespace, r: int) -> dict[str, Any]:
    from tandem.common import log

    log.configure("auto", "warning", stream=sys.stderr)  # stdout: the result
    serve_pipeline.check(args)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-serve-") as tmp:
        b = Bench(Path(tmp), args)
        b.nats.start()
        b.s3.start()
        try:
            bus = await Bus.connect(load(Settings, nats_url=b.nats.url), "bench")
            await bus.provision(streams.core_streams())
            # Results of (a) and (c)-(e) as they are written; (b) has its own observer, so
            # this process does nothing for the writes of the floor it measures.
            sub = await bus.nc.subscribe(subjects.TASK_RECORD.wildcard, cb=_sync(b.on_result))
            latency = await _latency(b, bus, args.requests)
            await sub.unsubscribe()
            proto = await _protocol(b, bus, args.tasks, args.rounds)
            proto["messages_per_task"] = latency["writes_per_task"]
            sub = await bus.nc.subscribe(subjects.TASK_RECORD.wildcard, cb=_sync(b.on_result))
            result = {
                "latency": latency, "protocol": proto,
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


def _validation(pro: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 19's verdict, one statistic for the JSON, the table and the text: the median
    over the repeats of the worker's drop with its validation, against the median of the
    noise (each repeat's larger spread of the two sides' own rounds); None without a
    spread. ``floor``: the same over the floor's pair, as context."""
    def judged(val: list[dict[str, Any]]) -> dict[str, Any]:
        drop = statistics.median(v["drop"] for v in val)
        noise = (None if val[0]["noise"] is None
                 else statistics.median(v["noise"] for v in val))
        return {"drop": round(drop, 4), "noise": None if noise is None else round(noise, 4),
                "within_noise": None if noise is None else drop <= noise}

    val = [x["validation"] for x in pro]
    return {**judged(val), "floor": judged([v["floor"] for v in val]),
            "check_task_us": statistics.median(v["check_task_us"] for v in val)}


def _validation_line(v: dict[str, Any]) -> str:
    def verdict(x: dict[str, Any], whose: str) -> str:
        return (f"against a noise of {x['noise']:.1%} (the spread of {whose} own rounds): "
                f"{'within' if x['within_noise'] else 'NOT within'} the noise"
                if x["noise"] is not None else "against no noise (one round: no spread)")

    f = v["floor"]
    return (f"the worker drops {v['drop']:.1%} with its validation, "
            f"{verdict(v, 'its two sides')}; the protocol floor {f['drop']:.1%} "
            f"{verdict(f, 'the floor sides')}; check_task costs {v['check_task_us']:g} us "
            "a task (medians of the repeats)")


def _share_line(r: dict[str, Any]) -> str:
    f = r["figures"]["protocol_share"]
    return (f"the worker's CPU per task beyond the floor's is {f['tandem']['median']:g}% "
            f"of a digits image in the bare pipeline (proposed goal <= {GOAL_SHARE_PCT:g}%; "
            f"{f['notes'][1]})")


def render(r: dict[str, Any]) -> str:
    a, t = r["latency"], r["protocol"]
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
        f"    durable writes per task, gateway + worker: {t['messages_per_task']:g} "
        f"(goal <= {GOAL_WRITES:g})",
        f"(b) protocol: {t['tasks']} queued no-op tasks per side and round, {t['rounds']} "
        "rounds interleaved; each side's median round",
        *(f"    {side:15s} {x['per_s']:>10,.1f}/s   CPU/task client {x['client_us']:6.1f} us"
          f" + nats-server {x['server_us']:5.1f} us   writes/task {x['writes_per_task']:g}"
          f"   wire msgs/task {x['wire_per_task']:g}"
          for side, x in [*t["sides"].items(), ("raw fetch+ack", t["raw"])]),
        f"    tandem / floor = {t['ratio']:.3f} (goal >= {GOAL_PROTOCOL:g})   CPU per task "
        f"{t['cpu_us_per_task']:g} us (goal <= {GOAL_CPU_US:g})",
        f"    beyond the floor: {_share_line(r)}",
        f"    validation: {_validation_line(r['validation'])}",
        *serve_pipeline.render(r),
    ])
