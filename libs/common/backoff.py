"""The one backoff of Tandem: every retry loop waits through it.

A ``Backoff`` is the policy, plain data: the first delay, the factor, the cap and an
optional jitter. ``Backoff.retries()`` runs it: an async iterator of attempt numbers
that waits before each attempt after the first. The wait ends early when ``stop`` is set
(the iteration ends, ``stopped`` is True), and no wait starts that would end past the
deadline (``within`` seconds) or after the last of ``attempts``. ``retry(op, ...)`` is the
common case built on it: await ``op`` until it succeeds, re-raising the last error.

::

    retries = Backoff(0.2, max_delay=5.0).retries(stop=stopping)
    async for attempt in retries:
        try:
            return await connect()
        except OSError as exc:
            log.warning("connect_failed", attempt=attempt, retry_in=retries.delay)
    return None  # stopping

A loop that never gives up (a consumer's fetch) calls ``wait()`` after a failure and
``reset()`` after a success instead of iterating.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays ``first``, ``first * factor``, ... capped at ``max_delay``.

    With ``jitter`` j (0..1) each delay is drawn from ``[d * (1 - j), d]``, so processes
    that failed together do not retry together.
    """

    first: float
    max_delay: float
    factor: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if self.first < 0 or self.max_delay < 0:
            raise ValueError(f"backoff delays must be >= 0: {self}")
        if self.factor < 1:
            raise ValueError(f"backoff factor must be >= 1: {self}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff jitter must be within 0..1: {self}")

    def delay(self, failures: int, rng: Callable[[], float] = random.random) -> float:
        """The wait after the ``failures``-th failure in a row (1: ``first``)."""
        try:
            d = min(self.first * self.factor ** max(failures - 1, 0), self.max_delay)
        except OverflowError:
            d = self.max_delay
        return d * (1 - self.jitter * rng()) if self.jitter else d

    def retries(self, *, stop: asyncio.Event | None = None, within: float | None = None,
                attempts: int | None = None, clock: Callable[[], float] = time.monotonic,
                rng: Callable[[], float] = random.random) -> Retries:
        """A fresh run of this policy (see ``Retries``)."""
        return Retries(self, stop=stop, within=within, attempts=attempts, clock=clock,
                       rng=rng)


class Retries:
    """One run of a ``Backoff``: yields attempt numbers 1, 2, ..., waiting between them.

    The first attempt is never held back. The iteration ends, without waiting, once
    ``attempts`` were made or the next wait would end past the deadline (``within``
    seconds after this run began, on ``clock``); it ends when ``stop`` is set, also in
    the middle of a wait (``stopped`` then says so). ``delay`` is the next wait.
    """

    def __init__(self, policy: Backoff, *, stop: asyncio.Event | None = None,
                 within: float | None = None, attempts: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 rng: Callable[[], float] = random.random) -> None:
        if attempts is not None and attempts < 1:
            raise ValueError(f"attempts must be >= 1, not {attempts}")
        self.policy = policy
        self.stop = stop
        self.attempts = attempts
        self.clock = clock
        self.rng = rng
        self.deadline = None if within is None else clock() + within
        self.attempt = 0  # attempts yielded so far
        self.failures = 0  # waits since the last reset
        self.stopped = False
        self.delay = policy.delay(1, rng)

    def more(self) -> bool:
        """Whether another attempt will follow the current one (if ``stop`` stays clear)."""
        if self.attempts is not None and self.attempt >= self.attempts:
            return False
        if self.stop is not None and self.stop.is_set():
            return False
        return self.deadline is None or self.clock() + self.delay <= self.deadline

    def reset(self) -> None:
        """Start again from the first delay (after a success, in a loop that goes on)."""
        if self.failures:
            self.failures = 0
            self.delay = self.policy.delay(1, self.rng)

    async def wait(self) -> bool:
        """Wait ``delay`` seconds and grow it; False (at once, or as soon as ``stop`` is
        set) when no attempt should follow."""
        if not self.more():
            # Ended by stop only when the attempts and the deadline would have allowed more.
            self.stopped = self.stop is not None and self.stop.is_set() and (
                self.attempts is None or self.attempt < self.attempts)
            return False
        if self.stop is None:
            await asyncio.sleep(self.delay)
        else:
            try:
                async with asyncio.timeout(self.delay):
                    await self.stop.wait()
            except TimeoutError:
                pass
            else:
                self.stopped = True
                return False
        self.failures += 1
        self.delay = self.policy.delay(self.failures + 1, self.rng)
        return True

    def __aiter__(self) -> Retries:
        return self

    async def __anext__(self) -> int:
        if self.attempt and not await self.wait():
            raise StopAsyncIteration
        self.attempt += 1
        return self.attempt


async def retry(op: Callable[[], Awaitable[T]], policy: Backoff, *,
                when: Callable[[BaseException], bool] = lambda exc: True,
                within: float | None = None, attempts: int | None = None,
                stop: asyncio.Event | None = None,
                on_retry: Callable[[BaseException, Retries], None] | None = None) -> T:
    """``await op()`` until it returns, waiting by ``policy`` after each error ``when``
    accepts; the last error is raised once no attempt may follow (``within``,
    ``attempts``, ``stop``) or at once when ``when`` refuses it. ``on_retry(exc, run)``
    is called before each wait (to log it). ``op`` must be safe to repeat."""
    retries = policy.retries(stop=stop, within=within, attempts=attempts)
    async for _ in retries:
        try:
            return await op()
        except Exception as exc:
            if not when(exc) or not retries.more():
                raise
            if on_retry is not None:
                on_retry(exc, retries)
            last = exc
    raise last  # stop was set during the wait: the last error stands


async def wait_any(events: tuple[asyncio.Event, ...], seconds: float) -> None:
    """Until one of ``events`` is set, or ``seconds`` have passed (a nap that a stop, or
    any other news, ends early)."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
