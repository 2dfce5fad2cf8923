"""The bus: one NATS connection per process, typed publish, typed pull consumers.

Acknowledgement is decided here and nowhere else (``Consumer._settle``):

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
stalling silently when the server stops redelivering it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError
from nats.js.kv import KeyValue
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from tandem.common import log, metrics, subjects, tracing
from tandem.common.errors import EventDecodeError, Reject, Retry
from tandem.common.events import DeadLetter, decode, encode
from tandem.common.permissions import violation
from tandem.common.settings import Settings
from tandem.common.streams import ConsumerSpec, Spec, provision

E = TypeVar("E")
_log = log.get("tandem.bus")

MSG_ID = "Nats-Msg-Id"
TRACEPARENT = "traceparent"
_RETRYABLE = (NatsTimeout, asyncio.TimeoutError, NoRespondersError, NoStreamResponseError,
              ConnectionClosedError)
T = TypeVar("T")


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a bus error that passes: a timeout, no responders or a 503 while
    a stream elects a leader, a reconnect."""
    if isinstance(exc, APIError):
        return (exc.code or 0) in (503, 0)
    return isinstance(exc, _RETRYABLE)


async def retry_transient(op: Callable[[], Awaitable[T]], retry_for: float,
                          what: str = "") -> T:
    """``await op()``, again after each ``transient`` error until ``retry_for`` seconds
    have passed (then the last error is raised). ``op`` must be safe to repeat: a KV
    create, a publish with ``Nats-Msg-Id``."""
    deadline = time.monotonic() + retry_for
    delay = 0.05
    while True:
        try:
            return await op()
        except Exception as exc:
            if not transient(exc) or time.monotonic() + delay > deadline:
                raise
            _log.warning("bus.retry", what=what, error=repr(exc))
            await asyncio.sleep(delay)  # backoff between retries, not synchronisation
            delay = min(delay * 2, 1.0)


class DomainJetStream(JetStreamContext):
    """JetStream in another domain (the control plane, reached through a leaf node).

    API calls go to ``$JS.<domain>.API`` (nats-py does that). KV writes must too, as
    ``$JS.<domain>.API.$KV.<bucket>.<key>``: the server does not carry ``$KV.>`` across
    a leaf connection between domains. nats-py 2.16 still writes to the bare ``$KV``
    subject (nats.py issue #1010, fixed upstream after 2.16 by matching nats.go's
    ``putPre``), so this does the same here. Reads and watches keep the bare subjects,
    which are the stream's own.
    """

    async def publish(self, subject: str, *args: Any, **kwargs: Any) -> PubAck:
        if subject.startswith("$KV."):
            subject = f"{self._prefix}.{subject}"
        return await super().publish(subject, *args, **kwargs)


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
        self.items: list[tuple[str, bytes, dict[str, str] | None]] = []
        self.acks: list[PubAck | None] = []
        self.errors: list[BaseException | None] = []
        self.owner: list[_Send] = []  # per slot: the send it belongs to
        self.sends: list[_Send] = []
        self.left = 0
        self.timer: asyncio.TimerHandle | None = None

    def join(self, items: Sequence[tuple[str, bytes, dict[str, str] | None]],
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

    async def send(self, items: Sequence[tuple[str, bytes, dict[str, str] | None]],
                   timeout: float) -> list[PubAck]:
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
        return group.result(send)

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
        if msg.headers and msg.headers.get("Status") == "503":
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


class Bus:
    """A connected NATS client with JetStream, shared by a process's loops."""

    def __init__(self, nc: NATS, service: str, js_domain: str | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = (
            nc.jetstream() if js_domain is None else DomainJetStream(nc, domain=js_domain))
        self.service = service
        self._kv: dict[str, KeyValue] = {}
        self._typed: dict[tuple[str, type], TypedKV[Any]] = {}
        self._acks: _Acks | None = None
        self.api_prefix = "$JS.API" if js_domain is None else f"$JS.{js_domain}.API"

    @classmethod
    async def connect(cls, settings: Settings, service: str, **options: Any) -> Bus:
        """Connect with endless reconnects; connection changes are logged."""
        lg = log.get("tandem.bus", service=service)

        async def on_error(exc: Exception) -> None:
            denied = violation(exc)
            if denied is not None:  # least privilege at work, or a missing grant
                lg.error("nats.permission_denied", operation=denied.operation,
                         subject=denied.subject, user=settings.nats_user or "",
                         hint="refused by the server: see tandem.common.permissions")
                return
            lg.warning("nats.error", error=repr(exc))

        async def on_disconnect() -> None:
            lg.warning("nats.disconnected")

        async def on_reconnect() -> None:
            url = nc.connected_url.netloc if nc.connected_url else ""
            lg.info("nats.reconnected", url=str(url))

        auth: dict[str, Any] = {}
        if settings.nats_user:
            auth["user"] = settings.nats_user
            auth["password"] = (
                settings.nats_password.get_secret_value() if settings.nats_password else ""
            )
        if settings.nats_creds:
            auth["user_credentials"] = settings.nats_creds
        if settings.nats_tls_ca:
            import ssl

            auth["tls"] = ssl.create_default_context(cafile=settings.nats_tls_ca)
            if settings.nats_tls_cert:  # mutual TLS: this client's certificate
                auth["tls"].load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key)
        opts: dict[str, Any] = dict(
            servers=settings.nats_servers,
            name=f"tandem-{service}-{settings.cluster}-{settings.node}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            connect_timeout=3,
            allow_reconnect=True,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            **auth,
        )
        opts.update(options)
        nc = await nats.connect(**opts)
        return cls(nc, service, settings.nats_js_domain)

    async def provision(self, specs: Sequence[Spec]) -> list[str]:
        created = await provision(self.js, specs)
        if created:
            _log.info("bus.provisioned", created=created)
        return created

    # ------------------------------------------------------------------------ publishing

    @staticmethod
    def headers(msg_id: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
        hdrs = {TRACEPARENT: tracing.traceparent()}
        if msg_id is not None:
            hdrs[MSG_ID] = msg_id
        if extra:
            hdrs.update(extra)
        return hdrs

    async def publish(self, subject: str, event: Any, *, msg_id: str | None = None,
                      headers: dict[str, str] | None = None, timeout: float = 5.0,
                      retry_for: float = 0.0) -> PubAck:
        """Publish to JetStream and wait for the stream's ack.

        With ``retry_for`` > 0, transient failures (timeouts, no responders during a
        leader election, a reconnect) are retried until that many seconds have passed,
        always with the same headers, so ``msg_id`` makes the retries idempotent.
        """
        item = (subject, event if isinstance(event, bytes) else encode(event),
                self.headers(msg_id, headers))
        deadline = time.monotonic() + retry_for
        delay = 0.05
        while True:
            try:
                [ack] = await self.send([item], timeout)
                metrics.PUBLISHED.labels(self.service).inc()
                return ack
            except Exception as exc:
                if not transient(exc) or time.monotonic() + delay > deadline:
                    raise
                _log.warning("bus.publish_retry", subject=subject, msg_id=msg_id, error=repr(exc))
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation
                delay = min(delay * 2, 1.0)

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
            await self.publish(subject, event, headers={_EXPECTED_LAST: "0"},
                               timeout=timeout, retry_for=retry_for)
        except APIError as err:
            if err.err_code in _WRONG_LAST:
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

    async def send(self, items: Sequence[tuple[str, bytes, dict[str, str] | None]],
                   timeout: float = 5.0) -> list[PubAck]:
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

    async def emit(self, subject: str, event: Any) -> None:
        """Core NATS publish: not stored, not acknowledged (progress, live views)."""
        data = event if isinstance(event, bytes) else encode(event)
        await self.nc.publish(subject, data, headers=self.headers())

    # ------------------------------------------------------------------------ consuming

    def consumer(self, spec: ConsumerSpec, event_type: type[E],
                 handler: Callable[[Delivery[E]], Awaitable[None]], **options: Any) -> Consumer[E]:
        return Consumer(self, spec, event_type, handler, **options)

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv:
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def typed(self, bucket: str, event_type: type[E]) -> TypedKV[E]:
        """Bucket ``bucket`` holding ``event_type`` values, written through this bus."""
        key = (bucket, event_type)
        if key not in self._typed:
            self._typed[key] = TypedKV(await self.kv(bucket), event_type, self, bucket)
        return self._typed[key]

    async def dead_letter(self, msg: Msg, reason: str, consumer: str = "") -> None:
        """Copy ``msg`` to ``dlq.<stream>`` with ``reason``; idempotent per stream seq."""
        md = msg.metadata
        stream = md.stream or "unknown"
        letter = DeadLetter(
            stream=stream, subject=msg.subject, seq=md.sequence.stream,
            num_delivered=md.num_delivered, reason=reason, data=bytes(msg.data),
            headers={k: v for k, v in (msg.headers or {}).items()}, consumer=consumer,
        )
        await self.publish(subjects.dlq(stream), letter,
                           msg_id=f"dlq-{stream}-{md.sequence.stream}", retry_for=10.0)
        metrics.DEAD_LETTERS.labels(stream, reason.split(":")[0][:40]).inc()
        _log.warning("bus.dead_letter", stream=stream, subject=msg.subject,
                     seq=md.sequence.stream, reason=reason)

    async def drain(self, timeout: float = 5.0) -> None:
        """Flush and close within ``timeout`` seconds; safe to call twice.

        While the server is unreachable a drain could wait forever on the reconnect
        loop, so past the timeout the connection is simply closed: anything unsent was
        never acknowledged, so no caller believes it was delivered.
        """
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), timeout)
        if not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), timeout)


@dataclass(slots=True)
class Delivery(Generic[E]):
    """One delivered message with its decoded event."""

    event: E
    msg: Msg
    consumer: Consumer[Any]

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

    @contextlib.asynccontextmanager
    async def keepalive(self, interval: float | None = None) -> AsyncIterator[None]:
        """Send in-progress acks every ``interval`` seconds while the block runs."""
        every = interval or max(self.consumer.spec.ack_wait / 3, 0.2)
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), every)
                if not stop.is_set():
                    with contextlib.suppress(Exception):
                        await self.msg.in_progress()

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            stop.set()
            await task


DeadHook = Callable[[Msg, str], Awaitable[None]]


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


class Consumer(Generic[E]):
    """A durable pull consumer loop: fetch, decode, handle, settle, repeat.

    ``run(stop)`` returns when ``stop`` is set and every in-flight handler finished.
    Messages fetched but not started when ``stop`` is set are handed back (nak).
    """

    def __init__(self, bus: Bus, spec: ConsumerSpec, event_type: type[E],
                 handler: Callable[[Delivery[E]], Awaitable[None]], *, batch: int = 64,
                 concurrency: int = 1, fetch_timeout: float = 1.0,
                 on_dead: DeadHook | None = None, span_name: str | None = None,
                 paused: Callable[[], bool] | None = None) -> None:
        self.bus = bus
        self.spec = spec
        self.event_type = event_type
        self.handler = handler
        self.batch = batch
        self.concurrency = concurrency
        self.fetch_timeout = fetch_timeout
        self.on_dead = on_dead
        self.paused = paused
        self.span_name = span_name or f"{spec.stream} process"
        self._sem = asyncio.Semaphore(concurrency)
        self._recording = tracing.recording()
        self._acked = metrics.CONSUMED.labels(spec.stream, "ack")
        self._sub: _Pull | None = None
        self.handled = 0

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to ``batch`` messages: what is there now, else the first to come within
        ``timeout`` seconds and what came with it; ``[]`` if none came."""
        if self._sub is None:
            self._sub = await _Pull.open(self.bus, self.spec.stream, self.spec.durable)
        return await self._sub.fetch(batch, timeout)

    async def run(self, stop: asyncio.Event) -> None:
        lg = _log.bind(stream=self.spec.stream, consumer=self.spec.durable)
        lg.info("consumer.start")
        backoff = 0.1
        async with asyncio.TaskGroup() as tg:
            while not stop.is_set():
                if self.paused is not None and self.paused():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.fetch_timeout)
                    continue
                # Sequential handlers take a whole batch; concurrent ones as many as they
                # have free slots for, so nothing fetched waits out its AckWait unstarted.
                want = self.batch if self.concurrency == 1 else min(
                    self.batch, max(self.concurrency - self._inflight(), 1))
                try:
                    msgs = await self.fetch(want, self.fetch_timeout)
                    backoff = 0.1
                except Exception as exc:  # server restart, leader election, reconnect
                    lg.warning("consumer.fetch_failed", error=repr(exc))
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                for i, msg in enumerate(msgs):
                    if stop.is_set():
                        for rest in msgs[i:]:
                            with contextlib.suppress(Exception):
                                await rest.nak()
                        break
                    if self.concurrency == 1:
                        await self.process(msg)
                    else:
                        await self._sem.acquire()
                        tg.create_task(self._process_released(msg))
        await self.close()
        lg.info("consumer.stopped", handled=self.handled)

    async def close(self) -> None:
        """Unsubscribe the pull inbox and hand back anything delivered but not fetched."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.close()

    def _inflight(self) -> int:
        return self.concurrency - self._sem._value

    async def _process_released(self, msg: Msg) -> None:
        try:
            await self.process(msg)
        finally:
            self._sem.release()

    async def process(self, msg: Msg) -> None:
        """Decode, handle and settle one message. Never raises except on cancel."""
        delivered = delivered_count(msg)
        if delivered >= self.spec.max_deliver:
            await self._dead(msg, f"exhausted: delivered {delivered} times")
            return
        try:
            event = decode(msg.data, self.event_type)
        except EventDecodeError as exc:
            await self._dead(msg, f"undecodable: {exc.reason}")
            return
        delivery: Delivery[E] = Delivery(event, msg, self)
        if self._recording:
            with tracing.tracer().start_as_current_span(
                    self.span_name, context=tracing.extract(msg.headers), kind=SpanKind.CONSUMER,
                    attributes={"messaging.system": "nats",
                                "messaging.destination.name": msg.subject,
                                "messaging.consumer.group.name": self.spec.durable,
                                "messaging.message.id": (msg.headers or {}).get(MSG_ID, "")}):
                await self._settle(delivery)
            return
        # Not exporting: only carry the producer's trace context forward, so logs and
        # anything published while handling stay in the producer's trace. This is the
        # hot path, so the handler is awaited here rather than through _settle.
        token = _attach_remote((msg.headers or {}).get(TRACEPARENT))
        try:
            await self.handler(delivery)
        except BaseException as exc:
            await self._failed(msg, exc)
        else:
            await msg.ack()
            self.handled += 1
            self._acked.inc()
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _settle(self, d: Delivery[E]) -> None:
        try:
            await self.handler(d)
        except BaseException as exc:
            await self._failed(d.msg, exc)
        else:
            await d.msg.ack()
            self.handled += 1
            self._acked.inc()

    async def _failed(self, msg: Msg, exc: BaseException) -> None:
        """Settle a message whose handler raised ``exc`` (see the module's table)."""
        if isinstance(exc, asyncio.CancelledError):
            # Never ack a cancelled handler: hand the message back for another worker.
            with contextlib.suppress(Exception):
                await asyncio.shield(msg.nak())
            raise exc
        if isinstance(exc, Retry):
            await msg.nak(delay=exc.delay)
            metrics.CONSUMED.labels(self.spec.stream, "retry").inc()
        elif isinstance(exc, Reject):
            await self._dead(msg, f"rejected: {exc.reason}")
        elif isinstance(exc, Exception):
            n = delivered_count(msg)
            if n + 1 >= self.spec.max_deliver:
                await self._dead(msg, f"failed {n} times: {exc!r}")
            else:
                _log.warning("consumer.handler_failed", stream=self.spec.stream,
                             subject=msg.subject, attempt=n, error=repr(exc))
                await msg.nak(delay=min(0.5 * 2 ** (n - 1), 30.0))
                metrics.CONSUMED.labels(self.spec.stream, "nak").inc()
        else:
            raise exc  # KeyboardInterrupt, SystemExit: not ours to settle

    async def _dead(self, msg: Msg, reason: str) -> None:
        try:
            await self.bus.dead_letter(msg, reason, consumer=self.spec.durable)
        except Exception as exc:
            # The DLQ is unreachable: keep the message (redelivered later), never drop it.
            _log.error("consumer.dlq_failed", error=repr(exc), reason=reason)
            with contextlib.suppress(Exception):
                await msg.nak(delay=2.0)
            return
        if self.on_dead is not None:
            try:
                await self.on_dead(msg, reason)
            except Exception as exc:
                _log.error("consumer.on_dead_failed", error=repr(exc))
        await msg.term()
        metrics.CONSUMED.labels(self.spec.stream, "dead").inc()


class _Pull:
    """Fetch from a durable pull consumer with one timer per fetch, not per message.

    nats-py's ``fetch`` starts a task, a timer and a uuid for every message it takes;
    here the inbox's callback appends to a deque and a fetch takes from it. Like
    nats-py, a fetch first asks for what is there now (``no_wait``); if nothing was,
    it waits up to ``timeout`` for one message, then asks (``no_wait``) for the rest of
    the batch. Each request has its own reply subject, so a status (404 no messages,
    408 expired) that ends an earlier request is told apart from the current one's.
    """

    def __init__(self, bus: Bus, stream: str, durable: str) -> None:
        self.nc = bus.nc
        self.next_subject = f"{bus.api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.prefix = f"{bus.nc.new_inbox()}."
        self.buf: collections.deque[Msg] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.requests = 0
        self.sub: Any = None

    @classmethod
    async def open(cls, bus: Bus, stream: str, durable: str) -> _Pull:
        pull = cls(bus, stream, durable)
        pull.sub = await bus.nc.subscribe(f"{pull.prefix}*", cb=pull._on_msg)
        return pull

    async def _on_msg(self, msg: Msg) -> None:
        self.buf.append(msg)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        out: list[Msg] = []
        self._take(out, batch, "")  # delivered for an earlier request, not yet taken
        if len(out) >= batch:
            return out
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._collect(out, batch, await self._request(batch - len(out)), deadline)
        if out:
            return out
        wait = deadline - loop.time()
        if wait < 0.01:
            return out
        await self._collect(out, 1, await self._request(1, expires=wait - 0.005), deadline)
        if out and batch > 1:  # the first came: whatever else is there comes with it
            scoop = loop.time() + max(timeout, 1.0)
            await self._collect(out, batch, await self._request(batch - 1), scoop)
        return out

    async def _request(self, n: int, expires: float | None = None) -> str:
        self.requests += 1
        reply = f"{self.prefix}{self.requests}"
        body = (f'{{"batch":{n},"no_wait":true}}' if expires is None
                else f'{{"batch":{n},"expires":{int(expires * 1e9)}}}')
        await self.nc.publish(self.next_subject, body.encode(), reply=reply)
        return reply

    async def _collect(self, out: list[Msg], want: int, reply: str, deadline: float) -> None:
        """Take messages until ``want``, ``reply``'s request ends, or ``deadline``."""
        while not self._take(out, want, reply) and len(out) < want:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout_at(deadline):
                    await self.waiter
            except TimeoutError:
                return
            finally:
                self.waiter = None

    def _take(self, out: list[Msg], want: int, reply: str) -> bool:
        """Move buffered messages to ``out`` (up to ``want``); True once the status that
        ends ``reply``'s request was seen. Other requests' statuses are dropped."""
        buf = self.buf
        while buf and len(out) < want:
            msg = buf.popleft()
            status = msg.headers.get("Status") if msg.headers else None
            if status is None:
                out.append(msg)
                continue
            if msg.subject != reply or status == "100":
                continue  # an earlier request's end, or an idle heartbeat
            if status in ("404", "408") or out:
                return True
            description = msg.headers.get("Description", "") if msg.headers else ""
            if status == "503":
                raise NoRespondersError
            raise APIError(code=int(status), description=description or f"status {status}")
        return False

    async def close(self) -> None:
        """Unsubscribe; nak what was delivered but never taken, so it is redelivered
        at once rather than after its AckWait."""
        with contextlib.suppress(Exception):
            await self.sub.unsubscribe()
        untaken: list[Msg] = []
        self._take(untaken, len(self.buf), "")  # statuses are dropped on the way
        for msg in untaken:
            with contextlib.suppress(Exception):
                await msg.nak()


def _attach_remote(tp: str | None) -> Any:
    if not tp:
        return None
    parts = tp.split("-")
    if len(parts) != 4:
        return None
    try:
        ctx = SpanContext(int(parts[1], 16), int(parts[2], 16), True, TraceFlags(int(parts[3], 16)))
    except ValueError:
        return None
    return otel_context.attach(trace.set_span_in_context(NonRecordingSpan(ctx)))


class TypedKV(Generic[E]):
    """A KV bucket whose values are events of one type, with compare-and-set updates.

    Made with ``bus``, writes go through the bus's pipelined publish (``Bus.send``)
    rather than a request each; a create that finds the key, and anything made without
    a bus, is left to nats-py's ``KeyValue``.
    """

    def __init__(self, kv: KeyValue, event_type: type[E], bus: Bus | None = None,
                 bucket: str = "") -> None:
        if bus is not None and not bucket:
            raise ValueError("TypedKV writing through a bus needs its bucket's name")
        self.kv = kv
        self.event_type = event_type
        self.bus = bus
        # nats-py writes a key to $KV.<bucket>.<key> (prefixed across a JetStream domain).
        self._pre = f"$KV.{bucket}." if bus is None or bus.api_prefix == "$JS.API" \
            else f"{bus.api_prefix}.$KV.{bucket}."

    async def get(self, key: str) -> tuple[E, int] | None:
        from nats.js.errors import KeyDeletedError, KeyNotFoundError

        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None:
            return None
        return decode(entry.value, self.event_type), entry.revision or 0

    async def put(self, key: str, value: E) -> int:
        """Write ``key`` whatever it holds; returns the new revision."""
        return await self._write(key, encode(value), None)

    async def create(self, key: str, value: E) -> int | None:
        """Create ``key``; return None if it already exists."""
        from nats.js.errors import KeyWrongLastSequenceError

        data = encode(value)
        try:
            if self.bus is not None:
                with contextlib.suppress(KeyWrongLastSequenceError):
                    return await self._write(key, data, 0)
            # The key exists, or once did: nats-py also re-creates a deleted key.
            return await self.kv.create(key, data)
        except KeyWrongLastSequenceError:
            return None

    async def _write(self, key: str, data: bytes, last: int | None) -> int:
        """Write ``key`` if its revision is ``last`` (0: it does not exist; None: any)."""
        from nats.js.errors import KeyWrongLastSequenceError

        if self.bus is None:
            if last is None:
                return await self.kv.put(key, data)
            return await self.kv.update(key, data, last=last)
        if not _KV_KEY.fullmatch(key):
            from nats.js.errors import InvalidKeyError

            raise InvalidKeyError(key)
        try:
            [ack] = await self.bus.send([(self._pre + key, data, None if last is None
                                          else {_EXPECTED_LAST: str(last)})])
        except APIError as err:
            if err.err_code in _WRONG_LAST:
                raise KeyWrongLastSequenceError(description=err.description) from None
            raise
        return ack.seq

    async def update(self, key: str, fn: Callable[[E | None], E | None],
                     attempts: int = 50, expect: tuple[E, int] | None = None) -> E | None:
        """Apply ``fn`` to the current value by compare-and-set until it sticks.

        ``fn`` returns the new value, or None to leave the key as it is. Returns the
        value stored (or the current one when ``fn`` declined). ``expect`` (a value and
        its revision, known without reading) is tried first: if the key has moved on,
        the compare-and-set fails and the loop reads it as usual.
        """
        from nats.js.errors import KeyWrongLastSequenceError

        for _ in range(attempts):
            guessed = expect is not None
            cur, expect = (expect or await self.get(key)), None
            new = fn(cur[0] if cur else None)
            if new is None:
                if guessed:
                    continue  # declined on the guess: decide on what is really stored
                return cur[0] if cur else None
            try:
                if cur is None:
                    await self.kv.create(key, encode(new))
                else:
                    await self._write(key, encode(new), cur[1])
                return new
            except KeyWrongLastSequenceError:
                continue
        raise RuntimeError(f"compare-and-set on {key} lost {attempts} races")

    async def items(self) -> dict[str, E]:
        from nats.js.errors import NoKeysError

        out: dict[str, E] = {}
        try:
            keys = await self.kv.keys()
        except NoKeysError:
            return out
        for k in keys:
            got = await self.get(k)
            if got is not None:
                out[k] = got[0]
        return out


_EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
_WRONG_LAST = (10071, 10164)  # JetStream's "wrong last sequence" error codes
_KV_KEY = re.compile(r"[-/_=a-zA-Z0-9]([-/_=.a-zA-Z0-9]*[-/_=a-zA-Z0-9])?")


def struct_replace(obj: E, **changes: Any) -> E:
    return msgspec.structs.replace(obj, **changes)  # type: ignore[type-var]
