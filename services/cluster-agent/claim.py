"""One agent instance per node: the claim at start and the heartbeat's compare-and-set.

Each agent has an ``instance`` id, carried by its heartbeat. ``NodeClaim.wait`` (at
start) waits up to ``claim_wait`` while another instance's heartbeat for the node is in
KV ``nodes`` (fresh: the TTL removes a dead one's, a graceful stop deletes it at once),
then refuses with ``NodeTaken``. ``NodeClaim.write`` writes each heartbeat by
compare-and-set on this instance's last write, so one that finds the key written by
another instance while it runs says so (an error) and raises ``NodeTaken``: the service
stops rather than flip the node's heartbeat between two agents. ``release`` (a graceful
stop) deletes the heartbeat only while the last write is still this instance's.

``NodeTaken`` is not a crash: it carries ``exit_code`` (``EXIT_NODE_TAKEN``, 3), the
process exit status meant to tell a supervisor "another agent owns this node" apart from
a crash (1) and a wrong setting (2); the common runner exits with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from typing import Any, ClassVar

from tandem.common.bus import Bus
from tandem.common.errors import EventDecodeError, TandemError
from tandem.common.events import NodeHeartbeat
from tandem.common.streams import HEARTBEAT_TTL, KV_NODES

# A replaced pod still stopping (Kubernetes' default terminationGracePeriodSeconds, the
# DaemonSet's) plus a killed one's heartbeat expiring: how long a new agent waits.
CLAIM_WAIT = 30.0 + HEARTBEAT_TTL
CLAIM_POLL = 0.5  # seconds between looks at another instance's heartbeat while waiting
EXIT_NODE_TAKEN = 3  # the process exit status of an agent refused or taken over


class NodeTaken(TandemError):
    """Another agent instance (``other``) heartbeats for ``node``: this one must not run.

    ``exit_code`` is the process exit status it stands for (``EXIT_NODE_TAKEN``), apart
    from a crash's 1 and a setting's 2."""

    exit_code: ClassVar[int] = EXIT_NODE_TAKEN

    def __init__(self, cluster: str, node: str, instance: str, other: str, why: str) -> None:
        self.cluster, self.node, self.instance, self.other = cluster, node, instance, other
        super().__init__(
            f"TANDEM_NODE={node} (cluster {cluster}): another cluster-agent, instance "
            f"{other or '(one older than instance ids)'}, {why}; this is instance {instance}. "
            "Two agents must not share a node name: set TANDEM_NODE to this node's own name "
            "(spec.nodeName under Kubernetes) or stop the other agent")


def instance_id() -> str:
    """This agent's id: host (the pod's name under Kubernetes), pid and a random part."""
    return f"{socket.gethostname()[:64]}-{os.getpid()}-{secrets.token_hex(3)}"


class NodeClaim:
    """The node's heartbeat key in KV ``nodes``, held by one agent instance."""

    def __init__(self, bus: Bus, cluster: str, node: str, key: str, instance: str,
                 claim_wait: float, log: Any) -> None:
        self.bus = bus
        self.cluster, self.node, self.key = cluster, node, key
        self.instance = instance
        self.claim_wait = claim_wait
        self.log = log
        self.waiting_for: str | None = None  # another instance's id, while ``wait`` waits
        self.taken_by: str | None = None  # the instance that took the node over
        self.beat: tuple[NodeHeartbeat, int] | None = None  # last written, its revision
        self._lock = asyncio.Lock()

    async def wait(self, stop: asyncio.Event | None) -> bool:
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
            got = await kv.get(self.key)
        except EventDecodeError as exc:  # not an agent's heartbeat: the first beat replaces it
            self.log.warning("agent.heartbeat_unreadable", error=exc.reason)
            return None
        if got is None or got[0].instance == self.instance:
            return None
        return str(got[0].instance)

    async def write(self, value: NodeHeartbeat) -> None:
        """Write ``value`` by compare-and-set on this instance's last write (or as a new
        key); raises ``NodeTaken`` when another instance wrote it since."""
        kv = await self.bus.typed(KV_NODES, NodeHeartbeat)

        def ours(cur: NodeHeartbeat | None) -> NodeHeartbeat:
            if cur is None or cur.instance == self.instance:
                return value
            if self.taken_by is None:
                self.log.error("agent.node_taken_over", other=cur.instance,
                               instance=self.instance, node=self.node)
            self.taken_by = cur.instance
            raise NodeTaken(self.cluster, self.node, self.instance, cur.instance,
                            "took this node's heartbeat over while this one ran")

        async with self._lock:
            try:
                self.beat = await kv.move(self.key, ours, attempts=5, expect=self.beat)
            except EventDecodeError as exc:  # not an agent's heartbeat: replace it
                self.log.warning("agent.heartbeat_unreadable", error=exc.reason)
                self.beat = (value, await kv.put(self.key, value))

    async def release(self) -> None:
        """Delete the heartbeat now if this instance's write is still the last (never
        another instance's that took the node over); a failure is left to the TTL."""
        if self.beat is not None:
            with contextlib.suppress(Exception):
                await (await self.bus.kv(KV_NODES)).delete(self.key, last=self.beat[1])
