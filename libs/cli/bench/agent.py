"""the cluster agent's CPU cost: per GPU sample, at 1 Hz, and the most GPUs per process.

Against a real nats-server started for the run, with simulated busy GPUs:

1. one 64-GPU node, ticked back to back: process CPU per tick (sample, classify, publish
   telemetry, heartbeat) and per GPU sample, against a raw loop that only publishes the
   same telemetry payloads and heartbeats with nats-py;
2. the same node on the wall clock at its real 1 Hz for ``--seconds``: the share of one
   core it uses, idle waiting included (the goal: under 2%);
3. nodes of 8 GPUs multiplexed in one process, ticked together once per round, doubling
   the node count (until a round takes over 0.5 s): the largest measured round that fits
   in one second, and the GPUs one core of agent CPU would carry at the last size.

CPU is ``time.process_time()`` of this process: the nats-server's own CPU is not counted.
Parts 1 and 2 run ``--repeat`` times (part 1 is one agent-then-raw pair per repeat);
figures give their min/median/max, the 1 Hz goal judged on the median; part 3, a search
for the largest size, runs once.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import zlib
from typing import Any

from tandem.cli.bench import saturation, stats

GOAL_CORE_FRACTION = 0.02
SMOKE = ("--gpus", "8", "--ticks", "20", "--seconds", "1", "--max-nodes", "16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=stats.positive_int, default=64, help="GPUs of the single node")
    p.add_argument("--ticks", type=stats.positive_int, default=300,
                   help="back-to-back ticks measured")
    p.add_argument("--seconds", type=stats.positive_float, default=10.0,
                   help="real-time 1 Hz run length")
    p.add_argument("--max-nodes", type=stats.positive_int, default=256,
                   help="largest number of 8-GPU nodes in the multiplexed run")
    stats.add_repeat(p, 3, what="repeats of parts 1 (agent then raw) and 2")


async def _agent(bus: Any, node: str, gpus: int, clock: Any) -> Any:
    from tandem.cluster_agent.agent import NodeAgent
    from tandem.cluster_agent.sim import SimBackend

    sim = SimBackend(gpus=gpus, load=0.95, seed=zlib.crc32(node.encode()))
    agent = NodeAgent(bus, "bench", node, sim, clock, auto_drain=False)
    await agent.start()
    return agent


async def _ticks(agent: Any, clock: Any, n: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        clock.advance(1.0)
        await agent.tick()
    return time.process_time() - cpu, time.perf_counter() - wall


async def _raw(bus: Any, payloads: list[tuple[bytes, bytes]], subject: str, key: str) -> float:
    kv = await bus.js.key_value("nodes")
    cpu = time.process_time()
    for telemetry, heartbeat in payloads:
        await bus.js.publish(subject, telemetry)
        await kv.put(key, heartbeat)
    return time.process_time() - cpu


async def _single(bus: Any, args: argparse.Namespace, r: int = 0) -> dict[str, Any]:
    from tandem.cluster_agent.clock import ManualClock
    from tandem.cluster_agent.health import Tracker
    from tandem.cluster_agent.sim import SimBackend
    from tandem.common import subjects
    from tandem.common.events import NodeTelemetry, encode

    clock = ManualClock(time.time())
    agent = await _agent(bus, f"single{r}", args.gpus, clock)
    await _ticks(agent, clock, 20)  # warm up
    cpu, wall = await _ticks(agent, clock, args.ticks)
    await agent.close()

    # The same payloads for the raw loop: telemetry as the agent encodes it, and its heartbeat.
    sim = SimBackend(gpus=args.gpus, load=0.95, seed=1)
    sim.open(0.0)
    payloads = []
    for t in range(args.ticks):
        agent.last = sim.sample(float(t + 1))
        payloads.append((encode(NodeTelemetry(cluster="bench", node="raw", gpus=agent.last,
                                              at=float(t), seq=t)),
                         encode(agent.heartbeat_value())))
    raw_cpu = await _raw(bus, payloads, subjects.telemetry("bench", "raw"), "bench.raw")

    # Sampling and classification alone (no bus), to show where the time goes.
    sim = SimBackend(gpus=args.gpus, load=0.95, seed=2)
    sim.open(0.0)
    tracker = Tracker()
    c0 = time.process_time()
    for t in range(args.ticks):
        tracker.observe(sim.sample(float(t + 1)), float(t + 1))
    classify = time.process_time() - c0

    per_tick = cpu / args.ticks
    return {
        "gpus": args.gpus, "ticks": args.ticks,
        "agent_cpu_ms_per_tick": round(per_tick * 1e3, 3),
        "agent_cpu_us_per_gpu_sample": round(per_tick / args.gpus * 1e6, 2),
        "agent_wall_ms_per_tick": round(wall / args.ticks * 1e3, 3),
        "sample_and_classify_us_per_gpu_sample": round(classify / args.ticks / args.gpus * 1e6, 2),
        "raw_cpu_ms_per_tick": round(raw_cpu / args.ticks * 1e3, 3),
        "raw_cpu_us_per_gpu_sample": round(raw_cpu / args.ticks / args.gpus * 1e6, 2),
        "agent_over_raw": round(cpu / raw_cpu, 2) if raw_cpu else None,
        "payload_bytes": len(payloads[0][0]) if payloads else 0,
        "heartbeat_bytes": len(payloads[0][1]) if payloads else 0,
    }


async def _realtime(bus: Any, args: argparse.Namespace, server: Any, r: int = 0
                    ) -> dict[str, Any]:
    from tandem.cluster_agent.clock import WallClock

    agent = await _agent(bus, f"realtime{r}", args.gpus, WallClock())
    stop = asyncio.Event()
    meter = saturation.Meter({"bench process (the agent)": saturation.this_process,
                              "nats-server": server.cpu_seconds},
                             loop="bench process (the agent)").start()
    cpu, wall = time.process_time(), time.perf_counter()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.sleep(args.seconds)  # the measured window itself, not synchronisation
    stop.set()
    await task
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    used = meter.stop()
    await agent.close()
    return {"gpus": args.gpus, "seconds": round(wall, 2), "ticks": agent.samples,
            "cpu_s": round(cpu, 4), "core_fraction": round(cpu / wall, 5), "cpu": used.json()}


async def _fleet(bus: Any, args: argparse.Namespace) -> dict[str, Any]:
    from tandem.cluster_agent.clock import ManualClock

    clock = ManualClock(time.time())
    agents: list[Any] = []
    rows = []
    nodes = 16
    while nodes <= args.max_nodes:
        agents += [await _agent(bus, f"n{i}", 8, clock) for i in range(len(agents), nodes)]
        await asyncio.gather(*(a.tick() for a in agents))  # warm the new ones
        rounds = 5
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(rounds):
            clock.advance(1.0)
            await asyncio.gather(*(a.tick() for a in agents))
        cpu, wall = (time.process_time() - cpu) / rounds, (time.perf_counter() - wall) / rounds
        rows.append({"nodes": nodes, "gpus": nodes * 8, "cpu_s_per_round": round(cpu, 4),
                     "wall_s_per_round": round(wall, 4),
                     "cpu_us_per_gpu_sample": round(cpu / (nodes * 8) * 1e6, 2)})
        if wall > 0.5:
            break
        nodes *= 2
    for a in agents:
        await a.close()
    fits = [r for r in rows if r["wall_s_per_round"] < 1.0 and r["cpu_s_per_round"] < 1.0]
    last = rows[-1]
    return {
        "rounds": rows,
        "max_gpus_measured_at_1hz": fits[-1]["gpus"] if fits else 0,
        # What one core of agent CPU would carry; on a shared box the nats-server's own
        # work (acks for every publish) bounds the wall time long before that.
        "max_gpus_by_agent_cpu_at_1hz": int(1.0 / (last["cpu_us_per_gpu_sample"] * 1e-6)),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.cli.devstack import scratch_nats
    from tandem.common import log, streams
    from tandem.common.bus import Bus
    from tandem.common.settings import Settings, load

    log.configure("auto", "error", stream=sys.stderr)  # stdout: the result
    with scratch_nats("agent") as (server, _):
        bus = await Bus.connect(load(Settings, nats_url=server.url), "bench")
        await bus.provision(streams.core_streams())
        singles = await stats.repeated(args.repeat, lambda r: _single(bus, args, r))
        realtimes = await stats.repeated(args.repeat,
                                         lambda r: _realtime(bus, args, server, r))
        fleet = await _fleet(bus, args)
        await bus.drain()
    per_sample = stats.Figure(
        "cpu_per_gpu_sample", "agent CPU per GPU sample (lower is better)", "us",
        [s["agent_cpu_us_per_gpu_sample"] for s in singles],
        [s["raw_cpu_us_per_gpu_sample"] for s in singles],
        "raw nats-py publishing the same payloads", digits=2)
    core = stats.Figure(
        "core_fraction_1hz", f"{args.gpus}-GPU node at 1 Hz, share of one core", "cores",
        [x["core_fraction"] for x in realtimes], goal=stats.Goal("<=", GOAL_CORE_FRACTION,
                                                                 on="tandem"), digits=5,
        notes=[stats.NO_BASELINE])
    if core.met is False:
        core.why = saturation.why(stats.median_run(realtimes, lambda x: x["core_fraction"])[
            "cpu"], loop="bench process (the agent)")
    most = stats.Figure("max_gpus_at_1hz", "most GPUs one process ticks at 1 Hz (measured)",
                        "GPUs", [fleet["max_gpus_measured_at_1hz"]],
                        notes=["one search, not repeated; no baseline"])
    fj = stats.figures_json([per_sample, core, most])
    return {
        "repeat": args.repeat,
        "single_node": stats.median_run(singles, lambda x: x["agent_cpu_us_per_gpu_sample"]),
        "realtime_1hz": stats.median_run(realtimes, lambda x: x["core_fraction"]),
        "multiplexed": fleet, "goal_core_fraction": GOAL_CORE_FRACTION, "figures": fj,
        "ok": stats.all_met(fj),
    }


def render(r: dict[str, Any]) -> str:
    s, rt, f = r["single_node"], r["realtime_1hz"], r["multiplexed"]
    lines = [
        f"tandem bench agent: simulated busy GPUs, real nats-server; parts 1-2: the median "
        f"of {r['repeat']} repeats",
        f"  one {s['gpus']}-GPU node, {s['ticks']} ticks back to back:",
        f"    agent  {s['agent_cpu_ms_per_tick']:.3f} ms CPU/tick  "
        f"{s['agent_cpu_us_per_gpu_sample']:.2f} us/GPU sample  "
        f"(sample+classify alone {s['sample_and_classify_us_per_gpu_sample']:.2f} us)",
        f"    raw    {s['raw_cpu_ms_per_tick']:.3f} ms CPU/tick  "
        f"{s['raw_cpu_us_per_gpu_sample']:.2f} us/GPU sample  (publish the same "
        f"{s['payload_bytes']} B telemetry + {s['heartbeat_bytes']} B heartbeat)",
        f"    agent / raw: {s['agent_over_raw']}x",
        f"  at 1 Hz on the wall clock for {rt['seconds']}s: {rt['ticks']} ticks, "
        f"{rt['cpu_s']:.3f} s CPU = {rt['core_fraction'] * 100:.3f}% of one core "
        f"(goal < {r['goal_core_fraction'] * 100:g}%)",
        "  8-GPU nodes multiplexed in one process (per round of one tick each):",
    ]
    for row in f["rounds"]:
        lines.append(f"    {row['nodes']:>4} nodes {row['gpus']:>5} GPUs  "
                     f"cpu {row['cpu_s_per_round'] * 1e3:8.1f} ms  "
                     f"wall {row['wall_s_per_round'] * 1e3:8.1f} ms  "
                     f"{row['cpu_us_per_gpu_sample']:.2f} us/GPU sample")
    lines.append(f"    most GPUs at 1 Hz: {f['max_gpus_measured_at_1hz']} measured (round under "
                 f"1 s wall); ~{f['max_gpus_by_agent_cpu_at_1hz']} by the agent's CPU alone "
                 "(the nats-server on the same machine bounds wall time first)")
    return "\n".join(lines)
