"""Request body limit as plain ASGI middleware (no buffering framework in the way).

A declared ``Content-Length`` over the limit is refused without the app reading the body;
a body without one (chunked) is read up to the limit and refused as soon as it passes it.
Either way the client gets ``413`` with the sizes, and the app never sees the body.

Before answering, up to ``DRAIN_BYTES`` of the refused body are read and thrown away:
a client that writes its whole body before reading (python-requests, curl) would
otherwise have the connection closed under it mid-send and never see the 413 (over
TLS, an "EOF in violation of protocol"; the fuzzer found it). Larger bodies are cut off.
A client that sent ``Expect: 100-continue`` has sent none of its body yet: it gets the
413 at once, never a ``100 Continue`` for a body that would be refused.
"""

from __future__ import annotations

import json
from typing import Any

Scope = dict[str, Any]
DRAIN_BYTES = 8 << 20  # read and discard at most this much of a refused body


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1
            if size > self.max_bytes:
                # A client that asked "Expect: 100-continue" waits to be told before it
                # sends: reading would tell it to (the server answers 100 on the first
                # read), so it is answered at once instead.
                waits = headers.get(b"expect", b"").lower() == b"100-continue"
                if size <= DRAIN_BYTES and not waits:
                    await _drain(receive)
                await self._refuse(send, f"request body is {size} bytes")
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            body = message.get("body", b"")
            total += len(body)
            more = message.get("more_body", False)
            if total > self.max_bytes:
                if more:
                    await _drain(receive, DRAIN_BYTES - total)
                await self._refuse(send, f"request body is over {total} bytes")
                return
            chunks.append(body)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict[str, Any]:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Any, what: str) -> None:
        body = json.dumps({"detail": f"{what}; the limit is {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Any, limit: int = DRAIN_BYTES) -> None:
    """Read and discard the rest of a request body, at most ``limit`` bytes."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
