"""A proxy between a NATS client and nats-server that can reorder what the server sends.

nats-server sends a consumer's pushed messages and its answers to API requests on the
same connection, in no fixed order between the two: a consumer's info can reach the
client before messages the server had already pushed (and counts as delivered). On one
box that is rare; on a busy one or across a cluster it happens. ``hold_deliveries(n)``
makes it happen every time: the next ``n`` pushed JetStream messages (their reply
subject is a ``$JS.ACK``) are held, the client's next consumer-info request waits until
the server has pushed all ``n``, its answer reaches the client (``answered`` is set),
and the held messages follow once the client has acted on it: when it next sends
anything, or when the test calls ``release()``.

``drop_then_hold(nth, n)`` loses the ``nth`` pushed message and passes the next, so an
ordered consumer sees the gap and recreates itself from the last message it got; the
new consumer's first ``n`` messages are then held the same way, behind the answer to
the first consumer-info request the client sends once they are all held.

``cut()`` hangs up on every client and on each that connects until ``mend()``: one
client's connection away while the server and its other clients carry on.

``hold_reply()`` holds the next reply the server sends to a request of the client (a
message on its ``_INBOX``: a JetStream write's ack, a KV compare-and-set's answer) until
``release_reply()``: the write is done on the server while the client still waits for
word of it (``reply_held`` is set once it is held).

The proxy parses the server's frames (``MSG``/``HMSG`` with their payloads, other
lines as they are) and passes the client's bytes through untouched; ``sent`` keeps them,
in the order the server got them.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

_INFO_REQUEST = b"$JS.API.CONSUMER.INFO."
_INFO_ANSWER = b"consumer_info_response"


class NatsProxy:
    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 4222)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._plan: list[str] = []  # what to do with each next delivery: pass, drop, hold
        self._late = False  # only an info request sent once all are held is answered first
        self._asked = False  # such a request went to the server
        self._held: list[bytes] = []
        self._all_held = asyncio.Event()
        self._all_held.set()
        self._client_w: asyncio.StreamWriter | None = None
        self.answered = asyncio.Event()  # a consumer-info answer passed the held messages
        self.reordered = 0  # times held messages were sent on behind an answer
        self.dropped = 0  # deliveries lost on purpose
        self.sent = bytearray()  # every client's bytes, as passed to the server
        self._cut = False  # while cut, a client that connects is hung up on at once
        self._hold_reply = False  # the next reply to a request is held (hold_reply)
        self._reply: tuple[bytes, asyncio.StreamWriter] | None = None
        self.reply_held = asyncio.Event()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def start(self) -> NatsProxy:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def cut(self) -> None:
        """Hang up on every client, and on each that connects until ``mend``: a
        connection away (the server and its other clients carry on)."""
        self._cut = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def mend(self) -> None:
        self._cut = False

    def hold_reply(self) -> None:
        self._hold_reply, self._reply = True, None
        self.reply_held.clear()

    def release_reply(self) -> None:
        assert self._reply is not None
        frame, w = self._reply
        self._reply = None
        w.write(frame)

    def hold_deliveries(self, n: int) -> None:
        self._arm(["hold"] * n, late=False)

    def drop_then_hold(self, nth: int, n: int) -> None:
        self._arm(["pass"] * (nth - 1) + ["drop", "pass"] + ["hold"] * n, late=True)

    def _arm(self, plan: list[str], late: bool) -> None:
        self._plan, self._late, self._asked, self._held = plan, late, False, []
        self._all_held.clear()
        self.answered.clear()

    def release(self) -> None:
        """Send the held messages on, behind the answer."""
        assert self.answered.is_set() and self._client_w is not None
        for frame in self._held:
            self._client_w.write(frame)
        self._held = []
        self.reordered += 1

    # ------------------------------------------------------------------------ pumps

    async def _connection(self, client_r: asyncio.StreamReader,
                          client_w: asyncio.StreamWriter) -> None:
        if self._cut:
            client_w.close()
            return
        server_r, server_w = await asyncio.open_connection(*self.upstream)
        pumps = [asyncio.create_task(self._from_client(client_r, server_w)),
                 asyncio.create_task(self._from_server(server_r, client_w))]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
                self._tasks.discard(task)
            for w in (client_w, server_w):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def _from_client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while chunk := await r.read(65536):
            if self._held and self.answered.is_set():
                self.release()  # the client spoke after the answer: it has read it
            at = chunk.find(_INFO_REQUEST)  # nats-py writes a command whole
            if at >= 0:
                line = chunk.rfind(b"\r\n", 0, at) + 2 if b"\r\n" in chunk[:at] else 0
                self.sent += chunk[:line]
                w.write(chunk[:line])  # what came before (the watch's SUB) goes now
                await w.drain()
                chunk = chunk[line:]
                if not self._late:
                    await self._all_held.wait()  # the server has pushed them all by now
                elif self._held and self._all_held.is_set():
                    self._asked = True
            self.sent += chunk
            w.write(chunk)
            await w.drain()

    async def _from_server(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        buf = b""
        while chunk := await r.read(65536):
            buf += chunk
            while (frame := _frame(buf)) is not None:
                buf = buf[len(frame):]
                self._forward(frame, w)
            await w.drain()

    def _forward(self, frame: bytes, w: asyncio.StreamWriter) -> None:
        if self._hold_reply and frame[:4].upper() in (b"MSG ", b"HMSG") \
                and frame.split(b" ", 2)[1].startswith(b"_INBOX."):
            self._hold_reply, self._reply = False, (frame, w)
            self.reply_held.set()
            return
        if self._plan and _is_delivery(frame):
            action = self._plan.pop(0)
            if action == "drop":
                self.dropped += 1
                return
            if action == "hold":
                self._held.append(frame)
                if "hold" not in self._plan:
                    self._all_held.set()
                return
        w.write(frame)
        if self._held and self._all_held.is_set() and _INFO_ANSWER in frame \
                and (self._asked or not self._late):
            self._client_w = w
            self.answered.set()


def _frame(buf: bytes) -> bytes | None:
    """The first whole frame in ``buf``, or None while it is incomplete."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    op = buf[:4].upper()
    if op.startswith((b"MSG ", b"HMSG")):
        size = int(buf[:end].split()[-1])
        whole = end + 2 + size + 2
        return buf[:whole] if len(buf) >= whole else None
    return buf[:end + 2]


def _is_delivery(frame: bytes) -> bool:
    line = frame[:frame.find(b"\r\n")].split()
    reply_at = {b"MSG": 3, b"HMSG": 3}.get(line[0].upper())
    with_reply = {b"MSG": 5, b"HMSG": 6}.get(line[0].upper())
    return (reply_at is not None and len(line) == with_reply
            and line[reply_at].startswith(b"$JS.ACK."))
