"""Where a new task goes: ``choose_cluster`` is the one seam for routing.

With a ``Router`` (the gateway's default, ``TANDEM_ROUTING=fleet``), in this order:

1. a pin names one of the configured clusters (else 422), which gets the task if it is
   healthy (else 503), serves the model (else 503) and is under its backlog limit
   (else 429);
2. otherwise the healthy clusters (a fresh heartbeat from at least one undrained,
   not-unhealthy node) that serve the model, under their backlog limit, compete: clusters
   with the model loaded first, then the largest usable GPUs minus backlog, then
   configuration order. A cluster serves the model if a serving node there announces it,
   or if its serving nodes announce no models at all (nothing known);
3. none healthy, or no healthy one serving the model: 503 with Retry-After; those left
   all over the limit: 429 with Retry-After. Nothing is ever enqueued where it is known
   not to run.

Reads are O(clusters): health and capacity come from ``ClusterBoard``'s running sums,
backlogs from one ``stream_info`` per cluster every ``backlog_refresh`` seconds (in the
background), plus what this gateway routed since, so a burst spreads across clusters
instead of piling onto the one that looked emptiest at the last refresh.

Without a router (``TANDEM_ROUTING=static``, for a deployment without cluster agents)
a pin is honoured as is and anything else goes to the first configured cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from tandem.common import log, metrics, subjects
from tandem.common.bus import Bus, describe
from tandem.common.clusters import ClusterBoard, ClusterSummary
from tandem.common.fleet import within_the_bucket
from tandem.common.settings import Settings
from tandem.common.streams import HEARTBEAT_TTL

_log = log.get("tandem.gateway.routing")

ROUTED = metrics.Counter("tandem_gateway_routed", "Routing decisions by outcome",
                         ["outcome"])


class RoutingSettings(Settings):
    """The gateway's routing settings (mixed into ``GatewaySettings``)."""

    routing: Literal["fleet", "static"] = Field(
        "fleet", description="fleet: route by cluster health, capacity and backlog; "
        "static: pins as given, else the first configured cluster (no agents needed).")
    heartbeat_ttl: float = Field(
        HEARTBEAT_TTL, gt=0, description="Seconds a node's heartbeat counts as fresh, for "
        "routing and /metrics alike; a cluster with no fresh undrained node gets no new "
        f"tasks. At most {HEARTBEAT_TTL:g}, the TTL of KV nodes.")
    max_backlog: int = Field(
        10_000, ge=1, description="Tasks waiting or running in one cluster's queue above "
        "which it gets no new ones (429 when every healthy cluster is over).")
    backlog_refresh: float = Field(
        0.25, gt=0, le=60, description="Seconds between reads of each queue's depth.")
    retry_after_unavailable: float = Field(
        5.0, gt=0, description="Retry-After of a 503 (no healthy cluster).")
    retry_after_busy: float = Field(
        2.0, gt=0, description="Retry-After of a 429 (every healthy cluster over its backlog).")

    @field_validator("heartbeat_ttl")
    @classmethod
    def _within_the_bucket(cls, ttl: float) -> float:
        return within_the_bucket(ttl)


@dataclass
class RoutingError(Exception):
    """No cluster can take the task; ``status`` is the HTTP status to answer with."""

    status: int
    message: str
    field: str | None = None  # the request field at fault (a bad pin), if any
    retry_after: float | None = None

    def __str__(self) -> str:
        return self.message


@dataclass
class _Backlog:
    depth: int = 0  # messages in the queue at the last read
    routed: int = 0  # tasks this gateway sent there since
    read_at: float = 0.0

    @property
    def value(self) -> int:
        return self.depth + self.routed


class Router:
    """Routing by fleet health, capacity and backlog; one per gateway process."""

    def __init__(self, bus: Bus, clusters: list[str], *, ttl: float = HEARTBEAT_TTL,
                 max_backlog: int = 10_000, backlog_refresh: float = 0.25,
                 retry_after_unavailable: float = 5.0, retry_after_busy: float = 2.0) -> None:
        self.bus = bus
        self.clusters = list(clusters)
        self.max_backlog = max_backlog
        self.backlog_refresh = backlog_refresh
        self.retry_after_unavailable = retry_after_unavailable
        self.retry_after_busy = retry_after_busy
        self.board = ClusterBoard(bus, within_the_bucket(ttl), tuple(self.clusters))
        self.backlog = {c: _Backlog() for c in self.clusters}
        self._refresher: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, bus: Bus, s: RoutingSettings, clusters: list[str]) -> Router:
        return cls(bus, clusters, ttl=s.heartbeat_ttl, max_backlog=s.max_backlog,
                   backlog_refresh=s.backlog_refresh,
                   retry_after_unavailable=s.retry_after_unavailable,
                   retry_after_busy=s.retry_after_busy)

    async def start(self) -> Router:
        """Load the fleet and the queue depths; refresh depths in the background."""
        await self.board.start()
        await self._refresh()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="routing backlog")
        return self

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
            self._refresher = None
        await self.board.stop()

    # ---------------------------------------------------------------------------- backlog

    async def _depth(self, cluster: str) -> int | None:
        try:
            info = await self.bus.js.stream_info(subjects.gen_stream_name(cluster))
        except Exception as exc:  # a reconnect or election: keep the last known depth
            _log.debug("routing.depth_unreadable", cluster=cluster, error=describe(exc))
            return None
        return int(info.state.messages)

    async def _refresh(self) -> None:
        # Tasks routed while the depths are read may or may not be in them: count them
        # as not (the limit errs on the side of the queue being fuller).
        before = {c: b.routed for c, b in self.backlog.items()}
        depths = await asyncio.gather(*(self._depth(c) for c in self.clusters))
        now = time.monotonic()
        for cluster, depth in zip(self.clusters, depths, strict=True):
            if depth is not None:
                during = self.backlog[cluster].routed - before[cluster]
                self.backlog[cluster] = _Backlog(depth=depth, routed=during, read_at=now)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.backlog_refresh)  # periodic poll of queue depths
            await self._refresh()

    # ---------------------------------------------------------------------------- decide

    def choose(self, pin: str | None, model: str) -> str:
        """The cluster for a new task of ``model``; raises ``RoutingError``."""
        try:
            cluster = self._choose(pin, model)
        except RoutingError as exc:
            ROUTED.labels(str(exc.status)).inc()
            raise
        self.backlog[cluster].routed += 1
        ROUTED.labels("pinned" if pin else "routed").inc()
        return cluster

    def _choose(self, pin: str | None, model: str) -> str:
        if pin is not None:
            _check_pin(self.clusters, pin)
            s = self.board.summary(pin)
            if not s.healthy:
                raise RoutingError(503, f"cluster {pin} is not healthy (no fresh heartbeat "
                                   "from an undrained node)",
                                   retry_after=self.retry_after_unavailable)
            if not _serves(s, model):
                raise RoutingError(503, f"cluster {pin} does not serve model {model!r} "
                                   f"(its nodes serve {', '.join(sorted(s.models))})",
                                   retry_after=self.retry_after_unavailable)
            if self.backlog[pin].value >= self.max_backlog:
                raise RoutingError(429, f"cluster {pin} has {self.backlog[pin].value} tasks "
                                   f"queued (limit {self.max_backlog})",
                                   retry_after=self.retry_after_busy)
            return pin
        if not self.clusters:
            raise RoutingError(503, "no cluster is configured",
                               retry_after=self.retry_after_unavailable)
        now = time.monotonic()
        healthy = [s for c in self.clusters if (s := self.board.summary(c, now)).healthy]
        if not healthy:
            raise RoutingError(503, f"no healthy cluster (of {', '.join(self.clusters)}); "
                               "none has a fresh heartbeat from an undrained node",
                               retry_after=self.retry_after_unavailable)
        # Only where the model is known to run: a cluster announcing no models at all
        # (nothing known) stays a candidate.
        serving = [s for s in healthy if _serves(s, model)]
        if not serving:
            raise RoutingError(503, f"no healthy cluster serves model {model!r} (healthy: "
                               f"{', '.join(s.name for s in healthy)})",
                               retry_after=self.retry_after_unavailable)
        open_ = [s for s in serving if self.backlog[s.name].value < self.max_backlog]
        if not open_:
            raise RoutingError(429, f"every healthy cluster has at least {self.max_backlog} "
                               "tasks queued", retry_after=self.retry_after_busy)
        order = {c: i for i, c in enumerate(self.clusters)}
        best = max(open_, key=lambda s: (model in s.models, self._score(s), -order[s.name]))
        return best.name

    def _score(self, s: ClusterSummary) -> int:
        return s.gpus_usable - self.backlog[s.name].value

    def describe(self) -> list[dict[str, Any]]:
        """Each configured cluster's health, capacity and backlog (for /healthz)."""
        now = time.monotonic()
        return [{**self.board.summary(c, now).to_dict(now),
                 "backlog": self.backlog[c].value} for c in self.clusters]


def _serves(s: ClusterSummary, model: str) -> bool:
    """Whether ``model`` may run in cluster ``s``: loaded on a serving node there, or
    nothing known (its serving nodes announce no models)."""
    return not s.models or model in s.models


def _check_pin(clusters: list[str], pin: str) -> None:
    if pin not in clusters:
        raise RoutingError(422, f"unknown cluster {pin!r}; known: {', '.join(clusters)}",
                           field="cluster")


async def choose_cluster(clusters: list[str], pin: str | None, model: str,
                         router: Router | None = None) -> str:
    """The cluster for a new task of ``model``; raises ``RoutingError``.

    With ``router`` the fleet decides (see the module); without, a pin as given or the
    first configured cluster.
    """
    if router is not None:
        return router.choose(pin, model)
    if pin is not None:
        _check_pin(clusters, pin)
        return pin
    if not clusters:
        raise RoutingError(503, "no cluster is configured", retry_after=5.0)
    return clusters[0]
