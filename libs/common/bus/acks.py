"""The acknowledgement policy: how a consumed message is settled, decided here only.

====================================  ===============================================
handler outcome                       what the message gets
====================================  ===============================================
returns                               ack
raises ``Retry(reason, delay)``       nak with that delay
raises ``Reject(reason)``             copied to DLQ with the reason, then term
payload does not decode               copied to DLQ with the reason, then term
raises anything else                  nak with backoff; on the last attempt, DLQ + term
cancelled (shutdown)                  nak at once: handed back, never acked
delivered ``max_deliver`` times       not handled again: DLQ ("exhausted") + term
====================================  ===============================================

The last delivery of a message is reserved for dead-lettering, so a task that kills its
worker every time (kill -9 leaves no chance to nak) still reaches the DLQ rather than
stalling silently when the server stops redelivering it. A DLQ that cannot be reached
keeps the message (nak, redelivered later): a message is never dropped. A letter too
large for the server (its body is cut to fit first: ``connect.fitting``) is no such
failure: it would never fit, so the message is ended without it, and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.errors import MaxPayloadError
from nats.js.errors import APIError

from tandem.common import log, metrics
from tandem.common.backoff import Backoff
from tandem.common.bus.retry import describe
from tandem.common.errors import Reject, Retry
from tandem.common.streams import ConsumerSpec

if TYPE_CHECKING:
    from tandem.common.bus.connect import Bus

_log = log.get("tandem.bus")

DeadHook = Callable[[Msg, str], Awaitable[None]]
# What the consumer's owner knows of why a message is dead that the bus does not (a task
# handed back by workers that do not serve its model): the reason, completed.
ExplainHook = Callable[[Msg, str], Awaitable[str]]
# The nak delay after a handler's n-th failure: 0.5 s, doubling, at most 30 s.
HANDLER_BACKOFF = Backoff(0.5, max_delay=30.0)
DLQ_UNREACHABLE_DELAY = 2.0  # nak delay while the DLQ cannot be written
MESSAGE_TOO_LARGE = 10054  # JetStream: "message size exceeds maximum allowed"


class LetterTooLarge(Exception):
    """A dead letter that cannot fit ``max_payload`` even cut (``connect.fitting``): permanent,
    never a reason to keep the message for a retry."""

    def __init__(self, size: int, max_payload: int) -> None:
        self.size = size
        self.max_payload = max_payload
        super().__init__(f"dead letter of {size} bytes exceeds max_payload {max_payload}")


def too_large(exc: BaseException) -> bool:
    """Whether a dead letter's publish failed for its size (``LetterTooLarge``, nats'
    ``MaxPayloadError``, JetStream's "message size exceeds maximum allowed"): permanent,
    unlike an unreachable DLQ."""
    return isinstance(exc, LetterTooLarge | MaxPayloadError) or (
        isinstance(exc, APIError) and exc.err_code == MESSAGE_TOO_LARGE)


def delivered_count(msg: Msg) -> int:
    """How many times ``msg`` was delivered, read straight from its ack subject.

    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`` (v1) or
    ``$JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>...`` (v2). Cheaper than
    ``msg.metadata``, which parses every field, on the per-message hot path.
    """
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:
        return int(tokens[4])
    if len(tokens) >= 12:
        return int(tokens[6])
    return msg.metadata.num_delivered


class AckPolicy:
    """The table above, for one consumer: its spec, its DLQ hook, its counters."""

    def __init__(self, bus: Bus, spec: ConsumerSpec, on_dead: DeadHook | None = None,
                 explain: ExplainHook | None = None) -> None:
        self.bus = bus
        self.spec = spec
        self.on_dead = on_dead
        self.explain = explain
        self.handled = 0
        self._acked = metrics.CONSUMED.labels(spec.stream, "ack")

    def exhausted(self, msg: Msg) -> str | None:
        """The dead-letter reason when ``msg`` must not be handled again, else None."""
        delivered = delivered_count(msg)
        if delivered >= self.spec.max_deliver:
            return f"exhausted: delivered {delivered} times"
        return None

    async def ack(self, msg: Msg) -> None:
        """The handler returned."""
        await msg.ack()
        self.handled += 1
        self._acked.inc()

    async def failed(self, msg: Msg, exc: BaseException) -> None:
        """The handler raised ``exc``. Re-raises a cancellation after handing back."""
        if isinstance(exc, asyncio.CancelledError):
            # Never ack a cancelled handler: hand the message back for another worker.
            with contextlib.suppress(Exception):
                await asyncio.shield(msg.nak())
            raise exc
        if isinstance(exc, Retry):
            await msg.nak(delay=exc.delay)
            metrics.CONSUMED.labels(self.spec.stream, "retry").inc()
        elif isinstance(exc, Reject):
            await self.dead(msg, f"rejected: {exc.reason}")
        elif isinstance(exc, Exception):
            n = delivered_count(msg)
            if n + 1 >= self.spec.max_deliver:
                await self.dead(msg, f"failed {n} times: {describe(exc)}")
            else:
                _log.warning("consumer.handler_failed", stream=self.spec.stream,
                             subject=msg.subject, attempt=n, error=describe(exc))
                await msg.nak(delay=HANDLER_BACKOFF.delay(n))
                metrics.CONSUMED.labels(self.spec.stream, "nak").inc()
        else:
            raise exc  # KeyboardInterrupt, SystemExit: not ours to settle

    async def dead(self, msg: Msg, reason: str) -> None:
        """Copy ``msg`` to the DLQ with ``reason`` (completed by ``explain``), tell
        ``on_dead``, then term."""
        if self.explain is not None:
            try:
                reason = await self.explain(msg, reason)
            except Exception as exc:  # the bus's own reason still says what it knew
                _log.warning("consumer.explain_failed", error=describe(exc), reason=reason)
        try:
            await self.bus.dead_letter(msg, reason, consumer=self.spec.durable)
        except Exception as exc:
            if not too_large(exc):
                # The DLQ is unreachable: keep the message (redelivered later), never
                # drop it.
                _log.error("consumer.dlq_failed", error=describe(exc), reason=reason)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=DLQ_UNREACHABLE_DELAY)
                return
            # A letter that cannot fit never will: keeping the message would redeliver
            # it forever. It is ended without its letter, and says why in the log.
            _log.error("consumer.dlq_letter_too_large", error=describe(exc), reason=reason,
                       stream=self.spec.stream, subject=msg.subject, size=len(msg.data))
        if self.on_dead is not None:
            try:
                await self.on_dead(msg, reason)
            except Exception as exc:
                _log.error("consumer.on_dead_failed", error=describe(exc))
        await msg.term()
        metrics.CONSUMED.labels(self.spec.stream, "dead").inc()


async def hand_back(msgs: list[Msg]) -> None:
    """Nak ``msgs`` at once: fetched, never started, so redelivered now (not after
    their AckWait)."""
    for msg in msgs:
        with contextlib.suppress(Exception):
            await msg.nak()
