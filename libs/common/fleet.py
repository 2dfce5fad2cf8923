"""The fleet as the agents report it: heartbeats in KV ``nodes``, drains in KV ``drains``.

No torch, no HTTP: plain msgspec Structs that the CLI prints, the gateway serves as
JSON (``msgspec.to_builtins``) and routes on, and workers watch.

- ``read_fleet(bus)``: one snapshot of every cluster and node (``tandem clusters``,
  ``GET /v1/clusters``).
- ``clusters.ClusterBoard`` keeps the same view live by KV watches (routing, failover,
  benchmarks): each cluster's counts at a cost independent of its node count.
- ``DrainWatch``: one node's drain flag, for a worker that must stop pulling when drained.
- ``drain`` / ``undrain``: what ``tandem node drain|undrain`` (and the agent) write.
- ``announce_models``: a worker tells its node's agent which models it has loaded.

A node is *up* while its heartbeat is in KV ``nodes`` (whose TTL removes a dead agent's;
no agent's clock is trusted for it), and
*serving* while up, not drained and not unhealthy. A cluster is healthy while at least
one of its nodes is serving. A drained node whose agent is gone stays in the view (as
down and drained) so an operator still sees it.

A value's KV key (``<cluster>.<node>``) says whose it is, never its body: a role writes
the nodes' keys it is allowed, and every reader looks a node up by key. A heartbeat
whose body names another node is dropped (logged); a drain record that does, or does
not decode, still drains the node of its key (stopping work is the safe side), as a
worker's ``DrainWatch`` of that key has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import msgspec
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from tandem.common import log, subjects
from tandem.common.bus import Bus, KeyWatch, snapshot
from tandem.common.bus.kv import entries
from tandem.common.errors import EventDecodeError
from tandem.common.events import DrainRecord, GpuBrief, Health, ModelsLoaded, NodeHeartbeat, decode
from tandem.common.streams import HEARTBEAT_TTL, KV_DRAINS, KV_NODES

_log = log.get("tandem.fleet")
N = TypeVar("N", NodeHeartbeat, DrainRecord)
_DELETED = ("DEL", "PURGE")


# A node's status: its heartbeat's health, "drained", or "down" (no fresh heartbeat).
NODE_STATES = (*(h.value for h in Health), "down")


class NodeView(msgspec.Struct, kw_only=True):
    cluster: str
    node: str
    status: str  # one of NODE_STATES
    health: Health | None  # from the last heartbeat; None when there is none
    up: bool
    serving: bool
    drained: bool
    drain_reason: str = ""
    drained_by: str = ""
    last_heartbeat: float | None = None  # epoch seconds, the agent's clock
    age_s: float | None = None
    gpus_total: int = 0
    gpus_usable: int = 0
    gpus_free: int = 0
    models: list[str] = []
    findings: list[str] = []
    gpus: list[GpuBrief] = []
    backend: str = ""


class ClusterCounts(msgspec.Struct, kw_only=True):
    """One cluster in a few numbers (``clusters.ClusterSummary`` keeps the same counts
    live for routing)."""

    name: str
    healthy: bool  # at least one node serving
    nodes_total: int
    nodes_up: int
    nodes_serving: int
    nodes_drained: int
    gpus_total: int  # on up nodes
    gpus_free: int  # on serving nodes
    models: list[str]  # loaded on serving nodes


class ClusterView(ClusterCounts, kw_only=True):
    """A cluster's summary with its nodes (same fields, same order, plus two)."""

    health: dict[str, int]  # node count per status
    nodes: list[NodeView]


class FleetView(msgspec.Struct, kw_only=True):
    clusters: list[ClusterView]
    at: float
    heartbeat_ttl: float

    def cluster(self, name: str) -> ClusterView | None:
        return next((c for c in self.clusters if c.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


def _node(hb: NodeHeartbeat | None, drain: DrainRecord | None, cluster: str, node: str,
          age: float | None, ttl: float, present: bool = False) -> NodeView:
    up = hb is not None and age is not None and (present or age <= ttl)
    drained = drain is not None or (hb is not None and hb.drained)
    health = hb.health if hb is not None else None
    if not up:
        status = "down"
    elif drained:
        status = Health.drained.value
    else:
        status = health.value if health is not None else "down"
    serving = up and not drained and health not in (Health.unhealthy, Health.drained)
    view = NodeView(
        cluster=cluster, node=node, status=status, health=health, up=up, serving=serving,
        drained=drained,
        drain_reason=drain.reason if drain else (hb.drain_reason if hb else ""),
        drained_by=drain.by if drain else "",
        age_s=round(age, 3) if age is not None else None,
    )
    if hb is not None:
        view.last_heartbeat = hb.at
        view.gpus_total, view.gpus_usable = hb.gpus_total, hb.gpus_usable
        view.gpus_free = hb.gpus_free if serving else 0
        view.models, view.findings, view.gpus = hb.models, hb.findings, hb.gpus
        view.backend = hb.backend
    return view


def summarize(heartbeats: Iterable[tuple[NodeHeartbeat, float]],
              drains: Iterable[DrainRecord], *, ttl: float = HEARTBEAT_TTL,
              at: float | None = None, present: bool = False) -> FleetView:
    """Build the fleet view from ``(heartbeat, age in seconds)`` pairs and drain records.

    With ``present`` every heartbeat given is up (read from KV, whose TTL already removed
    the stale ones); without, a heartbeat is up while its age is within ``ttl``."""
    hbs = {(hb.cluster, hb.node): (hb, age) for hb, age in heartbeats}
    drs = {(d.cluster, d.node): d for d in drains}
    by_cluster: dict[str, list[NodeView]] = {}
    for key in sorted(set(hbs) | set(drs)):
        hb, age = hbs.get(key, (None, None))
        by_cluster.setdefault(key[0], []).append(
            _node(hb, drs.get(key), *key, age, ttl, present))
    clusters = []
    for name, nodes in sorted(by_cluster.items()):
        serving = [n for n in nodes if n.serving]
        counts: dict[str, int] = {}
        for n in nodes:
            counts[n.status] = counts.get(n.status, 0) + 1
        clusters.append(ClusterView(
            name=name, healthy=bool(serving), nodes_total=len(nodes),
            nodes_up=sum(n.up for n in nodes), nodes_serving=len(serving),
            nodes_drained=sum(n.drained for n in nodes),
            gpus_total=sum(n.gpus_total for n in nodes if n.up),
            gpus_free=sum(n.gpus_free for n in serving),
            models=sorted({m for n in serving for m in n.models}),
            health=counts, nodes=nodes,
        ))
    return FleetView(clusters=clusters, at=time.time() if at is None else at, heartbeat_ttl=ttl)


# ------------------------------------------------------------------------------ snapshots


def within_the_bucket(ttl: float) -> float:
    """``ttl`` if KV nodes can honour it as a heartbeat's freshness; else ``ValueError``.

    The bucket drops a heartbeat ``HEARTBEAT_TTL`` after it was written, silently for a
    watch: a longer freshness kept routing to a dead agent's cluster while /metrics, which
    reads the bucket, already said down. The bucket's TTL is not a gateway's to change:
    every service provisions it alike (streams.py), and a differing one is a conflict.
    """
    if ttl > HEARTBEAT_TTL:
        raise ValueError(
            f"a heartbeat TTL of {ttl:g} s is longer than KV nodes' ({HEARTBEAT_TTL:g} s): "
            f"a heartbeat is gone from the bucket {HEARTBEAT_TTL:g} s after it was written, "
            f"so no node could stay fresh that long; use at most {HEARTBEAT_TTL:g}")
    return ttl


def keyed(key: str, data: bytes, event_type: type[N]) -> N:
    """``data``, the value at ``key`` (``<cluster>.<node>``) of KV ``nodes`` or
    ``drains``, decoded; raises ``EventDecodeError`` when it does not decode or when its
    body names another cluster or node than its key (a stray or forged entry: a body
    under ``ghost.n9`` saying ``cluster=east`` must not count for east)."""
    event = decode(data, event_type)
    cluster, _, node = key.partition(".")
    if (event.cluster, event.node) != (cluster, node):
        raise EventDecodeError(event_type.__name__, f"its body names {event.cluster}/"
                               f"{event.node}, its key {key}", bytes(data[:1024]))
    return event


def heartbeat_of(key: str, data: bytes) -> NodeHeartbeat | None:
    """The heartbeat at ``key`` of KV ``nodes``, or None (logged) when it does not decode
    or names another node than its key."""
    try:
        return keyed(key, data, NodeHeartbeat)
    except EventDecodeError as exc:
        _log.warning("fleet.bad_heartbeat", key=key, error=exc.reason)
        return None


def drain_of(key: str, data: bytes) -> DrainRecord:
    """The drain at ``key`` of KV ``drains``; one that does not decode, or names another
    node, is still a drain of ``key``'s node (logged): stopping work is the safe side."""
    try:
        return keyed(key, data, DrainRecord)
    except EventDecodeError as exc:
        _log.warning("fleet.bad_drain", key=key, error=exc.reason)
        cluster, _, node = key.partition(".")
        return DrainRecord(cluster=cluster, node=node,
                           reason=f"unreadable drain record: {exc.reason}")


async def read_drains(bus: Bus) -> list[DrainRecord]:
    return [drain_of(k, v) for k, v in (await snapshot(await bus.kv(KV_DRAINS))).items()]


async def read_heartbeats(bus: Bus) -> list[NodeHeartbeat]:
    raw = await snapshot(await bus.kv(KV_NODES))
    return [hb for k, v in raw.items() if (hb := heartbeat_of(k, v)) is not None]


async def read_fleet(bus: Bus, ttl: float = HEARTBEAT_TTL) -> FleetView:
    """One snapshot of the fleet.

    A node is up while its heartbeat entry is in KV ``nodes`` (the bucket's TTL,
    ``HEARTBEAT_TTL``, removes a dead agent's), whatever the agent's clock says; ages
    count from the entry's server timestamp. A ``ttl`` shorter than the bucket's (a
    gateway's ``TANDEM_HEARTBEAT_TTL``) also wants that age within it, as the same
    gateway's ``ClusterBoard`` does: its ``/metrics`` and its routing agree.
    """
    raw, drains = await asyncio.gather(entries(await bus.kv(KV_NODES)), read_drains(bus))
    now = time.time()
    heartbeats = []
    for key, entry in raw.items():
        hb = heartbeat_of(key, entry.value or b"")
        if hb is not None:
            stored = entry.created.timestamp() if entry.created else now
            heartbeats.append((hb, max(0.0, now - stored)))
    return summarize(heartbeats, drains, ttl=ttl, at=now, present=ttl >= HEARTBEAT_TTL)


# --------------------------------------------------------------------------- drain records


def operator() -> str:
    with contextlib.suppress(Exception):
        return f"{getpass.getuser()}@{socket.gethostname()}"
    return "unknown"


async def drain(bus: Bus, cluster: str, node: str, reason: str, by: str = "",
                overwrite: bool = True) -> DrainRecord:
    """Drain a node: its workers stop pulling, the trainer leaves it out of restarts.

    With ``overwrite=False`` an existing drain (and its reason) is kept and returned.
    """
    if not reason.strip():
        raise ValueError("a drain needs a reason")
    key = subjects.node_key(cluster, node)
    record = DrainRecord(cluster=cluster, node=node, reason=reason.strip(), by=by or operator())
    kv = await bus.kv(KV_DRAINS)
    if overwrite:
        await kv.put(key, msgspec.json.encode(record))
        return record
    from nats.js.errors import KeyWrongLastSequenceError

    try:
        await kv.create(key, msgspec.json.encode(record))
        return record
    except KeyWrongLastSequenceError:
        current = await drain_record(bus, cluster, node)
        return current or record


async def undrain(bus: Bus, cluster: str, node: str) -> DrainRecord | None:
    """Return a node to service; returns the drain that was lifted, if there was one.

    The delete is written even when the node was not drained: its agent takes an
    undrain as the operator's word that latched faults were dealt with.
    """
    previous = await drain_record(bus, cluster, node)
    kv = await bus.kv(KV_DRAINS)
    await kv.delete(subjects.node_key(cluster, node))
    return previous


async def _node_entry(bus: Bus, bucket: str, key: str) -> bytes | None:
    kv = await bus.kv(bucket)
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, KeyDeletedError):
        return None
    return entry.value or None


async def drain_record(bus: Bus, cluster: str, node: str) -> DrainRecord | None:
    """The node's drain, or None when it is not drained."""
    key = subjects.node_key(cluster, node)
    value = await _node_entry(bus, KV_DRAINS, key)
    return drain_of(key, value) if value is not None else None


async def heartbeat(bus: Bus, cluster: str, node: str) -> NodeHeartbeat | None:
    """The node's latest heartbeat, or None when it has none within the TTL (or one
    that is not the node's: ``heartbeat_of``)."""
    key = subjects.node_key(cluster, node)
    value = await _node_entry(bus, KV_NODES, key)
    return heartbeat_of(key, value) if value is not None else None


async def announce_models(bus: Bus, cluster: str, node: str, worker: str,
                          models: list[str]) -> None:
    """Tell the node's agent what ``worker`` has loaded; repeat every few seconds."""
    await bus.emit(subjects.models(cluster, node),
                   ModelsLoaded(cluster=cluster, node=node, worker=worker, models=models))


# ----------------------------------------------------------------------------- live watches

OnDrain = Callable[[DrainRecord | None], Awaitable[None]]


class DrainWatch(KeyWatch):
    """Whether one node is drained, kept current by a KV watch on ``drains``.

    ``drained`` is valid once ``start()`` returns. ``on_change(record)`` runs for every
    drain (a record) and undrain (None) written after the start, even one that does
    not change ``drained`` (the agent takes any undrain as "faults dealt with"), and
    when a re-watch finds that the state changed while the watch was gone.
    """

    def __init__(self, bus: Bus, cluster: str, node: str, on_change: OnDrain | None = None,
                 resync: float = 5.0, board: DrainBoard | None = None) -> None:
        super().__init__(bus, KV_DRAINS, subjects.node_key(cluster, node), resync)
        self.cluster, self.node = cluster, node
        self.on_change = on_change
        self.record: DrainRecord | None = None
        self.changed = asyncio.Event()
        self.board = board

    async def start(self) -> None:
        """Load the node's drain state and follow it: by a watch of its own, or through
        ``board`` when one process hosts many nodes of the cluster."""
        if self.board is None:
            await super().start()
        else:
            await self.board.attach(self)

    async def stop(self) -> None:
        if self.board is None:
            await super().stop()
        else:
            self.board.detach(self)

    @property
    def drained(self) -> bool:
        return self.record is not None

    async def __aenter__(self) -> DrainWatch:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait(self, drained: bool, timeout: float) -> bool:
        """Wait until ``drained`` is the state (or ``timeout``); return whether it is."""
        deadline = time.monotonic() + timeout
        while self.drained != drained:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)
        return True

    def _parse(self, value: bytes | None) -> DrainRecord | None:
        return drain_of(self.pattern, value) if value else None

    async def _set(self, record: DrainRecord | None, notify: bool) -> None:
        self.record = record
        self.changed.set()
        if notify and self.on_change is not None:
            await self.on_change(record)

    async def replace(self, values: dict[str, bytes], first: bool) -> None:
        record = self._parse(values.get(self.pattern))
        changed = (record is None) != (self.record is None)
        await self._set(record, notify=changed and not first)

    async def update(self, key: str, value: bytes | None) -> None:
        await self._set(self._parse(value), notify=True)


class DrainBoard(KeyWatch):
    """One watch on KV ``drains`` for every node of one cluster hosted by a process.

    A process that runs many nodes' agents (the simulated fleet multiplexes hundreds)
    would otherwise hold an ordered consumer, with its heartbeats and resync checks, per
    node. Each node's ``DrainWatch(board=...)`` is fed from this one watch instead, with
    the same semantics: its state on attach, then every change to its key, and a
    re-watch's state applied to all of them.
    """

    def __init__(self, bus: Bus, cluster: str, resync: float = 5.0) -> None:
        super().__init__(bus, KV_DRAINS, f"{subjects.token(cluster, 'cluster')}.*", resync)
        self.views: dict[str, DrainWatch] = {}
        self.values: dict[str, bytes] = {}
        self._starting = asyncio.Lock()

    async def attach(self, view: DrainWatch) -> None:
        async with self._starting:
            if self._task is None:
                await super().start()
        self.views[view.pattern] = view
        await view.replace(self.values, True)

    def detach(self, view: DrainWatch) -> None:
        if self.views.get(view.pattern) is view:
            del self.views[view.pattern]

    async def replace(self, values: dict[str, bytes], first: bool) -> None:
        self.values = dict(values)
        for view in list(self.views.values()):
            await view.replace(self.values, first)

    async def update(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.values.pop(key, None)
        else:
            self.values[key] = value
        view = self.views.get(key)
        if view is not None:
            await view.update(key, value)
