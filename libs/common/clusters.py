"""Per-cluster summaries for routing and failover, kept current at O(1) per heartbeat.

``fleet.FleetWatch.view()`` rebuilds every node's view on each call: right for an
operator's screen, too slow for a decision taken on every request of a large fleet.
``ClusterBoard`` follows the same KV watches (``nodes``, ``drains``) but keeps running
sums per cluster, so a read costs O(clusters) whatever the number of nodes:

- each heartbeat or drain change replaces that node's contribution to its cluster's
  sums (serving nodes, usable and free GPUs, models loaded);
- a heartbeat's freshness expires ``ttl`` seconds after it was received (KV expiry is
  silent); a heap of expiry times retires stale contributions when the board is read,
  amortised O(1) per heartbeat.

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

from tandem.common import log
from tandem.common.bus import Bus
from tandem.common.errors import EventDecodeError
from tandem.common.events import Health, NodeHeartbeat, decode
from tandem.common.fleet import _MapWatch
from tandem.common.streams import HEARTBEAT_TTL, KV_DRAINS, KV_NODES

_log = log.get("tandem.clusters")
_NOT_SERVING = (Health.unhealthy, Health.drained)


@dataclass(frozen=True, slots=True)
class ClusterSummary:
    """One cluster as routing sees it, at one instant (monotonic clock)."""

    name: str
    healthy: bool
    nodes_serving: int
    gpus_usable: int
    gpus_free: int
    models: frozenset[str]
    unhealthy_since: float | None  # monotonic; None while healthy

    def unhealthy_for(self, now: float | None = None) -> float:
        """Seconds this cluster has been unhealthy (0 while healthy)."""
        if self.unhealthy_since is None:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self.unhealthy_since)

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        return {"name": self.name, "healthy": self.healthy, "nodes_serving": self.nodes_serving,
                "gpus_usable": self.gpus_usable, "gpus_free": self.gpus_free,
                "models": sorted(self.models),
                "unhealthy_for_s": round(self.unhealthy_for(now), 3)}


@dataclass(slots=True)
class _Node:
    cluster: str
    hb: NodeHeartbeat | None = None
    seen: float = 0.0  # monotonic time the heartbeat was received
    drained: bool = False  # a drain record exists
    counted: bool = False  # contributes to its cluster's sums now
    stamp: int = 0  # bumped on every change, so stale heap entries are recognised


@dataclass(slots=True)
class _Sums:
    serving: int = 0
    gpus_usable: int = 0
    gpus_free: int = 0
    models: Counter[str] = field(default_factory=Counter)
    unhealthy_since: float | None = 0.0


class ClusterBoard:
    """Live per-cluster health and capacity from KV ``nodes`` and ``drains``.

    ``clusters`` are reported even before (or without) any heartbeat. Use as
    ``async with ClusterBoard(bus, ttl) as board:`` or ``start()`` / ``stop()``;
    ``summary(name)`` and ``summaries()`` are synchronous and cheap.
    """

    def __init__(self, bus: Bus, ttl: float = HEARTBEAT_TTL, clusters: tuple[str, ...] = ()
                 ) -> None:
        self.ttl = ttl
        self.started = time.monotonic()
        self._nodes: dict[str, _Node] = {}
        self._sums: dict[str, _Sums] = {c: _Sums(unhealthy_since=self.started) for c in clusters}
        self._expiry: list[tuple[float, int, str]] = []
        self._watches = [_MapWatch(bus, KV_NODES, self._on_heartbeat),
                         _MapWatch(bus, KV_DRAINS, self._on_drain)]

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
        return ClusterSummary(name, s.serving > 0, s.serving, s.gpus_usable, s.gpus_free,
                              frozenset(m for m, n in s.models.items() if n > 0),
                              s.unhealthy_since)

    def summaries(self, now: float | None = None) -> list[ClusterSummary]:
        """Every cluster known (configured or heard from), by name."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        return [self.summary(name, now) for name in sorted(self._sums)]

    def clusters(self) -> list[str]:
        return sorted(self._sums)

    # --------------------------------------------------------------------------- updates

    def _cluster(self, name: str) -> _Sums:
        s = self._sums.get(name)
        if s is None:
            s = self._sums[name] = _Sums(unhealthy_since=self.started)
        return s

    def _contribute(self, node: _Node, sign: int, now: float) -> None:
        hb = node.hb
        assert hb is not None
        s = self._cluster(node.cluster)
        was_healthy = s.serving > 0
        s.serving += sign
        s.gpus_usable += sign * hb.gpus_usable
        s.gpus_free += sign * hb.gpus_free
        for m in hb.models:
            s.models[m] += sign
            if s.models[m] <= 0:
                del s.models[m]
        node.counted = sign > 0
        if s.serving > 0:
            s.unhealthy_since = None
        elif was_healthy:
            s.unhealthy_since = now

    def _set(self, key: str, node: _Node, now: float, **changes: Any) -> None:
        """Apply ``changes`` to ``node`` and recount it; ``now`` dates a loss of health."""
        if node.counted:  # take back what the node's previous state contributed
            self._contribute(node, -1, now)
        for name, value in changes.items():
            setattr(node, name, value)
        node.stamp += 1
        hb = node.hb
        if hb is None:
            return
        expires = node.seen + self.ttl
        serving = (expires > now and not node.drained and not hb.drained
                   and hb.health not in _NOT_SERVING)
        if serving:
            self._contribute(node, +1, now)
            heapq.heappush(self._expiry, (expires, node.stamp, key))

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            expires, stamp, key = heapq.heappop(self._expiry)
            node = self._nodes.get(key)
            if node is not None and node.stamp == stamp and node.counted:
                # Unhealthy since the heartbeat went stale, not since someone looked.
                self._contribute(node, -1, expires)

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
        try:
            hb = decode(value, NodeHeartbeat)
        except EventDecodeError as exc:
            _log.warning("clusters.bad_heartbeat", key=key, error=exc.reason)
            return
        node = self._node(key, hb.cluster)
        if rewatch:
            if node.hb == hb:
                return  # the same heartbeat again: no fresher than when it came
            # A value loaded by a (re)watch may be old: date it by the agent's clock.
            seen = now - min(max(0.0, time.time() - hb.at), 10 * self.ttl)
        else:
            seen = now
        self._set(key, node, now, hb=hb, seen=seen, cluster=hb.cluster)

    def _on_drain(self, key: str, value: bytes | None, rewatch: bool) -> None:
        now = time.monotonic()
        self._expire(now)
        cluster = key.split(".", 1)[0]  # drains are keyed <cluster>.<node>
        node = self._node(key, cluster)
        drained = value is not None  # an unreadable drain is still a drain
        if drained != node.drained:
            self._set(key, node, now, drained=drained)
