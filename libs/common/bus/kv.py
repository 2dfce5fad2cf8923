"""KV buckets: typed values with compare-and-set, and watches that survive restarts.

- ``TypedKV``: a bucket whose values are events of one type; ``update`` applies a
  function by compare-and-set until it sticks.
- ``watch``: one watch of a key pattern whose end of the current values can be trusted
  (nats-py's can come early); ``snapshot``: every key's value, read by one.
- ``KeyWatch``: follows one key pattern (current values, then changes) and watches again
  when the server lost the watch; ``MapWatch`` feeds every key of a bucket to a callback.

One module past 450 lines: each of these stands on ``Watch``'s count of what the server
sent, the one subtle part (its docstring), which they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError
from nats.js.kv import KeyValue

from tandem.common import log
from tandem.common.backoff import Backoff
from tandem.common.bus.headers import EXPECTED_LAST, WRONG_LAST
from tandem.common.bus.retry import describe
from tandem.common.events import decode, encode

if TYPE_CHECKING:
    from tandem.common.bus.connect import Bus

E = TypeVar("E")
_log = log.get("tandem.bus.kv")
_DELETED = ("DEL", "PURGE")
_KV_KEY = re.compile(r"[-/_=a-zA-Z0-9]([-/_=.a-zA-Z0-9]*[-/_=a-zA-Z0-9])?")
WATCH_BACKOFF = Backoff(0.2, max_delay=5.0)  # between re-watches of a lost KV watch


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
                                          else {EXPECTED_LAST: str(last)})])
        except APIError as err:
            if err.err_code in WRONG_LAST:
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
        got = await self.move(key, fn, attempts, expect)
        return got[0] if got is not None else None

    async def applied(self, key: str, fn: Callable[[E | None], E | None],
                      attempts: int = 50) -> E | None:
        """``update``, answering only what ``fn`` made: the value this call stored, or
        None when ``fn`` declined the value it was last given (the key left as it is)."""
        made: list[E] = []

        def once(cur: E | None) -> E | None:
            made[:] = [] if (new := fn(cur)) is None else [new]
            return new

        await self.update(key, once, attempts)
        return made[0] if made else None

    async def move(self, key: str, fn: Callable[[E | None], E | None], attempts: int = 50,
                   expect: tuple[E, int] | None = None) -> tuple[E, int] | None:
        """``update``, with the revision: the value stored and its revision, or the
        current value and revision when ``fn`` declined (None if there is none), so the
        caller's next move on the key can be ``expect``-ed without a read."""
        from nats.js.errors import KeyWrongLastSequenceError

        for _ in range(attempts):
            guessed = expect is not None
            cur, expect = (expect or await self.get(key)), None
            new = fn(cur[0] if cur else None)
            if new is None:
                if guessed:
                    continue  # declined on the guess: decide on what is really stored
                return cur
            try:
                if cur is None:
                    rev = await self.kv.create(key, encode(new))
                else:
                    rev = await self._write(key, encode(new), cur[1])
                return new, rev
            except KeyWrongLastSequenceError:
                continue
        raise RuntimeError(f"compare-and-set on {key} lost {attempts} races")

    async def move_many(self, moves: Sequence[tuple[str, Callable[[E | None], E | None],
                                                    tuple[E, int] | None]]
                        ) -> list[tuple[E, int] | BaseException | None]:
        """``move`` of many keys, each ``(key, fn, expect)``: the first try of every key
        whose value and revision are expected goes out in one pipelined send (one wait
        for all, not one per key); a key that has moved on since, whose ``fn`` declined
        the guess, or with no guess, goes through ``move``. Each key's outcome is its
        own: what ``move`` returns, or what it raised."""
        out: list[tuple[E, int] | BaseException | None] = [None] * len(moves)
        again: list[int] = []
        tried: list[tuple[int, E]] = []
        items = []
        for i, (key, fn, expect) in enumerate(moves):
            new = fn(expect[0]) if expect is not None and self.bus is not None else None
            if new is None or not _KV_KEY.fullmatch(key):
                again.append(i)
                continue
            tried.append((i, new))
            items.append((self._pre + key, encode(new), {EXPECTED_LAST: str(expect[1])}))
        if items:
            assert self.bus is not None
            for (i, new), ack in zip(tried, await self.bus.send_each(items), strict=True):
                if not isinstance(ack, BaseException):
                    out[i] = (new, ack.seq)
                elif isinstance(ack, APIError) and ack.err_code in WRONG_LAST:
                    again.append(i)  # moved on: read it and decide again
                else:
                    out[i] = ack
        if again:
            got = await asyncio.gather(*(self.move(moves[i][0], moves[i][1]) for i in again),
                                       return_exceptions=True)
            for i, one in zip(again, got, strict=True):
                out[i] = one
        return out

    async def items(self) -> dict[str, E]:
        """Every key's value, read in one pass (``snapshot``); one that does not decode
        is left out (``readable``)."""
        values = await snapshot(self.kv)
        return {k: v for k, v, _ in self._readable((k, v, 0) for k, v in values.items())}

    async def entries(self) -> dict[str, tuple[E, int]]:
        """Every key's value and revision, read in one pass (``entries``); one that does
        not decode is left out (``readable``)."""
        got = await entries(self.kv)
        return {k: (v, rev) for k, v, rev in self._readable(
            (k, e.value, e.revision or 0) for k, e in got.items())}

    def _readable(self, values: Iterable[tuple[str, bytes, int]]) -> Iterator[tuple[str, E, int]]:
        """The values that decode as this bucket's events. One that does not (written by
        hand, or by a program with write access and a bug) is logged and skipped: a
        reader of the whole bucket (a coordinator adopting its runs, a count of a key's
        runs) must not fail on every other record for it."""
        for key, value, revision in values:
            try:
                yield key, decode(value, self.event_type), revision
            except Exception as exc:  # EventDecodeError, and whatever msgspec raises
                _log.warning("kv.undecodable", bucket=self.kv._name,
                             key=key, error=str(exc)[:200])

    async def delete(self, key: str, last: int | None = None) -> bool:
        """Delete ``key`` (if its revision is still ``last``, when given); whether it was."""
        from nats.js.errors import KeyWrongLastSequenceError

        try:
            await self.kv.delete(key, last=last)
        except KeyWrongLastSequenceError:
            return False
        except APIError as err:
            if err.err_code in WRONG_LAST:
                return False
            raise
        return True


# --------------------------------------------------------------------------------- watches


class Watch:
    """One watch of a KV key pattern: the current values, ``None`` after them, then each
    change, from ``updates(timeout)`` or ``async for``. ``watch`` starts one.

    Not nats-py's ``KeyValue.watch``: that one may put its ``None`` before values the
    server had already sent (nats-io/nats.py#842): it compares the consumer's pending
    count with the messages its client has read, not with those still on the wire, and a
    message's own pending count can read 0 early in a cluster (nats-io/nats.py#995). A
    snapshot taken with it can miss keys that were there all along (the gateway's
    ``/metrics`` lost a node that way in CI). Here the current values end once as many
    messages have been handled as the consumer's info said it had sent and had still to
    send. While they are still coming, a quiet spell asks the server again: a value that
    expired on its way is never delivered. The count is the consumer's own (each
    message's consumer sequence), of the consumer the server's answer is about: nats-py
    recreates an ordered consumer that skipped a message, from the last one it
    delivered, and the new one counts from 1 again and delivers only the rest.
    """

    def __init__(self, kv: KeyValue, pattern: str, ignore_deletes: bool,
                 inactive: float = 300.0) -> None:
        self.kv, self.pattern, self.ignore_deletes = kv, pattern, ignore_deletes
        self.inactive = inactive
        self.current_done = False  # the None after the current values is queued
        self._queue: asyncio.Queue[KeyValue.Entry | None] = asyncio.Queue()
        self._sub: Any = None
        # (consumer, its sequence) of the last message handed to _on_msg, and (consumer,
        # messages it had sent and still had to send) at the server's last answer.
        self._handled: tuple[str, int] = ("", 0)
        self._due: tuple[str, int] | None = None

    async def _start(self) -> Watch:
        from nats.js.api import DeliverPolicy

        self._sub = await self.kv._js.subscribe(
            f"{self.kv._pre}{self.pattern}", stream=self.kv._stream, cb=self._on_msg,
            ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            inactive_threshold=self.inactive)
        try:
            await self.check()
        except BaseException:
            await self.stop()
            raise
        return self

    async def check(self) -> None:
        """Ask the server about the watch's consumer; raises once the server has lost
        it (a restarted server). Ends the current values if the answer shows they have
        all been handled."""
        info = await self._sub.consumer_info()
        self._due = (info.name, info.delivered.consumer_seq + info.num_pending)
        self._maybe_done()

    async def _on_msg(self, msg: Any) -> None:
        meta = msg.metadata
        self._handled = (meta.consumer, meta.sequence.consumer)
        op = _operation(msg.headers)
        if op is not None and not (self.ignore_deletes and op in _DELETED):
            self._queue.put_nowait(KeyValue.Entry(
                bucket=self.kv._name, key=msg.subject[len(self.kv._pre):], value=msg.data,
                revision=meta.sequence.stream, delta=meta.num_pending,
                created=meta.timestamp, operation=op or None))
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.current_done or self._due is None:
            return
        consumer, due = self._due
        if due == 0 or (self._handled[0] == consumer and self._handled[1] >= due):
            self.current_done = True
            self._queue.put_nowait(None)

    async def updates(self, timeout: float | None = 5.0) -> KeyValue.Entry | None:
        """The next entry (None once, after the current values); raises nats-py's
        ``TimeoutError`` after ``timeout`` seconds without one."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - loop.time())
            if not self.current_done:
                wait = _QUIET if wait is None else min(wait, _QUIET)
            try:
                return await asyncio.wait_for(self._queue.get(), wait)
            except TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    raise NatsTimeout from None
                await self.check()  # quiet before the current values ended

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> KeyValue.Entry | None:
        return await self.updates(timeout=None)

    async def stop(self) -> None:
        await self._sub.unsubscribe()


_QUIET = 0.5  # seconds without a message before a watch asks whether its values ended


def _operation(headers: dict[str, str] | None) -> str | None:
    """"" for a value, "DEL" or "PURGE", None for a marker no reader needs."""
    if not headers:
        return ""
    if "KV-Operation" in headers:
        return headers["KV-Operation"]
    reason = headers.get("Nats-Marker-Reason")  # nats-server 2.11+'s expiry markers
    if reason is None:
        return ""
    return {"MaxAge": "PURGE", "Purge": "PURGE", "Remove": "DEL"}.get(reason)


async def watch(kv: KeyValue, pattern: str = ">", *, ignore_deletes: bool = False,
                inactive: float = 300.0) -> Watch:
    """Watch the keys of ``kv`` matching ``pattern`` (see ``Watch``). Its consumer
    outlives a connection without interest for ``inactive`` seconds (a reconnect finds
    it), and so also a stopped watch: roles may not delete consumers. A lasting watch is
    a service's, for its life; a one-pass read (``entries``) lets its consumer go soon."""
    return await Watch(kv, pattern, ignore_deletes, inactive)._start()


async def snapshot(kv: KeyValue, timeout: float = 5.0) -> dict[str, bytes]:
    """Every live key of a bucket and its value, in one ordered-consumer pass (not one
    get per key)."""
    return {k: e.value for k, e in (await entries(kv, timeout)).items()}


# How long a one-pass read's consumer outlives it on the server (roles may not delete
# consumers). With a lasting watch's 300 s, a gateway reading three buckets each second
# (the dashboard) held ~900 consumers, and polling /v1/clusters filled KV nodes' limit.
SNAPSHOT_INACTIVE = 5.0


async def entries(kv: KeyValue, timeout: float = 5.0) -> dict[str, KeyValue.Entry]:
    """``snapshot`` with each key's entry (its revision too); keys without a value are
    left out."""
    watcher = await watch(kv, ignore_deletes=True, inactive=SNAPSHOT_INACTIVE)
    out: dict[str, KeyValue.Entry] = {}
    try:
        while (entry := await watcher.updates(timeout=timeout)) is not None:
            if entry.value:
                out[entry.key] = entry
    finally:
        await watcher.stop()
    return out


class KeyWatch:
    """Follows the keys of one KV pattern: the current values, then every change.

    A KV watch is an ordered consumer. When it has been quiet for ``resync`` seconds the
    watch checks that the server still has its consumer (a restarted server does not)
    and, if not, watches again: the new watch's initial values replace the state, so an
    update missed in between is not lost. Subclasses implement ``replace`` and ``update``.
    """

    def __init__(self, bus: Bus, bucket: str, pattern: str, resync: float = 5.0) -> None:
        self.bus, self.bucket, self.pattern, self.resync = bus, bucket, pattern, resync
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.rewatches = 0
        self._written: dict[str, float] = {}

    async def replace(self, values: dict[str, bytes], first: bool) -> None: ...
    async def update(self, key: str, value: bytes | None) -> None: ...

    def written(self, key: str) -> float | None:
        """When the server stored the value of ``key`` last handed to ``replace`` or
        ``update`` (epoch seconds, by the server's clock: not the writer's), or None for
        a key without one. How old a value loaded by a (re)watch is, whoever wrote it."""
        return self._written.get(key)

    async def start(self) -> None:
        """Return once the current values are loaded; raise if the bucket cannot be read."""
        self._task = asyncio.create_task(self._run(), name=f"watch {self.bucket}")
        ready = asyncio.create_task(self.ready.wait())
        await asyncio.wait({self._task, ready}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if self._task.done():
            self._task.result()  # raise what went wrong

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        retries = WATCH_BACKOFF.retries(stop=self._stop)
        async for attempt in retries:  # ends when stop is set
            watcher = None
            try:
                kv = await self.bus.kv(self.bucket)
                watcher = await watch(kv, self.pattern)
                await self._follow(watcher)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a reconnect, a server restart: watch again
                if not self.ready.is_set() and attempt >= 5:
                    raise
                _log.warning("kv.watch_failed", bucket=self.bucket, error=describe(exc))
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    async def _follow(self, watcher: Watch) -> None:
        initial: dict[str, bytes] = {}
        written: dict[str, float] = {}
        live = False
        while not self._stop.is_set():
            try:
                entry = await watcher.updates(timeout=self.resync)
            except NatsTimeout:
                # Quiet: is the watch still there? Raises once the server has lost it.
                await watcher.check()
                continue
            if entry is None:  # the end of the current values
                if not live:
                    live = True
                    first = not self.ready.is_set()
                    self.rewatches += not first
                    self._written = written
                    await self.replace(initial, first)
                    self.ready.set()
                continue
            value = None if entry.operation in _DELETED or not entry.value else entry.value
            if live:
                self._stamp(self._written, entry.key, value, entry)
                await self.update(entry.key, value)
            else:
                self._stamp(written, entry.key, value, entry)
                if value is None:
                    initial.pop(entry.key, None)
                else:
                    initial[entry.key] = value

    @staticmethod
    def _stamp(written: dict[str, float], key: str, value: bytes | None,
               entry: KeyValue.Entry) -> None:
        if value is None or entry.created is None:
            written.pop(key, None)
        else:
            written[key] = entry.created.timestamp()


class MapWatch(KeyWatch):
    """Every key of ``bucket`` that matches ``keys`` (a KV key pattern: ``>`` every
    key), fed to ``apply(key, value or None, initial)``: the current values on
    (re)watch (``initial`` True, deleted keys as None), then each change."""

    def __init__(self, bus: Bus, bucket: str,
                 apply: Callable[[str, bytes | None, bool], None], keys: str = ">") -> None:
        super().__init__(bus, bucket, keys)
        self.apply = apply
        self.keys: set[str] = set()

    async def replace(self, values: dict[str, bytes], first: bool) -> None:
        for key in self.keys - set(values):
            self.apply(key, None, True)
        for key, value in values.items():
            self.apply(key, value, True)
        self.keys = set(values)

    async def update(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.keys.discard(key)
        else:
            self.keys.add(key)
        self.apply(key, value, False)
