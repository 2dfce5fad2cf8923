"""Stranded backlog: pull a dead cluster's queue from a healthy one, until it recovers.

Every cluster's tasks wait in its own work-queue stream on the control-plane NATS, so a
GPU cluster that dies leaves its queue intact but nobody pulling it. ``Failover`` runs
beside a worker's pull loop and edits the loop's list of consumers in place:

- it follows each cluster's health on a ``ClusterBoard`` (fresh heartbeat from an
  undrained, not-unhealthy node; O(clusters) per check);
- once a cluster has been unhealthy for ``failover_grace`` seconds, while this worker's
  own cluster is healthy and its node not drained, the worker also pulls that cluster's
  per-lane consumers (its interactive lane after the worker's own interactive lanes, its
  batch lane last), binding to them as they are: their AckWait and MaxDeliver are the
  ones the server holds, not this worker's;
- when the cluster is healthy again (or this worker's own cluster is not), it stops;
- it adopts a cluster only if it serves every model that cluster's workers were serving
  (the last models its nodes' heartbeats announced: remembered while it was healthy, else
  those of its nodes the board still holds), so a task that would wait for its cluster and
  run there is not handed back by a worker that cannot run it until its deliveries are
  spent; a cluster whose models are unknown is adopted on health alone.

Tasks the dead cluster's workers held are redelivered by the server after their AckWait,
to whoever pulls then: the adopting workers. A grace period (rather than pulling every
queue always) keeps a cluster's work on its own GPUs, next to its loaded models, while
it lives. Failover time, cluster death to first stranded task started elsewhere, is about
heartbeat TTL + grace + one check: 6 s + 2 s by default, under twice the TTL.

nats-py 2.16 has no consumer priority groups (ADR-42 pinned/overflow clients), so
adoption is done by the client; the server-side form can replace it later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Collection
from typing import Any

from nats.js.errors import NotFoundError
from pydantic import Field, field_validator

from tandem.common import log, metrics, subjects
from tandem.common.bus import Bus, Consumer, describe
from tandem.common.clusters import ClusterBoard
from tandem.common.errors import StreamConflict
from tandem.common.fleet import within_the_bucket
from tandem.common.settings import Settings
from tandem.common.streams import HEARTBEAT_TTL, ConsumerSpec, gen_consumer

_log = log.get("tandem.inference_worker.failover")

ADOPTIONS = metrics.Counter("tandem_worker_failover_adoptions",
                            "Times this worker started pulling a stranded cluster's queue",
                            ["cluster"])
PULLING = metrics.Gauge("tandem_worker_failover_pulling",
                        "1 while this worker pulls another cluster's queue", ["cluster"])

MakeConsumer = Callable[[ConsumerSpec], Consumer[Any]]


class FailoverSettings(Settings):
    """The worker's failover settings (mixed into ``WorkerSettings``)."""

    failover: bool = Field(True, description="Pull a dead cluster's queue after the grace "
                           "period, while this worker's own cluster is healthy.")
    failover_clusters: str = Field("", description="Comma-separated clusters this worker may "
                                   "fail over for; empty: every cluster with a work queue.")
    failover_grace: float = Field(2.0, ge=0, le=3600, description="Seconds a cluster must "
                                  "have been unhealthy before this worker pulls its queue.")
    heartbeat_ttl: float = Field(HEARTBEAT_TTL, gt=0, description="Seconds a node's "
                                 f"heartbeat counts as fresh; at most {HEARTBEAT_TTL:g}, the "
                                 "TTL of KV nodes.")

    @field_validator("failover_clusters")
    @classmethod
    def _clusters(cls, v: str) -> str:
        subjects.token_list(v, "cluster")
        return v

    @field_validator("heartbeat_ttl")
    @classmethod
    def _within_the_bucket(cls, ttl: float) -> float:
        return within_the_bucket(ttl)


def lane_of(spec: ConsumerSpec) -> str:
    """The lane a per-lane consumer takes (``gen.<cluster>.<lane>``); the first lane if
    the consumer takes a whole queue."""
    if not spec.filter_subjects:
        return subjects.LANES[0]
    return spec.filter_subjects[0].rsplit(".", 1)[-1]


async def work_queues(bus: Bus) -> list[str]:
    """Clusters that have a work-queue stream (``GEN_<CLUSTER>`` on ``gen.<cluster>.*``).

    Asks the server for the names of the streams on ``gen.*.*`` (``STREAM.NAMES``, paged),
    then for the config of each ``GEN_`` one: a worker needs no right to list every
    stream's config and counters (``STREAM.LIST``), and ``STREAM.INFO`` of a queue
    outside its grants is simply refused.
    """
    names: list[str] = []
    while True:
        reply = await bus.nc.request(f"{bus.api_prefix}.STREAM.NAMES", json.dumps(
            {"subject": "gen.*.*", "offset": len(names)}).encode(), timeout=5.0)
        page = json.loads(reply.data)
        if "error" in page:
            raise RuntimeError(f"STREAM.NAMES refused: {page['error']}")
        got = page.get("streams") or []
        names += got
        if not got or len(names) >= int(page.get("total", 0)):
            break
    out = []
    for name in names:
        if not name.startswith("GEN_"):
            continue
        try:  # a queue outside this worker's grants is refused: it cannot pull it anyway
            reply = await bus.nc.request(f"{bus.api_prefix}.STREAM.INFO.{name}", b"",
                                         timeout=1.0)
            subs = json.loads(reply.data)["config"]["subjects"] or []
        except Exception as exc:
            _log.warning("failover.queue_unreadable", stream=name, error=describe(exc))
            continue
        if len(subs) != 1:
            continue
        parts = subs[0].split(".")
        if len(parts) != 3 or parts[0] != "gen":
            continue
        try:
            cluster = subjects.token(parts[1], "cluster")
        except ValueError:
            continue
        if (subjects.gen_cluster_filter(cluster) == subs[0]
                and subjects.gen_stream_name(cluster) == name):
            out.append(cluster)
    return sorted(out)


class Failover:
    """One worker's failover: adopts and releases other clusters' consumers.

    ``consumers`` is the pull loop's own list, edited in place (the loop reads it each
    round); what it holds at construction is this worker's own. ``make`` turns a spec
    into a consumer with the worker's handler. ``drained()`` says whether this worker's
    node is drained.
    """

    def __init__(self, bus: Bus, own: list[str], consumers: list[Consumer[Any]],
                 make: MakeConsumer, *, enabled: bool = True, grace: float = 2.0,
                 ttl: float = HEARTBEAT_TTL, candidates: list[str] | None = None,
                 ack_wait: float = 30.0, max_deliver: int = 5,
                 drained: Callable[[], bool] = lambda: False, discover_every: float = 10.0,
                 serves: Collection[str] | None = None) -> None:
        self.bus = bus
        self.enabled = enabled
        self.own = list(own)
        self.consumers = consumers
        self.own_consumers = list(consumers)
        self.make = make
        self.grace = grace
        self.ttl = ttl
        self.fixed = candidates or None  # None: discover every work queue
        self.candidates = [c for c in (candidates or []) if c not in self.own]
        self.ack_wait, self.max_deliver = ack_wait, max_deliver
        self.drained = drained
        self.discover_every = discover_every
        self.check_every = max(0.05, min(0.5, ttl / 10, grace / 4 if grace else 0.5))
        self.board = ClusterBoard(bus, ttl, tuple(self.own + self.candidates))
        # The models this worker serves; None: unknown (adopt on health alone).
        self.serves = None if serves is None else frozenset(serves)
        # Each cluster's models while it was last healthy (its serving nodes' heartbeats).
        self.last_models: dict[str, frozenset[str]] = {}
        self._refused: dict[str, frozenset[str]] = {}  # cluster -> models missing (logged)
        self.adopted: dict[str, float] = {}  # cluster -> monotonic time adopted
        self.adoptions = 0
        self._bound: dict[str, list[Consumer[Any]]] = {}
        self._retry_at: dict[str, float] = {}

    @classmethod
    def for_worker(cls, bus: Bus, s: Any, consumers: list[Consumer[Any]], make: MakeConsumer,
                   drained: Callable[[], bool]) -> Failover:
        """From the worker's settings (``FailoverSettings`` plus ``clusters``, ``ack_wait``,
        ``max_deliver``, and ``serve`` with ``registry``: the models it serves, as the
        worker reads them)."""
        serves = subjects.token_list(s.serve, "model") or s.registry.names()
        return cls(bus, s.clusters, consumers, make, enabled=s.failover,
                   grace=s.failover_grace, ttl=s.heartbeat_ttl,
                   candidates=subjects.token_list(s.failover_clusters, "cluster") or None,
                   ack_wait=s.ack_wait, max_deliver=s.max_deliver, drained=drained,
                   serves=serves)

    # ------------------------------------------------------------------------------ life

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``check_every`` seconds until ``stop``; the board stops with it."""
        if not self.enabled:
            return
        await self.board.start()
        next_discovery = 0.0
        try:
            while not stop.is_set():
                now = time.monotonic()
                if self.fixed is None and now >= next_discovery:
                    next_discovery = now + self.discover_every
                    await self._discover()
                await self.check()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.check_every)
        finally:
            await self.board.stop()

    async def close(self) -> None:
        """Unsubscribe every consumer bound for failover (call after the pull loop ends)."""
        for consumers in self._bound.values():
            for c in consumers:
                await c.close()
        self._bound.clear()

    async def _discover(self) -> None:
        try:
            found = await work_queues(self.bus)
        except Exception as exc:  # a reconnect: discover again next time
            _log.warning("failover.discovery_failed", error=describe(exc))
            return
        for c in found:
            if c not in self.own and c not in self.candidates:
                self.candidates.append(c)

    # ---------------------------------------------------------------------------- decide

    def wanted(self, now: float | None = None) -> list[str]:
        """The clusters this worker should pull besides its own, now."""
        now = time.monotonic() if now is None else now
        if self.drained() or not any(self.board.summary(c, now).healthy for c in self.own):
            return []
        out = []
        for c in self.candidates:
            s = self.board.summary(c, now)
            if s.healthy:
                if s.models:
                    self.last_models[c] = s.models
                self._refused.pop(c, None)
            elif s.unhealthy_for(now) >= self.grace and self._can_serve(c):
                out.append(c)
        return out

    def known_models(self, cluster: str) -> frozenset[str]:
        """The models ``cluster``'s workers were serving, as last known; empty: unknown.

        What its serving nodes announced while this worker last saw it healthy; else (it
        died before this worker started, or was never seen serving) what the heartbeats
        the board still holds for its nodes announce (drained or stale ones too)."""
        known = self.last_models.get(cluster)
        if known:
            return known
        view = self.board.view().cluster(cluster)  # O(nodes): only for a dead cluster
        if view is None:
            return frozenset()
        known = frozenset(m for n in view.nodes for m in n.models)
        if known:  # kept: read once, not on every check while the cluster stays dead
            self.last_models[cluster] = known
        return known

    def _can_serve(self, cluster: str) -> bool:
        """Whether this worker serves every model ``cluster`` was serving (or they are
        unknown); says once, per set of missing models, why it is not adopted."""
        if self.serves is None:
            return True
        missing = self.known_models(cluster) - self.serves
        if not missing:
            self._refused.pop(cluster, None)
            return True
        if self._refused.get(cluster) != missing:
            self._refused[cluster] = missing
            _log.warning("failover.not_adopted", cluster=cluster,
                         reason="this worker does not serve every model its workers served",
                         missing=sorted(missing), serves=sorted(self.serves))
        return False

    async def check(self) -> None:
        now = time.monotonic()
        want = self.wanted(now)
        changed = False
        for c in want:
            if c not in self.adopted and now >= self._retry_at.get(c, 0.0):
                changed |= await self._adopt(c, now)
        for c in [c for c in self.adopted if c not in want]:
            del self.adopted[c]
            PULLING.labels(c).set(0)
            healthy = self.board.summary(c, now).healthy
            _log.info("failover.release", cluster=c, recovered=healthy)
            changed = True
        if changed:
            self._rebuild()

    async def _adopt(self, cluster: str, now: float) -> bool:
        try:
            consumers = self._bound.get(cluster) or await self._bind(cluster)
        except Exception as exc:  # no stream yet, a reconnect: try again a little later
            self._retry_at[cluster] = now + max(1.0, self.grace)
            _log.warning("failover.bind_failed", cluster=cluster, error=describe(exc))
            return False
        self._bound[cluster] = consumers
        self.adopted[cluster] = now
        self.adoptions += 1
        ADOPTIONS.labels(cluster).inc()
        PULLING.labels(cluster).set(1)
        _log.warning("failover.adopt", cluster=cluster,
                     unhealthy_for=round(self.board.summary(cluster, now).unhealthy_for(now), 3),
                     grace=self.grace, ttl=self.ttl)
        return True

    async def _bind(self, cluster: str) -> list[Consumer[Any]]:
        """The cluster's per-lane consumers, with the settings the server holds.

        A consumer that does not exist yet (the cluster never had a worker) is created
        with this worker's settings; a stream that does not exist raises.
        """
        out = []
        for lane in subjects.LANES:
            mine = gen_consumer(cluster, self.ack_wait, self.max_deliver, lane=lane)
            try:
                info = await self.bus.js.consumer_info(mine.stream, mine.durable)
            except NotFoundError:
                await self.bus.js.stream_info(mine.stream)  # raises if there is no queue
                with contextlib.suppress(StreamConflict):
                    await self.bus.provision([mine])
                info = await self.bus.js.consumer_info(mine.stream, mine.durable)
            cfg = info.config
            spec = ConsumerSpec(
                stream=mine.stream, durable=mine.durable, filter_subjects=mine.filter_subjects,
                ack_wait=float(cfg.ack_wait or mine.ack_wait),
                max_deliver=int(cfg.max_deliver or mine.max_deliver),
                max_ack_pending=int(cfg.max_ack_pending or mine.max_ack_pending))
            out.append(self.make(spec))
        return out

    def _rebuild(self) -> None:
        """Own lanes first within each lane, adopted clusters' after, lane by lane."""
        ordered: list[Consumer[Any]] = []
        for lane in subjects.LANES:
            ordered += [c for c in self.own_consumers if lane_of(c.spec) == lane]
            for cluster in self.adopted:
                ordered += [c for c in self._bound[cluster] if lane_of(c.spec) == lane]
        ordered += [c for c in self.own_consumers if c not in ordered]
        self.consumers[:] = ordered

    # ---------------------------------------------------------------------------- report

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"grace_s": self.grace, "heartbeat_ttl_s": self.ttl,
                "pulling": sorted(self.adopted), "adoptions": self.adoptions,
                "clusters": [s.to_dict(now) for s in self.board.summaries(now)]}
