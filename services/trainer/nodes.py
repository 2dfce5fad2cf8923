"""``NodeLauncher``: the coordinator's side of one trainer agent per node (no torch).

Instead of forking torchrun, the coordinator orders each placed node's agent
(``node_agent.py``) over core NATS request/reply on ``trainer.node.<cluster>.<node>``:

1. ``NodeLaunch`` to node rank 0 with ``master_port`` 0: it picks the static
   rendezvous port on its own address and replies with both; then ``NodeLaunch`` to
   every other node with that address and port. An order with no responder (the agent
   is not up yet: a DaemonSet pod restarting) is retried through the one backoff for
   ``launch_within_s``; past that, ``LaunchFailed``, and the nodes already started are
   stopped. A repeated order is answered from what the agent already runs, so a retry
   after a lost reply starts nothing twice.
2. While its torchrun runs, each agent sends ``NodeReport`` every ``report_every_s`` to
   ``trainer.report.<cluster>.<run>``, and once when torchrun exits (its exit code). The
   coordinator replies ``keep``: False when the report is of an attempt that is not the
   current one, so an agent that missed a stop kills its ranks at its next report.
3. ``poll`` returns an agent's exit from its report, or the agent as lost (code None)
   once it has been silent for ``lost_after_s``: the supervisor treats both as it
   treats a dead local agent (the attempt ends, the run restarts from the newest valid
   checkpoint).
4. ``interrupt`` (this coordinator stopping) sends ``NodeInterrupt`` to every node, from
   a task it owns: each agent SIGTERMs its torchrun, as its own stop does; the ranks
   checkpoint the step they agree on and exit, and the agents report the exits (3.).
   A node whose agent answers that it holds nothing of the attempt (no ``pid``: its
   torchrun ended, or the agent was replaced since the launch) has ended then: a
   replaced agent reports no exit, and nothing there is left to wait for. Where no
   agent took the order (agents older than it refuse it, "bad order"; or none
   answered), no rank was told: every node is sent ``NodeStop`` at once and its exit
   is that reply's. Where some took it, the others' ranks learn it from the step's
   all_gather (``rank.py``) and stop at the same step: they are left to.
5. ``stop`` sends ``NodeStop`` to every node; an agent that does not answer is already
   gone, or will find itself orphaned (no reply to its reports) and kill its ranks.

Each ``start`` first prunes the run's attempt folders on this host past the newest
``attempts_kept`` (``rank_output.prune_attempts``): the coordinator keeps one per attempt
(its launch spec) as the local launcher's and the node agents' do.

Why core NATS, not a stream: an order must reach the agent that is up now or fail now;
a stream would replay a launch to a later agent long after its attempt was given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from tandem.common import events, subjects
from tandem.common.backoff import Backoff, retry
from tandem.common.bus import Bus, transient
from tandem.common.errors import EventDecodeError
from tandem.common.events import (
    NodeInterrupt,
    NodeLaunch,
    NodeOrder,
    NodeReply,
    NodeReport,
    NodeReportReply,
    NodeStop,
)
from tandem.trainer.launcher import Agent, AgentEnded, Attempt, LaunchFailed, Placement
from tandem.trainer.rank_output import RankLogs, prune_attempts
from tandem.trainer.spec import LaunchSpec

ORDER_BACKOFF = Backoff(0.2, max_delay=2.0)  # between orders to an agent not (yet) there


@dataclass
class _Reports:
    """What one attempt's node agents said: when each was last heard, which ended."""

    nodes: list[str]
    seen: dict[str, float] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    q: asyncio.Queue[AgentEnded] = field(default_factory=asyncio.Queue)
    sub: Any = None
    interrupting: asyncio.Task[None] | None = None  # ``interrupt``'s orders, until ``stop``


class NodeLauncher:
    """The ``Launcher`` that has each node's trainer agent run its torchrun."""

    def __init__(self, bus: Bus, cluster: str, *, report_every_s: float = 1.0,
                 lost_after_s: float = 10.0, launch_within_s: float = 30.0,
                 order_timeout_s: float = 5.0, log: Any = None,
                 attempts_kept: int = RankLogs.attempts_kept) -> None:
        self.bus = bus
        self.cluster = cluster
        self.report_every_s = report_every_s
        self.lost_after_s = lost_after_s
        self.launch_within_s = launch_within_s
        self.order_timeout_s = order_timeout_s
        self.log = log
        self.attempts_kept = attempts_kept  # this host's attempt folders kept per run

    async def _order(self, cluster: str, node: str, order: NodeOrder,
                     within: float) -> NodeReply:
        subject = subjects.trainer_node(cluster, node)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within

        async def send() -> NodeReply:
            # No one request outlasts ``within``: a stop given 2 s waited out the order
            # timeout (5 s) for an agent that never answered.
            return await self.bus.request(subject, order, NodeReply, timeout=max(
                0.05, min(self.order_timeout_s, deadline - loop.time())))

        try:
            reply = await retry(send, ORDER_BACKOFF, when=transient, within=within)
        except EventDecodeError as exc:
            raise LaunchFailed(node, f"unreadable reply: {exc.reason}") from None
        except Exception as exc:
            raise LaunchFailed(node, f"no answer from its agent within {within:.0f}s "
                               f"({type(exc).__name__})") from None
        if not reply.ok:
            raise LaunchFailed(node, reply.error)
        return reply

    async def start(self, placement: Placement, spec: LaunchSpec, spec_path: Path,
                    attempt_dir: Path) -> Attempt:
        await asyncio.to_thread(prune_attempts, attempt_dir, self.attempts_kept,
                                [spec.checkpoint_root])
        cluster = spec.cluster or self.cluster
        reports = _Reports(nodes=list(placement.nodes))
        attempt = Attempt(run_id=spec.run_id, number=spec.attempt, cluster=cluster,
                          state=reports)

        async def on_report(msg: Any) -> None:
            await self._on_report(attempt, reports, msg)

        reports.sub = await self.bus.nc.subscribe(
            subjects.trainer_report(cluster, spec.run_id), cb=on_report)
        wire = msgspec.to_builtins(spec)
        addr, port = "", 0
        try:
            for rank, node in enumerate(placement.nodes):
                reply = await self._order(cluster, node, NodeLaunch(
                    run_id=spec.run_id, attempt=spec.attempt, node=node, node_rank=rank,
                    nnodes=len(placement.nodes), per_node=placement.per_node,
                    master_addr=addr, master_port=port, spec=wire,
                    report_every_s=self.report_every_s), self.launch_within_s)
                if rank == 0:
                    addr, port = reply.master_addr, reply.master_port
                attempt.agents.append(Agent(node=node, log_path=reply.log_path, pid=reply.pid))
                reports.seen.setdefault(node, time.monotonic())
        except LaunchFailed:
            await self.stop(attempt)
            raise
        return attempt

    async def _on_report(self, attempt: Attempt, reports: _Reports, msg: Any) -> None:
        try:
            report = events.decode(msg.data, NodeReport)
        except EventDecodeError:
            return
        current = (report.attempt == attempt.number and report.node in reports.nodes
                   and report.node not in reports.ended)
        with contextlib.suppress(Exception):
            await msg.respond(events.encode(NodeReportReply(keep=current)))
        if not current:
            return
        reports.seen[report.node] = time.monotonic()
        if not report.running:
            self._ended(reports, report.node, report.exit_code,
                        "torchrun agent exited (node agent's report)")

    async def poll(self, attempt: Attempt) -> AgentEnded:
        reports = attempt.state
        assert isinstance(reports, _Reports)
        while True:
            live = [n for n in reports.nodes if n not in reports.ended and n in reports.seen]
            if not live:
                return await reports.q.get()
            quiet = min(live, key=lambda n: reports.seen[n])
            left = reports.seen[quiet] + self.lost_after_s - time.monotonic()
            try:
                return await asyncio.wait_for(reports.q.get(), max(0.0, left))
            except TimeoutError:
                silent = time.monotonic() - reports.seen[quiet]
                if silent >= self.lost_after_s and quiet not in reports.ended:
                    reports.ended.add(quiet)
                    return AgentEnded(quiet, None, f"node agent silent for {silent:.1f}s "
                                      f"(lost after {self.lost_after_s:g}s)")

    def interrupt(self, attempt: Attempt) -> bool:
        """Ask every node's agent to let its ranks checkpoint and stop (``NodeInterrupt``,
        sent by a task that ``stop`` ends); their exits come through ``poll``. Always
        True: where no agent takes the order, the task stops them outright and ``poll``
        returns those exits (``_interrupt``)."""
        reports = attempt.state
        assert isinstance(reports, _Reports)
        if reports.interrupting is None:
            reports.interrupting = asyncio.create_task(
                self._interrupt(attempt, reports), name=f"interrupt-{attempt.run_id}")
        return True

    async def _interrupt(self, attempt: Attempt, reports: _Reports) -> None:
        cluster = attempt.cluster or self.cluster
        order = NodeInterrupt(run_id=attempt.run_id, attempt=attempt.number,
                              reason="coordinator stopping")

        async def one(node: str) -> bool:
            try:
                reply = await self._order(cluster, node, order, within=self.order_timeout_s)
            except LaunchFailed as exc:
                if self.log is not None:
                    self.log.warning("run.node_interrupt_refused", node=node,
                                     reason=exc.reason)
                return False
            if reply.pid:
                return True
            # NOTE: its agent runs nothing of the attempt (no pid: its torchrun ended,
            # or the agent was replaced since the launch, and a new one reports no exit):
            # ended now, rather than waited for until the stop's bound runs out.
            if self.log is not None:
                self.log.info("run.node_interrupt_nothing_held", node=node)
            self._ended(reports, node, reply.exit_code,
                        "its node agent holds nothing of the attempt (interrupt's reply)")
            return False

        nodes = [a.node for a in attempt.agents]
        if any(await asyncio.gather(*(one(n) for n in nodes))):
            return  # the ranks told stop all at one step: their exits are reported
        # NOTE: no rank was told, so none will save: stopped outright, as before this
        # order existed, and at once rather than when the watch gives up waiting.
        if reports.ended.issuperset(nodes):
            return  # none of them holds anything of the attempt: nothing left to stop
        codes = await self._stop_nodes(attempt, "coordinator stopping; no node agent "
                                       "took the interrupt order")
        for node, code in codes.items():
            self._ended(reports, node, code, "stopped outright: no node agent took the "
                        "interrupt order")

    @staticmethod
    def _ended(reports: _Reports, node: str, code: int | None, detector: str) -> None:
        """``node``'s torchrun ended (as ``detector`` found): for ``poll``, once."""
        if node not in reports.ended:
            reports.ended.add(node)
            reports.q.put_nowait(AgentEnded(node, code, detector))

    async def stop(self, attempt: Attempt, rank_pids: Sequence[int] = (),
                   timeout: float = 10.0) -> dict[str, int | None]:
        """Stop every node's torchrun; the exit codes the agents answer with, by node.
        ``rank_pids`` are this host's view of pids on other nodes: not used here (each
        agent finds its own ranks)."""
        reports = attempt.state
        assert isinstance(reports, _Reports)
        if reports.interrupting is not None:
            reports.interrupting.cancel()
            await asyncio.gather(reports.interrupting, return_exceptions=True)
        codes = await self._stop_nodes(attempt, "attempt ended", within=min(timeout, 2.0))
        if reports.sub is not None:
            with contextlib.suppress(Exception):
                await reports.sub.unsubscribe()
            reports.sub = None
        return codes

    async def _stop_nodes(self, attempt: Attempt, reason: str,
                          within: float = 2.0) -> dict[str, int | None]:
        """``NodeStop`` to every node at once: the exit codes answered, by node (None:
        no answer, or nothing of the attempt held)."""
        async def one(node: str) -> int | None:
            try:
                reply = await self._order(attempt.cluster or self.cluster, node, NodeStop(
                    run_id=attempt.run_id, attempt=attempt.number, reason=reason),
                    within=within)
            except LaunchFailed as exc:
                if self.log is not None:
                    self.log.info("run.node_stop_unanswered", node=node, reason=exc.reason)
                return None
            return reply.exit_code

        nodes = [a.node for a in attempt.agents]
        codes = await asyncio.gather(*(one(n) for n in nodes))
        return dict(zip(nodes, codes, strict=True))
