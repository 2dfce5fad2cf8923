"""Time for the agent, behind a Protocol so tests drive simulated time sample by sample.

Two clocks: ``now()`` is wall time, for what events carry; ``monotonic()`` schedules the
agent's ticks and heartbeats, so a wall-clock step (NTP) neither stalls nor floods them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from time import monotonic as _monotonic
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (wall time: events carry it)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never steps (scheduling: ``sleep_until``'s ``t``)."""
        ...

    async def sleep_until(self, t: float, stop: asyncio.Event) -> bool:
        """Wait until ``monotonic() >= t`` or ``stop`` is set; True if stopping."""
        ...


class WallClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return _monotonic()

    async def sleep_until(self, t: float, stop: asyncio.Event) -> bool:
        delay = t - _monotonic()
        if delay > 0:
            # A timeout on this task, not wait_for's extra task: an agent process ticks
            # hundreds of simulated nodes a second, and each wait_for made and cancelled one.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stop.wait()
        return stop.is_set()


class ManualClock:
    """A clock that moves only when told: ``advance(dt)``. ``sleep_until`` jumps to ``t``.

    Its wall and monotonic time are the same number (it never steps)."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t

    async def sleep_until(self, t: float, stop: asyncio.Event) -> bool:
        self.t = max(self.t, t)
        await asyncio.sleep(0)  # yield so other tasks (watchers, stop) get to run
        return stop.is_set()
