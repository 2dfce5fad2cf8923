"""the bus library against raw nats-py: JetStream publish, and pull fetch + ack.

Both sides run against the same nats-server in the same process, alternating rounds,
and the median round counts. Both build and JSON-encode the same event per message; the
raw side sends no headers and settles nothing but the ack, while the Tandem side adds
``traceparent`` to every message, decodes into the typed event, carries the trace
context into the handler and applies its ack policy, so the ratio is the whole cost of
the library. The library gains back more than that: its pipelined publish takes every
ack on one reply inbox with one future per call, and its fetch takes messages from the
inbox without the task, timer and uuid that nats-py spends on each one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import msgspec
from nats.js.api import RetentionPolicy

from tandem.cli.devstack import scratch_nats
from tandem.common import streams
from tandem.common.bus import Bus, Delivery
from tandem.common.events import GenerationTask, encode
from tandem.common.settings import Settings, load

GOAL = 0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages", type=int, default=20_000, help="messages per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side (median counts)")
    p.add_argument("--window", type=int, default=512, help="publishes in flight")
    p.add_argument("--batch", type=int, default=256, help="fetch batch size")


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


async def _round(bus: Bus, tag: str, args: argparse.Namespace, tandem: bool) -> tuple[float, float]:
    stream = streams.StreamSpec(f"BENCH_{tag}", (f"bench.{tag}",),
                                retention=RetentionPolicy.WORK_QUEUE)
    consumer = streams.ConsumerSpec(stream.name, "bench", max_ack_pending=100_000)
    await bus.provision([stream, consumer])
    subject = f"bench.{tag}"
    if tandem:
        pub = await _tandem_publish(bus, subject, args.messages, args.window)
        con = await _tandem_consume(bus, consumer, args.messages, args.batch)
    else:
        pub = await _raw_publish(bus, subject, args.messages, args.window)
        con = await _raw_consume(bus, consumer, args.messages, args.batch)
    await bus.js.delete_stream(stream.name)
    return pub, con


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.common import log

    log.configure("console", "warning", stream=sys.stderr)  # stdout: the result
    with scratch_nats("bus") as (server, _):
        settings = load(Settings, nats_url=server.url)
        bus = await Bus.connect(settings, "bench")
        rows: dict[str, list[float]] = {k: [] for k in
                                        ("raw_pub", "raw_con", "tandem_pub", "tandem_con")}
        await _round(bus, "warm", argparse.Namespace(**{**vars(args), "messages": 2000}), True)
        for r in range(args.rounds):
            for tandem in (False, True):
                pub, con = await _round(bus, f"{r}{int(tandem)}", args, tandem)
                side = "tandem" if tandem else "raw"
                rows[f"{side}_pub"].append(pub)
                rows[f"{side}_con"].append(con)
        await bus.drain()
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "messages": args.messages, "rounds": args.rounds, "window": args.window,
        "batch": args.batch,
        "publish": {"raw_per_s": round(med["raw_pub"]), "tandem_per_s": round(med["tandem_pub"]),
                    "ratio": round(med["tandem_pub"] / med["raw_pub"], 3)},
        "fetch_ack": {"raw_per_s": round(med["raw_con"]), "tandem_per_s": round(med["tandem_con"]),
                      "ratio": round(med["tandem_con"] / med["raw_con"], 3)},
        "goal_ratio": GOAL,
    }
    result["meets_goal"] = all(result[k]["ratio"] >= GOAL for k in ("publish", "fetch_ack"))
    return result


def render(r: dict[str, Any]) -> str:
    lines = [f"tandem bench bus: {r['messages']} messages x {r['rounds']} rounds (median)"]
    for key, label in (("publish", "JetStream publish (pipelined, acked)"),
                       ("fetch_ack", "pull fetch + ack")):
        x = r[key]
        lines.append(f"  {label:38s} raw {x['raw_per_s']:>8,}/s  tandem {x['tandem_per_s']:>8,}/s"
                     f"  ratio {x['ratio']:.3f}  (goal >= {r['goal_ratio']})")
    lines.append("  meets goal: " + ("yes" if r["meets_goal"] else "NO"))
    return "\n".join(lines)
