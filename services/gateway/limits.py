"""Request body checks as plain ASGI middleware (no buffering framework in the way): its
size and its media type.

A declared ``Content-Length`` over the limit is refused without the app reading the body;
a body without one (chunked) is read up to the limit and refused as soon as it passes it.
Either way the client gets ``413`` with the sizes, and the app never sees the body.

Before answering, up to ``DRAIN_BYTES`` of the refused body are read and thrown away:
a client that writes its whole body before reading (python-requests, curl) would
otherwise have the connection closed under it mid-send and never see the 413 (over
TLS, an "EOF in violation of protocol"; the fuzzer found it). Larger bodies are cut off.
A client that sent ``Expect: 100-continue`` has sent none of its body yet: it gets the
413 at once, never a ``100 Continue`` for a body that would be refused.

Every body the API takes is JSON. One sent under another ``Content-Type``, or under none,
gets ``415`` saying to send ``Content-Type: application/json`` (``curl -d`` sends
``application/x-www-form-urlencoded``; FastAPI alone answered an opaque 422, "Input should
be a valid dictionary"). It is refused rather than read as JSON all the same, as FastAPI
itself does (``strict_content_type``, after CVE-2021-32677): a browser sends a form,
``text/plain`` or a body with no type cross-site without asking first (no CORS
preflight), so any web page could otherwise submit jobs to an open gateway, such as
``tandem dev up``'s on 127.0.0.1. Taken: ``*/json`` and ``*/*+json`` (FastAPI's rule).
"""

from __future__ import annotations

import json
from typing import Any

Scope = dict[str, Any]
DRAIN_BYTES = 8 << 20  # read and discard at most this much of a refused body
FORM = "application/x-www-form-urlencoded"


def media_type(content_type: bytes) -> str:
    """``type/subtype`` of a ``Content-Type`` value, lower case, without parameters."""
    return content_type.decode("latin-1").partition(";")[0].strip().lower()


def is_json(content_type: bytes) -> bool:
    """Whether a body of ``content_type`` is read as JSON: ``*/json`` or ``*/*+json``."""
    subtype = media_type(content_type).partition("/")[2]
    return subtype == "json" or subtype.endswith("+json")


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        ctype = headers.get(b"content-type")
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if has_body and (ctype is None or not is_json(ctype)):
            # Read (up to the size limit) before answering, as for a 413: curl writes its
            # whole body before it reads.
            await _drain(receive, self.max_bytes)
            came = "with no Content-Type" if ctype is None else repr(ctype.decode("latin-1"))
            await self._answer(send, 415, (
                f"the request body must be JSON sent with 'Content-Type: application/json'; "
                f"it came as {came}"
                + (" (curl -d's default: add -H 'Content-Type: application/json', or use "
                   "curl --json)" if ctype is not None and media_type(ctype) == FORM else "")))
            return
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
        await self._answer(send, 413, f"{what}; the limit is {self.max_bytes} bytes")

    @staticmethod
    async def _answer(send: Any, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
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
