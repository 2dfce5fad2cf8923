"""Consuming: ``Consumer`` (one durable pull consumer) and ``Poller`` (the one loop).

A ``Consumer`` fetches (``pull.Pull``), decodes, runs its handler and settles the
message by the ack policy (``acks``). It does not loop on its own: ``Consumer.run`` is a
``Poller`` over that one consumer, and a service that pulls several queues (the
inference worker: lanes in priority order, other clusters' queues on failover) composes
its consumers into one ``Poller`` with its own room, polls and backoff.

A handler takes one delivery (a task of its own each), or, given as ``fetch_handler``,
a whole fetch: it yields each delivery back with its outcome as it finishes, and the
consumer settles each as it comes. The second is for handlers whose messages are worked
on together anyway (the inference worker batches them into pipeline calls): a message
then costs no task, no context switch and no wait of its own.

While spans are exported, each delivery's consumer span ends with the delivery's
outcome: status ERROR (and the exception as an event) when the handler failed it or the
bus dead-lettered it on arrival (exhausted, undecodable); a ``Retry`` (a deliberate "not
now") and a cancel (handed back) are no failure and leave it UNSET.

One module past 450 lines: ``Consumer`` and ``Poller`` share the room, the hand-back and
the settle path, and every service's pulling goes through both; apart, each would import
the other's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from tandem.common import log, tracing
from tandem.common.backoff import Backoff, wait_any
from tandem.common.bus.acks import AckPolicy, DeadHook, ExplainHook, hand_back
from tandem.common.bus.headers import MSG_ID, TRACEPARENT, attach_remote
from tandem.common.bus.pull import Pull
from tandem.common.bus.retry import describe
from tandem.common.errors import EventDecodeError, Retry
from tandem.common.events import decode
from tandem.common.streams import ConsumerSpec

if TYPE_CHECKING:
    from tandem.common.bus.connect import Bus

E = TypeVar("E")
_log = log.get("tandem.bus")

# Between fetches that fail (a server restart, a leader election, a reconnect).
FETCH_BACKOFF = Backoff(0.1, max_delay=2.0)


@dataclass(slots=True)
class Delivery(Generic[E]):
    """One delivered message with its decoded event."""

    event: E
    msg: Msg
    consumer: Consumer[Any]
    span: Any = None  # its consumer span, while spans are exported (whole fetches)

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def num_delivered(self) -> int:
        return self.msg.metadata.num_delivered

    @property
    def headers(self) -> dict[str, str]:
        return self.msg.headers or {}

    @property
    def trace_id(self) -> str | None:
        return tracing.trace_id(self.msg.headers)

    async def in_progress(self) -> None:
        """Reset the AckWait timer: this message is still being worked on."""
        await self.msg.in_progress()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Within the block, this message's trace is the current one (its consumer span
        while spans are exported, else the producer's context): for what a whole-fetch
        handler logs or records about this one message. A per-message handler runs in
        it already."""
        if self.span is not None:
            token = otel_context.attach(trace.set_span_in_context(self.span))
        else:
            token = attach_remote((self.msg.headers or {}).get(TRACEPARENT))
        try:
            yield
        finally:
            if token is not None:
                otel_context.detach(token)

    def keepalive(self, interval: float | None = None) -> _Kept:
        """``async with``: send in-progress acks every ``interval`` seconds (a third of
        AckWait by default) while the block runs. One timer per consumer serves every
        message it holds (``_Keeper``), so a block shorter than the interval costs no
        task and sends nothing."""
        every = interval or max(self.consumer.spec.ack_wait / 3, 0.2)
        return _Kept(self.consumer.keeper, self.msg, every)


class _Kept:
    """``Delivery.keepalive``'s block: the message is held by its consumer's keeper."""

    __slots__ = ("every", "keeper", "msg")

    def __init__(self, keeper: _Keeper, msg: Msg, every: float) -> None:
        self.keeper, self.msg, self.every = keeper, msg, every

    def enter(self) -> None:
        self.keeper.hold(self.msg, self.every)

    def exit(self) -> None:
        self.keeper.release(self.msg)

    async def __aenter__(self) -> None:
        self.enter()

    async def __aexit__(self, *exc: object) -> None:
        self.exit()


class _Keeper:
    """In-progress acks for every message a consumer's handlers hold: one task sleeps
    until the earliest is due, sends what is due and sleeps again; it ends when nothing
    is held (and the next hold starts it again)."""

    def __init__(self) -> None:
        self.held: dict[int, list[Any]] = {}  # id(msg) -> [next due (loop time), every, msg]
        self.task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._next = float("inf")  # when the task wakes next (loop time)

    def hold(self, msg: Msg, every: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + every
        self.held[id(msg)] = [due, every, msg]
        if self.task is None or self.task.done():
            self.task = loop.create_task(self._run())
        elif due < self._next:
            self._wake.set()  # a shorter interval than the one it sleeps for

    def release(self, msg: Msg) -> None:
        self.held.pop(id(msg), None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.held:
            self._next = min(entry[0] for entry in self.held.values())
            self._wake.clear()
            await _wait(self._wake, self._next - loop.time())
            now = loop.time()
            for entry in list(self.held.values()):
                if entry[0] <= now:
                    entry[0] = now + entry[1]
                    with contextlib.suppress(Exception):
                        await entry[2].in_progress()
        self._next = float("inf")

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


Handler = Callable[[Delivery[E]], Awaitable[None]]
Outcome = tuple[Delivery[E], BaseException | None]  # None: handled (ack)
FetchHandler = Callable[[list[Delivery[E]]], AsyncIterator[Outcome[E]]]


class Consumer(Generic[E]):
    """One durable pull consumer: fetch, decode, handle, settle.

    ``handler`` handles one delivery: it returns, or raises what the ack policy settles.
    ``fetch_handler`` instead takes every delivery of a fetch at once and yields each
    back with its outcome (``None``, or the exception it would have raised) as soon as
    it is done, in any order; a delivery it never yields is settled as if it raised what
    ended the handler (handed back if it was cancelled).

    ``run(stop)`` pulls it on its own (a ``Poller`` of one) and returns when ``stop`` is
    set and every in-flight handler finished; messages fetched but not started when
    ``stop`` is set are handed back (nak). ``batch``, ``concurrency``, ``fetch_timeout``
    (the long poll) and ``paused`` configure that loop.
    """

    def __init__(self, bus: Bus, spec: ConsumerSpec, event_type: type[E],
                 handler: Handler[E] | None = None, *, batch: int = 64,
                 concurrency: int = 1, fetch_timeout: float = 1.0,
                 on_dead: DeadHook | None = None, span_name: str | None = None,
                 paused: Callable[[], bool] | None = None,
                 fetch_handler: FetchHandler[E] | None = None,
                 explain: ExplainHook | None = None) -> None:
        if (handler is None) == (fetch_handler is None):
            raise ValueError("a consumer takes a handler or a fetch_handler, one of them")
        self.bus = bus
        self.spec = spec
        self.event_type = event_type
        self.handler = handler
        self.fetch_handler = fetch_handler
        self.batch = batch
        self.concurrency = concurrency
        self.fetch_timeout = fetch_timeout
        self.paused = paused
        self.span_name = span_name or f"{spec.stream} process"
        self.policy = AckPolicy(bus, spec, on_dead, explain)
        self.keeper = _Keeper()  # in-progress acks of the messages its handlers hold
        self._recording = tracing.recording()
        self._sub: Pull | None = None

    @property
    def handled(self) -> int:
        """Messages handled and acked."""
        return self.policy.handled

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to ``batch`` messages: what is there now, else the first to come within
        ``timeout`` seconds and what came with it; ``[]`` if none came."""
        if self._sub is None:
            self._sub = await Pull.open(self.bus.nc, self.bus.api_prefix, self.spec.stream,
                                        self.spec.durable)
        return await self._sub.fetch(batch, timeout)

    def interrupt(self) -> None:
        """End a fetch's wait now (stopping): it returns what it has."""
        if self._sub is not None:
            self._sub.interrupt()

    async def run(self, stop: asyncio.Event) -> None:
        lg = _log.bind(stream=self.spec.stream, consumer=self.spec.durable)
        lg.info("consumer.start")
        try:
            await Poller([self], batch=self.batch, concurrency=self.concurrency,
                         idle_poll=self.fetch_timeout, paused=self.paused).run(stop)
        finally:  # cancelled too: what a fetch had in hand is handed back now
            await self.close()
        lg.info("consumer.stopped", handled=self.handled)

    async def close(self) -> None:
        """Unsubscribe the pull inbox and hand back anything delivered but not fetched."""
        await self.keeper.close()
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.close()

    async def _delivery(self, msg: Msg) -> Delivery[E] | None:
        """``msg`` decoded, or None when it was dead-lettered instead (delivered too
        many times, or undecodable)."""
        reason = self.policy.exhausted(msg)
        if reason is None:
            try:
                return Delivery(decode(msg.data, self.event_type), msg, self)
            except EventDecodeError as exc:
                reason = f"undecodable: {exc.reason}"
        if not self._recording:
            await self.policy.dead(msg, reason)
            return None
        # No handler saw it, but it was delivered and ended: its span says so.
        span = self._span(msg)
        tracing.fail(span, reason)
        with trace.use_span(span, end_on_exit=True):
            await self.policy.dead(msg, reason)
        return None

    def _span(self, msg: Msg) -> Any:
        return tracing.tracer().start_span(
            self.span_name, context=tracing.extract(msg.headers), kind=SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.destination.name": msg.subject,
                        "messaging.consumer.group.name": self.spec.durable,
                        "messaging.message.id": (msg.headers or {}).get(MSG_ID, "")})

    async def process_fetch(self, msgs: list[Msg], settled: Callable[[int], None]) -> None:
        """Decode a whole fetch, hand it to ``fetch_handler`` and settle each message as
        the handler yields it (``settled(n)`` each time n more are); what it never
        yields is settled as failed with what ended it. Never raises except on cancel."""
        assert self.fetch_handler is not None
        deliveries: list[Delivery[E]] = []
        for msg in msgs:
            d = await self._delivery(msg)
            if d is None:
                settled(1)
                continue
            if self._recording:
                d.span = self._span(msg)
            deliveries.append(d)
        left = {id(d): d for d in deliveries}
        ended: BaseException = RuntimeError("the fetch handler returned without this message")
        outcomes = self.fetch_handler(deliveries)
        try:
            async for d, outcome in outcomes:
                if left.pop(id(d), None) is None:
                    continue  # not this fetch's, or yielded twice: settled once
                await self._settle_outcome(d, outcome)
                settled(1)
        except asyncio.CancelledError as exc:
            # Shutting down: hand every message not settled back, then stop.
            for d in left.values():
                with contextlib.suppress(Exception):
                    await asyncio.shield(d.msg.nak())
                self._end_span(d)
            settled(len(left))
            raise exc
        except Exception as exc:
            ended = exc
        finally:
            with contextlib.suppress(Exception):
                await outcomes.aclose()  # type: ignore[attr-defined]  # its cleanup now
        for d in left.values():
            await self._settle_outcome(d, ended)
            settled(1)

    async def _settle_outcome(self, d: Delivery[E], outcome: BaseException | None) -> None:
        try:
            if outcome is None:
                await self.policy.ack(d.msg)
            else:
                if failure(outcome):
                    tracing.fail(d.span, outcome)
                with d.context():  # its DLQ copy and log lines stay in its trace
                    await self.policy.failed(d.msg, outcome)
        finally:
            self._end_span(d)

    @staticmethod
    def _end_span(d: Delivery[E]) -> None:
        if d.span is not None:
            d.span.end()
            d.span = None

    async def process(self, msg: Msg) -> None:
        """Decode, handle and settle one message. Never raises except on cancel."""
        assert self.handler is not None
        policy = self.policy
        delivery = await self._delivery(msg)
        if delivery is None:
            return
        if self._recording:
            with trace.use_span(self._span(msg), end_on_exit=True):
                await self._settle(delivery)
            return
        # Not exporting: only carry the producer's trace context forward, so logs and
        # anything published while handling stay in the producer's trace. This is the
        # hot path, so the handler is awaited here rather than through _settle.
        token = attach_remote((msg.headers or {}).get(TRACEPARENT))
        try:
            await self.handler(delivery)
        except BaseException as exc:
            await policy.failed(msg, exc)
        else:
            await policy.ack(msg)
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _settle(self, d: Delivery[E]) -> None:
        """Handle and settle ``d`` inside its consumer span (the current one)."""
        assert self.handler is not None
        try:
            await self.handler(d)
        except BaseException as exc:
            if failure(exc):
                tracing.fail(trace.get_current_span(), exc)
            await self.policy.failed(d.msg, exc)
        else:
            await self.policy.ack(d.msg)


def failure(outcome: BaseException) -> bool:
    """Whether a handler's outcome failed its delivery (a span's status ERROR): any
    exception but a ``Retry``; a cancel (a ``BaseException``) hands the message back."""
    return isinstance(outcome, Exception) and not isinstance(outcome, Retry)


class Poller:
    """The one pull loop: consumers taken in priority order, sharing one room.

    Each round fetches as many messages as there is room for (``concurrency`` less the
    handlers running; a whole ``batch`` for sequential handlers, ``concurrency`` 1) from
    the first consumer that has any. The first is long-polled (``idle_poll``), so a
    message on it is taken the moment it arrives (a pull left open, as the hot path
    wants), and the others are asked (``busy_poll``) for what they hold now; each is
    asked that way in order, the first too, when a lower one had work last round or
    has not been asked for ``idle_poll`` seconds. So a lower consumer is never starved by
    a trickle on the first: it used to be asked only once a long poll of the first came
    back empty, which light interactive traffic (one task every 0.5 s) never let happen,
    while the worker sat idle and the batch queue grew for minutes.

    - ``consumers`` is read every round: its owner may edit it in place (failover).
    - A failed fetch (a reconnect, a leader election) is retried after ``backoff``,
      which grows while fetches fail, is reset by one that succeeds, and ends at stop.
    - While ``paused()`` nothing is fetched; what a fetch returns after it became paused
      is handed back (nak), so another worker takes it now. ``resume()`` says it may
      have ended: the loop asks again at once, not after its ``idle_poll`` nap.
    - What a fetch returns after its consumer left ``consumers`` (failover released a
      recovered cluster while the fetch waited) is handed back too: it is that
      cluster's again.
    - A consumer with a ``fetch_handler`` gets each fetch whole (one task for it), and
      each message frees its room as it is settled.
    - On stop, the fetch under way returns at once (``Consumer.interrupt``); messages
      fetched and not started are handed back, then ``on_stop()``
      runs while handlers still run (the owner hands back work it holds and waits for
      the rest with ``idle``); ``run`` returns once every handler finished.
    """

    def __init__(self, consumers: list[Consumer[Any]], *, batch: int = 64,
                 concurrency: int = 1, idle_poll: float = 1.0, busy_poll: float = 0.01,
                 paused: Callable[[], bool] | None = None, backoff: Backoff = FETCH_BACKOFF,
                 on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        self.consumers = consumers
        self.batch = batch
        self.concurrency = concurrency
        self.idle_poll = idle_poll
        self.busy_poll = busy_poll
        self.paused = paused
        self.backoff = backoff
        self.on_stop = on_stop
        self.inflight = 0  # handlers running (concurrent handlers only)
        self._slot = asyncio.Event()  # set when a handler finishes
        self._resumed = asyncio.Event()  # set by resume(): a pause may have ended

    def resume(self) -> None:
        """A pause may have ended (an undrain): check ``paused()`` again now."""
        self._resumed.set()

    async def run(self, stop: asyncio.Event) -> None:
        retries = self.backoff.retries(stop=stop)
        loop = asyncio.get_running_loop()
        lower_busy, lower_asked = False, -math.inf
        async with asyncio.TaskGroup() as tg:
            interrupter = tg.create_task(self._interrupt_on(stop))
            while not stop.is_set():
                if self.paused is not None and self.paused():
                    self._resumed.clear()
                    await wait_any((stop, self._resumed), self.idle_poll)
                    continue
                room = self.batch if self.concurrency == 1 else min(
                    self.batch, self.concurrency - self.inflight)
                if room <= 0:
                    self._slot.clear()
                    await _wait(self._slot, self.idle_poll)
                    continue
                owner, msgs = None, []
                consumers = list(self.consumers)
                lower_due = len(consumers) > 1 and loop.time() - lower_asked >= self.idle_poll
                for i, c in enumerate(consumers):
                    first_waits = i == 0 and not (lower_busy or lower_due)
                    wait = self.idle_poll if first_waits else self.busy_poll
                    if i == 1:
                        lower_asked = loop.time()
                    try:
                        msgs = await c.fetch(room, wait)
                    except Exception as exc:
                        _log.warning("consumer.fetch_failed", stream=c.spec.stream,
                                     consumer=c.spec.durable, error=describe(exc))
                        if not await retries.wait():
                            break  # stopping
                        continue
                    retries.reset()
                    if msgs:
                        owner, lower_busy = c, i > 0
                        break
                else:
                    lower_busy = False
                if owner is None:
                    continue
                if ((self.paused is not None and self.paused())  # while the fetch waited
                        or owner not in self.consumers):
                    await hand_back(msgs)
                    continue
                if owner.fetch_handler is not None:
                    if stop.is_set():
                        await hand_back(msgs)
                    elif self.concurrency == 1:
                        await owner.process_fetch(msgs, _ignore)
                    else:
                        self.inflight += len(msgs)
                        tg.create_task(self._process_fetch(owner, msgs))
                    continue
                for i, msg in enumerate(msgs):
                    if stop.is_set():
                        await hand_back(msgs[i:])
                        break
                    if self.concurrency == 1:
                        await owner.process(msg)
                    else:
                        self.inflight += 1
                        tg.create_task(self._process(owner, msg))
            interrupter.cancel()
            if self.on_stop is not None:
                await self.on_stop()

    async def _interrupt_on(self, stop: asyncio.Event) -> None:
        """At stop, end the long poll under way rather than wait it out (``idle_poll``:
        a second on every service's stop)."""
        await stop.wait()
        for c in list(self.consumers):
            c.interrupt()

    async def idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every running handler to finish; whether
        they did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inflight:
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._slot.clear()
            await _wait(self._slot, left)
        return True

    async def _process_fetch(self, c: Consumer[Any], msgs: list[Msg]) -> None:
        left = len(msgs)

        def settled(n: int) -> None:
            nonlocal left
            left -= n
            self.inflight -= n
            self._slot.set()

        try:
            await c.process_fetch(msgs, settled)
        finally:
            settled(left)  # none, unless it was cut short

    async def _process(self, c: Consumer[Any], msg: Msg) -> None:
        try:
            await c.process(msg)
        finally:
            self.inflight -= 1
            self._slot.set()


def _ignore(n: int) -> None:
    return None


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; whether it is set."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()
