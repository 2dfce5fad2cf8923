"""scale: a simulated fleet on the leaf-node topology, and what each cost grows with.

For each fleet size (default 10, 100 and 1,000 nodes of 8 simulated GPUs, 1 Hz), a fresh
production topology on loopback: a control-plane JetStream cluster (``--hub-size``
servers, domain ``hub``) holding every stream and KV bucket, one leaf-node server per
GPU cluster (``--clusters``, default 4). Behind each leaf: that cluster's simulated
nodes (``tandem.cli.bench.simfleet``: real ``NodeAgent``s multiplexed, at most
``--nodes-per-proc`` per process) and an inference worker serving the no-op model; on
the hub: one gateway. Then:

1. steady window (``--seconds``): no-op tasks offered at ``--task-rate``/s through the
   gateway's HTTP API (not pinned: the gateway routes). Measured: telemetry and
   heartbeats delivered (stored in the hub) against offered, NATS servers' CPU (from
   /proc) and memory (RSS), JetStream API requests/s, bytes in per node, the gateway's
   routing decision time (its ``tandem_gateway_routing_seconds`` histogram, p50/p99
   interpolated within buckets), task end-to-end latency (POST sent -> ``succeeded``
   result seen), the work-queue and KV-watch backlogs at the start and end;
2. burst (``--burst-seconds``): as many no-op tasks as ``--burst-conns`` connections get
   accepted: tasks/s through one gateway process, and their latency.

Also, in the bench process, a ``ClusterBoard`` over the live fleet (what the gateway's
router reads): the cost of the routing input read as per-cluster summaries against
building the whole fleet view.

There is no raw baseline (no raw nats-py fleet to set beside it): each figure is judged
against its goal only, on the median of ``--repeat`` runs of every size (default 1: one
run of the three sizes takes minutes). A telemetry or burst goal not met says what was
saturated in that window (each process's CPU from /proc, the machine's busy cores).

One module past 600 lines on purpose: the fleet it starts and the two windows it
measures share one set of readings; the fleet's nodes (``simfleet``), the load it offers
(``load``), the servers (``tandem.cli.topology``) and the figures and report it prints
(``scale_report``) are elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.cli import http
from tandem.cli.bench import saturation, stats
from tandem.cli.bench.children import ServiceProcess, child_env, ms, wait_ready
from tandem.cli.bench.load import HeartbeatLag, Http, Tasks
from tandem.cli.bench.scale_report import (  # noqa: F401 - render: the bench's printer
    GOAL_DELIVERED,
    GOAL_TASKS_PER_S,
    figures,
    largest_ratio,
    render,
)
from tandem.cli.devstack import NatsServer, Process, free_port
from tandem.cli.topology import Topology

# No worker drains the queue when the gateway is measured alone, so its backlog cap (10,000
# by default) would be hit within seconds and turn the rest of the burst into cheap 429s.
BACKLOG_UNCAPPED = 10_000_000
SMOKE = ("--sizes", "4", "--clusters", "2", "--hub-size", "1", "--seconds", "2",
         "--burst-seconds", "1", "--burst-conns", "4", "--task-rate", "20")


def _sizes(text: str) -> str:
    """``--sizes``: comma-separated whole numbers, each at least 1."""
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not parts or not all(s.isdigit() and int(s) >= 1 for s in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated whole numbers, "
                                         "each at least 1")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=_sizes, default="10,100,1000",
                   help="fleet sizes, in nodes")
    p.add_argument("--gpus", type=stats.positive_int, default=8, help="simulated GPUs per node")
    p.add_argument("--clusters", type=stats.positive_int, default=4,
                   help="GPU clusters (leaf servers)")
    p.add_argument("--interval", type=stats.positive_float, default=1.0,
                   help="agent sample interval, s")
    p.add_argument("--seconds", type=stats.positive_float, default=20.0, help="steady window, s")
    p.add_argument("--task-rate", type=stats.positive_float, default=100.0,
                   help="no-op tasks/s offered in the steady window")
    p.add_argument("--burst-seconds", type=stats.positive_float, default=10.0,
                   help="burst window, s")
    p.add_argument("--burst-conns", type=stats.positive_int, default=64,
                   help="connections in the burst")
    p.add_argument("--hub-size", type=stats.positive_int, default=3,
                   help="control-plane nats-servers")
    p.add_argument("--nodes-per-proc", type=stats.positive_int, default=250,
                   help="most simulated nodes per agent process")
    stats.add_repeat(p, 1, what="runs of every size (no baseline: goals only)")
    p.add_argument("--root", type=Path, default=None,
                   help="keep servers' and processes' logs here (default: a temp folder)")


# ----------------------------------------------------------------------------- measuring


def proc_rss(pid: int) -> int:
    """Resident memory of a process in bytes, from /proc/<pid>/status."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def histogram(metrics_text: str, name: str) -> list[tuple[float, float]]:
    """``(le, cumulative count)`` of a Prometheus histogram in exposition text."""
    out = []
    prefix = f"{name}_bucket{{"
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            labels, value = line[len(prefix):].rsplit("}", 1)
            le = labels.split('le="', 1)[1].split('"', 1)[0]
            out.append((math.inf if le == "+Inf" else float(le), float(value)))
    return sorted(out)


def bucket_quantile(before: list[tuple[float, float]], after: list[tuple[float, float]],
                    q: float) -> float | None:
    """Quantile ``q`` of the observations between two histogram readings, interpolated
    linearly within its bucket (as Prometheus' histogram_quantile does)."""
    old = dict(before)
    counts = [(le, c - old.get(le, 0.0)) for le, c in after]
    if not counts or counts[-1][1] <= 0:
        return None
    rank = q * counts[-1][1]
    lower, below = 0.0, 0.0
    for le, cum in counts:
        if cum >= rank:
            if math.isinf(le):
                return lower
            inside = cum - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, cum
    return None


class _Fleet:
    """One fleet size: topology, gateway, workers and simulated nodes, then measured."""

    def __init__(self, root: Path, nodes: int, args: argparse.Namespace) -> None:
        self.root, self.nodes, self.args = root, nodes, args
        self.clusters = [f"c{i}" for i in range(args.clusters)]
        self.topo = Topology(root / "nats", self.clusters, hub_size=args.hub_size)
        self.procs: dict[str, tuple[Process, int]] = {}  # name -> (process, metrics port)
        self.specs: dict[str, tuple[str, str | None, dict[str, str]]] = {}
        self.restarts: dict[str, int] = {}  # processes that died starting, restarted once
        self.gateway_port = free_port()

    def spawn(self, name: str, module: str, cluster: str | None, **values: str) -> None:
        self.specs[name] = (module, cluster, values)
        port = free_port()
        base = {"s3_endpoint": "http://127.0.0.1:9", "s3_access_key": "x", "s3_secret_key": "x",
                "log_level": "warning", "log_format": "json", "metrics_port": str(port),
                "cluster": cluster or "control", **self.topo.env_for(cluster)}
        p = ServiceProcess(name=name, log_path=self.root / f"{name}.log").start(
            module, child_env(**{**base, **values}))
        self.procs[name] = (p, port)

    def split(self) -> dict[str, list[tuple[int, int]]]:
        """Per cluster, the (first node index, node count) of each agent process."""
        per = [self.nodes // len(self.clusters) + (i < self.nodes % len(self.clusters))
               for i in range(len(self.clusters))]
        out: dict[str, list[tuple[int, int]]] = {}
        for cluster, n in zip(self.clusters, per, strict=True):
            step = self.args.nodes_per_proc
            out[cluster] = [(i, min(step, n - i)) for i in range(0, n, step)]
        return out

    async def start(self) -> None:
        a = self.args
        self.topo.start()
        self.spawn("gateway", "tandem.gateway", None, http_port=str(self.gateway_port),
                   clusters=",".join(self.clusters))
        for c in self.clusters:
            self.spawn(f"worker-{c}", "tandem.inference_worker", c, node="w0", serve="noop",
                       worker_id=f"w-{c}", max_batch="64")
        await self._ready("gateway", None, url=f"http://127.0.0.1:{self.gateway_port}/healthz")
        for c in self.clusters:
            await self._ready(f"worker-{c}", lambda h: bool(h.get("models_loaded")))
        for c, chunks in self.split().items():
            for j, (first, count) in enumerate(chunks):
                self.spawn(f"agents-{c}-{j}", "tandem.cli.bench.simfleet", c,
                           fleet_nodes=str(count), fleet_first=str(first), fleet_prefix="n",
                           sim_gpus=str(a.gpus), sim_load="0.9", agent_interval=str(a.interval))
        for name in self.agent_procs():
            await self._ready(name, lambda h: bool(h.get("started")), timeout=300)

    async def _ready(self, name: str, pred: Any, url: str | None = None,
                     timeout: float = 120) -> None:
        proc, port = self.procs[name]
        try:
            await wait_ready(url or f"http://127.0.0.1:{port}/healthz", proc, pred, timeout)
        except RuntimeError:
            if proc.running or self.restarts.get(name):
                raise
            # Died starting (on a starved box, a JetStream request at start can time out):
            # restart it once, as compose's restart policy would, and say so in the result.
            self.restarts[name] = 1
            module, cluster, values = self.specs[name]
            self.spawn(name, module, cluster, **values)
            if name == "gateway":
                url = f"http://127.0.0.1:{self.gateway_port}/healthz"
            await self._ready(name, pred, url, timeout)

    def agent_procs(self) -> list[str]:
        return [n for n in self.procs if n.startswith("agents-")]

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            proc.stop(10)
        self.topo.stop()

    # ------------------------------------------------------------------------ readings

    def _servers(self) -> dict[str, NatsServer]:
        return {s.name: s for s in self.topo.servers}

    async def telemetry_counts(self, bus: Any) -> dict[str, float]:
        """The two sides of the telemetry ratio, each agent process's read in one reply:
        what its nodes tried to publish (samples, counted before each publish) and what
        the stream acknowledged storing (PubAcks), so both cover the same instants; and
        the hub's stream sequence beside them as a cross-check.

        Read apart (the stream's sequence against the nominal ``nodes / interval``, the
        other readings between them) the two sides covered windows that differed by as
        long as those readings took on a busy box (seconds at 1,000 nodes), and the
        nominal rate is not what agents offer while they catch up after a late tick."""
        from tandem.common.streams import TELEMETRY

        async def counts(name: str) -> dict[str, Any]:
            # A reply missing on a starved box once counted as zero samples: a whole
            # process's nodes left out of the ratio. Wait for it, or fail the size.
            h = await asyncio.to_thread(
                http.get_json, f"http://127.0.0.1:{self.procs[name][1]}/healthz", 60.0)
            if not h:
                raise RuntimeError(f"{name} did not answer /healthz within 60 s: its "
                                   "telemetry counts are unknown")
            return dict(h)

        healths = await asyncio.gather(*(counts(n) for n in self.agent_procs()))
        tele = await bus.js.stream_info(TELEMETRY)
        return {"t_counts": time.perf_counter(), "telemetry_seq": tele.state.last_seq,
                "samples": sum(h.get("samples", 0) for h in healths),
                "acked": sum(h.get("telemetry_stored", 0) for h in healths),
                "failed": sum(h.get("telemetry_failed", 0) for h in healths)}

    def cpu_now(self) -> dict[str, Any]:
        """The clock, the machine's CPU counters, the load and each process's CPU seconds."""
        return {"t": time.perf_counter(), "machine": saturation.machine_cpu(),
                "load": os.getloadavg()[0],
                "cpu": {**{n: s.cpu_seconds() for n, s in self._servers().items()},
                        **{n: p.cpu_seconds() for n, (p, _) in self.procs.items()},
                        "bench (load, watchers)": saturation.this_process()}}

    def cores_between(self, s0: dict[str, Any], s1: dict[str, Any]) -> dict[str, Any]:
        """Cores each process used between two ``cpu_now`` readings, the NATS servers and
        the agent processes summed, and how busy the whole machine was."""
        dt = s1["t"] - s0["t"]
        cpu = {n: round((s1["cpu"][n] - s0["cpu"].get(n, 0.0)) / dt, 4) for n in s1["cpu"]}
        return {
            "cpu_cores": cpu,
            "nats_servers": [s.name for s in self.topo.servers],
            "nats_cpu_cores": round(sum(cpu.get(s.name, 0.0) for s in self.topo.servers), 4),
            "agents_cpu_cores": round(sum(cpu[n] for n in self.agent_procs()), 4),
            "machine_busy": round((s1["machine"][0] - s0["machine"][0])
                                  / max(1.0, s1["machine"][1] - s0["machine"][1]), 3)}

    async def snapshot(self, bus: Any) -> dict[str, Any]:
        from tandem.common.streams import KV_NODES

        counts = await self.telemetry_counts(bus)
        beats = await bus.js.stream_info(f"KV_{KV_NODES}")
        varz = {name: await asyncio.to_thread(http.get_json, f"http://127.0.0.1:{s.monitor_port}/varz")
                for name, s in self._servers().items()}
        metrics_text = await asyncio.to_thread(
            http.get_text, f"http://127.0.0.1:{self.procs['gateway'][1]}/metrics")
        return {
            **counts, **self.cpu_now(), "heartbeat_seq": beats.state.last_seq,
            "api": sum(((v or {}).get("jetstream", {}).get("stats", {}).get("api", {})
                        .get("total", 0)) for v in varz.values()),
            "leaf_in_bytes": sum((v or {}).get("in_bytes", 0) for n, v in varz.items()
                                 if n.startswith("leaf-")),
            "routing": histogram(metrics_text, "tandem_gateway_routing_seconds"),
        }

    async def backlog(self, bus: Any) -> dict[str, int]:
        from tandem.common import subjects

        queued = 0
        for c in self.clusters:
            queued += (await bus.js.stream_info(subjects.gen_stream_name(c))).state.messages
        return {"gen_queued": queued}

    def memory(self) -> dict[str, int]:
        return {
            "hub_rss": sum(proc_rss(s.pid or 0) for s in self.topo.hub.servers),  # type: ignore[union-attr]
            "leaves_rss": sum(proc_rss(s.pid or 0) for s in self.topo.leaves.values()),
            "agents_rss": sum(proc_rss(self.procs[n][0].pid or 0) for n in self.agent_procs()),
            "gateway_rss": proc_rss(self.procs["gateway"][0].pid or 0),
        }


async def _steady(f: _Fleet, bus: Any, tasks: Tasks, lag: HeartbeatLag) -> dict[str, Any]:
    a = f.args
    conns = [Http("127.0.0.1", f.gateway_port) for _ in range(8)]
    stop = asyncio.Event()
    t0 = time.perf_counter() + 0.1

    async def pace(k: int) -> None:
        # Open loop: connection k sends task k, k+8, ... at its scheduled time.
        i = k
        while not stop.is_set():
            delay = t0 + i / a.task_rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the offered rate's schedule, not synchronisation
            if stop.is_set():
                break
            await tasks.submit(conns[k])
            i += len(conns)

    before_ids = set(tasks.sent)
    back0 = await f.backlog(bus)
    s0 = await f.snapshot(bus)
    senders = [asyncio.create_task(pace(k)) for k in range(len(conns))]
    await asyncio.sleep(a.seconds)  # the measured window itself
    s1 = await f.snapshot(bus)
    mid = (s0["t"] + s1["t"]) / 2
    lags = {"first_half": lag.between(s0["t"], mid), "second_half": lag.between(mid, s1["t"])}
    back1 = await f.backlog(bus)
    stop.set()
    await asyncio.gather(*senders)
    for c in conns:
        await c.close()
    ids = [i for i in tasks.sent if i not in before_ids]
    lost = await tasks.wait_all(ids, 30)
    dt = s1["t"] - s0["t"]
    cores = f.cores_between(s0, s1)
    cpu = cores["cpu_cores"]
    nominal = f.nodes / a.interval
    tried = s1["samples"] - s0["samples"]
    stored = s1["acked"] - s0["acked"]
    # The ratio is over the samples whose publish ended (acked or raised) in the window.
    # Each node publishes its next sample only once the last one ended, so a sample in
    # flight at either edge belongs to exactly one window; stored / tried was off by the
    # difference of the two edges' in-flight samples (up to one per node: 1.0152 once).
    failed = s1["failed"] - s0["failed"]
    ended = stored + failed
    counted = s1["t_counts"] - s0["t_counts"]
    routing = {f"p{int(q * 100)}_us": (round(v * 1e6, 2) if (v := bucket_quantile(
        s0["routing"], s1["routing"], q)) is not None else None) for q in (0.5, 0.99)}
    return {
        "window_s": round(dt, 2),
        # offered: what the agents tried to publish; delivered: what the stream acked.
        "telemetry": {"offered_per_s": round(tried / counted, 1),
                      "delivered_per_s": round(stored / counted, 1),
                      "stream_stored_per_s": round(
                          (s1["telemetry_seq"] - s0["telemetry_seq"]) / counted, 1),
                      "ratio": round(stored / ended, 4) if ended else 0.0,
                      "offered": tried, "delivered": stored, "ended": ended,
                      # Publishes that raised in the agents: what was lost for sure (the
                      # rest of a shortfall is still in flight when the window closes).
                      "publish_failed": failed,
                      "nominal_per_s": round(nominal, 1),
                      "on_schedule": round(tried / counted / nominal, 4)},
        "heartbeats_per_s": round((s1["heartbeat_seq"] - s0["heartbeat_seq"]) / dt, 1),
        "js_api_per_s": round((s1["api"] - s0["api"]) / dt, 1),
        "leaf_in_bytes_per_s": round((s1["leaf_in_bytes"] - s0["leaf_in_bytes"]) / dt),
        # The box is shared: how busy all of it was, and its load average, in the window.
        **cores,
        "hub_cpu_cores": round(sum(cpu.get(s.name, 0) for s in f.topo.hub.servers), 4),  # type: ignore[union-attr]
        "gateway_cpu_cores": cpu.get("gateway", 0.0),
        "backlog_start": back0, "backlog_end": back1, "heartbeat_lag": lags,
        "load_avg_1m": [round(s0["load"], 2), round(s1["load"], 2)],
        "routing": routing,
        "tasks": {"offered_per_s": a.task_rate, "accepted": len(ids), "rejected": tasks.rejected,
                  "not_done_30s_after": lost,
                  "throughput_per_s": round(len(ids) / dt, 1),
                  "latency": ms(tasks.latencies(ids))},
    }


async def _burst(f: _Fleet, tasks: Tasks) -> dict[str, Any]:
    a = f.args
    conns = [Http("127.0.0.1", f.gateway_port) for _ in range(a.burst_conns)]
    before = set(tasks.sent)
    s0 = f.cpu_now()
    t0 = time.perf_counter()
    deadline = t0 + a.burst_seconds

    async def hammer(c: Http) -> None:
        while time.perf_counter() < deadline:
            await tasks.submit(c)

    await asyncio.gather(*(hammer(c) for c in conns))
    wall = time.perf_counter() - t0
    # What the machine did in the burst (the fleet's agents and servers go on beside it).
    cores = f.cores_between(s0, f.cpu_now())
    for c in conns:
        await c.close()
    ids = [i for i in tasks.sent if i not in before]
    lost = await tasks.wait_all(ids, 60)
    last = max((tasks.done[i] for i in ids if i in tasks.done), default=t0)
    accepted = len(ids) / wall
    return {"connections": a.burst_conns, "seconds": round(wall, 2), "accepted": len(ids),
            "accepted_per_s": round(accepted, 1),
            "completed_per_s": round((len(ids) - lost) / (last - t0), 1) if last > t0 else 0.0,
            "not_done_60s_after": lost,
            "gateway_cpu_cores": round(cores["cpu_cores"].get("gateway", 0.0), 3), **cores,
            "latency": ms(tasks.latencies(ids)),
            "meets_goal": accepted >= GOAL_TASKS_PER_S and lost == 0}


async def _gateway_alone(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The gateway's own ceiling: one nats-server, one cluster kept healthy by a heartbeat
    written here, no fleet and no worker (tasks are only accepted): its CPU per task."""
    from tandem.common import streams
    from tandem.common.bus import Bus
    from tandem.common.events import NodeHeartbeat, encode
    from tandem.common.settings import Settings, load

    srv = NatsServer(name="alone", log_path=root / "nats.log", store_dir=root / "js").start()
    port, metrics_port = free_port(), free_port()
    gw = ServiceProcess(name="gateway-alone", log_path=root / "gateway.log")
    try:
        bus = await Bus.connect(load(Settings, nats_url=srv.url), "bench")
        await bus.provision([*streams.core_streams(), streams.gen_stream("c0")])
        kv = await bus.kv(streams.KV_NODES)
        beat = encode(NodeHeartbeat(cluster="c0", node="n0", gpus_total=8, gpus_usable=8,
                                    gpus_free=8, models=["noop"]))

        async def heartbeat() -> None:
            while True:
                await kv.put("c0.n0", beat)
                await asyncio.sleep(1.0)  # the node's heartbeat interval

        beating = asyncio.create_task(heartbeat())
        gw.start("tandem.gateway", child_env(
            nats_url=srv.url, http_port=str(port), metrics_port=str(metrics_port),
            cluster="c0", clusters="c0", max_backlog=str(BACKLOG_UNCAPPED),
            s3_endpoint="http://127.0.0.1:9", s3_access_key="x",
            s3_secret_key="x", log_level="warning", log_format="json"))
        await wait_ready(f"http://127.0.0.1:{port}/healthz", gw)
        tasks = Tasks()
        conns = [Http("127.0.0.1", port) for _ in range(args.burst_conns)]
        await asyncio.gather(*(tasks.submit(c) for c in conns))  # connections open, warm
        cpu0, t0 = gw.cpu_seconds(), time.perf_counter()
        deadline = t0 + args.burst_seconds
        before = len(tasks.sent)

        async def hammer(c: Http) -> None:
            while time.perf_counter() < deadline:
                await tasks.submit(c)

        await asyncio.gather(*(hammer(c) for c in conns))
        wall, cpu = time.perf_counter() - t0, gw.cpu_seconds() - cpu0
        n = len(tasks.sent) - before
        for c in conns:
            await c.close()
        beating.cancel()
        await bus.drain()
    finally:
        gw.stop(10)
        srv.stop()
    return {"connections": args.burst_conns, "accepted_per_s": round(n / wall, 1),
            "rejected": tasks.rejected, "gateway_cpu_cores": round(cpu / wall, 3),
            "gateway_cpu_ms_per_task": round(cpu / n * 1e3, 3) if n else None,
            "meets_goal": n / wall >= GOAL_TASKS_PER_S and not tasks.rejected}


async def _routing_input(board: Any, n: int = 200) -> dict[str, float]:
    """In this process: reading per-cluster summaries against building the full view."""
    def best(fn: Any, calls: int, batches: int = 5) -> float:
        # The fastest batch: on a shared box a slower one measures the other processes.
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
        return min(times)

    up = sum(s.nodes_up for s in board.summaries())
    return {"summaries_us": round(best(board.summaries, n) * 1e6, 2),
            "full_view_us": round(best(board.view, 3) * 1e6, 2), "nodes_up_seen": up}


async def _one(nodes: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from tandem.common import streams, subjects
    from tandem.common.bus import Bus
    from tandem.common.clusters import ClusterBoard
    from tandem.common.settings import Settings, load

    f = _Fleet(root, nodes, args)
    t_start = time.perf_counter()
    try:
        await f.start()
        started_s = time.perf_counter() - t_start
        bus = await Bus.connect(load(Settings, nats_url=f.topo.hub_url), "bench")
        await bus.provision(streams.core_streams())
        tasks = Tasks()
        sub = await bus.nc.subscribe(subjects.TASK_RECORD.wildcard, cb=tasks.on_record)
        lag = HeartbeatLag()
        lag_sub = await bus.nc.subscribe(f"$KV.{streams.KV_NODES}.>", cb=lag.on_put)
        board = await ClusterBoard(bus).start()
        await asyncio.sleep(3 * args.interval)  # warm-up: every node ticked a few times
        steady = await _steady(f, bus, tasks, lag)
        await lag_sub.unsubscribe()
        steady["routing_input"] = await _routing_input(board)
        mem = f.memory()
        burst = await _burst(f, tasks)
        await board.stop()
        await sub.unsubscribe()
        await bus.drain()
    finally:
        f.stop()
    per_node = {
        "nats_cpu_ms_per_s": round(steady["nats_cpu_cores"] / nodes * 1e3, 4),
        "agent_cpu_ms_per_s": round(steady["agents_cpu_cores"] / nodes * 1e3, 4),
        "leaf_in_bytes_per_s": round(steady["leaf_in_bytes_per_s"] / nodes),
        "js_api_per_s": round(steady["js_api_per_s"] / nodes, 4),
        "agent_rss_kib": round(mem["agents_rss"] / nodes / 1024, 1),
    }
    return {"nodes": nodes, "gpus": nodes * args.gpus, "startup_s": round(started_s, 1),
            "restarted_at_start": f.restarts,
            "steady": steady, "burst": burst, "memory_bytes": mem, "per_node": per_node,
            "no_backlog_growth": _no_backlog(steady, args)}


def _no_backlog(steady: dict[str, Any], args: argparse.Namespace) -> bool:
    """Telemetry stored as fast as offered, heartbeats arriving within one interval at
    the end of the window, no queue growing by more than a second of tasks."""
    late = steady["heartbeat_lag"]["second_half"]["p99_ms"]
    grew = steady["backlog_end"]["gen_queued"] - steady["backlog_start"]["gen_queued"]
    return (steady["telemetry"]["ratio"] >= GOAL_DELIVERED and late is not None
            and late <= args.interval * 1e3 and grew <= args.task_rate
            and steady["tasks"]["not_done_30s_after"] == 0)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` runs of every size; the detail shown is the median run's (by the
    largest size's telemetry ratio), the figures span every run."""
    runs = await stats.repeated(args.repeat, lambda r: _once(args, r))
    result = stats.median_run(runs, largest_ratio)
    result["repeat"] = args.repeat
    result["ok"] = all(x["ok"] for x in runs)  # a size that failed in any run
    result["figures"] = stats.figures_json(figures(runs, args))
    return result


async def _once(args: argparse.Namespace, r: int = 0) -> dict[str, Any]:
    from tandem.common import log

    log.configure("auto", "error", stream=sys.stderr)  # stdout: the result
    sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    rows, failed = [], []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-scale-") as tmp:
        root = (args.root / f"run{r}" if args.repeat > 1 else args.root) if args.root \
            else Path(tmp)
        alone = await _gateway_alone(args, root / "gateway-alone")
        for n in sizes:
            try:
                rows.append(await _one(n, args, root / f"n{n}"))
            except Exception as exc:  # report it and go on with the next size
                logs = sorted((root / f"n{n}").glob("*.log"))
                tails = {p.name: p.read_text(errors="replace")[-1500:] for p in logs
                         if "Traceback" in p.read_text(errors="replace")}
                failed.append({"nodes": n, "error": repr(exc), "logs": tails})
    marginal = None
    if len(rows) >= 2 and rows[-1]["nodes"] > rows[0]["nodes"]:
        lo, hi = rows[0], rows[-1]
        dn = hi["nodes"] - lo["nodes"]
        marginal = {
            "nats_cpu_ms_per_node_s": round((hi["steady"]["nats_cpu_cores"]
                                             - lo["steady"]["nats_cpu_cores"]) / dn * 1e3, 4),
            "nats_rss_kib_per_node": round(((hi["memory_bytes"]["hub_rss"]
                                             + hi["memory_bytes"]["leaves_rss"])
                                            - (lo["memory_bytes"]["hub_rss"]
                                               + lo["memory_bytes"]["leaves_rss"])) / dn / 1024, 1),
        }
    largest = rows[-1] if rows else None
    return {
        "cpus": os.cpu_count(), "clusters": args.clusters, "gpus_per_node": args.gpus,
        "interval_s": args.interval, "hub_size": args.hub_size, "sizes": rows,
        "marginal_per_node": marginal, "failed": failed, "gateway_alone": alone,
        "goals": {
            "no_backlog_at_largest": bool(largest and largest["no_backlog_growth"]),
            "tasks_per_s_goal": GOAL_TASKS_PER_S,
            "tasks_per_s_best": max((r["burst"]["accepted_per_s"] for r in rows), default=0),
            "tasks_per_s_gateway_alone": alone["accepted_per_s"],
        },
        "ok": not failed,  # goals are reported, not enforced; a failed size is not
    }


