"""One run, supervised: launch, relay, watch, restart from the newest valid checkpoint.

The life of a run (each transition is in KV ``runs`` and on ``train.<run>.status``)::

    pending ─claim─> starting ─first step─> running ─all ranks done─> succeeded
                        ^                      │
                        └── restarting <───────┘  rank exit, hang, node lost, loss anomaly
                                │
                                └─ restarts > max_restarts ─> failed (with every incident)

    starting ─a rank cannot build or start the run (``invalid``)─> failed (invalid_config)

Failures are detected from the ranks' own signals (a rank's connection closing without
a goodbye is a dead rank, found within milliseconds; an agent's non-zero exit), from
time (no step within ``hang_multiple`` x the median step interval: a hang, whose stacks
are captured before the kill), from the fleet (``health.<cluster>.<node>`` unhealthy or
drained, KV ``drains``) and from the loss (the ranks stop on NaN/inf or a spike before
applying the update; the run rolls back and skips the data window that ended in the bad
batch).

A rollback goes to the newest checkpoint whose state holds none of that window (a step
at most ``at_step - skip_batches``: each step consumes at least one data position), and
starts a new lineage forked there (``checkpoints.Lineage``, recorded in KV ``runs``
``forks`` with the decision, before any rank starts): the steps it trains again are
checkpointed and announced under names of their own, checkpoints the old lineage wrote
past the fork are abandoned (never resumed from or served), and a record whose latest
committed checkpoint was one of them forgets it. Every other restart resumes in the same
lineage, from the newest valid checkpoint of its history.

One module, over the size the house keeps to: the state machine above and the run's
record are one thing (every transition writes the record, bounded to fit the bus), and
the attempt's watching already lives apart (``watch.AttemptWatch``, its base).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tandem.common import checkpoints as ck
from tandem.common import fleet, subjects, tracing
from tandem.common.backoff import Backoff, retry, wait_any
from tandem.common.bus import Bus, TypedKV, describe
from tandem.common.bus.acks import too_large
from tandem.common.events import (
    Health,
    RunRecord,
    RunState,
    TrainStatus,
    struct_replace,
)
from tandem.common.runs import RunConfig
from tandem.common.streams import KV_DRAINS, KV_RUNS
from tandem.trainer.health import Goodput, StragglerDetector
from tandem.trainer.launcher import Launcher, LaunchFailed, Placement, place
from tandem.trainer.run_metrics import RunMetrics
from tandem.trainer.spec import LaunchSpec
from tandem.trainer.watch import MAX_NOTED, AttemptWatch, Outcome

TERMINAL = tuple(s for s in RunState if s.terminal)
RECORD_BACKOFF = Backoff(0.1, max_delay=2.0)  # between writes of the run record
BAD_HEALTH = (Health.unhealthy, Health.drained)
# A run's KV record must fit the bus's max_payload (1 MB), or no write of it lands, its
# end included: it keeps the newest incidents, each with its long fields cut (``stored``).
MAX_INCIDENTS = 32
INCIDENT_CHARS = 1000  # a stored incident's longest text (an error, a rank's stack)...
NEWEST_CHARS = 4000  # ... but the newest's: a rank's whole stack (``capture_stacks``)
INCIDENT_ITEMS = 16  # its longest list or mapping (ranks' stacks, excluded nodes, logs)


@dataclass
class SupervisorConfig:
    checkpoint_root: Path
    work_root: Path
    cluster: str
    node: str
    relay_host: str = "127.0.0.1"
    threads_per_rank: int = 0
    status_every_s: float = 2.0
    record_retry_s: float = 15.0  # how long a KV runs update is retried on bus errors
    # async (run_id, dest, line) -> ck.Resume | None: the newest committed checkpoint of
    # ``line``'s history restored from S3; None only when none is committed (or none
    # verifies). It raises when S3 cannot say (an outage): the attempt then fails
    # (``RestoreFailed``) and is retried with backoff, never started afresh.
    restore: Any = None
    # async (run_id, line) -> committed steps of ``line``'s history in S3, oldest first.
    # Set when the nodes have disks of their own (launcher nodes): this host's disk is
    # never read for a resume point (it is one node's at most); the ranks are told the
    # committed steps (and the forks, so each step's lineage) and every node fetches the
    # newest that all of them verify (``fetch.py``).
    s3_steps: Any = None
    data_root: str = ""  # TANDEM_DATA_ROOT: the ranks' image folders stay under it
    # TANDEM_STOP_CHECKPOINT_S: how long ranks told to stop have to checkpoint (this
    # coordinator's own stop, launcher local), and, with ``s3_steps``, how long a
    # preempted attempt's checkpoint may take to be committed before the next attempt.
    stop_checkpoint_s: float = 15.0


class RestoreFailed(Exception):
    """S3 could not say which checkpoint the run resumes from (unreachable, throttling):
    not the same as nothing committed, so the attempt fails instead of starting afresh."""


class RunSupervisor(AttemptWatch):
    """One run's coordinator: its life (here) and the watching of each attempt, the
    rank channel included (``AttemptWatch``, in ``watch.py``)."""

    def __init__(self, bus: Bus, cfg: SupervisorConfig, run_id: str, config: RunConfig,
                 launcher: Launcher, log: Any) -> None:
        self.bus = bus
        self.cfg = cfg
        self.run_id = run_id
        self.config = config
        self.launcher = launcher
        self.log = log.bind(run_id=run_id)
        self.cluster = config.cluster or cfg.cluster
        self.q: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self.attempt_no = 0
        self.restarts = 0
        self.incidents: list[dict[str, Any]] = []
        self.cause: dict[str, Any] | None = None  # the incident the next attempt restarts after
        self.skipped: list[list[int]] = []
        self.excluded: dict[str, str] = {}  # node -> why (health events, drains)
        self.goodput = Goodput()
        self.metrics = RunMetrics(run_id)
        self.last_ckpt_step = 0
        self.latest_step = 0
        self.line = ck.Lineage()  # the run's current lineage (KV runs ``forks``)
        self.placement: Placement | None = None
        self.relay_address = ""  # host:port ranks send to, once run() listens
        self.pids: dict[int, int] = {}
        self.rank_node: dict[int, str] = {}  # each rank's node, as its hello says
        self._byes: set[int] = set()
        self._ckpt_failed: set[tuple[int, int, str]] = set()  # (lineage, step, node) reported
        self._kv: TypedKV[RunRecord] | None = None
        self._last_kv = 0.0
        self._too_large = False  # the last record write failed: over max_payload
        self.stragglers = StragglerDetector(config.straggler.ratio, config.straggler.window)
        self.cancelled = asyncio.Event()  # a client asked to stop the run (cancel_reason)
        self.cancel_reason = ""
        self.suspect = ""  # the node named by the last incident

    def request_cancel(self, reason: str) -> None:
        """A client cancelled the run (``runs.cancel_run``): the attempt in flight stops
        its ranks and the run ends ``cancelled``; no further attempt starts."""
        if self.cancelled.is_set():
            return
        self.cancel_reason = reason
        self.cancelled.set()
        self.q.put_nowait(("cancel", self.attempt_no))

    # ------------------------------------------------------------------------ bookkeeping

    async def kv(self) -> TypedKV[RunRecord]:
        if self._kv is None:
            self._kv = await self.bus.typed(KV_RUNS, RunRecord)
        return self._kv

    async def _record(self, **changes: Any) -> RunRecord | None:
        changes.setdefault("goodput", self.goodput.summary())
        changes["updated_at"] = time.time()
        self.metrics.progress(self.restarts, changes["goodput"].get("goodput"))

        changes["forks"] = self.line.json()
        line = self.line

        def apply(cur: RunRecord | None) -> RunRecord | None:
            if cur is None:
                return RunRecord(run_id=self.run_id, **changes)
            out = struct_replace(cur, **changes)
            # A rollback abandoned the checkpoint the record names as the latest
            # committed: readers list S3 (by the new history) until the next commit.
            if out.latest_checkpoint_step is not None and line.abandoned(
                    out.latest_checkpoint_step, out.latest_checkpoint_lineage):
                out = struct_replace(out, latest_checkpoint_step=None,
                                     latest_checkpoint_uri="", latest_checkpoint_lineage=0)
            return out

        self._last_kv = time.monotonic()
        # The ranks keep training through a bus outage (a NATS restart, a leader
        # election): retry for a while, then log and go on; the next update catches up.
        async def update() -> RunRecord | None:
            return await (await self.kv()).update(self.run_id, apply)

        # A record over max_payload never fits however long it is retried: not retried
        # (``_status`` cuts it harder for the run's end).
        self._too_large = False
        try:
            return await retry(update, RECORD_BACKOFF, within=self.cfg.record_retry_s,
                               when=lambda exc: not too_large(exc))
        except Exception as exc:
            self._too_large = too_large(exc)
            self.log.warning("run.record_failed", error=describe(exc))
            return None

    async def _current(self) -> RunRecord | None:
        """The run's record, or None when it cannot be read now (bus outage)."""
        try:
            got = await (await self.kv()).get(self.run_id)
        except Exception as exc:
            self.log.warning("run.record_unreadable", error=describe(exc))
            return None
        return got[0] if got else None

    async def _status(self, state: RunState, reason: str = "",
                      incident: dict[str, Any] | None = None, **record: Any) -> None:
        if state in (RunState.starting, RunState.running, RunState.restarting, *TERMINAL):
            record["state"] = state
        incidents = self.incidents[-MAX_INCIDENTS:]
        kept = await self._record(
            restarts=self.restarts, skipped=self.skipped, latest_step=self.latest_step,
            incidents=[stored(i, chars=NEWEST_CHARS if n == len(incidents) - 1 else
                              INCIDENT_CHARS) for n, i in enumerate(incidents)], **record)
        if kept is None and self._too_large and state in TERMINAL:
            await self._record_cut(state, reason)
        await self._publish(subjects.train(self.run_id, "status"), TrainStatus(
            run_id=self.run_id, state=state, reason=reason, restarts=self.restarts,
            incident=incident), f"{self.run_id}-status-{uuid.uuid4().hex[:12]}")
        # An on-call search by level finds a run that restarts or fails (it was all info).
        level = {RunState.restarting: "warning", RunState.failed: "error"}.get(state, "info")
        getattr(self.log, level)("run.status", state=state.value, reason=reason,
                                 restarts=self.restarts)

    async def _record_cut(self, state: RunState, reason: str) -> None:
        """The run's end, when its record does not fit max_payload even bounded: the state
        and why (an incident ``record_cut``), with every list cut to its newest few
        entries and those cut harder, so readers of KV ``runs`` see the run ended."""
        rec = await self._current()

        def few(entries: list[Any]) -> list[Any]:
            return [stored(e, chars=200, items=4) for e in entries[-2:]]

        note = {"kind": "record_cut", "state": state.value, "reason": reason[:INCIDENT_CHARS],
                "at": time.time(), "detector": "the run's record did not fit the bus's "
                "max_payload: its lists are cut to their newest entries"}
        await self._record(
            state=state, restarts=self.restarts, latest_step=self.latest_step,
            incidents=[*few(self.incidents), note], skipped=self.skipped[-2:], ranks=[],
            stragglers=few(rec.stragglers) if rec else [],
            corrupt_checkpoints=few(rec.corrupt_checkpoints) if rec else [],
            checkpoint_failures=few(rec.checkpoint_failures) if rec else [])

    async def _publish(self, subject: str, event: Any, msg_id: str,
                       retry_for: float = 10.0) -> None:
        try:
            await self.bus.publish(subject, event, msg_id=msg_id, retry_for=retry_for)
        except Exception as exc:  # the bus is down for long: the run goes on, KV catches up
            self.log.warning("run.publish_failed", subject=subject, error=describe(exc))

    # --------------------------------------------------------------------------- health

    def on_health(self, node: str, current: str, reason: str) -> None:
        """A node of this cluster changed health (event or drain); called by the service."""
        if current in (Health.unhealthy.value, Health.drained.value):
            self.excluded[node] = f"{current}: {reason}"
            if self.placement is not None and node in self.placement.nodes:
                self.q.put_nowait(("health", self.attempt_no, node, current, reason))
        else:
            self.excluded.pop(node, None)

    async def healthy_nodes(self) -> tuple[list[str], dict[str, str]]:
        candidates = list(self.config.nodes) or [self.cfg.node]
        why = {n: r for n, r in self.excluded.items() if n in candidates}
        drains = await self.bus.kv(KV_DRAINS)
        for n in candidates:
            key = subjects.node_key(self.cluster, n)
            with contextlib.suppress(Exception):
                entry = await drains.get(key)
                if entry.value:
                    why[n] = "drained"
            with contextlib.suppress(Exception):
                # The node's own heartbeat (one whose body names another is not: fleet)
                hb = await fleet.heartbeat(self.bus, self.cluster, n)
                if hb is not None and (hb.drained or hb.health in BAD_HEALTH):
                    why[n] = f"heartbeat says {hb.health.value}"
        return [n for n in candidates if n not in why], why

    async def _telemetry(self, node: str) -> dict[str, Any]:
        with contextlib.suppress(Exception):
            hb = await fleet.heartbeat(self.bus, self.cluster, node)
            if hb is not None:
                return msgspec.to_builtins(hb)
        return {}

    # ------------------------------------------------------------------------- the life

    async def run(self, stopping: asyncio.Event, adopted: bool = False) -> RunState:
        """Supervise the run to its end (or until ``stopping``); return its last state.

        ``adopted``: the run was this coordinator's before it restarted; its ranks died
        with the old process, which is recorded as an incident (not counted against
        ``max_restarts``: the run did nothing wrong).
        """
        rec = (await (await self.kv()).get(self.run_id))
        if rec is not None:
            r = rec[0]
            self.restarts, self.incidents = r.restarts, list(r.incidents)
            self.skipped = [list(w) for w in r.skipped]
            self.latest_step = r.latest_step
            self.line = ck.Lineage.of(r.forks)
            # NOTE: the newest attempt started, not only the one whose ranks all said
            # hello: a node agent still running an attempt answers a repeated order of it
            # with the torchrun it holds, whose ranks report to the dead coordinator.
            self.attempt_no = max([r.attempt, *(int(x.get("attempt", 0)) for x in r.ranks)])
            if r.state in TERMINAL:
                return r.state
            if r.cancel:  # cancelled while no coordinator watched it
                self.request_cancel(r.cancel)
            if adopted:
                if r.goodput:
                    self.goodput = Goodput.resumed(r.goodput, r.updated_at)
                self.cause = {
                    "kind": "coordinator_restart", "attempt": self.attempt_no,
                    "at": time.time(), "step": r.latest_step, "state": r.state.value,
                    "detector": "run adopted by its restarted coordinator"}
                self.incidents.append(self.cause)
        server = await self.listen()
        try:
            return await self._supervise(stopping)
        finally:
            self.metrics.ended()
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

    async def _supervise(self, stopping: asyncio.Event) -> RunState:
        wd = self.config.watchdog
        while True:
            if self.cancelled.is_set():
                await self._status(RunState.cancelled, self.cancel_reason)
                return RunState.cancelled
            # One trace per restart cycle: why it began (the incident that ended the cycle
            # before), placement, restore, launch, training, and its outcome, including the
            # status event that reports it.
            with tracing.new_trace("train attempt", self._cycle_attributes()) as span:
                if self.cause is not None:
                    span.add_event("restart", _primitive(self.cause, "tandem.incident."))
                    self.cause = None
                outcome = await self._attempt(stopping)
                span.set_attributes({"tandem.attempt": self.attempt_no,
                                     "tandem.outcome": outcome.kind,
                                     "tandem.step": self.latest_step})
                if outcome.kind not in ("succeeded", "preempted", "stopping", "cancelled"):
                    tracing.fail(span, f"{outcome.kind}: {outcome.detail.get('detector', '')}")
                ended = await self._conclude(outcome)
            if ended is not None:
                return ended
            delay = Backoff(wd.backoff_s, max_delay=wd.backoff_max_s).delay(self.restarts)
            await wait_any((stopping, self.cancelled), delay)
            if stopping.is_set():
                await self._status(RunState.restarting, "coordinator stopping")
                return RunState.restarting

    async def _conclude(self, outcome: Outcome) -> RunState | None:
        """Record and report how an attempt ended; the run's final state, or None when
        it restarts."""
        wd = self.config.watchdog
        if outcome.kind == "succeeded":
            self.goodput.finished()
            await self._status(RunState.succeeded, f"trained {self.latest_step} steps")
            return RunState.succeeded
        if outcome.kind == "stopping":
            saved = f" ({outcome.detail['reason']})" if outcome.detail.get("reason") else ""
            await self._status(RunState.restarting, f"coordinator stopping{saved}; resumes "
                               "when a coordinator adopts the run")
            return RunState.restarting
        if outcome.kind == "cancelled":
            self.goodput.finished()
            await self._status(RunState.cancelled, self.cancel_reason)
            return RunState.cancelled
        if outcome.kind == "invalid_config":  # a rank could not build or train it: no restart
            self.goodput.finished()
            incident = {"kind": "invalid_config", "attempt": self.attempt_no,
                        "at": time.time(), "step": self.latest_step, **outcome.detail}
            self.incidents.append(incident)
            await self._status(RunState.failed, f"invalid config: {outcome.detail['reason']}",
                               incident)
            return RunState.failed
        fork: dict[str, Any] = {}
        if outcome.kind == "loss_anomaly":
            # The state of a checkpoint at step s holds the batches of steps 1..s, and
            # positions grow by at least one a step, so s <= at_step - skip_batches
            # holds none of the window: the rollback goes there, in a new lineage.
            skip = self.config.loss_health.skip_batches
            self.line = self.line.fork(int(outcome.detail["at_step"]) - skip)
            fork = {"lineage": self.line.current, "forked_at": self.line.forks[-1]}
        if outcome.kind == "preempted" and outcome.detail.get("checkpoint_step"):
            await self._await_commit(int(outcome.detail["checkpoint_step"]))
        # The ranks are gone: the newest whole checkpoint of the run's history is where
        # the next attempt resumes (unless it fails verification, reported then).
        on_disk = ck.complete_steps(self.cfg.checkpoint_root, self.run_id, self.line) \
            if self.cfg.s3_steps is None else []  # launcher nodes: S3's list (above)
        resume_from = on_disk[0][0] if on_disk else (
            self.last_ckpt_step if not fork else 0)
        if not on_disk and self.cfg.s3_steps is not None:
            with contextlib.suppress(Exception):  # only what goodput counts as redone
                committed = await self.cfg.s3_steps(self.run_id, self.line)
                resume_from = committed[-1] if committed else 0
        self.goodput.failed(resume_from)
        incident = {"kind": outcome.kind, "attempt": self.attempt_no, "at": time.time(),
                    "step": self.latest_step, "resume_from": resume_from,
                    **outcome.detail, **fork}
        if incident.get("node"):  # placed last next time, behind any spare node
            self.suspect = str(incident["node"])
        if outcome.kind == "loss_anomaly":
            pos = int(outcome.detail["data_pos"])
            window = [max(0, pos - self.config.loss_health.skip_batches + 1), pos]
            self.skipped.append(window)
            incident["skip_window"] = window
        self.incidents.append(incident)
        self.cause = incident
        if outcome.kind == "preempted":
            # NOTE: a node taken away (a spot reclaim, an upgrade) is not the run's
            # failure: not counted against ``max_restarts``, as an adoption is not.
            await self._status(RunState.restarting, incident["reason"], incident)
            return None
        self.restarts += 1
        if self.restarts > wd.max_restarts:
            await self._status(RunState.failed, f"gave up after {wd.max_restarts} restarts; "
                               f"last: {_summary(incident)}", incident)
            return RunState.failed
        await self._status(RunState.restarting, _summary(incident), incident)
        return None

    async def _await_commit(self, step: int) -> None:
        """With nodes that resume from S3's committed list alone (``s3_steps``), wait up
        to ``stop_checkpoint_s`` for ``step`` (the checkpoint preempted ranks wrote, which
        their node's checkpointer mirrors) to be committed there, so the next attempt
        resumes from it rather than from the one before; past that it goes on without."""
        if self.cfg.s3_steps is None:
            return
        deadline = time.monotonic() + self.cfg.stop_checkpoint_s
        while not self.cancelled.is_set():
            with contextlib.suppress(Exception):  # S3 away: as if not committed yet
                if step in await self.cfg.s3_steps(self.run_id, self.line):
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                self.log.warning("run.preempted_checkpoint_uncommitted", step=step,
                                 waited_s=self.cfg.stop_checkpoint_s)
                return
            await wait_any((self.cancelled,), min(1.0, left))  # S3's list, each second

    def _cycle_attributes(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {"tandem.run_id": self.run_id, "tandem.restarts": self.restarts}
        if self.cause is not None:
            attrs.update({"tandem.restart.reason": _summary(self.cause),
                          "tandem.restart.incident": self.cause["kind"],
                          "tandem.restart.after_attempt": int(self.cause.get("attempt", 0))})
        return attrs

    async def _attempt(self, stopping: asyncio.Event) -> Outcome:
        self.attempt_no += 1
        healthy, why = await self.healthy_nodes()
        # NOTE: the node of the last incident (its agent lost, a rank dead on it) goes
        # last, so a spare node takes its place when the run names one; without a spare
        # it is placed as before. Nothing else about it is held against it.
        healthy.sort(key=lambda n: n == self.suspect)
        placement = place(self.config.ranks, healthy)
        if placement is None:
            return Outcome("no_healthy_nodes", {"excluded": why})
        try:
            resume = await self._resume_point()
        except RestoreFailed as exc:  # never start afresh over committed checkpoints
            return Outcome("restore_failed", {
                "reason": str(exc), "detector": "restoring the newest committed "
                "checkpoint from S3"})
        fetch: list[int] = []
        if resume is None and self.cfg.s3_steps is not None:
            try:
                fetch = list(reversed(await self.cfg.s3_steps(self.run_id, self.line)))
            except Exception as exc:  # never start afresh over committed checkpoints
                return Outcome("restore_failed", {
                    "reason": repr(exc), "detector": "listing committed checkpoints in S3"})
        ck.remove_incomplete(self.cfg.checkpoint_root, self.run_id)
        self.last_ckpt_step = resume.step if resume else fetch[0] if fetch else 0
        self.latest_step = self.last_ckpt_step
        attempt_dir = self.cfg.work_root / self.run_id / f"attempt-{self.attempt_no}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        spec = LaunchSpec(
            run_id=self.run_id, attempt=self.attempt_no,
            # Only what differs from a default: a rank of an older version (its node
            # agent not yet upgraded) refuses a field it does not know.
            config=self.config.stored(),
            checkpoint_root=str(self.cfg.checkpoint_root), attempt_dir=str(attempt_dir),
            events=self.relay_address, rank_nodes=placement.rank_nodes,
            resume_path=str(resume.path) if resume else "", resume_steps=fetch,
            skipped=self.skipped, forks=self.line.json(),
            threads=self.cfg.threads_per_rank, node=self.cfg.node, cluster=self.cluster,
            data_root=self.cfg.data_root)
        spec_path = attempt_dir / "launch.json"
        spec_path.write_bytes(msgspec.json.encode(spec))
        self.placement = placement
        self.pids, self.rank_node, self._byes = {}, {}, set()
        self._ckpt_failed = set()  # a step failing again in this attempt is reported again
        self.stragglers.reset()
        await self._status(RunState.starting,
                           f"attempt {self.attempt_no} on {','.join(placement.nodes)} "
                           f"({placement.per_node} ranks each), "
                           + (f"resuming from step {resume.step}" if resume else
                              f"each node fetching from S3 the newest of committed steps "
                              f"{', '.join(map(str, fetch))} that every node verifies"
                              if fetch else "from scratch"),
                           nodes=placement.nodes, attempt=self.attempt_no)
        if stopping.is_set():  # no launch by a coordinator on its way out: left for adoption
            self.placement = None
            return Outcome("stopping")
        with tracing.tracer().start_as_current_span("launch", attributes={
                "tandem.nodes": placement.nodes, "tandem.ranks": self.config.ranks}):
            try:
                attempt = await self.launcher.start(placement, spec, spec_path, attempt_dir)
            except LaunchFailed as exc:
                self.placement = None
                return Outcome("launch_failed", {"node": exc.node, "reason": exc.reason,
                                                 "detector": "node agent refused or absent"})
        self.goodput.launched()
        try:
            outcome = await self._watch(attempt, attempt_dir, stopping)
        finally:
            codes = await self.launcher.stop(attempt, list(self.pids.values()))
            self.placement = None
        if outcome.kind != "succeeded":
            outcome.detail.setdefault("agent_exit_codes", codes)
            outcome.detail.setdefault("logs", [str(a.log_path) for a in attempt.agents])
        return outcome

    async def _resume_point(self) -> ck.Resume | None:
        """The newest checkpoint that verifies, local else from S3; corrupt ones skipped
        are recorded and reported. None: nothing to resume from; ``RestoreFailed`` when
        S3 could not be asked."""
        with tracing.tracer().start_as_current_span("restore") as span:
            if self.cfg.s3_steps is not None:
                # NOTE: the nodes have disks of their own, and this host's is at most one
                # node's (in Kubernetes, a training node's hostPath): what is here may be
                # that node's part of a sharded checkpoint, or a full one older than what
                # S3 has committed since. The resume point is S3's committed list alone
                # (``_attempt``), which every node fetches and verifies.
                span.set_attributes({"tandem.resume_step": 0, "tandem.resume_from": "s3"})
                return None
            resume, rejected = ck.newest_valid(self.cfg.checkpoint_root, self.run_id,
                                               line=self.line)
            if rejected:
                await self.report_corrupt(
                    RunState.restarting if self.restarts else RunState.starting,
                    [{"step": r.step, "path": r.path, "reason": r.reason} for r in rejected])
            if resume is None and self.cfg.restore is not None and self.cfg.s3_steps is None:
                try:
                    resume = await self.cfg.restore(
                        self.run_id, ck.run_dir(self.cfg.checkpoint_root, self.run_id),
                        self.line)
                except Exception as exc:
                    raise RestoreFailed(f"{type(exc).__name__}: {exc}") from exc
            span.set_attributes({"tandem.resume_step": resume.step if resume else 0,
                                 "tandem.corrupt_skipped": [r.step for r in rejected]})
            return resume

    async def report_corrupt(self, state: RunState, corrupt: list[dict[str, Any]]) -> None:
        """Checkpoints a resume skipped because they failed verification: a status event
        and KV ``corrupt_checkpoints``."""
        corrupt = [{**c, "at": time.time()} for c in corrupt]
        rec = await self._current()
        before = rec.corrupt_checkpoints if rec else []
        await self._status(state, "corrupt checkpoint(s) skipped: " + "; ".join(
                               f"step {c['step']}: {c['reason']}" for c in corrupt),
                           {"kind": "corrupt_checkpoint", "checkpoints": corrupt},
                           corrupt_checkpoints=[*before, *corrupt][-MAX_NOTED:])


def _primitive(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The scalar entries of ``values`` as span attributes (OpenTelemetry takes no dicts)."""
    return {prefix + k: v for k, v in values.items()
            if isinstance(v, (str, bool, int, float))}


def stored(value: Any, chars: int = INCIDENT_CHARS, items: int = INCIDENT_ITEMS) -> Any:
    """An incident (or another entry of a run's record) as the record keeps it: each
    text cut to ``chars`` characters, its start and its end (an error says what it is
    first, a stack its outermost frames last), each list or mapping within it to its
    first ``items`` entries, saying how much was left out. Its own keys are all kept."""
    def cut(v: Any) -> Any:
        if isinstance(v, str) and len(v) > chars:
            half = chars // 2
            return f"{v[:half]} ... ({len(v) - 2 * half} characters cut) ... {v[-half:]}"
        if isinstance(v, dict):
            kept: Any = {k: cut(x) for k, x in list(v.items())[:items]}
            if len(v) > items:
                kept["..."] = f"{len(v) - items} more left out"
            return kept
        if isinstance(v, list | tuple):
            kept = [cut(x) for x in v[:items]]
            if len(v) > items:
                kept.append(f"... {len(v) - items} more left out")
            return kept
        return v

    return {k: cut(v) for k, v in value.items()} if isinstance(value, dict) else cut(value)


def _summary(incident: dict[str, Any]) -> str:
    parts = [incident["kind"]]
    for k in ("rank", "node", "exit_code", "anomaly", "skip_window", "detector"):
        if incident.get(k) not in (None, ""):
            parts.append(f"{k}={incident[k]}")
    return " ".join(str(p) for p in parts)
