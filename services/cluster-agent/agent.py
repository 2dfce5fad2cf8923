"""One node's agent: sample, publish telemetry, classify, publish transitions, heartbeat.

``NodeAgent`` owns no connection and no process: the service runs one per node, the
benchmarks and a simulated fleet run many on one bus. ``tick()`` is one sample of the
node, so tests drive simulated time sample by sample.

Transitions are numbered per node and published through the node's ``TransitionLog``
(``transitions.py``), which resumes at start from the last one on the node's subject: the
agent takes its active rules and its handled drains back, so a latched XID is not
forgotten by a restart. One instance per node: ``NodeClaim`` (``claim.py``) waits at
start while another instance heartbeats for the node and writes each heartbeat by
compare-and-set; either raises ``NodeTaken``, which stops the agent.

With ``gpu_gauges`` (the service's one agent) each sample also sets the node's GPU gauges
(``tandem_gpu_*{cluster,node,gpu}``) on the process's ``/metrics``, before it is
published, so they read what the last telemetry event says even while NATS is away. A
simulated fleet of thousands of nodes in one process leaves them off.

Telemetry is the least of the node's signals: a TELEMETRY stream that refuses a sample
is logged (``telemetry_failed``) and holds back neither the transition, the drain nor
the heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Sequence
from typing import Any

from tandem.cluster_agent.announced import AnnouncedModels
from tandem.cluster_agent.backend import AgentDeath, Backend, NoGpus
from tandem.cluster_agent.claim import CLAIM_WAIT, NodeClaim, NodeTaken, instance_id
from tandem.cluster_agent.clock import Clock, WallClock
from tandem.cluster_agent.health import Change, Tracker
from tandem.cluster_agent.rules import RULES, SEVERITY, XID_MAX, Limits, Rule, valid_xid
from tandem.cluster_agent.transitions import TransitionLog
from tandem.common import fleet, log, metrics, subjects
from tandem.common.bus import Bus
from tandem.common.events import (
    DrainRecord,
    GpuBrief,
    GpuSample,
    Health,
    HealthTransition,
    NodeHeartbeat,
    NodeTelemetry,
)
from tandem.common.streams import HEARTBEAT_TTL

SAMPLES = metrics.Counter("tandem_agent_samples", "GPU samples taken")
XIDS_INVALID = metrics.Counter("tandem_agent_xids_invalid", "XID codes a backend reported "
                               f"outside 1..{XID_MAX}, dropped")
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
                 drains: fleet.DrainBoard | None = None, instance: str | None = None,
                 claim_wait: float = CLAIM_WAIT) -> None:
        self.bus = bus
        self.cluster = subjects.token(cluster, "cluster")
        self.node = subjects.node(node)
        self.backend = backend
        self.clock = clock or WallClock()
        self.interval = interval
        self.ttl = heartbeat_ttl
        self.auto_drain = auto_drain
        self.instance = instance or instance_id()
        self.gpu_gauges = gpu_gauges
        self.tracker = Tracker(rules, limits)
        self.log = log.get("tandem.cluster_agent", cluster=cluster, node=node)
        self.models = AnnouncedModels(self.cluster, self.node, models, heartbeat_ttl, self.log)
        self.transitions = TransitionLog(bus, self.cluster, self.node, self.instance, self.log)
        self.claim = NodeClaim(bus, self.cluster, self.node,
                               subjects.node_key(cluster, node), self.instance, claim_wait,
                               self.log)
        self.samples = 0
        self.telemetry_stored = 0  # samples the stream acknowledged (its PubAck: stored)
        self.telemetry_failed = 0  # samples whose publish raised (no ack from the stream)
        self.xids_invalid = 0  # XID codes dropped as no XID's (``_drop_invalid_xids``)
        self.heartbeats = 0
        self.last: list[GpuSample] = []
        self.gpus = 0
        self._telemetry_subject = subjects.telemetry(cluster, node)
        self._lock = asyncio.Lock()
        self._sub: Any = None
        self._pending: tuple[Health, dict[str, Any]] | None = None  # transition owed
        self._drained_for: set[str] = set()  # hard rules (rule@gpu) already drained for
        self.drain = fleet.DrainWatch(bus, cluster, node, on_change=self._on_drain,
                                      board=drains)

    @property
    def state(self) -> Health:
        """The node's health as last published."""
        return self.transitions.state

    @property
    def seq(self) -> int:
        """The number of the node's last published transition."""
        return self.transitions.seq

    @property
    def published(self) -> Sequence[HealthTransition]:
        """The last transitions this instance published, newest last."""
        return self.transitions.published

    @property
    def waiting_for(self) -> str | None:
        """Another instance's id, while ``start`` waits for it to go."""
        return self.claim.waiting_for

    @property
    def taken_by(self) -> str | None:
        """The instance that took the node over while this one ran."""
        return self.claim.taken_by

    # ------------------------------------------------------------------------- lifecycle

    async def start(self, stop: asyncio.Event | None = None) -> bool:
        """Open the GPUs, claim the node, resume from the last published transition,
        watch drains. False (nothing started) when ``stop`` is set while another
        instance's heartbeat is awaited.

        Raises ``NoGpus`` when the backend opens no GPU (such a node would count as
        serving with nothing to serve on), ``NodeTaken`` when another instance still
        heartbeats for the node after ``claim_wait``, and what the backend's ``open``
        raises (``NvmlUnavailable``).
        """
        self.gpus = await self._backend_call(self.backend.open, self.clock.now())
        try:
            if not self.gpus:
                raise NoGpus(self.backend.name, self.node)
            claimed = await self.claim.wait(stop)
        except BaseException:
            self.backend.close()
            raise
        if not claimed:
            self.backend.close()
            return False
        await self._restore()
        await self.drain.start()
        self._sub = await self.bus.nc.subscribe(subjects.models(self.cluster, self.node),
                                                cb=self.models.on_message)
        now = self.clock.now()
        self.log.info("agent.started", backend=self.backend.name, gpus=self.gpus,
                      health=self.state.value, seq=self.seq, drained=self.drain.drained,
                      active=self.tracker.active(), instance=self.instance)
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
        return True

    async def close(self, remove_heartbeat: bool = True) -> None:
        """Stop watching and release the GPUs; a graceful stop removes the heartbeat now
        (a killed agent's heartbeat expires with the TTL instead), if this instance's
        write is still the last (never another instance's that took the node over)."""
        await self.drain.stop()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if remove_heartbeat:
            await self.claim.release()
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
        except (AgentDeath, NodeTaken):
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
        self._drop_invalid_xids(samples)
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
        # Telemetry is the least of the three signals: a stream that refuses it (full, its
        # leader away) must hold back neither a transition, its drain, nor the heartbeat.
        try:
            await self.bus.publish(self._telemetry_subject, telemetry)
        except Exception as exc:
            self.telemetry_failed += 1
            if not self.bus.nc.is_connected:
                raise  # NATS itself is away: nothing else goes out either (it stays owed)
            self.log.warning("agent.telemetry_failed", error=repr(exc), seq=self.samples)
        else:
            self.telemetry_stored += 1
        failed: Exception | None = None
        try:
            async with self._lock:
                await self._settle([], now)
        except Exception as exc:  # still owed: the next tick publishes it
            failed = exc
        try:
            await self.heartbeat()
        except Exception as exc:
            if failed is None or isinstance(exc, NodeTaken):
                raise
            self.log.warning("agent.heartbeat_failed", error=repr(exc))
        if failed is not None:
            raise failed
        return telemetry

    def _drop_invalid_xids(self, samples: list[GpuSample]) -> None:
        """Take out of each sample the XID codes no XID can have (``valid_xid``), before
        the rules, telemetry or a transition see them: counted (``xids_invalid``,
        ``tandem_agent_xids_invalid``), and logged the first time only, so a driver or
        binding that sends garbage costs one warning, never unbounded values downstream."""
        for s in samples:
            if not s.xids or all(map(valid_xid, s.xids)):
                continue
            bad = [x for x in s.xids if not valid_xid(x)]
            s.xids = [x for x in s.xids if valid_xid(x)]
            if not self.xids_invalid:
                self.log.warning("agent.xid_invalid", gpu=s.index, most=XID_MAX,
                                 codes=[repr(x)[:32] for x in bad[:8]],
                                 note="logged once; later ones are only counted")
            self.xids_invalid += len(bad)
            XIDS_INVALID.inc(len(bad))

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

    def _drain_handled(self, undrain: bool = False) -> None:
        """The hard rules active now are the operator's call (an undrain). Not a state
        fault an operator's live ``undrain`` found the GPU still showing (``Rule.state``:
        ``clear_latched`` kept it): the node is drained again at once, never served."""
        self._drained_for = {f"{r.name}@{g}" for r, g in self._hard()
                             if not (undrain and r.state)}

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
        """Publish the transition to ``target`` (``TransitionConflict``: still owed)."""
        evidence = {k: v for k, v in cause.items() if k not in ("reason", "action")}
        evidence.update(at=now, sample=self.samples, agent=self.instance)
        await self.transitions.publish(HealthTransition(
            cluster=self.cluster, node=self.node, previous=self.state, current=target,
            rule=str(cause["rule"]), reason=str(cause["reason"]),
            action=str(cause.get("action", "")), gpu=cause.get("gpu"), evidence=evidence,
            at=now, active=self.tracker.active(), handled=sorted(self._drained_for)))

    async def _restore(self) -> None:
        """Resume the last transition's state, number, active rules and handled drains."""
        last = await self.transitions.restore()
        if last is None:
            return
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
                self._drain_handled(undrain=True)
                cause = {"rule": "undrain", "action": "",
                         "reason": "returned to service: latched faults cleared",
                         "cleared": [c.key for c in cleared]}
                await self._settle(cleared, now, cause)
        with contextlib.suppress(NodeTaken):  # logged; the run loop's next beat stops it
            await self._guarded(self.heartbeat())

    # -------------------------------------------------------------------------- heartbeat

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
            gpus_free=0 if record is not None else len(free), models=self.models.names(),
            drained=record is not None, drain_reason=record.reason if record else "",
            at=time.time(), findings=self.tracker.active(),
            gpus=[_brief(s) for s in self.last], backend=self.backend.name,
            interval=self.interval, seq=self.heartbeats, instance=self.instance,
        )

    async def heartbeat(self) -> None:
        """Write the heartbeat; raises ``NodeTaken`` when another instance wrote it since
        this one's last write."""
        await self.claim.write(self.heartbeat_value())
