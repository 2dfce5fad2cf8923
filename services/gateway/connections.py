"""The gateway's HTTP connections: uvicorn's httptools protocol with three bounds of its
own, so that a gateway with no proxy in front (compose, the local stack) is not worn out
by clients that open connections and hold them:

- a request head (request line and headers) over ``max_header_bytes`` → 431. httptools
  gathers a header's value whole before it hands it on, so the bytes are counted as they
  arrive, not in the parser's callbacks;
- a head not complete ``head_timeout`` seconds after the connection opened, or after the
  first byte of a later request → 408 (or a bare close when nothing of a head came).
  Between requests the keep-alive timeout governs instead, and nothing times a request
  once its head is in: a body being sent or a response streamed (SSE) is never cut;
- a connection opened while ``max_connections`` are open → 503 at once, before anything
  of it is read; connections already open, and their requests, go on.

A refusal is written, the connection half-closed and whatever the client still sends read
and dropped until it closes, for at most ``LINGER`` seconds: closing with input unread
makes the kernel reset the connection, and a client mid-write then never sees the answer.

Why not uvicorn's own knobs: ``limit_concurrency`` accepts the connection and reads its
head before answering 503, and answers 503 to every request while the count is at the
limit, those on connections already open included; ``h11_max_incomplete_event_size``
bounds only the head's size, and only with the h11 parser (half the requests/s of
httptools, with or without these bounds, on one keep-alive loop: 2026-12-07).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from tandem.common import metrics

# Seconds a refused client has to stop sending before its connection is closed anyway.
LINGER = 2.0

REFUSED = metrics.Counter("tandem_gateway_http_refused", "HTTP connections the gateway "
                          "refused or closed", ["reason"])


@dataclass(frozen=True)
class HttpBounds:
    """What one gateway process allows its HTTP clients (``TANDEM_HTTP_*``, README)."""

    max_header_bytes: int = 64 * 1024
    head_timeout: float = 20.0
    max_connections: int = 1000


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` that keeps ``bounds``; ``with_bounds`` makes the
    class uvicorn's ``Config(http=...)`` takes."""

    bounds: ClassVar[HttpBounds] = HttpBounds()

    @classmethod
    def with_bounds(cls, bounds: HttpBounds) -> type[BoundedHttpTools]:
        return type(cls.__name__, (cls,), {"bounds": bounds})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes the head being read may still take; None while none is (from a head's
        # end to its message's end: the body, which may also be the response's time).
        self._head_room: int | None = self.bounds.max_header_bytes
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.bounds.max_connections:
            REFUSED.labels("connections").inc()
            self._refuse(503, f"the gateway has its {self.bounds.max_connections} connections "
                         "open (TANDEM_HTTP_MAX_CONNECTIONS); retry", retry_after=1)
        else:
            self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._refused and not self.transport.is_closing():
            room = self._head_room
            if room is None or len(view) <= room:
                if room is not None:
                    self._head_room = room - len(view)
                    self._start_head_timer()  # the first bytes of a head after a response
                super().data_received(view)  # type: ignore[arg-type]
                return
            # This read runs past what the head may still take, unless the head ends
            # within that much (and a body or the next request follows): feed that much,
            # and if the head still goes on it is too large.
            self._head_room = 0
            if room:
                super().data_received(view[:room])  # type: ignore[arg-type]
            if self._head_room == 0:
                REFUSED.labels("head_too_large").inc()
                self._refuse(431, f"request line and headers over "
                             f"{self.bounds.max_header_bytes} bytes "
                             "(TANDEM_HTTP_MAX_HEADER_BYTES)")
                return
            view = view[room:]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._start_head_timer()  # a head that began in a read that ended another request

    def on_headers_complete(self) -> None:
        self._head_room = None
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_room = self.bounds.max_header_bytes  # what comes next is the next head

    def _start_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.bounds.head_timeout, self._head_late)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        REFUSED.labels("head_timeout").inc()
        if self._head_room == self.bounds.max_header_bytes:
            self.transport.close()  # nothing of a head came: no one to answer
        else:
            self._refuse(408, f"request head not complete within {self.bounds.head_timeout:g} "
                         "s (TANDEM_HTTP_HEAD_TIMEOUT)")

    def _refuse(self, status: int, reason: str, retry_after: int | None = None) -> None:
        """Answer ``status`` with ``reason``, then close; what the client sends after is
        dropped unread."""
        self._refused = True
        self._unset_keepalive_if_required()
        self._stop_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            # A response is being written (a client sent the next head while it waited):
            # an answer now would land inside it.
            self.transport.close()
            return
        body = reason.encode()
        head = [STATUS_LINE[status]]
        for name, value in [*self.server_state.default_headers,
                            (b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()),
                            *([(b"retry-after", str(retry_after).encode())]
                              if retry_after is not None else []),
                            (b"connection", b"close")]:
            head += [name, b": ", value, b"\r\n"]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then its end
        self.flow.resume_reading()  # read on, so that closing resets nothing
        self._linger = self.loop.call_later(LINGER, self.transport.close)
