"""The scale bench's load side: a keep-alive HTTP client cheap enough not to cost what it
measures, the tasks it offers and their results, and heartbeat lag."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import msgspec

from tandem.cli.bench.children import ms
from tandem.common.tasks import succeeded

NOOP_BODY = b'{"model":"noop"}'


class Http:
    """A minimal HTTP/1.1 keep-alive client: the load generator must cost far less CPU
    than the gateway it measures (an httpx request costs about as much as the gateway's
    own handling of it)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()


class Tasks:
    """When each task was sent and when its record was seen ``succeeded`` (``on_record``,
    subscribed to ``$KV.tasks.*``)."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.rejected = 0
        self.changed = asyncio.Event()

    async def on_record(self, msg: Any) -> None:  # a task's result is its success
        if succeeded(msg.data) is not None:
            self.done.setdefault(msg.subject.rsplit(".", 1)[-1], time.perf_counter())
            self.changed.set()

    async def submit(self, http: Http) -> None:
        t0 = time.perf_counter()
        status, body = await http.post("/v1/generations", NOOP_BODY)
        if status != 202:
            self.rejected += 1
            return
        self.sent[json.loads(body)["id"]] = t0

    async def wait_all(self, ids: list[str], timeout: float) -> int:
        """Wait (bounded) until every id is done; return how many are not."""
        deadline = time.monotonic() + timeout
        while (left := sum(i not in self.done for i in ids)) and time.monotonic() < deadline:
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())
        return left

    def latencies(self, ids: list[str]) -> list[float]:
        return [self.done[i] - self.sent[i] for i in ids if i in self.done]


class HeartbeatLag:
    """How late heartbeats reach the hub: each KV put on ``$KV.nodes.>`` seen by a core
    subscriber, against the agent's own timestamp (same host, same clock). A backlog
    anywhere between the agents and the hub shows as a lag that grows."""

    class _At(msgspec.Struct):
        at: float = 0.0

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []  # (perf_counter, lag in seconds)
        self._decode = msgspec.json.Decoder(self._At).decode

    async def on_put(self, msg: Any) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            at = self._decode(msg.data).at
            if at:
                self.seen.append((time.perf_counter(), time.time() - at))

    def between(self, t0: float, t1: float) -> dict[str, float | None]:
        return ms([lag for t, lag in self.seen if t0 <= t < t1])


# ------------------------------------------------------------------------------- the run
