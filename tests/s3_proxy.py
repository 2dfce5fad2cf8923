"""A ``FaultProxy`` that can also answer S3 requests itself, as a failing store would.

``answer(fn)`` arms it: each request is passed to ``fn(method, path, body)``; what it
returns, ``(status, xml)``, goes back to the client instead of forwarding the request
(``None``: forwarded as usual). ``answer(None)`` disarms it. ``answered`` records
``(method, path)`` of every request answered so; ``requests`` still records them all.

``s3_error`` is an S3 error document (``503 SlowDown``, ``403 AccessDenied``, ...);
``delete_errors(code)`` answers every ``DeleteObjects`` with status 200 and a per-key
``Error`` for each key asked for: S3's way of saying a batch delete removed nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

from tests.checkpoint_support import FaultProxy

Answer = Callable[[str, str, bytes], tuple[int, bytes] | None]
_XML = b'<?xml version="1.0" encoding="UTF-8"?>'


def s3_error(code: str, message: str = "") -> bytes:
    return (_XML + f"<Error><Code>{code}</Code><Message>{message or code}</Message>"
            "</Error>".encode())


def is_delete_objects(method: str, path: str) -> bool:
    return method == "POST" and "delete" in path.split("?", 1)[-1].split("&")


def delete_errors(code: str = "InternalError") -> Answer:
    """Answers each ``DeleteObjects`` as S3 does when it could delete none of the keys."""
    def fn(method: str, path: str, body: bytes) -> tuple[int, bytes] | None:
        if not is_delete_objects(method, path):
            return None
        errors = b"".join(b"<Error><Key>" + key + b"</Key><Code>" + code.encode() +
                          b"</Code><Message>try again</Message></Error>"
                          for key in re.findall(rb"<Key>(.*?)</Key>", body))
        return 200, (_XML + b'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                     + errors + b"</DeleteResult>")
    return fn


class AnsweringProxy(FaultProxy):
    def __init__(self, upstream: str) -> None:
        self._answer: Answer | None = None
        self.answered: list[tuple[str, str]] = []
        super().__init__(upstream)

    def answer(self, fn: Answer | None) -> None:
        with self.lock:
            self._answer = fn

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        base = super()._handler()
        proxy = self

        class Handler(base):  # type: ignore[misc,valid-type]
            _read: bytes | None = None  # a body read here, handed to the base's _forward

            def _body(self) -> bytes:
                if self._read is not None:
                    body, self._read = self._read, None
                    return body
                return base._body(self)

            def _forward(self) -> None:
                body = base._body(self)
                with proxy.lock:
                    fn = proxy._answer
                got = fn(self.command, self.path, body) if fn is not None else None
                if got is None:
                    self._read = body
                    base._forward(self)
                    return
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                    proxy.answered.append((self.command, self.path))
                status, data = got
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
