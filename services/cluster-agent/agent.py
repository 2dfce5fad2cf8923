"""One node's agent: sample, publish telemetry, classify, publish transitions, heartbeat.

``NodeAgent`` owns no connection and no process: the service runs one per node, the
benchmarks and a simulated fleet run many on one bus. ``tick()`` is one sample of the
node, so tests drive simulated time sample by sample.

Transitions are numbered per node (``seq``) and published with ``Nats-Msg-Id``
``health-<cluster>-<node>-<seq>``. At start the agent reads the last transition on its
subject and resumes from it: same state, same number, the same rules active (a latched
XID is not forgotten by a restart), so a restart publishes nothing until the node's
health really changes, and a retried publish is deduplicated by the stream. A message
on the subject that is not the node's transition (junk, another node's) is read past
to the last one that is; if none is found, numbering resumes from the junk's stream
sequence, a number no transition of the node can have used. A publish the stream
answers "duplicate" is this instance's own earlier try (its evidence names the
instance) or a conflict: the number is someone else's, so the agent says so and
publishes under the next free one.

One instance per node: each agent has an ``instance`` id, carried by its heartbeat.
``start`` waits (up to ``claim_wait``) while another instance's heartbeat for the node
is in KV (fresh: the TTL removes a dead one's, a graceful stop deletes it at once), then
refuses with ``NodeTaken``. Heartbeats are written by compare-and-set on this instance's
last write, so one that finds the key written by another instance while it runs says so
(an error) and raises ``NodeTaken``: the service stops rather than flip the node's
heartbeat between two agents.

With ``gpu_gauges`` (the service's one agent) each sample also sets the node's GPU gauges
(``tandem_gpu_*{cluster,node,gpu}``) on the process's ``/metrics``, before it is
published, so they read what the last telemetry event says even while NATS is away. A
simulated fleet of thousands of nodes in one process leaves them off.

Telemetry is the least of the node's signals: a TELEMETRY stream that refuses a sample
is logged (``telemetry_failed``) and holds back neither the transition, the drain nor
the heartbeat.

One module past 450 lines: the transition numbering (restore, publish, conflicts), the
node's claim and its heartbeat share the agent's state under one lock, and each keeps
an invariant the others rely on (a number is used once; one instance writes).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from tandem.cluster_agent.backend import AgentDeath, Backend, NoGpus
from tandem.cluster_agent.clock import Clock, WallClock
from tandem.cluster_agent.health import Change, Tracker
from tandem.cluster_agent.rules import RULES, SEVERITY, Limits, Rule
from tandem.common import fleet, log, metrics, subjects
from tandem.common.bus import Bus
from tandem.common.errors import EventDecodeError, InvalidToken, TandemError
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
# A replaced pod still stopping (Kubernetes' default terminationGracePeriodSeconds, the
# DaemonSet's) plus a killed one's heartbeat expiring: how long a new agent waits.
CLAIM_WAIT = 30.0 + HEARTBEAT_TTL
CLAIM_POLL = 0.5  # seconds between looks at another instance's heartbeat while waiting
# Bounds on what workers announce, so the heartbeat always fits the server's max_payload:
# at most MAX_MODELS names of at most 64 characters (subject tokens), about 17 kB.
MAX_MODELS = 256
MAX_WORKERS = 64
RESTORE_SCAN = 256  # messages of the node's subject read back past an unreadable last one
CONFLICTS = 5  # msg ids found taken in one publish before it gives up until the next tick


class NodeTaken(TandemError):
    """Another agent instance (``other``) heartbeats for ``node``: this one must not run."""

    def __init__(self, cluster: str, node: str, instance: str, other: str, why: str) -> None:
        self.cluster, self.node, self.instance, self.other = cluster, node, instance, other
        super().__init__(
            f"TANDEM_NODE={node} (cluster {cluster}): another cluster-agent, instance "
            f"{other or '(one older than instance ids)'}, {why}; this is instance {instance}. "
            "Two agents must not share a node name: set TANDEM_NODE to this node's own name "
            "(spec.nodeName under Kubernetes) or stop the other agent")


class TransitionConflict(TandemError):
    """Every msg id tried for the node's next transition was taken by another writer."""


def instance_id() -> str:
    """This agent's id: host (the pod's name under Kubernetes), pid and a random part."""
    return f"{socket.gethostname()[:64]}-{os.getpid()}-{secrets.token_hex(3)}"


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
        self.static_models = {subjects.token(m, "model name") for m in models}
        if len(self.static_models) > MAX_MODELS:
            raise ValueError(f"{len(self.static_models)} models always reported: at most "
                             f"{MAX_MODELS}")
        self.instance = instance or instance_id()
        self.claim_wait = claim_wait
        self.waiting_for: str | None = None  # another instance's id, while start waits
        self.taken_by: str | None = None  # the instance that took the node over
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
        self._beat: tuple[NodeHeartbeat, int] | None = None  # last written, its revision
        self._beat_lock = asyncio.Lock()
        self._workers: dict[str, tuple[list[str], float]] = {}
        self._capped = False  # the last heartbeat left announced models out
        self._sub: Any = None
        self._pending: tuple[Health, dict[str, Any]] | None = None  # transition owed
        self._drained_for: set[str] = set()  # hard rules (rule@gpu) already drained for
        self.drain = fleet.DrainWatch(bus, cluster, node, on_change=self._on_drain,
                                      board=drains)

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
            claimed = await self._claim(stop)
        except BaseException:
            self.backend.close()
            raise
        if not claimed:
            self.backend.close()
            return False
        await self._restore()
        await self.drain.start()
        self._sub = await self.bus.nc.subscribe(subjects.models(self.cluster, self.node),
                                                cb=self._on_models)
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

    async def _claim(self, stop: asyncio.Event | None) -> bool:
        """Wait until no other instance's heartbeat for the node is in KV; False if
        ``stop`` is set first; ``NodeTaken`` after ``claim_wait``.

        Presence is freshness: the bucket's TTL removes a dead agent's heartbeat, a
        graceful stop deletes it. So a replaced pod's successor starts as soon as the old
        one has stopped, or one TTL after it was killed, and one still there after the
        wait is an instance alive elsewhere. Polled: an expiry sends no watch event.
        """
        kv = await self.bus.typed(KV_NODES, NodeHeartbeat)
        deadline = time.monotonic() + self.claim_wait
        while (other := await self._other(kv)) is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                exc = NodeTaken(self.cluster, self.node, self.instance, other,
                                f"still heartbeats for this node after {self.claim_wait:g} s")
                self.log.error("agent.node_taken", error=str(exc), other=other)
                raise exc
            if self.waiting_for is None:
                self.log.warning("agent.waiting_for_node", other=other, wait_s=self.claim_wait,
                                 instance=self.instance)
            self.waiting_for = other
            stopping = stop or asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(CLAIM_POLL, left)):
                    await stopping.wait()
            if stopping.is_set():
                return False
        self.waiting_for = None
        return True

    async def _other(self, kv: Any) -> str | None:
        """The id of another instance whose heartbeat is the node's now, else None."""
        try:
            got = await kv.get(self._key)
        except EventDecodeError as exc:  # not an agent's heartbeat: the first beat replaces it
            self.log.warning("agent.heartbeat_unreadable", error=exc.reason)
            return None
        if got is None or got[0].instance == self.instance:
            return None
        return str(got[0].instance)

    async def close(self, remove_heartbeat: bool = True) -> None:
        """Stop watching and release the GPUs; a graceful stop removes the heartbeat now
        (a killed agent's heartbeat expires with the TTL instead), if this instance's
        write is still the last (never another instance's that took the node over)."""
        await self.drain.stop()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if remove_heartbeat and self._beat is not None:
            with contextlib.suppress(Exception):
                await (await self.bus.kv(KV_NODES)).delete(self._key, last=self._beat[1])
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
        """Publish the transition to ``target``; raises ``TransitionConflict`` when every
        number tried was taken by another writer (the transition stays owed)."""
        evidence = {k: v for k, v in cause.items() if k not in ("reason", "action")}
        evidence.update(at=now, sample=self.samples, agent=self.instance)
        for _ in range(CONFLICTS):
            seq = self.seq + 1
            tr = HealthTransition(
                cluster=self.cluster, node=self.node, previous=self.state, current=target,
                rule=str(cause["rule"]), reason=str(cause["reason"]),
                action=str(cause.get("action", "")), gpu=cause.get("gpu"), evidence=evidence,
                at=now, seq=seq, active=self.tracker.active(),
                handled=sorted(self._drained_for))
            # The msg id makes a retried publish (same seq) land once in HEALTH.
            msg_id = f"health-{self.cluster}-{self.node}-{seq}"
            ack = await self.bus.publish(self._health_subject, tr, msg_id=msg_id, retry_for=10.0)
            if not ack.duplicate:
                self._published(tr)
                return
            stored = await self._stored(ack.seq)
            if stored is not None and stored.seq == seq and \
                    stored.evidence.get("agent") == self.instance:
                self._published(stored)  # an earlier try of ours landed; its ack was lost
                if stored.current == target:
                    return
                continue  # then the state owed now
            self.log.error("agent.transition_conflict", seq=seq, msg_id=msg_id,
                           stream_seq=ack.seq, other=stored.evidence.get("agent")
                           if stored is not None else None)
            self.seq = max(seq, await self._floor())
        raise TransitionConflict(f"{CONFLICTS} msg ids for node {self.node}'s next transition "
                                 f"were taken by another writer (up to seq {self.seq})")

    def _published(self, tr: HealthTransition) -> None:
        self.seq, self.state = tr.seq, tr.current
        self.published.append(tr)
        TRANSITIONS.labels(tr.current.value).inc()
        self.log.warning("agent.transition", previous=tr.previous.value,
                         current=tr.current.value, rule=tr.rule, gpu=tr.gpu, seq=tr.seq,
                         action=tr.action)

    def _readable(self, data: bytes) -> HealthTransition | None:
        """``data`` as this node's transition, or None (junk, or another node's)."""
        try:
            tr = decode(data, HealthTransition)
        except EventDecodeError:
            return None
        return tr if (tr.cluster, tr.node) == (self.cluster, self.node) else None

    async def _stored(self, stream_seq: int) -> HealthTransition | None:
        msg = await self.bus.js.get_msg(HEALTH, seq=stream_seq)
        return self._readable(msg.data) if msg.subject == self._health_subject else None

    async def _floor(self) -> int:
        """A number at or above every transition number stored on the node's subject."""
        try:
            msg = await self.bus.js.get_last_msg(HEALTH, self._health_subject)
        except NotFoundError:
            return 0
        last = self._readable(msg.data)
        return last.seq if last is not None else int(msg.seq or 0)

    async def _last_readable(self, before: int) -> HealthTransition | None:
        """The newest of the node's transitions stored before stream sequence ``before``,
        reading back at most ``RESTORE_SCAN`` messages of its subject; None past that.

        Windows of the stream, each 8 times the last, newest first; within one, the
        subject's messages oldest first, one get each (the agent's role may read HEALTH's
        messages, not make consumers on it).
        """
        hi, span, read = before, 64, 0
        while hi > 1:
            lo, found, seq = max(1, hi - span), None, max(1, hi - span)
            while True:
                try:
                    msg = await self.bus.js.get_msg(HEALTH, seq=seq,
                                                    subject=self._health_subject, next=True)
                except NotFoundError:
                    break
                if msg.seq >= hi:
                    break
                read += 1
                if read > RESTORE_SCAN:
                    return None
                found = self._readable(msg.data) or found
                seq = msg.seq + 1
            if found is not None:
                return found
            hi, span = lo, span * 8
        return None

    async def _restore(self) -> None:
        try:
            msg = await self.bus.js.get_last_msg(HEALTH, self._health_subject)
        except NotFoundError:
            return
        last = self._readable(msg.data)
        if last is None:
            last = await self._last_readable(int(msg.seq or 0))
            if last is None:
                # Nothing to resume: number on from the junk's stream sequence, which no
                # transition of the node can have had (each took a stream sequence of its
                # own at or above its number), so none of its msg ids is reused.
                self.seq = int(msg.seq or 0)
                self.log.error("agent.restore_unreadable", stream_seq=msg.seq, seq=self.seq,
                               scanned=RESTORE_SCAN)
                return
            self.log.warning("agent.restore_past_unreadable", stream_seq=msg.seq, seq=last.seq)
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
                self._drain_handled(undrain=True)
                cause = {"rule": "undrain", "action": "",
                         "reason": "returned to service: latched faults cleared",
                         "cleared": [c.key for c in cleared]}
                await self._settle(cleared, now, cause)
        with contextlib.suppress(NodeTaken):  # logged; the run loop's next beat stops it
            await self._guarded(self.heartbeat())

    # -------------------------------------------------------------------------- heartbeat

    def _models(self) -> list[str]:
        """The static models, then the workers' fresh ones: at most ``MAX_MODELS``."""
        fresh = time.monotonic() - self.ttl
        self._workers = {w: v for w, v in self._workers.items() if v[1] >= fresh}
        announced = set().union(*(names for names, _ in self._workers.values()))
        extra = sorted(announced - self.static_models)
        room = MAX_MODELS - len(self.static_models)
        capped = len(extra) > room
        if capped and not self._capped:  # said once, until it fits again
            self.log.warning("agent.models_capped", announced=len(announced),
                             left_out=extra[room:room + 10], most=MAX_MODELS)
        self._capped = capped
        return sorted(self.static_models.union(extra[:room]))

    async def _on_models(self, msg: Msg) -> None:
        """Fold one worker's announcement in; one that is not this node's, or names
        what no task can ask for (not a token), or too much, is logged and ignored."""
        try:
            ev = decode(msg.data, ModelsLoaded)
            problem = self._models_problem(ev)
        except (EventDecodeError, InvalidToken) as exc:
            problem = str(exc)
        if problem:
            self.log.warning("agent.bad_models_message", error=problem)
            return
        self._workers[ev.worker] = (list(ev.models), time.monotonic())

    def _models_problem(self, ev: ModelsLoaded) -> str:
        """What is wrong with ``ev`` for this agent ("" if nothing); raises
        ``InvalidToken`` for a node, worker or model that is not a token."""
        if ev.cluster != self.cluster or subjects.node(ev.node) != self.node:
            return (f"worker {ev.worker!r} announces for {ev.cluster}/{ev.node}, not this "
                    f"agent's {self.cluster}/{self.node}")
        subjects.token(ev.worker, "worker")
        if len(ev.models) > MAX_MODELS:
            return f"worker {ev.worker!r} announces {len(ev.models)} models: at most {MAX_MODELS}"
        for m in ev.models:
            subjects.token(m, "model name")
        fresh = time.monotonic() - self.ttl
        if ev.worker not in self._workers and sum(
                t >= fresh for _, t in self._workers.values()) >= MAX_WORKERS:
            return f"worker {ev.worker!r}: {MAX_WORKERS} workers already announce on this node"
        return ""

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
            interval=self.interval, seq=self.heartbeats, instance=self.instance,
        )

    async def heartbeat(self) -> None:
        """Write the heartbeat by compare-and-set on this instance's last write (or as a
        new key); raises ``NodeTaken`` when another instance wrote it since."""
        kv = await self.bus.typed(KV_NODES, NodeHeartbeat)
        value = self.heartbeat_value()

        def ours(cur: NodeHeartbeat | None) -> NodeHeartbeat:
            if cur is None or cur.instance == self.instance:
                return value
            if self.taken_by is None:
                self.log.error("agent.node_taken_over", other=cur.instance,
                               instance=self.instance, node=self.node)
            self.taken_by = cur.instance
            raise NodeTaken(self.cluster, self.node, self.instance, cur.instance,
                            "took this node's heartbeat over while this one ran")

        async with self._beat_lock:
            try:
                self._beat = await kv.move(self._key, ours, attempts=5, expect=self._beat)
            except EventDecodeError as exc:  # not an agent's heartbeat: replace it
                self.log.warning("agent.heartbeat_unreadable", error=exc.reason)
                self._beat = (value, await kv.put(self._key, value))
