"""The checkpointer's last call: after SIGTERM, the checkpoints a stopping node still writes.

A node that goes away (a spot node reclaimed, a graceful node shutdown) sends SIGTERM to
its checkpointer and to its trainer's node agent at the same moment. The agent's ranks
answer by saving their step (the trainer's ``STOP_CHECKPOINT_S``, then SIGKILL), and the
coordinator hands that checkpoint to this node's checkpointer (``mirror.<cluster>.<node>``):
seconds *after* the SIGTERM. A checkpointer that stopped pulling at SIGTERM never took it,
and the node's disk went with the node.

So a stopping checkpointer keeps pulling (``Linger.run``), for at most its window
(``TANDEM_STOP_LINGER_S``), while a checkpoint may still come:

- a run claimed and not ended still places ranks on its node (KV ``runs``: ``nodes`` of
  the current attempt, in the cluster of the run's coordinator; with ``scope=fleet``, on
  any node). With S3 as the resume point (``LAUNCHER=nodes``) the coordinator keeps
  naming them until the preempted attempt's checkpoint is committed, or it gave up
  waiting for it, and the next attempt starts;
- or a checkpoint waits in its queue, not yet taken (what the coordinator handed over
  just before it moved on).

Neither (no training on this node, the usual restart): it stops pulling at once, as
every service does. KV ``runs`` or the server unreadable: as if one may still come, until
the window ends. What it took meanwhile is mirrored within the runner's drain.

NOTE: why the run's record and not a fixed window: a fixed one would hold the stop of
every checkpointer, on a node that trains or not (dev stacks, idle nodes), for the whole
window, for a checkpoint that can only come from ranks on its node; the record is what
the coordinator already keeps of where an attempt's ranks are, written before they
start. The node agent is another pod, whose ranks the checkpointer cannot see. A
checkpointer restarted alone on a node that trains (a rollout) lingers too, mirroring as
before, until the window ends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tandem.common.bus import Bus, TypedKV
from tandem.common.events import RunRecord, RunState
from tandem.common.streams import ConsumerSpec

POLL_S = 1.0  # how often a lingering checkpointer asks again


class Linger:
    """When a stopping checkpointer stops pulling: ``run`` sets ``done``.

    ``node`` is this checkpointer's (cluster, node) with ``scope=node``; None with
    ``scope=fleet`` (every node's checkpoints are its)."""

    def __init__(self, bus: Bus, runs: TypedKV[RunRecord], spec: ConsumerSpec,
                 node: tuple[str, str] | None, window: float, log: Any) -> None:
        self.bus = bus
        self.runs = runs
        self.spec = spec
        self.node = node
        self.window = window
        self.log = log
        self._runs: list[str] | None = None  # the runs found on this node at SIGTERM

    async def run(self, stopping: asyncio.Event, done: asyncio.Event) -> None:
        """From ``stopping``, keep ``done`` clear while a checkpoint may still come (at
        most ``window`` seconds), then set it; logs why it waited and why it ended."""
        await stopping.wait()
        start = time.monotonic()
        deadline = start + self.window
        try:
            why = await self._awaited(deadline) if self.window > 0 else ""
            if why:
                self.log.info("checkpointer.lingering", within_s=self.window, why=why)
            while why and time.monotonic() < deadline:
                await asyncio.sleep(min(POLL_S, deadline - time.monotonic()))  # its pace
                why = await self._awaited(deadline)
            waited = round(time.monotonic() - start, 3)
            if why:
                self.log.warning("checkpointer.linger_over", waited_s=waited, still=why)
            else:
                self.log.info("checkpointer.nothing_to_come", waited_s=waited)
        finally:
            done.set()

    def trains_here(self, rec: RunRecord) -> bool:
        """Whether ``rec``'s run, claimed and not ended, places ranks on this
        checkpointer's node (``scope=fleet``: on any node). A record that names no
        coordinator's cluster is taken as this cluster's."""
        if rec.state == RunState.pending or rec.state.terminal or not rec.nodes:
            return False
        if self.node is None:
            return True
        cluster, node = self.node
        return node in rec.nodes and rec.coordinator.partition(".")[0] in ("", cluster)

    async def _awaited(self, deadline: float) -> str:
        """Why a checkpoint may still come ("" if none), read by ``deadline`` at most."""
        try:
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                return await self._why()
        except Exception as exc:  # KV or the server away: not known, so it may
            return f"not known ({type(exc).__name__}: {exc})"

    async def _why(self) -> str:
        if self._runs is None:  # every record once, then only those that were here
            here = [run for run, rec in (await self.runs.items()).items()
                    if self.trains_here(rec)]
        else:
            here = []
            for run in self._runs:
                got = await self.runs.get(run)
                if got is not None and self.trains_here(got[0]):
                    here.append(run)
        self._runs = here
        if here:
            return f"ranks of run(s) {', '.join(sorted(here))} on its node(s)"
        info = await self.bus.js.consumer_info(self.spec.stream, self.spec.durable)
        if info.num_pending:
            return f"{info.num_pending} checkpoint(s) waiting in {self.spec.durable}"
        return ""
