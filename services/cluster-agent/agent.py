"""One node's agent: sample, publish telemetry, classify, publish transitions, heartbeat.

``NodeAgent`` owns no connection and no process: the service runs one per node, the
benchmarks and a simulated fleet run many on one bus. ``tick()`` is one sample of the
node, so tests drive simulated time sample by sample.

Transitions are numbered per node (``seq``) and published with ``Nats-Msg-Id``
``health-<cluster>-<node>-<seq>``. At start the agent reads the last transition on its
subject and resumes from it: same state, same number, the same rules active (a latched
XID is not forgotten by a restart), so a restart publishes nothing until the node's
health really changes, and a retried publish is deduplicated by the stream.

With ``gpu_gauges`` (the service's one agent) each sample also sets the node's GPU gauges
(``tandem_gpu_*{cluster,node,gpu}``) on the process's ``/metrics``, before it is
published, so they read what the last telemetry event says even while NATS is away. A
simulated fleet of thousands of nodes in one process leaves them off.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from tandem.cluster_agent.backend import AgentDeath, Backend
from tandem.cluster_agent.clock import Clock, WallClock
from tandem.cluster_agent.health import Change, Tracker
from tandem.cluster_agent.rules import RULES, SEVERITY, Limits, Rule
from tandem.common import fleet, log, metrics, subjects
from tandem.common.bus import Bus
from tandem.common.errors import EventDecodeError
from tandem.common.events import (
    DrainRecord,
    GpuBrief,
    GpuSample,
    Health,
    HealthTransition,
    ModelsLoaded,
    NodeHeartbeat,
    NodeTelemetry,
    decode,
)
from tandem.common.streams import HEALTH, HEARTBEAT_TTL, KV_NODES

TRANSITIONS = metrics.Counter("tandem_agent_transitions", "Health transitions published",
                              ["current"])
SAMPLES = metrics.Counter("tandem_agent_samples", "GPU samples taken")
FREE_MEM_FRACTION = 0.1  # a GPU using less memory than this is free for new work
HARD_ACTIONS = ("drain", "reset", "replace")


def _brief(s: GpuSample) -> GpuBrief:
    return GpuBrief(index=s.index, util=s.util, mem_used=s.mem_used, mem_total=s.mem_total,
                    temp=s.temp, power=s.power, sm_clock=s.sm_clock, lost=s.lost)


class NodeAgent:
    def __init__(self, bus: Bus, cluster: str, node: str, backend: Backend,
                 clock: Clock | None = None, *, interval: float = 1.0,
                 heartbeat_ttl: float = HEARTBEAT_TTL, auto_drain: bool = True,
                 models: Iterable[str] = (), rules: Sequence[Rule] = RULES,
                 limits: Limits | None = None, gpu_gauges: bool = False,
                 drains: fleet.DrainBoard | None = None) -> None:
        self.bus = bus
        self.cluster = subjects.token(cluster, "cluster")
        self.node = subjects.node(node)
        self.backend = backend
        self.clock = clock or WallClock()
        self.interval = interval
        self.ttl = heartbeat_ttl
        self.auto_drain = auto_drain
        self.static_models = set(models)
        self.gpu_gauges = gpu_gauges
        self.tracker = Tracker(rules, limits)
        self.log = log.get("tandem.cluster_agent", cluster=cluster, node=node)
        self.state = Health.healthy  # last published
        self.seq = 0  # number of the last published transition
        self.samples = 0
        self.telemetry_stored = 0  # samples the stream acknowledged (its PubAck: stored)
        self.telemetry_failed = 0  # samples whose publish raised (no ack from the stream)
        self.heartbeats = 0
        self.last: list[GpuSample] = []
        self.gpus = 0
        # The last transitions published by this instance, newest last (HEALTH has them all).
        self.published: collections.deque[HealthTransition] = collections.deque(maxlen=64)
        self._telemetry_subject = subjects.telemetry(cluster, node)
        self._health_subject = subjects.health(cluster, node)
        self._key = subjects.node_key(cluster, node)
        self._lock = asyncio.Lock()
        self._workers: dict[str, tuple[list[str], float]] = {}
        self._sub: Any = None
        self._pending: tuple[Health, dict[str, Any]] | None = None  # transition owed
        self._drained_for: set[str] = set()  # hard rules (rule@gpu) already drained for
        self.drain = fleet.DrainWatch(bus, cluster, node, on_change=self._on_drain,
                                      board=drains)

    # ------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Resume from the last published transition, watch drains, open the GPUs."""
        await self._restore()
        await self.drain.start()
        self._sub = await self.bus.nc.subscribe(subjects.models(self.cluster, self.node),
                                                cb=self._on_models)
        now = self.clock.now()
        self.gpus = await self._backend_call(self.backend.open, now)
        self.log.info("agent.started", backend=self.backend.name, gpus=self.gpus,
                      health=self.state.value, seq=self.seq, drained=self.drain.drained,
                      active=self.tracker.active())
        async with self._lock:
            cleared: list[Change] = []
            cause = None
            if self.state == Health.drained and not self.drain.drained:
                # Undrained while this agent was down: the same as an undrain seen live.
                cleared = self.tracker.clear_latched(now)
                self._drain_handled()
                cause = {"rule": "undrain", "action": "", "reason": "undrained while the "
                         "agent was down: latched faults cleared"}
            await self._settle(cleared, now, cause)

    async def close(self, remove_heartbeat: bool = True) -> None:
        """Stop watching and release the GPUs; a graceful stop removes the heartbeat now
        (a killed agent's heartbeat expires with the TTL instead)."""
        await self.drain.stop()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if remove_heartbeat:
            with contextlib.suppress(Exception):
                await (await self.bus.kv(KV_NODES)).delete(self._key)
        self.backend.close()

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``interval`` and heartbeat at least every TTL/3 until ``stop``.

        Scheduled on the clock's monotonic time: a wall-clock step back (NTP) does not
        stop ticks and heartbeats for as long as the step.
        """
        hb_every = min(self.interval, self.ttl / 3)
        next_tick = next_hb = self.clock.monotonic()
        while not stop.is_set():
            now = self.clock.monotonic()
            if now >= next_tick:
                await self._guarded(self.tick())
                next_tick = max(next_tick + self.interval, now)
                next_hb = now + hb_every
            elif now >= next_hb:
                await self._guarded(self.heartbeat())
                next_hb = now + hb_every
            if await self.clock.sleep_until(min(next_tick, next_hb), stop):
                break

    async def _guarded(self, work: Any) -> None:
        try:
            await work
        except AgentDeath:
            raise
        except Exception as exc:
            # NATS down or a backend hiccup: log, keep sampling; the next tick retries.
            self.log.warning("agent.tick_failed", error=repr(exc))

    async def _backend_call(self, fn: Any, now: float) -> Any:
        if self.backend.blocking:
            return await asyncio.to_thread(fn, now)
        return fn(now)

    # ------------------------------------------------------------------------------ tick

    async def tick(self) -> NodeTelemetry:
        """One sample of the node: health, telemetry, transitions, heartbeat.

        The sample is classified before anything is published: a backend hands each XID
        over once, so a publish that fails (NATS away) must not lose it. What the sample
        decided (a transition, an auto-drain) stays pending in the agent's state and is
        published by the first tick that can.
        """
        now = self.clock.now()
        samples = await self._backend_call(self.backend.sample, now)
        self.samples += 1
        self.last = samples
        SAMPLES.inc(len(samples))
        if self.gpu_gauges:
            metrics.set_gpus(self.cluster, self.node, samples)
        async with self._lock:
            changes = self.tracker.observe(samples, now)
            for c in changes:
                say = self.log.warning if c.fired else self.log.info
                say("agent.rule_fired" if c.fired else "agent.rule_cleared", rule=c.rule.name,
                    gpu=c.gpu, severity=c.rule.severity.value, evidence=c.evidence)
            self._note(changes)
        telemetry = NodeTelemetry(cluster=self.cluster, node=self.node, gpus=samples, at=now,
                                  seq=self.samples)
        try:
            await self.bus.publish(self._telemetry_subject, telemetry)
        except Exception:
            self.telemetry_failed += 1
            raise
        self.telemetry_stored += 1
        async with self._lock:
            await self._settle([], now)
        await self.heartbeat()
        return telemetry

    # ------------------------------------------------------------------------ transitions

    def target(self) -> Health:
        return Health.drained if self.drain.drained else self.tracker.health

    def _note(self, changes: list[Change], cause: dict[str, Any] | None = None) -> None:
        """Record the transition the node owes, with its cause, until it is published.

        A cause is decided when the state changes (by the changes that changed it, or the
        drain or undrain that did) and kept across failed publishes: a retry on a later
        tick, with no changes of its own, publishes the same cause.
        """
        target = self.target()
        if target == self.state:
            # A fault that never heals (latched: an XID, a lost GPU) on a node already
            # that bad is still noted, state unchanged: the transition's ``active`` is
            # what a restarted agent resumes from, and an operator reads the findings.
            latched = [c for c in changes if c.fired and c.rule.latched]
            if latched:
                c = max(latched, key=lambda c: SEVERITY[c.rule.severity])
                self._pending = (target, {
                    "rule": c.rule.name, "reason": f"also: {c.rule.reason}",
                    "action": c.rule.action, "gpu": c.gpu, "values": c.evidence,
                    "fired": True})
            elif self._pending is not None and self._pending[0] != target:
                self._pending = None
            return
        pending = self._pending
        if cause is None:
            cause = self._cause(target, changes)
            if cause["rule"] == "restore" and pending is not None and pending[0] == target:
                return
        self._pending = (target, cause)

    async def _settle(self, changes: list[Change], now: float,
                      cause: dict[str, Any] | None = None) -> None:
        """Publish the transition the node owes, if any; auto-drain on a hard fault."""
        self._note(changes, cause)
        if self._pending is not None:
            target, why = self._pending
            await self._publish(target, why, now)
            self._pending = None
        await self._auto_drain()

    def _hard(self) -> list[tuple[Rule, int]]:
        """Active rules that call for taking the node out of service."""
        return [(r, g) for r, g in self.tracker.active_rules()
                if r.severity == Health.unhealthy and r.action in HARD_ACTIONS]

    async def _auto_drain(self) -> None:
        """Drain for an active hard rule this agent has not drained for yet.

        Decided from state, not from this tick's changes, so a drain whose write failed
        is written by the next settle. A rule that clears may drain again when it fires
        again; one active when the operator undrained does not. Each transition carries
        what was handled, so an agent restarted between a transition and its drain still
        drains.
        """
        if not self.auto_drain:
            return
        hard = self._hard()
        self._drained_for &= {f"{r.name}@{g}" for r, g in hard}
        if self.drain.drained:
            return
        todo = [(r, g) for r, g in hard if f"{r.name}@{g}" not in self._drained_for]
        if not todo:
            return
        rule, gpu = todo[0]
        await fleet.drain(self.bus, self.cluster, self.node, overwrite=False,
                          reason=f"{rule.name} on GPU {gpu}: {rule.reason} "
                                 f"(action: {rule.action})", by="agent")
        self._drained_for |= {f"{r.name}@{g}" for r, g in hard}

    def _drain_handled(self) -> None:
        """The hard rules active now are the operator's call (an undrain)."""
        self._drained_for = {f"{r.name}@{g}" for r, g in self._hard()}

    def _cause(self, target: Health, changes: list[Change]) -> dict[str, Any]:
        worse = target == Health.drained or (
            self.state != Health.drained and SEVERITY[target] > SEVERITY[self.state])
        pool = [c for c in changes if c.fired == worse]
        if not pool:
            return {"rule": "restore", "reason": "state at agent start", "action": ""}
        c = max(pool, key=lambda c: SEVERITY[c.rule.severity])
        return {"rule": c.rule.name, "reason": c.rule.reason if c.fired else
                f"cleared: {c.rule.reason}", "action": c.rule.action if c.fired else "",
                "gpu": c.gpu, "values": c.evidence, "fired": c.fired}

    async def _publish(self, target: Health, cause: dict[str, Any], now: float) -> None:
        seq = self.seq + 1
        evidence = {k: v for k, v in cause.items() if k not in ("reason", "action")}
        evidence.update(at=now, sample=self.samples)
        tr = HealthTransition(
            cluster=self.cluster, node=self.node, previous=self.state, current=target,
            rule=str(cause["rule"]), reason=str(cause["reason"]),
            action=str(cause.get("action", "")), gpu=cause.get("gpu"), evidence=evidence,
            at=now, seq=seq, active=self.tracker.active(), handled=sorted(self._drained_for),
        )
        # The msg id makes a retried publish (same seq) land once in HEALTH.
        await self.bus.publish(self._health_subject, tr,
                               msg_id=f"health-{self.cluster}-{self.node}-{seq}", retry_for=10.0)
        self.seq, self.state = seq, target
        self.published.append(tr)
        TRANSITIONS.labels(target.value).inc()
        self.log.warning("agent.transition", previous=tr.previous.value, current=target.value,
                         rule=tr.rule, gpu=tr.gpu, seq=seq, action=tr.action)

    async def _restore(self) -> None:
        try:
            msg = await self.bus.js.get_last_msg(HEALTH, self._health_subject)
        except NotFoundError:
            return
        try:
            last = decode(msg.data, HealthTransition)
        except EventDecodeError as exc:
            self.log.warning("agent.restore_unreadable", error=exc.reason)
            return
        self.state, self.seq = last.current, last.seq
        self.tracker.restore(last.active, self.clock.now())
        if last.handled is None:
            self._drain_handled()
        else:  # a drain owed when the last agent died (its write failed, or never came)
            self._drained_for = set(last.handled)

    async def _on_drain(self, record: DrainRecord | None) -> None:
        now = self.clock.now()
        async with self._lock:
            if record is not None:
                cause = {"rule": "drain", "reason": record.reason, "action": "drain",
                         "by": record.by, "drained_at": record.at}
                await self._settle([], now, cause)
            else:
                cleared = self.tracker.clear_latched(now)
                self._drain_handled()
                cause = {"rule": "undrain", "action": "",
                         "reason": "returned to service: latched faults cleared",
                         "cleared": [c.key for c in cleared]}
                await self._settle(cleared, now, cause)
        await self._guarded(self.heartbeat())

    # -------------------------------------------------------------------------- heartbeat

    def _models(self) -> list[str]:
        fresh = time.monotonic() - self.ttl
        self._workers = {w: v for w, v in self._workers.items() if v[1] >= fresh}
        models = set(self.static_models)
        for names, _ in self._workers.values():
            models.update(names)
        return sorted(models)

    async def _on_models(self, msg: Msg) -> None:
        try:
            ev = decode(msg.data, ModelsLoaded)
        except EventDecodeError as exc:
            self.log.warning("agent.bad_models_message", error=exc.reason)
            return
        self._workers[ev.worker] = (list(ev.models), time.monotonic())

    def heartbeat_value(self) -> NodeHeartbeat:
        bad = self.tracker.gpus_with(Health.unhealthy)
        usable = [s for s in self.last if not s.lost and s.index not in bad]
        free = [s for s in usable if s.mem_used is None or not s.mem_total
                or s.mem_used < FREE_MEM_FRACTION * s.mem_total]
        record = self.drain.record
        self.heartbeats += 1
        return NodeHeartbeat(
            cluster=self.cluster, node=self.node, health=self.state,
            gpus_total=len(self.last) or self.gpus, gpus_usable=len(usable),
            gpus_free=0 if record is not None else len(free), models=self._models(),
            drained=record is not None, drain_reason=record.reason if record else "",
            at=time.time(), findings=self.tracker.active(),
            gpus=[_brief(s) for s in self.last], backend=self.backend.name,
            interval=self.interval, seq=self.heartbeats,
        )

    async def heartbeat(self) -> None:
        kv = await self.bus.typed(KV_NODES, NodeHeartbeat)
        await kv.put(self._key, self.heartbeat_value())
