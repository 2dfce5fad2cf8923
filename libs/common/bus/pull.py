"""The fetch of a durable pull consumer (``CONSUMER.MSG.NEXT``), one timer per fetch."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.errors import APIError

from tandem.common.bus.headers import DESCRIPTION, STATUS


class Pull:
    """Fetch from a durable pull consumer with one timer per fetch, not per message.

    nats-py's ``fetch`` starts a task, a timer and a uuid for every message it takes;
    here the inbox's callback appends to a deque and a fetch takes from it. Like
    nats-py, a fetch first asks for what is there now (``no_wait``); if nothing was,
    it waits up to ``timeout`` for one message, then asks (``no_wait``) for the rest of
    the batch. Each request has its own reply subject, so a status (404 no messages,
    408 expired) that ends an earlier request is told apart from the current one's.
    ``interrupt`` ends a fetch's wait at once, and every wait after it (the owner is
    stopping): what came is returned, what comes later is naked back by ``close``.
    """

    def __init__(self, nc: NATS, api_prefix: str, stream: str, durable: str) -> None:
        self.nc = nc
        self.next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.prefix = f"{nc.new_inbox()}."
        self.buf: collections.deque[Msg] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.requests = 0
        self.sub: Any = None
        self.interrupted = False

    @classmethod
    async def open(cls, nc: NATS, api_prefix: str, stream: str, durable: str) -> Pull:
        pull = cls(nc, api_prefix, stream, durable)
        pull.sub = await nc.subscribe(f"{pull.prefix}*", cb=pull._on_msg)
        return pull

    def interrupt(self) -> None:
        """Stop waiting: the fetch waiting now, and any later one, returns what it has."""
        self.interrupted = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _on_msg(self, msg: Msg) -> None:
        self.buf.append(msg)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        out: list[Msg] = []
        try:
            return await self._fetch(out, batch, timeout)
        except BaseException:
            # Cancelled (or failed) midway: what it had taken goes back to the buffer,
            # where the next fetch or ``close`` (which naks it) finds it, not to AckWait.
            self.buf.extendleft(reversed(out))
            raise

    async def _fetch(self, out: list[Msg], batch: int, timeout: float) -> list[Msg]:
        self._take(out, batch, "")  # delivered for an earlier request, not yet taken
        if len(out) >= batch:
            return out
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        await self._collect(out, batch, await self._request(batch - len(out)), deadline)
        if out:
            return out
        wait = deadline - loop.time()
        if wait < 0.01 or self.interrupted:
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
            if self.interrupted:
                return
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
            status = msg.headers.get(STATUS) if msg.headers else None
            if status is None:
                out.append(msg)
                continue
            if msg.subject != reply or status == "100":
                continue  # an earlier request's end, or an idle heartbeat
            if status in ("404", "408") or out:
                return True
            description = msg.headers.get(DESCRIPTION, "") if msg.headers else ""
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
