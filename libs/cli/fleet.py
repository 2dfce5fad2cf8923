"""``tandem clusters`` and ``tandem node drain|undrain``: the fleet as its agents report it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from tandem.common.events import GpuBrief

GIB = 1 << 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("clusters", help="each cluster and node: health, heartbeat, GPUs",
                       description="Read the fleet from KV nodes (heartbeats) and KV drains "
                       "and print each cluster and node with its health, last heartbeat, GPUs "
                       "and their latest key metrics.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--gpus", action="store_true", help="also print one line per GPU")
    p.set_defaults(func=lambda a: _sync(_clusters(a)))

    node = sub.add_parser("node", help="drain or undrain a node",
                          description="A drained node's workers stop pulling new tasks and "
                          "finish what they hold; the trainer leaves it out of its next restart.")
    nsub = node.add_subparsers(dest="node_command", metavar="<action>", required=True)
    d = nsub.add_parser("drain", help="take a node out of service")
    d.add_argument("cluster")
    d.add_argument("node")
    d.add_argument("--reason", required=True, help="why (kept with the drain, shown everywhere)")
    d.set_defaults(func=lambda a: _sync(_drain(a)))
    u = nsub.add_parser("undrain", help="return a node to service (clears latched faults)")
    u.add_argument("cluster")
    u.add_argument("node")
    u.set_defaults(func=lambda a: _sync(_undrain(a)))


def _sync(coro: Awaitable[int]) -> int:
    return asyncio.run(coro)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def _bus() -> AsyncIterator[Any]:
    """A bus connection, or a clear message saying how to start the stack."""
    from nats.js.errors import BucketNotFoundError

    from tandem.common import log
    from tandem.common.bus import Bus
    from tandem.common.settings import Settings, load

    # stdout is the command's output (--json): the bus's own connection logs stay out of it.
    log.configure("auto", "error", stream=sys.stderr)
    settings = load(Settings, "tandem")
    try:
        bus = await Bus.connect(settings, "cli", allow_reconnect=False, connect_timeout=2,
                                max_reconnect_attempts=1)
    except Exception as exc:
        from tandem.cli.reach import refusal_message

        refused = refusal_message(exc)
        if refused is not None:
            raise _Unreachable(refused) from None
        raise _Unreachable(
            f"cannot reach NATS at {settings.nats_url} ({type(exc).__name__}: {exc}).\n"
            "Start the local stack with `tandem dev up`, or point TANDEM_NATS_URL at your "
            "NATS servers.") from None
    try:
        yield bus
    except BucketNotFoundError:
        raise _Unreachable(
            f"NATS at {settings.nats_url} has no Tandem KV buckets yet: no service has "
            "provisioned them. Start the stack with `tandem dev up`.") from None
    finally:
        await bus.drain()


class _Unreachable(Exception):
    pass


def _handled(fn: Callable[[argparse.Namespace], Awaitable[int]]) -> Any:
    async def run(args: argparse.Namespace) -> int:
        try:
            return await fn(args)
        except _Unreachable as exc:
            print(f"tandem: {exc}", file=sys.stderr)
            return 1

    return run


# --------------------------------------------------------------------------------- clusters


@_handled
async def _clusters(args: argparse.Namespace) -> int:
    from tandem.common.fleet import read_fleet

    async with _bus() as bus:
        view = await read_fleet(bus)
    if args.json:
        print(json.dumps(view.to_dict()))
    else:
        print(render(view, gpus=args.gpus))
    return 0


def _ago(age: float | None) -> str:
    if age is None:
        return "never"
    return f"{age:.1f}s ago" if age < 120 else f"{age / 60:.0f}m ago"


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _gpu_summary(gpus: list[GpuBrief]) -> tuple[str, str, str, str]:
    alive = [g for g in gpus if not g.lost]
    utils = [g.util for g in alive if g.util is not None]
    temps = [g.temp for g in alive if g.temp is not None]
    powers = [g.power for g in alive if g.power is not None]
    used = sum(g.mem_used or 0 for g in alive)
    total = sum(g.mem_total or 0 for g in alive)
    return (
        _num(sum(utils) / len(utils)) if utils else "-",
        _num(max(temps)) if temps else "-",
        _num(sum(powers)) if powers else "-",
        f"{used / GIB:.0f}/{total / GIB:.0f}" if total else "-",
    )


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def render(view: Any, gpus: bool = False) -> str:
    """The fleet as text: one block per cluster, one line per node (and per GPU)."""
    if not view.clusters:
        return ("no nodes: no agent has sent a heartbeat within the last "
                f"{view.heartbeat_ttl:g}s (start one with `tandem dev up` or "
                "`tandem run cluster-agent`)")
    out: list[str] = []
    for c in view.clusters:
        state = "healthy" if c.healthy else "UNHEALTHY (no serving node)"
        models = ", ".join(c.models) or "-"
        out.append(f"{c.name}  {state}  nodes {c.nodes_up}/{c.nodes_total} up, "
                   f"{c.nodes_serving} serving, {c.nodes_drained} drained  "
                   f"GPUs {c.gpus_total} ({c.gpus_free} free)  models: {models}")
        rows = [["NODE", "STATUS", "HEARTBEAT", "GPUS", "FREE", "UTIL%", "MAX°C", "POWER W",
                 "MEM GiB", "FINDINGS / DRAIN"]]
        for n in c.nodes:
            util, temp, power, mem = _gpu_summary(n.gpus)
            notes = ", ".join(n.findings)
            if n.drained:
                notes = f"drained: {n.drain_reason}" + (f" ({n.drained_by})" if n.drained_by
                                                         else "") + (f"; {notes}" if notes else "")
            rows.append([n.node, n.status, _ago(n.age_s), f"{n.gpus_usable}/{n.gpus_total}",
                         str(n.gpus_free), util, temp, power, mem, notes or "-"])
        table = _table(rows)
        out.append(table[0])
        for n, line in zip(c.nodes, table[1:], strict=True):
            out.append(line)
            if gpus:
                out.extend(_gpu_lines(n.gpus))
        out.append("")
    out.append(f"(as of {time.strftime('%H:%M:%S', time.localtime(view.at))}; "
               f"heartbeat TTL {view.heartbeat_ttl:g}s)")
    return "\n".join(out)


def _gpu_lines(gpus: list[GpuBrief]) -> list[str]:
    rows = []
    for g in gpus:
        if g.lost:
            rows.append([f"gpu{g.index}", "LOST (off the bus)", "", "", "", ""])
            continue
        mem = (f"{(g.mem_used or 0) / GIB:.1f}/{g.mem_total / GIB:.0f} GiB"
               if g.mem_total else "-")
        rows.append([f"gpu{g.index}", f"util {_num(g.util)}%", f"{_num(g.temp)}°C",
                     f"{_num(g.power)} W", f"sm {_num(g.sm_clock)} MHz", mem])
    return _table(rows, indent="      ") if rows else []


# ------------------------------------------------------------------------------ drain/undrain


@_handled
async def _drain(args: argparse.Namespace) -> int:
    from tandem.common import fleet, subjects

    cluster, node = subjects.token(args.cluster, "cluster"), subjects.node(args.node)
    if not args.reason.strip():
        print("tandem: --reason must say why the node is drained", file=sys.stderr)
        return 2
    async with _bus() as bus:
        record = await fleet.drain(bus, cluster, node, args.reason)
        hb = await fleet.heartbeat(bus, cluster, node)
    print(f"drained {cluster}/{node}: {record.reason} (by {record.by})")
    if hb is None:
        print(f"note: no heartbeat from {cluster}/{node} right now; the drain holds and "
              "applies when its agent and workers start")
    return 0


@_handled
async def _undrain(args: argparse.Namespace) -> int:
    from tandem.common import fleet, subjects

    cluster, node = subjects.token(args.cluster, "cluster"), subjects.node(args.node)
    async with _bus() as bus:
        previous = await fleet.undrain(bus, cluster, node)
    if previous is None:
        print(f"{cluster}/{node} was not drained; its agent clears any latched faults")
    else:
        print(f"undrained {cluster}/{node} (was drained by {previous.by}: {previous.reason}); "
              "its agent clears latched faults")
    return 0
