"""The live fleet: per-cluster summaries for routing and failover, kept current at O(1)
per heartbeat, and every node's view on demand.

``ClusterBoard`` follows KV ``nodes`` and ``drains`` by watches and keeps running sums
per cluster, so a read costs O(clusters) whatever the number of nodes (``view()``, which
builds every node's view as ``fleet.read_fleet`` does, is for an operator's screen):

- each heartbeat or drain change replaces that node's contribution to its cluster's
  sums (serving nodes, usable and free GPUs, models loaded);
- a heartbeat's freshness expires ``ttl`` seconds after it was received (KV expiry is
  silent); a heap of expiry times retires stale contributions when the board is read,
  amortised O(1) per heartbeat. One loaded by a (re)watch (a board starting, or
  watching again after a reconnect) was received when the server stored it (the entry's
  timestamp): an agent's clock, however wrong, never dates it;
- a heartbeat counts for the node of its key (``fleet.heartbeat_of``), never for the
  cluster its body names.

The rule is ``fleet``'s: a node serves while its heartbeat is fresh, it is not drained
and not unhealthy; a cluster is healthy while at least one node serves. A cluster the
board has never heard from counts as unhealthy since the board started, so a process
started after a cluster died still sees it as down (and for how long).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tandem.common.bus import Bus, MapWatch
from tandem.common.events import DrainRecord, Health, NodeHeartbeat
from tandem.common.fleet import FleetView, drain_of, heartbeat_of, summarize
from tandem.common.streams import HEARTBEAT_TTL, KV_DRAINS, KV_NODES

_NOT_SERVING = (Health.unhealthy, Health.drained)


@dataclass(frozen=True, slots=True)
class ClusterSummary:
    """One cluster as routing sees it, at one instant (monotonic clock)."""

    name: str
    healthy: bool  # at least one node serving
    nodes_serving: int
    gpus_usable: int  # on serving nodes
    gpus_free: int  # on serving nodes
    models: frozenset[str]  # loaded on serving nodes
    unhealthy_since: float | None  # monotonic; None while healthy
    nodes_total: int = 0  # with a heartbeat key or a drain record
    nodes_up: int = 0  # heartbeat fresh
    nodes_drained: int = 0
    gpus_total: int = 0  # on up nodes

    def unhealthy_for(self, now: float | None = None) -> float:
        """Seconds this cluster has been unhealthy (0 while healthy)."""
        if self.unhealthy_since is None:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self.unhealthy_since)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        return {"name": self.name, "healthy": self.healthy, "nodes_total": self.nodes_total,
                "nodes_up": self.nodes_up, "nodes_serving": self.nodes_serving,
                "nodes_drained": self.nodes_drained, "gpus_total": self.gpus_total,
                "gpus_usable": self.gpus_usable, "gpus_free": self.gpus_free,
                "models": sorted(self.models),
                "unhealthy_for_s": round(self.unhealthy_for(now), 3)}


# A node's share of its cluster's counts, in this order.
_TOTAL, _UP, _SERVING, _DRAINED, _GPUS_TOTAL, _GPUS_USABLE, _GPUS_FREE = range(7)
_NOTHING = (0,) * 7


@dataclass(slots=True)
class _Node:
    cluster: str
    hb: NodeHeartbeat | None = None
    seen: float = 0.0  # monotonic time the heartbeat was received
    drain: DrainRecord | None = None
    share: tuple[int, ...] = _NOTHING  # what it adds to its cluster's counts now
    models: tuple[str, ...] = ()  # what it adds to its cluster's models now
    stamp: int = 0  # bumped on every change, so stale heap entries are recognised


@dataclass(slots=True)
class _Sums:
    counts: list[int] = field(default_factory=lambda: [0] * len(_NOTHING))
    models: Counter[str] = field(default_factory=Counter)
    unhealthy_since: float | None = 0.0


class ClusterBoard:
    """Live per-cluster counts, health and capacity from KV ``nodes`` and ``drains``.

    ``clusters`` are reported even before (or without) any heartbeat. Use as
    ``async with ClusterBoard(bus, ttl) as board:`` or ``start()`` / ``stop()``;
    ``summary(name)`` and ``summaries()`` are synchronous and cost O(clusters); ``view()``
    builds every node's view (``fleet.FleetView``) for an operator's screen.

    A heartbeat stale for ten times the TTL is forgotten (KV expiry is silent), so a
    fleet whose nodes come and go for months does not grow the board.
    """

    FORGET_AFTER = 10  # TTLs after its heartbeat, a silent node is forgotten

    def __init__(self, bus: Bus, ttl: float = HEARTBEAT_TTL, clusters: tuple[str, ...] = ()
                 ) -> None:
        self.ttl = ttl
        self.started = time.monotonic()
        self._nodes: dict[str, _Node] = {}
        self._sums: dict[str, _Sums] = {c: _Sums(unhealthy_since=self.started) for c in clusters}
        self._expiry: list[tuple[float, int, str]] = []
        self._beats = MapWatch(bus, KV_NODES, self._on_heartbeat)
        self._watches = [self._beats, MapWatch(bus, KV_DRAINS, self._on_drain)]

    async def start(self) -> ClusterBoard:
        """Return once the current heartbeats and drains are loaded."""
        for w in self._watches:
            await w.start()
        return self

    async def stop(self) -> None:
        for w in self._watches:
            await w.stop()

    async def __aenter__(self) -> ClusterBoard:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------------------- reads

    def summary(self, name: str, now: float | None = None) -> ClusterSummary:
        now = time.monotonic() if now is None else now
        self._expire(now)
        s = self._sums.get(name)
        if s is None:  # never heard of: down since this board started
            return ClusterSummary(name, False, 0, 0, 0, frozenset(), self.started)
        c = s.counts
        return ClusterSummary(name, c[_SERVING] > 0, c[_SERVING], c[_GPUS_USABLE],
                              c[_GPUS_FREE], frozenset(m for m, n in s.models.items() if n > 0),
                              s.unhealthy_since, nodes_total=c[_TOTAL], nodes_up=c[_UP],
                              nodes_drained=c[_DRAINED], gpus_total=c[_GPUS_TOTAL])

    def summaries(self, now: float | None = None) -> list[ClusterSummary]:
        """Every cluster known (configured or heard from), by name."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        return [self.summary(name, now) for name in sorted(self._sums)]

    def clusters(self) -> list[str]:
        return sorted(self._sums)

    def placements(self, now: float | None = None) -> dict[str, list[str]]:
        """Each model loaded on a node whose heartbeat is fresh (drained or unhealthy
        nodes too: the model is loaded there), with those nodes as ``cluster/node``,
        sorted. O(nodes) in memory: no read of the bus."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        out: dict[str, list[str]] = {}
        for node in self._nodes.values():
            hb = node.hb
            if hb is not None and node.seen + self.ttl > now:
                for model in hb.models:
                    out.setdefault(model, []).append(f"{hb.cluster}/{hb.node}")
        return {model: sorted(where) for model, where in out.items()}

    def view(self) -> FleetView:
        """Every node's view, as ``fleet.read_fleet`` builds it from a snapshot; ages
        count from when this process received each heartbeat."""
        now = time.monotonic()
        self._expire(now)
        nodes = list(self._nodes.values())
        return summarize(((n.hb, now - n.seen) for n in nodes if n.hb is not None),
                         [n.drain for n in nodes if n.drain is not None], ttl=self.ttl)

    # --------------------------------------------------------------------------- updates

    def _cluster(self, name: str) -> _Sums:
        s = self._sums.get(name)
        if s is None:
            s = self._sums[name] = _Sums(unhealthy_since=self.started)
        return s

    def _share(self, node: _Node, at: float) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``node``'s share of its cluster at ``at``: the rule of ``fleet``'s view."""
        hb = node.hb
        if hb is None and node.drain is None:
            return _NOTHING, ()
        up = hb is not None and node.seen + self.ttl > at
        drained = node.drain is not None or (hb is not None and hb.drained)
        serving = up and not drained and hb is not None and hb.health not in _NOT_SERVING
        if hb is None:
            return (1, 0, 0, int(drained), 0, 0, 0), ()
        return ((1, int(up), int(serving), int(drained), hb.gpus_total if up else 0,
                 hb.gpus_usable if serving else 0, hb.gpus_free if serving else 0),
                tuple(hb.models) if serving else ())

    def _apply(self, node: _Node, sign: int, at: float) -> None:
        s = self._cluster(node.cluster)
        was_healthy = s.counts[_SERVING] > 0
        for i, v in enumerate(node.share):
            s.counts[i] += sign * v
        for m in node.models:
            s.models[m] += sign
            if s.models[m] <= 0:
                del s.models[m]
        if s.counts[_SERVING] > 0:
            s.unhealthy_since = None
        elif was_healthy:
            s.unhealthy_since = at

    def _set(self, key: str, node: _Node, at: float, **changes: Any) -> None:
        """Apply ``changes`` to ``node`` and recount its share as of ``at`` (which also
        dates a loss of health); forget a node left with neither heartbeat nor drain."""
        self._apply(node, -1, at)  # take back what its previous state contributed
        for name, value in changes.items():
            setattr(node, name, value)
        node.stamp += 1
        node.share, node.models = self._share(node, at)
        self._apply(node, +1, at)
        if node.hb is None and node.drain is None:
            del self._nodes[key]
        elif node.hb is not None:
            expires = node.seen + self.ttl
            when = expires if expires > at else node.seen + self.FORGET_AFTER * self.ttl
            heapq.heappush(self._expiry, (when, node.stamp, key))

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            when, stamp, key = heapq.heappop(self._expiry)
            node = self._nodes.get(key)
            if node is None or node.stamp != stamp:
                continue  # changed since: a newer entry stands for it
            if node.seen + self.ttl >= when:  # its heartbeat went stale at ``when``
                # Unhealthy since then, not since someone looked.
                self._set(key, node, when)
            else:  # silent for FORGET_AFTER TTLs: drop the heartbeat
                self._set(key, node, when, hb=None)

    def _node(self, key: str, cluster: str) -> _Node:
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = _Node(cluster=cluster)
        return node

    def _on_heartbeat(self, key: str, value: bytes | None, rewatch: bool) -> None:
        now = time.monotonic()
        self._expire(now)
        node = self._nodes.get(key)
        if value is None:
            if node is not None and node.hb is not None:
                self._set(key, node, now, hb=None)
            return
        hb = heartbeat_of(key, value)
        if hb is None:  # unreadable, or another node's body: logged, the old one stands
            return
        node = self._node(key, hb.cluster)
        if rewatch:
            if node.hb == hb:
                return  # the same heartbeat again: no fresher than when it came
            # A value loaded by a (re)watch may be old: date it by when the server stored
            # it, as fleet.read_fleet does (an agent's clock may be off by hours).
            stored = self._beats.written(key)
            age = 0.0 if stored is None else max(0.0, time.time() - stored)
            seen = now - min(age, self.FORGET_AFTER * self.ttl)
        else:
            seen = now
        self._set(key, node, now, hb=hb, seen=seen, cluster=hb.cluster)

    def _on_drain(self, key: str, value: bytes | None, rewatch: bool) -> None:
        now = time.monotonic()
        self._expire(now)
        if value is None:
            node = self._nodes.get(key)
            if node is not None and node.drain is not None:
                self._set(key, node, now, drain=None)
            return
        drain = drain_of(key, value)  # an unreadable drain is still a drain
        node = self._node(key, drain.cluster)
        if drain != node.drain:
            self._set(key, node, now, drain=drain)
