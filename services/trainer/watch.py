"""Watching one attempt: the coordinator's end of the rank channel, and the watchdog.

``AttemptWatch`` is the watching half of ``RunSupervisor`` (``supervisor.py`` holds the
life of the run and its bookkeeping). It is a mixin, not a collaborator, because what it
watches *is* the supervisor's state: the step it reports, the goodput it accumulates,
the KV record and status events it writes (``_status``, ``_record``, ``_current``,
``_publish``, ``_telemetry`` are the supervisor's). Split only to keep each file to one
concern.

What it does:

- ``listen``/``handle_connection``: one TCP connection per rank, lines of up to
  ``channel.LINE_LIMIT`` bytes (asyncio's default, 64 KiB, is less than a legal
  ``StepReport`` of a big run); each line is decoded into a
  ``channel.RankMessage`` by its one typed decoder and queued. A line that does not
  decode ends the connection, logged with the reason: the rank is treated as failing,
  as a broken connection is (see the note there).
- ``_watch``: one attempt's queue (rank messages, connections closing, agents ending as
  the launcher's ``poll`` reports them, an agent lost included, health, stop) with a
  deadline (the startup timeout, then the hang limit); it dispatches each message by
  its type and returns the attempt's ``Outcome``.
- ``relay``: a ``StepReport`` or ``CheckpointWritten`` becomes bus events, KV ``runs``
  updates, goodput, stragglers and metrics.
- Ranks told to stop (``channel.Preempted``; or this coordinator's own stop, asked of
  them through ``Launcher.interrupt``): the attempt ends once every agent exited and
  every connection is read to its end, whatever the exit codes (``Halt``, ``_halted``).

One module past 450 lines: ``_watch`` is one state machine over one queue (rank
messages, agent exits, health, stop), whose deadline depends on every kind of item, and
the relay handlers it dispatches to write the state (steps, checkpoints) that it reads;
split, each half would declare and reach into the other's.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.errors import EventDecodeError
from tandem.common.events import CheckpointWritten, RunRecord, RunState, TrainStep
from tandem.common.runs import RunConfig
from tandem.trainer import channel
from tandem.trainer.channel import (
    Anomaly,
    Bye,
    CheckpointWriteFailed,
    Done,
    Hello,
    Invalid,
    Preempted,
    RankMessage,
    Resumed,
    StepReport,
)
from tandem.trainer.health import Goodput, HangWatch, StragglerDetector
from tandem.trainer.launcher import (
    Attempt,
    Launcher,
    Placement,
    capture_stacks,
    proc_state,
)
from tandem.trainer.run_metrics import RunMetrics

MAX_FAILURES = 20  # checkpoint write failures a run's record keeps, the newest
MAX_NOTED = 20  # stragglers flagged and corrupt checkpoints skipped it keeps, the newest

if TYPE_CHECKING:
    from tandem.trainer.supervisor import SupervisorConfig


# How long an agent's non-zero exit waits for its node's ranks' connections to be read
# to their end (they are gone: their ends come at once) before it is decided a failure.
EXIT_SETTLE_S = 2.0


@dataclass
class Outcome:
    kind: str  # succeeded, rank_exit, hang, startup_timeout, node_lost, loss_anomaly,
    #            final_checkpoint_unwritten, no_healthy_nodes, launch_failed,
    #            restore_failed, invalid_config, preempted, stopping, cancelled
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Halt:
    """An attempt's ranks told to stop (SIGTERM; ``channel.Preempted``): since when, the
    step they agreed to stop at, the nodes whose ranks got the signal, and whether this
    coordinator asked (its own stop) rather than a node."""

    since: float
    step: int | None = None
    nodes: set[str] = field(default_factory=set)
    by_coordinator: bool = False


class AttemptWatch:
    """``RunSupervisor``'s watching half; see the module docstring."""

    # The supervisor's state this half reads and writes (set in RunSupervisor.__init__).
    run_id: str
    config: RunConfig
    cfg: SupervisorConfig
    cluster: str
    log: Any
    q: asyncio.Queue[tuple[Any, ...]]
    attempt_no: int
    placement: Placement | None
    pids: dict[int, int]
    rank_node: dict[int, str]
    _byes: set[int]
    _ckpt_failed: set[tuple[int, int, str]]
    latest_step: int
    last_ckpt_step: int
    line: ck.Lineage
    goodput: Goodput
    stragglers: StragglerDetector
    metrics: RunMetrics
    _last_kv: float
    launcher: Launcher
    relay_address: str

    if TYPE_CHECKING:  # the supervisor's bookkeeping, which this half calls
        async def _status(self, state: RunState, reason: str = "",
                          incident: dict[str, Any] | None = None, **record: Any) -> None: ...
        async def _record(self, **changes: Any) -> RunRecord | None: ...
        async def _current(self) -> RunRecord | None: ...
        async def _publish(self, subject: str, event: Any, msg_id: str,
                           retry_for: float = 10.0) -> None: ...
        async def _telemetry(self, node: str) -> dict[str, Any]: ...
        async def report_corrupt(self, state: RunState,
                                 corrupt: list[dict[str, Any]]) -> None: ...

    async def listen(self) -> asyncio.Server:
        """The relay: a server on ``relay_host`` (a free port, ``relay_address``) that
        takes each rank's connection (``handle_connection``)."""
        server = await asyncio.start_server(self.handle_connection, self.cfg.relay_host, 0,
                                            limit=channel.LINE_LIMIT)
        self.relay_address = f"{self.cfg.relay_host}:{server.sockets[0].getsockname()[1]}"
        return server

    async def handle_connection(self, reader: asyncio.StreamReader,
                                writer: asyncio.StreamWriter) -> None:
        """One rank's connection: forward each message; a close without goodbye is a death."""
        rank, attempt = -1, -1
        try:
            while line := await reader.readline():
                message = channel.decode(line)
                if isinstance(message, Hello):
                    rank, attempt = message.rank, message.attempt
                self.q.put_nowait(("msg", attempt, rank, message))
        # NOTE: a line that does not decode ends the connection, as an unreadable line
        # always did: the close is then a rank's death (no goodbye), so the attempt
        # restarts, and the rank, its socket closed, exits ORPHANED. Reading on past a
        # message we cannot understand could miss a ``bye`` or an ``anomaly``.
        except EventDecodeError as exc:
            self.log.warning("relay.bad_message", rank=rank, reason=exc.reason,
                             line=exc.payload[:200].decode(errors="replace"))
        except (ConnectionError, ValueError) as exc:  # ValueError: a line over the limit
            self.log.warning("relay.bad_connection", rank=rank, error=repr(exc))
        except asyncio.CancelledError:
            # The coordinator stopping: ended here, since asyncio's server asks a handler
            # task for its exception when it is done, and a cancelled one raises there
            # ("Exception in callback" in the log of every stop with ranks connected).
            pass
        finally:
            self.q.put_nowait(("closed", attempt, rank))
            writer.close()

    async def _watch(self, attempt: Attempt, attempt_dir: Path,
                     stopping: asyncio.Event) -> Outcome:
        wd = self.config.watchdog
        hang = HangWatch(wd.hang_multiple, wd.hang_floor_s)
        waiters = [asyncio.create_task(self._agent_exits(attempt))]
        stop_task = asyncio.create_task(self._on_stop(stopping))
        started, last_step_at, done = time.monotonic(), None, False
        finished_at: float | None = None  # when the last step was done and all said goodbye
        anomaly: Outcome | None = None  # ranks stop by themselves: let them flush and exit
        halt: Halt | None = None  # ranks told to stop (SIGTERM): they checkpoint and exit
        early: Outcome | None = None  # an agent's failed exit, its ranks' lines not all read
        settle_by = 0.0
        exits: dict[str, int | None] = {}
        closed: set[int] = set()  # ranks whose connection ended: all they sent is read
        try:
            while True:
                now = time.monotonic()
                if early is not None:
                    if halt is not None:
                        early = None  # that exit was the ranks stopping as told
                    elif now >= settle_by or not self._open_on(early.detail["node"], closed):
                        return early
                finishing = (done or anomaly is not None or halt is not None
                             or self.latest_step >= self.config.steps)
                # Before the first step and after the last one, ranks import, load, write
                # the final checkpoint and tear down: judged by the startup timeout.
                limit = (wd.startup_timeout_s if last_step_at is None or finishing
                         else hang.limit())
                since = started if last_step_at is None else last_step_at
                if halt is not None:  # from when they were told; this coordinator's own
                    since = halt.since  # stop must end within its drain
                    limit = self.cfg.stop_checkpoint_s if halt.by_coordinator else limit
                if finished_at is not None:  # only exiting is left: judged by its own grace
                    limit, since = wd.teardown_grace_s, finished_at
                wait = since + limit - now
                if early is not None:
                    wait = min(wait, settle_by - now)
                try:
                    item = await asyncio.wait_for(self.q.get(), max(0.0, wait))
                except TimeoutError:
                    if early is not None:
                        continue  # settled: decided above
                    if anomaly is not None:
                        return anomaly
                    if halt is not None:  # what is left is stopped now; as far as it got
                        return self._halted(halt, exits)
                    if finished_at is not None:
                        # Every step is trained and its checkpoint written (rank 0 says
                        # done only then): a rank stuck on its way out is stopped, and
                        # the run has succeeded.
                        self.log.warning("run.exit_hung_after_goodbye",
                                         grace_s=wd.teardown_grace_s,
                                         rank_states={r: proc_state(p)
                                                      for r, p in sorted(self.pids.items())})
                        return self._ended()
                    kind = "startup_timeout" if last_step_at is None else "hang"
                    states = {r: proc_state(p) for r, p in sorted(self.pids.items())}
                    stopped = [r for r, s in states.items() if s in ("T", "t")]
                    stacks = await capture_stacks(self.pids, attempt_dir)
                    return Outcome(kind, {
                        "waited_s": round(time.monotonic() - since, 3), "limit_s": round(limit, 3),
                        "median_step_s": hang.median(), "stopped_ranks": stopped,
                        "detector": f"no step within {limit:.2f}s",
                        "rank_states": {str(r): s for r, s in states.items()},
                        "stacks": stacks})
                tag = item[0]
                if tag == "stop":
                    # The ranks are asked to checkpoint and stop, as on a preemption, where
                    # the launcher can ask (``Launcher.interrupt``); else ended at once.
                    if halt is None and self.launcher.interrupt(attempt):
                        halt = Halt(since=time.monotonic())
                    if halt is None:
                        return Outcome("stopping")
                    halt.by_coordinator = True
                    continue
                if tag == "cancel":  # a client cancelled the run: stop its ranks
                    return Outcome("cancelled", {"reason": getattr(self, "cancel_reason", "")})
                if item[1] != self.attempt_no:
                    continue  # from an earlier attempt: its dying ranks or agents
                if tag == "exit":
                    node, code, detector = item[2], item[3], item[4]
                    exits[node] = code
                    if anomaly is not None:
                        if len(exits) == len(attempt.agents):
                            return anomaly
                        continue
                    if halt is not None:  # stopping as told: whatever the exit codes
                        if self._all_gone(attempt, exits, closed):
                            return self._halted(halt, exits)
                        continue
                    if code is None:  # its node agent went silent: the node is gone
                        return Outcome("node_lost", {"node": node, "detector": detector})
                    if code != 0:
                        failed = Outcome("rank_exit", {
                            "node": node, "exit_code": code,
                            "detector": "torchrun agent exited non-zero"})
                        if not self._open_on(node, closed):
                            return failed
                        # NOTE: its ranks' lines are not all read yet (an exit and a
                        # connection's lines race to this queue): a ``preempted`` may be
                        # among them. Its ranks are gone, so their ends come at once.
                        early, settle_by = failed, time.monotonic() + EXIT_SETTLE_S
                        continue
                    if len(exits) == len(attempt.agents):
                        if done:
                            # Each node's last checkpoint write is told on its own rank's
                            # connection: decided once every rank's is read to its end.
                            if len(closed) >= self.config.ranks:
                                return self._ended()
                            finished_at = finished_at or time.monotonic()
                            continue
                        return Outcome("rank_exit", {"detector": "ranks exited before the "
                                                     "last step", "exit_code": 0})
                elif tag == "health":
                    if halt is not None:
                        continue  # the attempt is ending: the node is left out next time
                    _, _, node, current, reason = item
                    return Outcome("node_lost", {"node": node, "health": current,
                                                 "reason": reason,
                                                 "detector": "health event / drain"})
                elif tag == "closed":
                    rank = item[2]
                    if rank >= 0:
                        closed.add(rank)
                    if (done and len(exits) == len(attempt.agents)
                            and len(closed) >= self.config.ranks):
                        return self._ended()  # the last connection read after the exits
                    if halt is not None:
                        if self._all_gone(attempt, exits, closed):
                            return self._halted(halt, exits)
                        continue
                    if rank >= 0 and rank not in self._byes and anomaly is None:
                        pid = self.pids.get(rank, 0)
                        return Outcome("rank_exit", {
                            "rank": rank, "pid": pid, "process": proc_state(pid),
                            "node": self._node_of(rank),
                            "detected_after_last_step_s": None if last_step_at is None else
                            round(time.monotonic() - last_step_at, 3),
                            "detector": "rank connection closed without goodbye"})
                elif tag == "msg":
                    message: RankMessage = item[3]
                    match message:
                        case Hello():
                            await self._on_hello(message)
                        case Resumed():
                            await self._on_resumed(message)
                        case Bye():
                            self._byes.add(message.rank)
                        case Done():
                            done = True
                        case StepReport():
                            t = time.monotonic()
                            if last_step_at is not None:
                                hang.observe(t - last_step_at)
                            else:
                                await self._status(RunState.running,
                                                   f"attempt {self.attempt_no} training")
                            last_step_at = t
                            await self._on_step(message)
                        case CheckpointWritten():
                            await self._on_checkpoint(message)
                        case CheckpointWriteFailed():
                            await self._on_checkpoint_failed(item[2], message)
                        case Preempted():
                            if halt is None:
                                halt = Halt(since=time.monotonic())
                                self.log.info("run.ranks_stopping", step=message.step,
                                              rank=message.rank, node=message.node)
                            halt.step = message.step  # the same on every rank
                            if message.signalled:
                                halt.nodes.add(message.node)
                        case Invalid():
                            # The run cannot be built or trained as configured: every
                            # attempt would end alike, so the run ends (``_conclude``).
                            return Outcome("invalid_config", {
                                "reason": message.error, "rank": message.rank,
                                "node": self._node_of(message.rank),
                                "detector": "the rank building or starting the run"})
                        case Anomaly():
                            anomaly = Outcome("loss_anomaly", {
                                "anomaly": message.anomaly, "data_pos": message.data_pos,
                                "at_step": message.step, "loss": message.loss,
                                "grad_norm": message.grad_norm, "evidence": message.evidence,
                                "detector": "rank loss health (update not applied)"})
                    if (finished_at is None and done
                            and len(self._byes) >= self.config.ranks):
                        finished_at = time.monotonic()
        finally:
            stop_task.cancel()
            for w in waiters:
                w.cancel()
            await asyncio.gather(stop_task, *waiters, return_exceptions=True)

    def _open_on(self, node: str, closed: set[int]) -> bool:
        """Whether a rank of ``node`` (as its hello said) still has its connection open:
        not all it sent is read yet."""
        return any(n == node and r not in closed for r, n in self.rank_node.items())

    def _all_gone(self, attempt: Attempt, exits: dict[str, int | None],
                  closed: set[int]) -> bool:
        """Every agent ended and every rank's connection is read to its end."""
        return len(exits) == len(attempt.agents) and set(self.pids) <= closed

    def _halted(self, halt: Halt, exits: dict[str, int | None]) -> Outcome:
        """How an attempt whose ranks were told to stop ended: ``stopping`` (this
        coordinator's own stop), ``node_lost`` (an agent gone unheard, as one killed
        outright is: the kernel's SIGTERM to its torchrun is what stopped the ranks),
        else ``preempted``; each with the step the ranks stopped at and the checkpoint
        written of it (None: not written; the restart resumes from an older one)."""
        nodes = sorted(halt.nodes)
        step = halt.step
        failed = step is not None and any(
            (ln, st) == (self.line.owner(step), step) for ln, st, _ in self._ckpt_failed)
        written = step if step is not None and self.last_ckpt_step >= step and not failed \
            else None
        where = ", ".join(nodes) or "?"
        saved = (f"checkpointed at step {written}" if written is not None else
                 f"the checkpoint of step {step} was not written" if step is not None else
                 "stopped before a step")
        detail: dict[str, Any] = {
            "node": nodes[0] if nodes else "", "nodes": nodes, "at_step": step,
            "checkpoint_step": written, "exit_codes": dict(exits)}
        lost = sorted(n for n, code in exits.items() if code is None)
        if halt.by_coordinator:
            return Outcome("stopping", {**detail, "reason": f"ranks {saved}"})
        if lost:
            return Outcome("node_lost", {**detail, "node": lost[0], "reason": saved,
                                         "detector": "node agent lost (its ranks stopped "
                                         "on torchrun's SIGTERM)"})
        return Outcome("preempted", {
            **detail, "reason": f"preempted: node {where} stopping; {saved}",
            "detector": f"SIGTERM to the ranks on {where} (node agent or torchrun "
            "stopping)"})

    def _ended(self) -> Outcome:
        """Every step trained: succeeded, unless the last step's checkpoint (the run's
        result) could not be written on some node in this attempt. Then it restarts as
        after a failure, from the newest whole checkpoint, and writes it again (the
        node named goes last in the next placement), bounded by ``max_restarts``."""
        last = self.config.steps
        line = self.line.owner(last)
        nodes = sorted(n for ln, step, n in self._ckpt_failed if (ln, step) == (line, last))
        if not nodes:
            return Outcome("succeeded")
        return Outcome("final_checkpoint_unwritten", {
            "node": nodes[0], "nodes": nodes, "checkpoint_step": last,
            "detector": f"the last step's checkpoint was not written on {', '.join(nodes)}"})

    def _node_of(self, rank: int) -> str:
        """The node ``rank`` said it runs on (the rendezvous placed it); before its hello,
        the placement's guess."""
        if rank in self.rank_node:
            return self.rank_node[rank]
        nodes = self.placement.rank_nodes if self.placement else []
        return nodes[rank] if 0 <= rank < len(nodes) else ""

    async def _agent_exits(self, attempt: Attempt) -> None:
        """Every torchrun agent's end, as the launcher sees it, into the queue."""
        while True:
            ended = await self.launcher.poll(attempt)
            self.q.put_nowait(("exit", attempt.number or self.attempt_no, ended.node,
                               ended.code, ended.detector))

    async def _on_stop(self, stopping: asyncio.Event) -> None:
        await stopping.wait()
        self.q.put_nowait(("stop", self.attempt_no))

    # ------------------------------------------------------------------- the relay

    async def relay(self, message: RankMessage) -> None:
        """Turn a rank's ``StepReport`` or ``CheckpointWritten`` into bus events and
        records; other kinds are the watchdog's (``_watch``)."""
        match message:
            case StepReport():
                await self._on_step(message)
            case CheckpointWritten():
                await self._on_checkpoint(message)

    async def _on_hello(self, hello: Hello) -> None:
        self.pids[hello.rank] = hello.pid
        self.rank_node[hello.rank] = hello.node
        if len(self.pids) == self.config.ranks:
            await self._record(ranks=[
                {"rank": r, "pid": p, "node": self._node_of(r), "attempt": self.attempt_no}
                for r, p in sorted(self.pids.items())])

    async def _on_resumed(self, resumed: Resumed) -> None:
        """The nodes fetched the resume checkpoint from S3: that step is where this
        attempt starts; the ones they skipped as corrupt are reported and recorded."""
        self.last_ckpt_step = self.latest_step = resumed.step
        if resumed.skipped:
            await self.report_corrupt(RunState.starting, [
                {"step": step, "path": "s3", "reason": reason}
                for step, reason in sorted(resumed.skipped.items(), reverse=True)])
        await self._status(RunState.starting, f"attempt {self.attempt_no} resumed from step "
                           f"{resumed.step}, fetched from S3 by every node" if resumed.step
                           else f"attempt {self.attempt_no}: no committed checkpoint verified "
                           "on every node; from scratch")

    async def _on_step(self, report: StepReport) -> None:
        step = report.step
        self.latest_step = step
        self.goodput.step(step)
        if report.blocked_s:
            self.goodput.checkpoint_blocked(report.blocked_s)
        times, nodes = list(report.rank_step_times), list(report.rank_nodes)
        for s in self.stragglers.observe(times, nodes):
            record = {"kind": "straggler", "rank": s.rank, "node": s.node,
                      "score": round(s.score, 3), "rank_time_s": s.rank_time,
                      "median_time_s": s.median_time, "steps": s.steps, "step": step,
                      "telemetry": await self._telemetry(s.node), "at": time.time()}
            rec = await self._current()
            before = rec.stragglers if rec else []
            await self._status(RunState.running, f"straggler: rank {s.rank} on {s.node} "
                              f"at {s.score:.2f}x the median step time", record,
                              stragglers=[*before, record][-MAX_NOTED:])
        loss = _finite(report.loss)
        self.metrics.step(step, loss, report.samples_per_s, report.step_time)
        every = self.config.step_event_every
        if step % every == 0 or step == self.config.steps:
            # A step's identity is its lineage's too: after a rollback the same number
            # is another step (checkpoints.Lineage); the attempt tells repeats apart.
            lineage = self.line.owner(step)
            await self._publish(subjects.train(self.run_id, "step"), TrainStep(
                run_id=self.run_id, step=step, loss=loss, grad_norm=_finite(report.grad_norm),
                lr=report.lr, samples_per_s=report.samples_per_s, step_time=report.step_time,
                rank_step_times=times, rank_nodes=nodes, attempt=self.attempt_no,
                lineage=lineage),
                f"{self.run_id}-step-{step}-l{lineage}-a{self.attempt_no}", retry_for=2.0)
        if time.monotonic() - self._last_kv >= self.cfg.status_every_s:
            await self._record(latest_step=step)

    async def _on_checkpoint_failed(self, rank: int, failed: CheckpointWriteFailed) -> None:
        """A rank could not write a checkpoint (a full disk): training goes on (the next
        one may be written, and a resume uses the newest whole one), and the run says so:
        a status event, KV ``checkpoint_failures`` and a counter. Once per step and node
        (every rank of a sharded checkpoint may report the same write)."""
        node = self._node_of(rank) if rank >= 0 else self.cfg.node
        self.log.error("run.checkpoint_failed", step=failed.step, rank=rank, node=node,
                       error=failed.error)
        key = (self.line.owner(failed.step), failed.step, node)
        if key in self._ckpt_failed:
            return
        self._ckpt_failed.add(key)
        self.metrics.checkpoint_failed()
        record = {"kind": "checkpoint_write_failed", "step": failed.step, "rank": rank,
                  "node": node, "error": failed.error, "attempt": self.attempt_no,
                  "last_written": self.last_ckpt_step or None, "at": time.time()}
        rec = await self._current()
        before = rec.checkpoint_failures if rec else []
        newest = (f"the newest written is step {self.last_ckpt_step}" if self.last_ckpt_step
                  else "no checkpoint is written yet")
        await self._status(RunState.running, f"checkpoint step {failed.step} not written on "
                           f"{node} (rank {rank}): {failed.error}; training goes on, {newest}",
                           record, checkpoint_failures=[*before, record][-MAX_FAILURES:])

    async def _on_checkpoint(self, written: CheckpointWritten) -> None:
        step = written.step
        self.last_ckpt_step = max(self.last_ckpt_step, step)
        # The run, cluster and attempt are the coordinator's to say; ``at`` is when it
        # relays, as it always was (the checkpointer measures written -> committed from it).
        event = msgspec.structs.replace(written, run_id=self.run_id, cluster=self.cluster,
                                        node=written.node or self.cfg.node,
                                        attempt=self.attempt_no, at=time.time())
        self.metrics.checkpoint(event.blocked_s)
        # A step rewritten after a resume is announced again (the checkpointer's mirror
        # is idempotent), since the first copy may have been lost with the node. Each
        # node writes its own part of a sharded checkpoint: one event per node. The name
        # carries the lineage: a rollback's checkpoint of the same step is another.
        key = (f"{self.run_id}-{ck.step_name(step, written.manifest.lineage)}"
               f"-a{self.attempt_no}-{event.node}")
        await self._publish(subjects.train(self.run_id, "checkpoint"), event,
                            f"ckpt-{key}", retry_for=30.0)
        # The files are on that node's disk only: its own checkpointer mirrors them.
        await self._publish(subjects.mirror(event.cluster, event.node), event,
                            f"mirror-{key}", retry_for=30.0)


def _finite(x: float | None) -> float:
    # Non-finite values arrive as None (JSON has no NaN); anomalies are reported apart.
    return x if x is not None and math.isfinite(x) else 0.0
