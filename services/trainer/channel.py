"""Rank → coordinator messages: JSON lines over one TCP connection per rank (no torch).

The training step only enqueues; a background thread writes to the socket, so a slow
coordinator never stalls a step. Losing the coordinator means nobody supervises the
rank any more, so the rank exits (``ORPHANED``) rather than train unobserved.

Messages are dicts with ``t`` naming the kind: ``hello``, ``step``, ``checkpoint``,
``anomaly``, ``done``. The coordinator turns them into bus events.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
from typing import Any

import msgspec

ORPHANED = 17  # exit code of a rank whose coordinator went away
_STOP = object()


class EventChannel:
    """A non-blocking sender of rank messages; ``None`` address makes it a no-op."""

    def __init__(self, address: str | None, *, exit_on_loss: bool = True) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._enc = msgspec.json.Encoder()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.exit_on_loss = exit_on_loss
        if address:
            host, _, port = address.rpartition(":")
            self._sock = socket.create_connection((host, int(port)), timeout=30)
            self._sock.settimeout(None)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._thread = threading.Thread(target=self._pump, name="tandem-events", daemon=True)
            self._thread.start()

    def send(self, message: str, /, **fields: Any) -> None:
        if self._sock is not None:
            self._q.put({**fields, "t": message})

    def _pump(self) -> None:
        assert self._sock is not None
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            try:
                self._sock.sendall(self._enc.encode(item) + b"\n")
            except OSError as exc:
                if self.exit_on_loss:
                    print(f"tandem rank: coordinator connection lost ({exc}); exiting",
                          file=sys.stderr, flush=True)
                    os._exit(ORPHANED)
                return

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is queued, then close."""
        if self._sock is None or self._thread is None:
            return
        self._q.put(_STOP)
        self._thread.join(timeout)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._sock = None
