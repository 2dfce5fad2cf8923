"""the bus library against raw nats-py: JetStream publish, and pull fetch + ack.

Both sides run against the same nats-server in the same process, interleaved in each of
``--repeat`` repeats (``stats.schedule``); goals are judged on the median repeat's ratio.
Both build and JSON-encode the same event per message; the raw side sends no headers and
settles nothing but the ack, while the Tandem side adds ``traceparent`` to every message,
decodes into the typed event, carries the trace context into the handler and applies its
ack policy, so the ratio is the whole cost of the library. The library gains back more
than that: its pipelined publish takes every ack on one reply inbox with one future per
call, and its fetch takes messages from the inbox without the task, timer and uuid that
nats-py spends on each one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import msgspec
from nats.js.api import RetentionPolicy

from tandem.cli.bench import saturation, stats
from tandem.cli.devstack import scratch_nats
from tandem.common import streams
from tandem.common.bus import Bus, Delivery
from tandem.common.events import GenerationTask, encode
from tandem.common.settings import Settings, load

GOAL = 0.8
SMOKE = ("--messages", "500", "--window", "64", "--batch", "64")
PARTS = (("publish", "JetStream publish (pipelined, acked)"), ("fetch_ack", "pull fetch + ack"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages", type=stats.positive_int, default=20_000, help="messages per round")
    stats.add_repeat(p, 3, "--rounds")
    p.add_argument("--window", type=stats.positive_int, default=512, help="publishes in flight")
    p.add_argument("--batch", type=stats.positive_int, default=256, help="fetch batch size")


def _task(i: int) -> GenerationTask:
    return GenerationTask(task_id=f"t{i}", model="digits", class_label=i % 10, seed=i,
                          submitted_at=1.0)


async def _raw_publish(bus: Bus, subject: str, n: int, window: int) -> float:
    # A raw nats-py user serialises their payload too; they send no headers.
    js = bus.js
    t = time.perf_counter()
    for start in range(0, n, window):
        futs = [await js.publish_async(subject, encode(_task(i)))
                for i in range(start, min(start + window, n))]
        await asyncio.gather(*futs)
    return n / (time.perf_counter() - t)


async def _tandem_publish(bus: Bus, subject: str, n: int, window: int) -> float:
    t = time.perf_counter()
    for start in range(0, n, window):
        await bus.publish_many(
            [(subject, _task(i), None) for i in range(start, min(start + window, n))])
    return n / (time.perf_counter() - t)


async def _raw_consume(bus: Bus, spec: streams.ConsumerSpec, n: int, batch: int) -> float:
    sub = await bus.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)
    got = 0
    t = time.perf_counter()
    while got < n:
        for msg in await sub.fetch(batch, timeout=2):
            msgspec.json.decode(msg.data)  # a raw user reads the payload too (untyped)
            await msg.ack()
            got += 1
    rate = n / (time.perf_counter() - t)
    await sub.unsubscribe()
    return rate


async def _tandem_consume(bus: Bus, spec: streams.ConsumerSpec, n: int, batch: int) -> float:
    stop = asyncio.Event()
    count = 0

    async def handle(d: Delivery[GenerationTask]) -> None:
        nonlocal count
        count += 1
        if count >= n:
            stop.set()

    consumer = bus.consumer(spec, GenerationTask, handle, batch=batch, fetch_timeout=2)
    t = time.perf_counter()
    await consumer.run(stop)
    return n / (time.perf_counter() - t)


async def _round(bus: Bus, tag: str, args: argparse.Namespace, tandem: bool,
                 server: Any = None) -> dict[str, Any]:
    """One side once: publish rate, then fetch + ack rate, each with the CPU it cost this
    process (the client), its event loop and the nats-server."""
    stream = streams.StreamSpec(f"BENCH_{tag}", (f"bench.{tag}",),
                                retention=RetentionPolicy.WORK_QUEUE)
    consumer = streams.ConsumerSpec(stream.name, "bench", max_ack_pending=100_000)
    await bus.provision([stream, consumer])
    subject = f"bench.{tag}"
    procs: dict[str, Any] = {"bench process": saturation.this_process}
    if server is not None:
        procs["nats-server"] = server.cpu_seconds
    meter = saturation.Meter(procs, loop="bench process")
    meter.start()
    pub = await (_tandem_publish if tandem else _raw_publish)(bus, subject, args.messages,
                                                              args.window)
    pub_cpu = meter.stop()
    meter.start()
    con = await (_tandem_consume if tandem else _raw_consume)(bus, consumer, args.messages,
                                                              args.batch)
    con_cpu = meter.stop()
    await bus.js.delete_stream(stream.name)
    return {"publish": pub, "fetch_ack": con,
            "cpu": {"publish": pub_cpu.json(), "fetch_ack": con_cpu.json()}}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.common import log

    log.configure("auto", "warning", stream=sys.stderr)  # stdout: the result
    with scratch_nats("bus") as (server, _):
        settings = load(Settings, nats_url=server.url)
        bus = await Bus.connect(settings, "bench")
        await _round(bus, "warm", argparse.Namespace(**{**vars(args), "messages": 2000}), True)
        runs = await stats.interleaved(args.repeat, {
            "raw": lambda r: _round(bus, f"{r}raw", args, False, server),
            "tandem": lambda r: _round(bus, f"{r}tandem", args, True, server)})
        await bus.drain()
    figures = []
    for key, label in PARTS:
        fig = stats.Figure(key, label, "msg/s", [x[key] for x in runs["tandem"]],
                           [x[key] for x in runs["raw"]], "raw nats-py",
                           goal=stats.Goal(">=", GOAL), digits=1)
        if fig.met is False:
            # The saturation of the repeat whose ratio is the median, both sides.
            r = stats.median_run(range(args.repeat), lambda i, f=fig: f.ratio[i])  # type: ignore[index]
            t, b = runs["tandem"][r]["cpu"][key], runs["raw"][r]["cpu"][key]
            us = {side: x["cores"]["bench process"] * x["wall_s"] / args.messages * 1e6
                  for side, x in (("tandem", t), ("raw", b))}
            fig.why = (saturation.why(t, loop="bench process")
                       + f"; client CPU per message: tandem {us['tandem']:.1f} us, raw "
                       f"{us['raw']:.1f} us")
        figures.append(fig)
    fj = stats.figures_json(figures)
    result: dict[str, Any] = {
        "messages": args.messages, "repeat": args.repeat, "window": args.window,
        "batch": args.batch,
        **{key: {"raw_per_s": round(fj[key]["baseline"]["median"]),
                 "tandem_per_s": round(fj[key]["tandem"]["median"]),
                 "ratio": fj[key]["ratio"]["median"]} for key, _ in PARTS},
        "goal_ratio": GOAL, "figures": fj,
        "cpu": {side: [x["cpu"] for x in rs] for side, rs in runs.items()},
    }
    result["meets_goal"] = stats.all_met(fj)
    return result


def render(r: dict[str, Any]) -> str:
    lines = [f"tandem bench bus: {r['messages']} messages x {r['repeat']} repeats "
             "(raw and tandem interleaved), medians"]
    for key, label in PARTS:
        x = r[key]
        lines.append(f"  {label:38s} raw {x['raw_per_s']:>8,}/s  tandem {x['tandem_per_s']:>8,}/s"
                     f"  ratio {x['ratio']:.3f}  (goal >= {r['goal_ratio']})")
    return "\n".join(lines)
