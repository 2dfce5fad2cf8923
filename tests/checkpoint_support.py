"""Checkpointer test support: local checkpoints to mirror, and a fault-injecting proxy.

``write_checkpoint`` writes a checkpoint directory as the trainer would (random bytes
plus a small safetensors file) and returns its manifest.

``FaultProxy`` sits between an S3 client and an S3 endpoint.

The client talks plain HTTP/1.1 to ``proxy.url``; each request is forwarded to the
upstream endpoint and its response relayed. Faults, armed by the test:

- ``corrupt(n, match)``: flip one byte in the body of the next ``n`` requests for which
  ``match(method, path)`` is true — an upload corrupted in transit (Content-Length and
  headers unchanged, so only a checksum comparison can tell).
- ``hold(match)``: park every request for which ``match(method, path)`` is true until
  ``release()``; ``holding`` is set once one is parked (the upload is mid-way,
  deterministically, without sleeping). ``release(drop=True)`` drops the parked
  requests' connections instead of forwarding them (their client was killed).

When the upstream is down the client's connection is dropped without a response, as a
dead endpoint would (counted in ``failures``). ``requests`` records ``(method, path)``
of every request received; ``inflight`` counts those being forwarded.
"""

from __future__ import annotations

import http.client
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.events import CheckpointManifest, CheckpointWritten

MiB = 1 << 20
# A big file (three 5 MiB parts with 5 MiB parts), small ones, a safetensors file.
SIZES = {"optimizer.bin": 11 * MiB, "rng.bin": 3000, "data_position.json": 40}


def write_checkpoint(root: Path, run_id: str, step: int, sizes: dict[str, int] | None = None,
                     lineage: int = 0) -> tuple[Path, CheckpointManifest]:
    """Write ``root/step-<step>/`` (of ``lineage``) with random files and a safetensors
    file; its manifest."""
    import numpy as np
    from safetensors.numpy import save_file

    directory = root / ck.step_name(step, lineage)
    directory.mkdir(parents=True)
    for name, size in (SIZES if sizes is None else sizes).items():
        (directory / name).write_bytes(os.urandom(size))
    rng = np.random.default_rng(step)
    save_file({"w": rng.standard_normal((16, 16)).astype(np.float32),
               "b": np.full((16,), step, dtype=np.float32)},
              str(directory / "model.safetensors"))
    return directory, ck.scan(directory, run_id, step, lineage)


def written(directory: Path, manifest: CheckpointManifest, cluster: str = "local",
            node: str = "node-0", attempt: int = 1) -> CheckpointWritten:
    """The event the coordinator publishes for a checkpoint written on ``node``."""
    return CheckpointWritten(run_id=manifest.run_id, step=manifest.step,
                             path=str(directory), manifest=manifest, cluster=cluster,
                             node=node, attempt=attempt)


def mirror_subject(ev: CheckpointWritten) -> str:
    """Where the coordinator hands ``ev`` to its node's checkpointer."""
    return subjects.mirror(ev.cluster, ev.node)

Match = Callable[[str, str], bool]
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te",
        "trailer", "upgrade"}


def is_upload(method: str, path: str) -> bool:
    """A request that carries object bytes: PutObject or UploadPart."""
    return method == "PUT" and "/runs/" in path and "uploads" not in path.split("?")[-1]


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname or "127.0.0.1", u.port or 80)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.corrupted: list[str] = []
        self._corrupt_left = 0
        self._corrupt_match: Match = is_upload
        self._hold: Match | None = None
        self._drop = False
        self.inflight = 0
        self.failures = 0
        self.holding = threading.Event()
        self._released = threading.Event()
        self._released.set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    # ---------------------------------------------------------------------------- faults

    def corrupt(self, n: int, match: Match = is_upload) -> None:
        with self.lock:
            self._corrupt_left = n
            self._corrupt_match = match

    def hold(self, match: Match) -> None:
        with self.lock:
            self._hold = match
            self._released.clear()
            self.holding.clear()

    def release(self, drop: bool = False) -> None:
        with self.lock:
            self._hold = None
            self._drop = drop
        self._released.set()

    def uploads(self) -> list[tuple[str, str]]:
        with self.lock:
            return [r for r in self.requests if is_upload(*r)]

    def _admit(self, method: str, path: str, body: bytes) -> bytes | None:
        """Apply armed faults to one request; may block while held; None: drop it."""
        park = False
        with self.lock:
            park = self._hold is not None and self._hold(method, path)
            if body and self._corrupt_left > 0 and self._corrupt_match(method, path):
                self._corrupt_left -= 1
                self.corrupted.append(path)
                i = len(body) // 2
                body = body[:i] + bytes([body[i] ^ 0xFF]) + body[i + 1:]
        if park:
            self.holding.set()
            self._released.wait()
            if self._drop:
                return None
        return body

    # --------------------------------------------------------------------------- serving

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _forward(self) -> None:
                body = self._body()
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                admitted = proxy._admit(self.command, self.path, body)
                if admitted is None:
                    self.close_connection = True
                    return
                body = admitted
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                with proxy.lock:
                    proxy.inflight += 1
                try:
                    conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except OSError:
                    # Upstream is dead: drop the client's connection, no response.
                    with proxy.lock:
                        proxy.failures += 1
                    self.close_connection = True
                    return
                finally:
                    with proxy.lock:
                        proxy.inflight -= 1
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                length = resp.getheader("Content-Length")
                self.send_header("Content-Length",
                                 length if self.command == "HEAD" and length else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
