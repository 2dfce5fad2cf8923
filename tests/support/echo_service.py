"""A minimal service for runner tests: consumes ``echo.<name>`` and records each event.

Each handled message is published to ``echo.done.<name>`` *after* a configurable delay
(``TANDEM_ECHO_DELAY``) so a test can SIGTERM the process while work is in flight.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pydantic import Field

from tandem.common import streams
from tandem.common.bus import Delivery
from tandem.common.events import Event
from tandem.common.runner import Context, Service, main
from tandem.common.settings import Settings


class Echo(Event, kw_only=True):
    n: int


class EchoSettings(Settings):
    echo_name: str = Field("echo", description="Stream and subject suffix.")
    echo_delay: float = Field(0.0, description="Seconds each message takes.")
    echo_hang: str = Field("", description="A thread that never ends, started with the "
                           "run: 'executor' (a ThreadPoolExecutor's, as a pipeline call's) "
                           "or 'default' (asyncio.to_thread's); '' none.")


class EchoService(Service):
    name = "echo"
    settings_class = EchoSettings

    def stream(self) -> streams.StreamSpec:
        s: EchoSettings = self.settings  # type: ignore[assignment]
        return streams.StreamSpec(f"ECHO_{s.echo_name}", (f"echo.{s.echo_name}",))

    def consumer(self) -> streams.ConsumerSpec:
        return streams.ConsumerSpec(self.stream().name, "echo", ack_wait=30, max_deliver=3)

    def streams(self) -> Sequence[streams.Spec]:
        return [self.stream(), self.consumer()]

    async def run(self, ctx: Context) -> None:
        s: EchoSettings = self.settings  # type: ignore[assignment]
        if s.echo_hang == "executor":  # as a pipeline call stuck in a driver
            ThreadPoolExecutor(1, thread_name_prefix="hung").submit(threading.Event().wait)
        elif s.echo_hang == "default":
            hung = asyncio.ensure_future(asyncio.to_thread(threading.Event().wait))
            hung.add_done_callback(lambda _: None)
        if s.echo_hang:
            ctx.log.info("echo.hung", kind=s.echo_hang)

        async def handle(d: Delivery[Echo]) -> None:
            ctx.log.info("echo.start", n=d.event.n)
            await ctx.bus.emit(f"echo.started.{s.echo_name}", d.event)
            await asyncio.sleep(s.echo_delay)  # simulated work, not synchronisation
            await ctx.bus.emit(f"echo.done.{s.echo_name}", d.event)

        await ctx.bus.consumer(self.consumer(), Echo, handle, batch=1).run(ctx.stopping)


if __name__ == "__main__":
    main(EchoService)
