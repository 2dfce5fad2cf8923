"""The node's transition log: its health transitions on ``health.<cluster>.<node>``.

Transitions are numbered per node (``seq``) and published with ``Nats-Msg-Id``
``health-<cluster>-<node>-<seq>``. At start the agent reads the last transition on its
subject and resumes from it (``restore``): same state, same number, and the agent takes
the same rules as active (a latched XID is not forgotten by a restart), so a restart
publishes nothing until the node's health really changes, and a retried publish is
deduplicated by the stream. A message on the subject that is not the node's transition
(junk, another node's) is read past to the last one that is; if none is found, numbering
resumes from the junk's stream sequence, a number no transition of the node can have
used. A publish the stream answers "duplicate" is this instance's own earlier try (its
evidence names the instance) or a conflict: the number is someone else's, so the log
says so and publishes under the next free one. The invariant it keeps: a number is used
once.
"""

from __future__ import annotations

import collections
from typing import Any

import msgspec
from nats.js.errors import NotFoundError

from tandem.common import metrics, subjects
from tandem.common.bus import Bus
from tandem.common.errors import EventDecodeError, TandemError
from tandem.common.events import Health, HealthTransition, decode
from tandem.common.streams import HEALTH

TRANSITIONS = metrics.Counter("tandem_agent_transitions", "Health transitions published",
                              ["current"])
RESTORE_SCAN = 256  # messages of the node's subject read back past an unreadable last one
CONFLICTS = 5  # msg ids found taken in one publish before it gives up until the next tick


class TransitionConflict(TandemError):
    """Every msg id tried for the node's next transition was taken by another writer."""


class TransitionLog:
    """The node's published state and the number of its last transition."""

    def __init__(self, bus: Bus, cluster: str, node: str, instance: str, log: Any) -> None:
        self.bus = bus
        self.cluster, self.node, self.instance = cluster, node, instance
        self.log = log
        self.subject = subjects.health(cluster, node)
        self.state = Health.healthy  # last published
        self.seq = 0  # number of the last published transition
        # The last transitions published by this instance, newest last (HEALTH has them all).
        self.published: collections.deque[HealthTransition] = collections.deque(maxlen=64)

    async def publish(self, tr: HealthTransition) -> None:
        """Publish ``tr`` as the node's next transition, from the state last published
        (its ``previous`` and ``seq`` are set here); raises ``TransitionConflict`` when
        every number tried was taken by another writer (the transition stays owed)."""
        target = tr.current
        for _ in range(CONFLICTS):
            seq = self.seq + 1
            tr = msgspec.structs.replace(tr, previous=self.state, seq=seq)
            # The msg id makes a retried publish (same seq) land once in HEALTH.
            msg_id = f"health-{self.cluster}-{self.node}-{seq}"
            ack = await self.bus.publish(self.subject, tr, msg_id=msg_id, retry_for=10.0)
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
        return self._readable(msg.data) if msg.subject == self.subject else None

    async def _floor(self) -> int:
        """A number at or above every transition number stored on the node's subject."""
        try:
            msg = await self.bus.js.get_last_msg(HEALTH, self.subject)
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
                                                    subject=self.subject, next=True)
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

    async def restore(self) -> HealthTransition | None:
        """Resume from the node's last stored transition: its state and number; return it
        (its ``active`` and ``handled`` are the agent's to resume), or None when there is
        none to resume from."""
        try:
            msg = await self.bus.js.get_last_msg(HEALTH, self.subject)
        except NotFoundError:
            return None
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
                return None
            self.log.warning("agent.restore_past_unreadable", stream_seq=msg.seq, seq=last.seq)
        self.state, self.seq = last.current, last.seq
        return last
