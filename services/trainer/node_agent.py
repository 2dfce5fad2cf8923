"""The trainer's node agent: one per node, running that node's torchrun when ordered.

``python -m tandem.trainer`` with ``TANDEM_TRAINER_ROLE=node`` (the same image and
settings as the coordinator, so a node runs exactly the code that ranks need and the
launcher's command line cannot drift between the two). It answers orders on
``trainer.node.<cluster>.<node>`` (``NodeLaunch``, ``NodeStop``, ``NodeInterrupt``;
``nodes.py`` is the coordinator's side and says the protocol) and reports each torchrun
it runs.

Invariants it keeps:

- At most one torchrun per run on this node: a launch of a newer attempt kills the
  older one first; a repeated launch (the same order, retried after a lost reply) is
  answered from what runs. Another order of the same attempt (a restarted
  coordinator's: its relay differs) replaces it too: the ranks held would report to a
  coordinator that is gone.
- An order's run id is a token (it names a folder under ``work_root``) and its
  ``report_every_s`` a positive number; any other order is refused.
- The command line is ``LocalLauncher.command``'s, with the launch spec rebased onto
  this node's own folders (``checkpoint_root``, ``work_root``): nothing of the
  coordinator's disk is read.
- Its ranks never outlive their supervision: torchrun is SIGKILLed with its ranks on a
  stop, when the coordinator's reply to a report says the attempt is no longer wanted,
  and when no reply came for ``orphan_after_s``. If the agent itself is killed -9,
  torchrun gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``) and stops its ranks.
- This agent stopping (SIGTERM: a rolling upgrade, a spot node reclaimed) is the ranks'
  cue to save, not to die: its torchruns get SIGTERM, which they pass on to their ranks
  (they checkpoint at the next step boundary and exit, ``rank.StopRequest``); each is
  given ``STOP_CHECKPOINT_S`` to end, then SIGKILLed, and its exit reported to the
  coordinator at once (not found by its silence), within the drain. A ``NodeInterrupt``
  (its coordinator stopping) does the same to that attempt's torchrun alone.
- What its torchruns print stays bounded on its disk, which in Kubernetes is an
  emptyDir whose ``sizeLimit`` evicts the pod: each attempt's log is capped, a launch
  removes the run's older attempt folders (never a checkpoint) and the output is also
  on the agent's stderr, prefixed, for ``kubectl logs`` (``rank_output``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tandem.common import events, subjects
from tandem.common.backoff import Backoff, retry
from tandem.common.bus import transient
from tandem.common.errors import EventDecodeError, InvalidToken
from tandem.common.events import NodeInterrupt, NodeLaunch, NodeReply, NodeStop
from tandem.common.runner import Context, Service
from tandem.common.settings import Settings
from tandem.common.streams import Spec
from tandem.trainer.launcher import (
    LocalLauncher,
    Placement,
    kill_agent,
    rank_env,
    rendezvous_id,
    rendezvous_port,
    spawn,
)
from tandem.trainer.rank_output import RankLogs, Torchrun, prefix, prune_attempts
from tandem.trainer.service import TrainerSettings
from tandem.trainer.spec import LaunchSpec

EXIT_REPORT_BACKOFF = Backoff(0.1, max_delay=1.0)
# Past STOP_CHECKPOINT_S, torchrun SIGKILLs its ranks and exits: the agent waits this
# much longer before it kills torchrun itself.
STOP_SLACK_S = 2.0


@dataclass
class Held:
    """One torchrun this agent runs: an attempt of a run, as ordered."""

    order: NodeLaunch
    cluster: str  # the run's (where its coordinator listens for reports)
    proc: Torchrun
    reply: NodeReply
    stopped: str = ""  # why this agent killed it; empty while it runs on its own
    interrupted: bool = False  # told to save and stop (SIGTERM): its exit is reported


def node_command(settings: TrainerSettings, order: NodeLaunch, master_addr: str, port: int,
                 spec_path: Path) -> list[str]:
    """The torchrun command line this node runs for ``order``: ``LocalLauncher.command``'s,
    with this node's interpreter and the rendezvous the order (or node rank 0) named."""
    nodes = list(dict.fromkeys(order.spec.get("rank_nodes", [])))
    if len(nodes) != order.nnodes:
        nodes = [f"node{i}" for i in range(order.nnodes)]
    return LocalLauncher(python=settings.python, master_addr=master_addr).command(
        Placement(nodes=nodes, per_node=order.per_node), order.node_rank, port, spec_path,
        rendezvous_id(order.run_id, order.attempt), local_addr=settings.rendezvous_host)


def refused(order: NodeLaunch) -> str:
    """Why this agent cannot run ``order``, or "": its run id becomes a folder under
    ``work_root`` (a token: no ``..``, no ``/``), its ``report_every_s`` every wait."""
    try:
        subjects.token(order.run_id, "run id")
    except InvalidToken as exc:
        return str(exc)
    if not (math.isfinite(order.report_every_s) and order.report_every_s > 0):
        return f"report_every_s must be a positive number of seconds, got {order.report_every_s}"
    return ""


class NodeAgent(Service):
    name = "trainer-node"
    settings_class = TrainerSettings

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        assert isinstance(settings, TrainerSettings)
        self.s: TrainerSettings = settings
        self.held: dict[str, Held] = {}  # by run id

    def streams(self) -> Sequence[Spec]:
        return []  # orders and reports are core NATS: nothing to provision

    def health(self) -> dict[str, Any]:
        return {"role": "node", "runs": {r: h.order.attempt for r, h in self.held.items()}}

    async def run(self, ctx: Context) -> None:
        self.ctx = ctx
        subject = subjects.trainer_node(self.s.cluster, self.s.node)
        async with asyncio.TaskGroup() as tg:
            self.tg = tg
            # A queue group: were two agents of one node up at once (a pod replaced),
            # an order reaches one of them, never both.
            sub = await ctx.bus.nc.subscribe(subject, queue="trainer-node", cb=self._on_order)
            ctx.log.info("node_agent.ready", subject=subject)
            await ctx.stopping.wait()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            # A torchrun already interrupted by order is waited for by that order's task.
            await self._let_stop([h for h in self.held.values() if not h.interrupted],
                                 "node agent stopping")
        # The TaskGroup waited for each report task: every exit is reported.

    async def _let_stop(self, held: list[Held], why: str) -> None:
        """Let ``held``'s ranks save and stop (this agent stopping; a ``NodeInterrupt``):
        SIGTERM each torchrun still running (passed on to the ranks, which checkpoint and
        exit), up to ``stop_bound`` + ``STOP_SLACK_S`` for them to end, then SIGKILL what
        is left. Each exit is reported as it happens (``_report``: ``interrupted``)."""
        held = [h for h in held if h.proc.returncode is None]
        bound = self.s.stop_bound()
        for h in held:
            h.interrupted = True
            self.ctx.log.warning("node_agent.stopping_ranks", run_id=h.order.run_id,
                                 attempt=h.order.attempt, within_s=bound, reason=why)
            with contextlib.suppress(ProcessLookupError):
                os.kill(h.proc.pid, signal.SIGTERM)
        if not held:
            return
        waits = [asyncio.ensure_future(h.proc.wait()) for h in held]
        _, pending = await asyncio.wait(waits, timeout=bound + STOP_SLACK_S)
        for w in pending:
            w.cancel()
        for h in held:
            if h.proc.returncode is None:
                self._kill(h, f"{why}: its ranks did not stop within {bound:g}s")

    # --------------------------------------------------------------------------- orders

    async def _on_order(self, msg: Any) -> None:
        try:
            order = events.decode(msg.data, events.NodeOrder)
        except EventDecodeError as exc:
            reply = NodeReply(node=self.s.node, ok=False, error=f"bad order: {exc.reason}")
        else:
            try:
                match order:
                    case NodeLaunch():
                        reply = await self._launch(order)
                    case NodeStop():
                        reply = await self._stop(order)
                    case NodeInterrupt():
                        reply = self._interrupt(order)
            except Exception as exc:  # refuse the order, keep serving
                self.ctx.log.error("node_agent.order_failed", error=repr(exc), exc_info=exc)
                reply = NodeReply(node=self.s.node, ok=False, error=repr(exc))
        with contextlib.suppress(Exception):
            await msg.respond(events.encode(reply))

    def _spec_for_this_node(self, order: NodeLaunch) -> tuple[LaunchSpec, Path]:
        """The launch spec with its folders on this node's disk, written to its attempt
        folder; a resume path under the coordinator's checkpoint root moves to ours."""
        spec = msgspec.convert(order.spec, LaunchSpec)
        root = Path(self.s.checkpoint_root).resolve()
        attempt_dir = (Path(self.s.work_root).resolve() / order.run_id
                       / f"attempt-{order.attempt}-node{order.node_rank}")
        attempt_dir.mkdir(parents=True, exist_ok=True)
        resume = spec.resume_path
        if resume:
            with contextlib.suppress(ValueError):
                resume = str(root / Path(resume).relative_to(spec.checkpoint_root))
        spec = msgspec.structs.replace(spec, checkpoint_root=str(root), resume_path=resume,
                                       attempt_dir=str(attempt_dir))
        path = attempt_dir / "launch.json"
        path.write_bytes(msgspec.json.encode(spec))
        return spec, path

    async def _launch(self, order: NodeLaunch) -> NodeReply:
        if problem := refused(order):
            return NodeReply(node=self.s.node, ok=False, error=f"bad order: {problem}")
        held = self.held.get(order.run_id)
        if held is not None:
            if held.order == order and held.proc.returncode is None:
                return held.reply  # a retried order whose reply was lost
            self._kill(held, f"superseded by attempt {order.attempt}"
                       + (" of another coordinator" if held.order.attempt == order.attempt
                          else ""))
            await held.proc.wait()
        spec, spec_path = self._spec_for_this_node(order)
        removed = await asyncio.to_thread(prune_attempts, Path(spec.attempt_dir),
                                          self.s.attempts_kept, [spec.checkpoint_root])
        if removed:
            self.ctx.log.info("node_agent.attempts_pruned", run_id=order.run_id,
                              removed=[p.name for p in removed])
        addr, port = order.master_addr, order.master_port
        if order.node_rank == 0 and not port:  # the rendezvous is ours to open
            addr = self.s.rendezvous_host
            port = rendezvous_port(addr, allowed=self.s.rendezvous_port_range())
        command = node_command(self.s, order, addr, port, spec_path)
        log_path = Path(spec.attempt_dir) / f"agent-{order.node_rank}-{self.s.node}.log"
        proc = await spawn(command, log_path, rank_env(None, self.s.node, self.s.stop_bound()),
                           with_parent=True, logs=RankLogs.of(self.s),
                           line_prefix=prefix(order.run_id, order.attempt, self.s.node))
        reply = NodeReply(node=self.s.node, master_addr=addr, master_port=port, pid=proc.pid,
                          log_path=str(log_path))
        held = Held(order=order, cluster=spec.cluster or self.s.cluster, proc=proc, reply=reply)
        self.held[order.run_id] = held
        self.tg.create_task(self._report(held), name=f"report-{order.run_id}")
        self.ctx.log.info("node_agent.launched", run_id=order.run_id, attempt=order.attempt,
                          node_rank=order.node_rank, pid=proc.pid, master=f"{addr}:{port}")
        return reply

    async def _stop(self, order: NodeStop) -> NodeReply:
        held = self.held.get(order.run_id)
        if held is None or held.order.attempt != order.attempt:
            return NodeReply(node=self.s.node)  # nothing of that attempt here
        self._kill(held, order.reason or "stop order")
        try:
            code = await asyncio.wait_for(held.proc.wait(), 10.0)
        except TimeoutError:
            code = None
        return NodeReply(node=self.s.node, pid=held.proc.pid, exit_code=code)

    def _interrupt(self, order: NodeInterrupt) -> NodeReply:
        """Let the attempt's ranks save and stop (``_let_stop``, in the background: they
        take up to ``stop_bound``); answered at once. A repeated order starts nothing
        twice."""
        held = self.held.get(order.run_id)
        if held is None or held.order.attempt != order.attempt \
                or held.proc.returncode is not None:
            return NodeReply(node=self.s.node)  # nothing of that attempt runs here
        if not held.interrupted:
            held.interrupted = True  # before the task runs: a retried order finds it set
            self.tg.create_task(self._let_stop([held], order.reason or "interrupt order"),
                                name=f"interrupt-{order.run_id}")
        return NodeReply(node=self.s.node, pid=held.proc.pid)

    def _kill(self, held: Held, why: str) -> None:
        if held.proc.returncode is None and not held.stopped:
            self.ctx.log.warning("node_agent.killing", run_id=held.order.run_id,
                                 attempt=held.order.attempt, reason=why)
        held.stopped = held.stopped or why
        kill_agent(held.proc.pid)

    # -------------------------------------------------------------------------- reports

    async def _report(self, held: Held) -> None:
        """Report ``held`` every ``report_every_s`` while it runs, and its exit once;
        kill it when the coordinator disowns it or stays silent (``orphan_after_s``)."""
        order, bus = held.order, self.ctx.bus
        subject = subjects.trainer_report(held.cluster, order.run_id)
        answered = time.monotonic()
        try:
            while held.proc.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(held.proc.wait()),
                                           order.report_every_s)
                if held.proc.returncode is not None:
                    break
                try:
                    reply = await bus.request(subject, self._report_of(held),
                                              events.NodeReportReply,
                                              timeout=order.report_every_s)
                except Exception:  # no coordinator answered this time
                    if time.monotonic() - answered >= self.s.orphan_after_s:
                        self._kill(held, f"no word from the coordinator for "
                                   f"{self.s.orphan_after_s:g}s")
                    continue
                answered = time.monotonic()
                if not reply.keep:
                    self._kill(held, "the coordinator no longer runs this attempt")
            if held.stopped and not held.interrupted:
                return  # killed by order or by us: the coordinator is not waiting to hear
            await held.proc.wait()  # its output in its log before its exit is told
            report = self._report_of(held)
            with contextlib.suppress(Exception):
                await retry(lambda: bus.request(subject, report, events.NodeReportReply,
                                                timeout=order.report_every_s),
                            EXIT_REPORT_BACKOFF, when=transient, within=self.s.orphan_after_s)
            self.ctx.log.info("node_agent.exited", run_id=order.run_id, attempt=order.attempt,
                              code=held.proc.returncode)
        finally:
            if self.held.get(order.run_id) is held:
                del self.held[order.run_id]

    def _report_of(self, held: Held) -> events.NodeReport:
        code = held.proc.returncode
        return events.NodeReport(run_id=held.order.run_id, attempt=held.order.attempt,
                          node=self.s.node, running=code is None, exit_code=code,
                          pid=held.proc.pid)
