"""The pipelined publish: every JetStream publish of a process acked on one inbox.

``Publishing`` gives ``Bus`` its verbs: ``publish`` (one event, optionally retried through
transient errors), ``publish_once`` (a subject that holds at most one message),
``publish_many`` (one operation of many), ``send`` (encoded messages, the primitive the
others and ``TypedKV`` use) and ``emit`` (core NATS, not stored). Underneath, the sends of
one loop turn form a ``_Group`` published together; ``_Acks`` routes each ack on the
process's one reply inbox to its group's slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError

from tandem.common import metrics, tracing
from tandem.common.bus.headers import (
    EXPECTED_LAST,
    MSG_ID,
    STATUS,
    TRACEPARENT,
    WRONG_LAST,
    build,
)
from tandem.common.bus.retry import retry_transient
from tandem.common.events import encode

Item = tuple[str, bytes, dict[str, str] | None]  # subject, encoded event, headers


class _AckWire(msgspec.Struct):
    """A JetStream publish ack (or its error) as the server sends it."""

    stream: str = ""
    seq: int = 0
    domain: str | None = None
    duplicate: bool | None = None
    error: dict[str, Any] | None = None


_ACK_DECODER = msgspec.json.Decoder(_AckWire)


class _Send:
    """One ``Bus.send`` within a group: its slots, how many are unsettled, its deadline."""

    __slots__ = ("deadline", "future", "left", "n", "start")

    def __init__(self, start: int, n: int, deadline: float,
                 future: asyncio.Future[None]) -> None:
        self.start, self.n, self.left = start, n, n
        self.deadline = deadline
        self.future = future

    def wake(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class _Group:
    """The sends of one loop turn (``Bus.send``): published together and acked on one
    inbox key. A slot holds its ack or its error. Each send wakes when its own slots are
    settled or its own timeout passes, so one send's error or wait never becomes
    another's. One timer stands for every deadline: the earliest still waiting.
    """

    __slots__ = ("acks", "errors", "items", "key", "left", "on_done", "owner", "sends",
                 "timer")

    def __init__(self, key: str, on_done: Callable[[_Group], None]) -> None:
        self.key = key
        self.on_done = on_done
        self.items: list[Item] = []
        self.acks: list[PubAck | None] = []
        self.errors: list[BaseException | None] = []
        self.owner: list[_Send] = []  # per slot: the send it belongs to
        self.sends: list[_Send] = []
        self.left = 0
        self.timer: asyncio.TimerHandle | None = None

    def join(self, items: Sequence[Item],
             timeout: float) -> _Send:
        loop = asyncio.get_running_loop()
        send = _Send(len(self.items), len(items), loop.time() + timeout, loop.create_future())
        n = len(items)
        self.items.extend(items)
        self.acks.extend([None] * n)
        self.errors.extend([None] * n)
        self.owner.extend([send] * n)
        self.sends.append(send)
        self.left += n
        return send

    def arm(self) -> None:
        """Set the timer for the earliest deadline of a send still waiting."""
        waiting = [s.deadline for s in self.sends if not s.future.done()]
        if not waiting:
            self.finish()
            return
        loop = asyncio.get_running_loop()
        self.timer = loop.call_at(min(waiting), self._expire)

    def _expire(self) -> None:
        now = asyncio.get_running_loop().time()
        for send in self.sends:
            if send.deadline <= now:
                send.wake()  # its missing acks read as a timeout
        self.arm()

    def settle(self, i: int, ack: PubAck | None, error: BaseException | None) -> None:
        if i >= len(self.acks) or self.acks[i] is not None or self.errors[i] is not None:
            return
        if error is not None:
            self.errors[i] = error
        else:
            self.acks[i] = ack
        send = self.owner[i]
        send.left -= 1
        if send.left == 0:
            send.wake()
        self.left -= 1
        if self.left == 0:
            self.finish()

    def fail(self, error: BaseException) -> None:
        """Every slot not yet settled gets ``error`` (the publish itself failed)."""
        for i, ack in enumerate(self.acks):
            if ack is None and self.errors[i] is None:
                self.settle(i, None, error)

    def finish(self) -> None:
        """Every send is answered (or gave up): wake any left, stop listening."""
        if self.timer is not None:
            self.timer.cancel()
        for send in self.sends:
            send.wake()
        self.on_done(self)

    def result(self, send: _Send) -> list[PubAck]:
        """The acks of one send's slice; its first error, or a timeout if any is missing."""
        start, n = send.start, send.n
        for error in self.errors[start:start + n]:
            if error is not None:
                raise error
        acks = self.acks[start:start + n]
        if any(a is None for a in acks):
            raise NatsTimeout
        return acks  # type: ignore[return-value]

    def each(self, send: _Send) -> list[PubAck | BaseException]:
        """Each slot of one send's slice: its ack, its error, or a timeout if missing."""
        start, n = send.start, send.n
        return [ack if ack is not None else error if error is not None else NatsTimeout()
                for ack, error in zip(self.acks[start:start + n], self.errors[start:start + n],
                                      strict=True)]


class _Acks:
    """One reply inbox (``<inbox>.<group>.<i>``) for every pipelined publish of a process.

    Each ack settles its group's slot (``_Group``). nats-py resubscribes the inbox after a
    reconnect; acks lost in between make those sends time out, and the caller retries
    (with ``Nats-Msg-Id`` that is idempotent).
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = f"{nc.new_inbox()}."
        self.calls: dict[str, _Group] = {}
        self.next = 0
        self.open: _Group | None = None  # the group this loop turn's sends join
        self._sub: Any = None
        self._publishing: set[asyncio.Task[None]] = set()  # held until done
        self._subscribing = asyncio.Lock()

    async def send(self, items: Sequence[Item], timeout: float) -> list[PubAck]:
        group, send = await self._sent(items, timeout)
        return group.result(send)

    async def send_each(self, items: Sequence[Item],
                        timeout: float) -> list[PubAck | BaseException]:
        group, send = await self._sent(items, timeout)
        return group.each(send)

    async def _sent(self, items: Sequence[Item], timeout: float) -> tuple[_Group, _Send]:
        """``items`` published with this loop turn's group; once their acks are in."""
        if self._sub is None:
            async with self._subscribing:  # concurrent first sends subscribe once
                if self._sub is None:
                    self._sub = await self.nc.subscribe(f"{self.prefix}*.*", cb=self._on_ack)
        group = self.open
        if group is None:
            self.next += 1
            group = self.open = self.calls[str(self.next)] = _Group(str(self.next), self._done)
            # Published once this loop turn's other sends have joined: a task of its own,
            # so no caller's cancellation can strand the group.
            asyncio.get_running_loop().call_soon(self._publish_soon, group)
        send = group.join(items, timeout)
        await send.future
        return group, send

    def _publish_soon(self, group: _Group) -> None:
        if self.open is group:
            self.open = None
        group.arm()
        task = asyncio.ensure_future(self._publish(group))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, group: _Group) -> None:
        prefix = f"{self.prefix}{group.key}."
        publish = self.nc.publish
        try:
            for i, (subject, data, hdrs) in enumerate(group.items):
                await publish(subject, data, reply=f"{prefix}{i}", headers=hdrs)
        except Exception as exc:  # closed, draining, a bad subject: every send raises it
            group.fail(exc)

    def _done(self, group: _Group) -> None:
        self.calls.pop(group.key, None)

    async def _on_ack(self, msg: Msg) -> None:
        key, _, idx = msg.subject[len(self.prefix):].partition(".")
        call = self.calls.get(key)
        if call is None:
            return  # a late ack for a call that gave up
        i = int(idx)
        if msg.headers and msg.headers.get(STATUS) == "503":
            call.settle(i, None, NoStreamResponseError())
            return
        try:
            wire = _ACK_DECODER.decode(msg.data)
        except msgspec.DecodeError as exc:
            call.settle(i, None, APIError(description=f"unreadable publish ack: {exc}"))
            return
        if wire.error is not None:
            try:
                APIError.from_error(wire.error)  # raises the error's own class
            except APIError as exc:
                call.settle(i, None, exc)
            return
        call.settle(i, PubAck(stream=wire.stream, seq=wire.seq, domain=wire.domain,
                              duplicate=wire.duplicate), None)


class Publishing:
    """The publishing verbs of ``Bus`` (which provides ``nc`` and ``service``)."""

    nc: NATS
    service: str
    _acks: _Acks | None = None

    @staticmethod
    def headers(msg_id: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
        return build(msg_id, extra)

    async def publish(self, subject: str, event: Any, *, msg_id: str | None = None,
                      headers: dict[str, str] | None = None, timeout: float = 5.0,
                      retry_for: float = 0.0) -> PubAck:
        """Publish to JetStream and wait for the stream's ack.

        With ``retry_for`` > 0, transient failures (timeouts, no responders during a
        leader election, a reconnect) are retried until that many seconds have passed
        (``retry_transient``), always with the same headers, so ``msg_id`` makes the
        retries idempotent.
        """
        item = (subject, event if isinstance(event, bytes) else encode(event),
                self.headers(msg_id, headers))
        if retry_for > 0:
            [ack] = await retry_transient(lambda: self.send([item], timeout), retry_for,
                                          event="bus.publish_retry", subject=subject,
                                          msg_id=msg_id)
        else:  # the hot path: nothing to retry, so no retry loop to set up
            [ack] = await self.send([item], timeout)
        metrics.PUBLISHED.labels(self.service).inc()
        return ack

    async def publish_once(self, subject: str, event: Any, *, timeout: float = 5.0,
                           retry_for: float = 0.0) -> bool:
        """Publish to a subject that holds at most one message, ever: True if this call
        stored it, False if one was already there.

        The stream checks ``Nats-Expected-Last-Subject-Sequence: 0`` under its lock, so
        a redelivered task's second result, or a retry of a publish whose ack was lost,
        stores nothing, however late it comes. A ``Nats-Msg-Id`` only dedupes within
        the stream's duplicate window (two minutes), and costs the server more.
        """
        try:
            await self.publish(subject, event, headers={EXPECTED_LAST: "0"},
                               timeout=timeout, retry_for=retry_for)
        except APIError as err:
            if err.err_code in WRONG_LAST:
                return False
            raise
        return True

    async def publish_many(self, items: Sequence[tuple[str, Any, str | None]], *,
                           timeout: float = 5.0) -> list[PubAck]:
        """Pipelined publish of ``(subject, event, msg_id)`` items; waits for every ack.

        One call is one operation: its messages share one trace context (the current
        span's, or one fresh root), as they would inside a caller's span.
        """
        shared = {TRACEPARENT: tracing.traceparent()}
        acks = await self.send([
            (subject, event if isinstance(event, bytes) else encode(event),
             shared if msg_id is None else {**shared, MSG_ID: msg_id})
            for subject, event, msg_id in items], timeout)
        metrics.PUBLISHED.labels(self.service).inc(len(acks))
        return acks

    async def send(self, items: Sequence[Item], timeout: float = 5.0) -> list[PubAck]:
        """Send encoded ``(subject, data, headers)`` to JetStream, pipelined; every ack.

        The acks come back on one reply inbox for the whole process (``_Acks``), and the
        sends of one loop turn go out as one group (``_Group``) with one timer: a send
        costs a waiter future, not a future, a token and a semaphore wait per message as
        nats-py's ``publish_async`` does, nor a timer of its own. The workers' tasks
        finishing together, or a gateway's concurrent requests, share one. Returns once
        its own acks are in. Raises the first error one of its own messages got
        (``APIError``, ``NoStreamResponseError``), or nats' ``TimeoutError`` when acks
        are missing after ``timeout`` seconds. Headers are sent as given.
        """
        if not items:
            return []
        if self._acks is None:
            self._acks = _Acks(self.nc)
        return await self._acks.send(items, timeout)

    async def send_each(self, items: Sequence[Item],
                        timeout: float = 5.0) -> list[PubAck | BaseException]:
        """``send``, where each message's outcome is its own: its ack, or the error it
        got (a timeout when its ack is missing after ``timeout`` seconds), in order. For
        writes that succeed or fail one by one (compare-and-sets of many keys)."""
        if not items:
            return []
        if self._acks is None:
            self._acks = _Acks(self.nc)
        return await self._acks.send_each(items, timeout)

    async def emit(self, subject: str, event: Any) -> None:
        """Core NATS publish: not stored, not acknowledged (progress, live views)."""
        data = event if isinstance(event, bytes) else encode(event)
        await self.nc.publish(subject, data, headers=self.headers())
