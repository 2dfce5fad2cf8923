"""``SyncClient``: the async client driven by a private event loop, for plain scripts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from tandem.client.transports import Client, connect


class SyncClient:
    """Blocking calls over either transport::

        with SyncClient("http://127.0.0.1:8000") as tandem:
            record = tandem.wait(tandem.generate(model="digits", class_label=1)["id"])

    Every method of ``Client`` is here with the same arguments; ``events`` is a plain
    iterator. One loop runs every call, so the NATS connection stays on its loop.
    """

    def __init__(self, url: str, api_key: str | None = None, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._client: Client = self._loop.run_until_complete(connect(url, api_key, **options))

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if name == "events" or not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run_until_complete(method(*args, **kwargs))

        return call

    def events(self, task_id: str) -> Iterator[dict[str, Any]]:
        it = self._client.events(task_id)
        try:
            while True:
                try:
                    yield self._loop.run_until_complete(it.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            # Left before the end (a break, close()): the follow is closed on this
            # client's loop, not by the garbage collector outside any loop.
            if not self._loop.is_closed():
                self._loop.run_until_complete(it.aclose())

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
