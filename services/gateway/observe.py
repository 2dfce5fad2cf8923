"""What the operator sees: one live picture of the system, for the dashboard and /metrics.

The ``Observer`` runs beside the HTTP API in the gateway. Every ``interval`` seconds it
reads the fleet (KV ``nodes`` and ``drains``), each cluster's queue per lane (the
``GEN_<CLUSTER>`` work-queue streams: how many tasks wait and how old the oldest is) and
the training runs (KV ``runs``); from core NATS it follows training steps, checkpoints
and the writes of task records (``$KV.tasks.*``), showing the tasks that succeeded as
their records are stored (a write heard may be one the bucket refused). It
keeps a bounded history (a loss curve per run, the last generations) and sets the
Prometheus gauges below, so a scrape of the gateway's ``/metrics`` shows the whole
system's state alongside the gateway's own counters (the way kube-state-metrics does
for Kubernetes).

Nothing here is authoritative: it is a view, rebuilt from the bus after a restart
(the loss history of a run is refilled from the ``TRAIN`` stream the first time the run
is seen).

What the gauges say of things that leave the view:

- a configured cluster (``TANDEM_CLUSTERS``) always has ``tandem_cluster_healthy``, 0
  while no heartbeat of it is in KV ``nodes`` (every agent gone, or never started);
- a node's ``tandem_node_health{state}`` is 1 for its status in the fleet view
  (``fleet.NODE_STATES``: healthy, degraded, unhealthy, drained, down; what the
  dashboard shows) and 0 for the others, so a node up but drained or unhealthy is
  visible to an alert (``tandem_node_serving`` alone cannot tell it from a dead one);
- a node that leaves the view (its heartbeat key expired, no drain keeps it) reads 0 in
  ``tandem_node_up`` and ``tandem_node_serving``, and ``down`` in its health, for
  ``GONE_GRACE`` seconds, then its series go, as do an unconfigured cluster's: an alert
  on ``== 0`` sees the node down rather than a series that vanished, and a gateway that
  runs for months does not keep every node it ever saw (past the grace, and for a
  gateway started after the node died, the alert rules look back at what Prometheus
  kept: docs/observability.md). Its GPU series go at once (their last figures would lie);
- a node is up while its heartbeat is fresh by ``heartbeat_ttl`` (the gateway's
  ``TANDEM_HEARTBEAT_TTL``, which its router uses too: ``fleet.read_fleet``);
- ``tandem_observer_last_refresh_timestamp_seconds`` is when the view was last read
  whole: while the bus cannot be read every gauge keeps its last value, and only this
  one says how old they are.

Every gateway exports the whole view, so with N gateways each of these series is there N
times (one per scrape target): dashboards and rules aggregate them (``max by (cluster,
lane)``, ``min by (cluster)``), never ``sum``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem.common import log, metrics, subjects
from tandem.common.bus import describe
from tandem.common.events import (
    CheckpointWritten,
    GenerationTask,
    RunRecord,
    RunState,
    TaskRecord,
    TaskState,
    TrainEvent,
    TrainStep,
    decode,
)
from tandem.common.fleet import NODE_STATES, read_fleet
from tandem.common.runs import filled
from tandem.common.streams import HEARTBEAT_TTL, KV_RUNS, KV_TASKS
from tandem.common.tasks import succeeded

_log = log.get("tandem.gateway.observe")

QUEUE_DEPTH = metrics.Gauge("tandem_queue_depth", "Generation tasks in a cluster's queue "
                            "(waiting or running, not yet acked)", ["cluster", "lane"])
QUEUE_AGE = metrics.Gauge("tandem_queue_oldest_age_seconds", "Age of the oldest task in a "
                          "cluster's queue, seconds (0 when empty)", ["cluster", "lane"])
CLUSTER_HEALTHY = metrics.Gauge("tandem_cluster_healthy", "1 while a cluster has a serving "
                                "node", ["cluster"])
NODE_UP = metrics.Gauge("tandem_node_up", "1 while a node's heartbeat is fresh",
                        ["cluster", "node"])
NODE_SERVING = metrics.Gauge("tandem_node_serving", "1 while a node is up, healthy enough "
                             "and not drained", ["cluster", "node"])
NODE_HEALTH = metrics.Gauge("tandem_node_health", "1 for a node's status now (healthy, "
                            "degraded, unhealthy, drained or down), 0 for the others",
                            ["cluster", "node", "state"])
RUN_STATE = metrics.Gauge("tandem_train_run_state", "1 for a training run's state now, 0 for "
                          "the others (the runs the view keeps)", ["run", "state"])
REFRESHED = metrics.Gauge("tandem_observer_last_refresh_timestamp_seconds", "When this "
                          "gateway last read the whole system view (Unix time): the age of "
                          "every fleet, queue and run gauge it exports")
# The GPU and training series (tandem_gpu_*, tandem_train_*, checkpoint blocked time) are
# libs/common/metrics.py's: the agents and the trainer set the same ones on their own
# /metrics, from the figures they publish.

MAX_POINTS = 600  # loss points kept per run (thinned evenly beyond this)
# Seconds a node gone from the view reads 0 before its series go: longer than any alert's
# ``for`` on it, so the alert fires and stays rather than resolving with a vanished series.
GONE_GRACE = 900.0
MAX_RUNS = 12
MAX_GENERATIONS = 24


@dataclass
class RunView:
    run_id: str
    loss: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    record: RunRecord | None = None
    backfilled: bool = False
    _every: int = 1
    _seen: int = 0

    def add_step(self, step: int, loss: float) -> None:
        self._seen += 1
        if self._seen % self._every:
            return
        if self.loss and step <= self.loss[-1][0]:  # a restart replays steps: keep the new
            self.loss = [p for p in self.loss if p[0] < step]
        self.loss.append((step, loss))
        if len(self.loss) > MAX_POINTS:
            self.loss = self.loss[::2]
            self._every *= 2

    def add_checkpoint(self, step: int) -> None:
        """One mark per step, the newest ``MAX_POINTS`` kept: a sharded run reports a step
        once per node, and a restart writes steps again."""
        if step not in self.checkpoints:
            self.checkpoints = sorted([*self.checkpoints, step])[-MAX_POINTS:]


class Vanishing:
    """The series of one gauge group (label tuples) for things in the view; one that
    leaves it reads 0 for ``grace`` seconds, then goes (back in the view: shown again)."""

    def __init__(self, gauges: tuple[Any, ...], grace: float) -> None:
        self.gauges = gauges
        self.grace = grace
        self.shown: set[tuple[str, ...]] = set()
        self.gone: dict[tuple[str, ...], float] = {}  # label tuple -> left the view at

    def update(self, shown: set[tuple[str, ...]], now: float) -> set[tuple[str, ...]]:
        """``shown``: what the view holds now (its values already set). Returns what left
        the view since the last update."""
        left = self.shown - shown
        for key in left:
            self.gone.setdefault(key, now)
        for key in shown:
            self.gone.pop(key, None)
        self.shown = shown
        for key, since in list(self.gone.items()):
            if now - since > self.grace:
                del self.gone[key]
                self.forget(key)
            else:
                self.down(key)
        return left

    def down(self, key: tuple[str, ...]) -> None:
        """``key`` is out of the view, within the grace: its series read 0."""
        for gauge in self.gauges:
            gauge.labels(*key).set(0)

    def forget(self, key: tuple[str, ...]) -> None:
        """``key`` is past the grace: its series go."""
        for gauge in self.gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(*key)


def node_health(cluster: str, node: str, status: str) -> None:
    """``tandem_node_health``: 1 for ``status``, 0 for the other states."""
    for state in NODE_STATES:
        NODE_HEALTH.labels(cluster, node, state).set(1 if state == status else 0)


class VanishingNodes(Vanishing):
    """A node's series (up, serving, health by state): out of the view it reads down."""

    def __init__(self, grace: float) -> None:
        super().__init__((NODE_UP, NODE_SERVING), grace)

    def down(self, key: tuple[str, ...]) -> None:
        super().down(key)
        node_health(*key, "down")

    def forget(self, key: tuple[str, ...]) -> None:
        super().forget(key)
        NODE_HEALTH.remove_by_labels({"cluster": key[0], "node": key[1]})


class Observer:
    """The live picture; ``run(stop)`` keeps it fresh until ``stop`` is set.

    ``clock``: monotonic seconds, for how long a node has been gone (``GONE_GRACE``);
    ``heartbeat_ttl``: how long a heartbeat counts as fresh (the router's)."""

    def __init__(self, bus: Any, clusters: list[str], *, s3: Any = None, bucket: str = "",
                 url_ttl: float = 3600.0, interval: float = 1.0,
                 clock: Any = time.monotonic, heartbeat_ttl: float = HEARTBEAT_TTL) -> None:
        self.bus = bus
        self.clusters = clusters
        self.heartbeat_ttl = heartbeat_ttl
        self.s3 = s3
        self.bucket = bucket
        self.url_ttl = url_ttl
        self.interval = interval
        self.runs: dict[str, RunView] = {}
        self.generations: deque[dict[str, Any]] = deque(maxlen=MAX_GENERATIONS)
        self.fleet: dict[str, Any] = {"clusters": [], "at": 0.0, "heartbeat_ttl": 0.0}
        self.queues: list[dict[str, Any]] = []
        self.refreshed_at = 0.0
        self.ready = asyncio.Event()
        self._subs: list[Any] = []
        self._urls: dict[str, tuple[str, float]] = {}  # key -> (presigned URL, made at)
        self.clock = clock
        self._clusters = Vanishing((CLUSTER_HEALTHY,), GONE_GRACE)
        self._nodes = VanishingNodes(GONE_GRACE)
        self._heard: list[str] = []  # tasks whose success was heard, not yet shown

    # ------------------------------------------------------------------------- life

    async def run(self, stop: asyncio.Event) -> None:
        nc = self.bus.nc
        self._subs = [
            await nc.subscribe(subjects.train_kind_filter("step"), cb=self._on_train),
            await nc.subscribe(subjects.train_kind_filter("checkpoint"), cb=self._on_train),
            await nc.subscribe(subjects.TASK_RECORD.wildcard, cb=self._on_record),
        ]
        try:
            while not stop.is_set():
                try:
                    await self.refresh()
                except Exception as exc:  # NATS restarting, a bucket not there yet
                    _log.warning("observe.refresh_failed", error=describe(exc))
                self.ready.set()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
        finally:
            for sub in self._subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def refresh(self) -> None:
        view = await read_fleet(self.bus, self.heartbeat_ttl)
        self.fleet = view.to_dict()
        self._fleet_gauges(view)
        self.queues = [q for c in self.clusters for q in await self._queues(c)]
        await self._runs()
        await self._generations()
        self.refreshed_at = time.time()
        REFRESHED.set(self.refreshed_at)

    # ---------------------------------------------------------------------- readers

    def _fleet_gauges(self, view: Any) -> None:
        """Each node's series while it is in the fleet, its GPUs only while it is up;
        what left the view as the module docstring says."""
        clusters: set[tuple[str, ...]] = set()
        nodes: set[tuple[str, ...]] = set()
        for c in view.clusters:
            clusters.add((c.name,))
            CLUSTER_HEALTHY.labels(c.name).set(1 if c.healthy else 0)
            for n in c.nodes:
                nodes.add((c.name, n.node))
                NODE_UP.labels(c.name, n.node).set(1 if n.up else 0)
                NODE_SERVING.labels(c.name, n.node).set(1 if n.serving else 0)
                node_health(c.name, n.node, n.status)
                if n.up:
                    metrics.set_gpus(c.name, n.node, n.gpus)
                else:
                    metrics.forget_gpus(c.name, n.node)
        for name in self.clusters:
            if (name,) not in clusters:  # no heartbeat of it at all: down, not unknown
                clusters.add((name,))
                CLUSTER_HEALTHY.labels(name).set(0)
        now = self.clock()
        self._clusters.update(clusters, now)
        for cluster, node in self._nodes.update(nodes, now):
            metrics.forget_gpus(cluster, node)

    async def _queues(self, cluster: str) -> list[dict[str, Any]]:
        stream = subjects.gen_stream_name(cluster)
        try:
            info = await self.bus.js.stream_info(stream,
                                                 subjects_filter=subjects.gen_cluster_filter(
                                                     cluster))
        except Exception:
            return []
        counts = info.state.subjects or {}
        out = []
        now = time.time()
        for lane in subjects.LANES:
            subject = subjects.gen(cluster, lane)
            depth = int(counts.get(subject, 0))
            age = 0.0
            if depth:
                with contextlib.suppress(Exception):
                    msg = await self.bus.js.get_msg(stream, seq=1, subject=subject, next=True)
                    task = msgspec.json.decode(msg.data, type=GenerationTask)
                    age = max(0.0, now - task.submitted_at)
            QUEUE_DEPTH.labels(cluster, lane).set(depth)
            QUEUE_AGE.labels(cluster, lane).set(age)
            out.append({"cluster": cluster, "lane": lane, "depth": depth,
                        "oldest_age_s": round(age, 2)})
        return out

    async def _runs(self) -> None:

        kv = await self.bus.typed(KV_RUNS, RunRecord)
        records = await kv.items()
        newest = sorted(records.values(), key=lambda r: r.created_at)[-MAX_RUNS:]
        for rec in newest:
            view = self.runs.setdefault(rec.run_id, RunView(rec.run_id))
            view.record = rec
            if not view.backfilled:
                view.backfilled = True
                await self._backfill(view)
            metrics.RESTARTS.labels(rec.run_id).set(rec.restarts)
            for state in RunState:
                RUN_STATE.labels(rec.run_id, state.value).set(1 if rec.state == state else 0)
            if rec.goodput.get("goodput") is not None:
                metrics.GOODPUT.labels(rec.run_id).set(rec.goodput["goodput"])
        keep = {r.run_id for r in newest}
        for run_id in [r for r in self.runs if r not in keep]:
            del self.runs[run_id]
            metrics.forget_run(run_id)  # out of the view: its series go too
            RUN_STATE.remove_by_labels({"run": run_id})

    async def _backfill(self, view: RunView) -> None:
        """A run's earlier steps from the TRAIN stream (this gateway may be newer)."""
        from nats.js.api import DeliverPolicy

        if view.loss:
            return
        with contextlib.suppress(Exception):
            sub = await self.bus.js.subscribe(
                subjects.train(view.run_id, "step"), ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL)
            try:
                info = await sub.consumer_info()
                if not info.num_pending and not info.delivered.stream_seq:
                    return  # no steps yet: followed live from here
                while True:  # until the consumer says nothing more is pending
                    msg = await sub.next_msg(timeout=2.0)
                    ev = decode(msg.data, TrainStep)
                    view.add_step(ev.step, ev.loss)
                    if not msg.metadata.num_pending:
                        break
            finally:
                await sub.unsubscribe()

    # --------------------------------------------------------------------- followers

    async def _on_train(self, msg: Any) -> None:
        try:
            ev = decode(msg.data, TrainEvent)  # type: ignore[arg-type]
        except Exception:
            return
        if msg.subject.split(".")[1:2] != [ev.run_id]:
            return  # an event naming another run than its subject (train.<run>.<kind>)
        view = self.runs.get(ev.run_id)
        if view is None:
            if len(self.runs) >= 4 * MAX_RUNS:
                return
            view = self.runs.setdefault(ev.run_id, RunView(ev.run_id))
            view.backfilled = True  # followed live from here
        if isinstance(ev, TrainStep):
            view.add_step(ev.step, ev.loss)
            metrics.train_step(ev.run_id, ev.step, ev.loss, ev.samples_per_s, ev.step_time)
        elif isinstance(ev, CheckpointWritten):
            view.add_checkpoint(ev.step)
            metrics.CKPT_BLOCKED.labels(ev.run_id).observe(ev.blocked_s)

    async def _on_record(self, msg: Any) -> None:
        rec = succeeded(msg.data)
        if rec is not None:
            self._heard.append(rec.task.task_id)
            del self._heard[:-MAX_GENERATIONS]  # only the newest can be shown

    async def _generations(self) -> None:
        """The successes heard since the last refresh, each shown once, as its record is
        stored. A subscriber to ``$KV.tasks.*`` hears every write published, one the
        bucket refused too (a stale worker's second success; a success written after a
        cancel), and such a write must not show as a generation. At most
        ``MAX_GENERATIONS`` reads a refresh, whatever the rate of successes."""
        heard, self._heard = self._heard, []
        shown = {g["id"] for g in self.generations}
        wanted = [t for t in dict.fromkeys(heard) if t not in shown]
        if not wanted:
            return
        try:
            kv = await self.bus.typed(KV_TASKS, TaskRecord)
            got = await asyncio.gather(*(kv.get(t) for t in wanted))
        except BaseException:  # kept for the next refresh
            self._heard = (heard + self._heard)[-MAX_GENERATIONS:]
            raise
        for entry in got:
            rec = entry[0] if entry is not None else None
            if rec is None or rec.state != TaskState.succeeded:
                continue  # the success heard was refused
            self.generations.appendleft({
                "id": rec.task.task_id, "cluster": rec.cluster, "worker": rec.worker,
                "checkpoint": rec.checkpoint, "checkpoint_step": rec.checkpoint_step,
                "images": list(rec.images), "at": rec.finished_at or rec.updated_at})

    # -------------------------------------------------------------------------- view

    def _url(self, key: str) -> str:
        # The same URL for a while, so a polling page does not reload every image.
        if self.s3 is None:
            return ""
        url, made = self._urls.get(key, ("", 0.0))
        if time.time() - made > self.url_ttl / 2:
            url = self.s3.generate_presigned_url("get_object", Params={
                "Bucket": self.bucket, "Key": key}, ExpiresIn=int(self.url_ttl))
            if len(self._urls) > 4 * MAX_GENERATIONS * 4:
                self._urls.clear()
            self._urls[key] = (url, time.time())
        return url

    def snapshot(self) -> dict[str, Any]:
        """The dashboard's JSON: fleet, queues, runs with loss curves, generations."""
        runs = []
        for view in sorted(self.runs.values(), key=lambda v: (
                v.record.created_at if v.record else 0.0), reverse=True):
            rec = view.record
            runs.append({
                "run_id": view.run_id,
                "state": rec.state.value if rec else "unknown",
                "steps": int(filled(rec.config).get("steps", 0)) if rec else 0,
                # Step events arrive before the trainer's periodic KV update: newest wins.
                "latest_step": max(rec.latest_step if rec else 0,
                                   view.loss[-1][0] if view.loss else 0),
                "restarts": rec.restarts if rec else 0,
                "latest_checkpoint_step": rec.latest_checkpoint_step if rec else None,
                "goodput": rec.goodput.get("goodput") if rec else None,
                "incidents": len(rec.incidents) if rec else 0,
                "loss": view.loss, "checkpoints": view.checkpoints})
        gens = [{**g, "image_urls": [self._url(k) for k in g["images"][:4]]}
                for g in self.generations]
        return {"at": time.time(), "refreshed_at": self.refreshed_at, "fleet": self.fleet,
                "queues": self.queues, "runs": runs, "generations": gens}
