"""The one backoff: its delays, its deadline, its stop event, and ``retry``."""

from __future__ import annotations

import asyncio

import pytest

from tandem.common.backoff import Backoff, retry


def test_delays_grow_by_the_factor_up_to_the_cap() -> None:
    b = Backoff(0.1, max_delay=1.0)
    assert [b.delay(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert Backoff(1.0, max_delay=60.0, factor=3.0).delay(3) == 9.0
    assert b.delay(100_000) == 1.0  # no overflow, however long it has failed


def test_jitter_draws_each_delay_from_its_lower_part() -> None:
    b = Backoff(1.0, max_delay=8.0, jitter=0.5)
    assert b.delay(3, rng=lambda: 0.0) == 4.0
    assert b.delay(3, rng=lambda: 1.0) == 2.0
    assert b.delay(9, rng=lambda: 0.5) == 6.0  # jitter applies to the capped delay too


def test_a_policy_refuses_nonsense() -> None:
    for bad in (dict(first=-1.0, max_delay=1.0), dict(first=1.0, max_delay=1.0, factor=0.5),
                dict(first=1.0, max_delay=1.0, jitter=2.0)):
        with pytest.raises(ValueError):
            Backoff(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Backoff(1.0, max_delay=1.0).retries(attempts=0)


async def test_a_run_waits_the_growing_delays_between_its_attempts() -> None:
    run = Backoff(0.001, max_delay=0.004).retries(attempts=5)
    seen = []
    async for attempt in run:
        seen.append((attempt, run.delay))
    assert seen == [(1, 0.001), (2, 0.002), (3, 0.004), (4, 0.004), (5, 0.004)]
    assert not run.stopped


async def test_reset_starts_again_from_the_first_delay() -> None:
    run = Backoff(0.001, max_delay=1.0).retries()
    assert await run.wait() and await run.wait()
    assert run.delay == 0.004
    run.reset()
    assert run.delay == 0.001


async def test_no_wait_starts_that_would_end_past_the_deadline() -> None:
    now = [0.0]
    run = Backoff(0.001, max_delay=1.0).retries(within=0.01, clock=lambda: now[0])
    attempts = []
    async for attempt in run:
        attempts.append(attempt)
        # The attempt itself takes time on the (fake) clock: 4 ms, then 4.5 ms.
        now[0] += 0.004 if attempt == 1 else 0.0045
    # After attempt 1 (t=4 ms) a 1 ms wait fits; after attempt 2 (t=8.5 ms) 2 ms does not.
    assert attempts == [1, 2]
    assert not run.stopped


async def test_setting_the_stop_event_ends_the_wait_early() -> None:
    stop = asyncio.Event()
    run = Backoff(3600.0, max_delay=3600.0).retries(stop=stop)
    assert await anext(run) == 1
    asyncio.get_running_loop().call_soon(stop.set)  # once the wait below has begun
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(run), 30)  # an hour's wait, ended by stop
    assert run.stopped


async def test_a_stop_already_set_ends_the_run_before_any_wait() -> None:
    stop = asyncio.Event()
    stop.set()
    run = Backoff(3600.0, max_delay=3600.0).retries(stop=stop)
    assert [a async for a in run] == [1]  # the first attempt is never held back
    assert run.stopped


async def test_a_run_out_of_attempts_is_not_stopped_even_when_stop_is_set() -> None:
    stop = asyncio.Event()
    run = Backoff(0.0, max_delay=0.0).retries(stop=stop, attempts=1)
    async for _ in run:
        stop.set()
    assert not run.stopped


async def test_retry_returns_once_the_operation_succeeds() -> None:
    calls, retried = [], []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "done"

    got = await retry(flaky, Backoff(0.0, max_delay=0.0),
                      on_retry=lambda exc, run: retried.append((repr(exc), run.attempt)))
    assert got == "done"
    assert retried == [("ConnectionError('not yet')", 1), ("ConnectionError('not yet')", 2)]


async def test_retry_raises_the_last_error_when_no_attempt_may_follow() -> None:
    calls = []

    async def broken() -> None:
        calls.append(1)
        raise ConnectionError(f"attempt {len(calls)}")

    with pytest.raises(ConnectionError, match="attempt 3"):
        await retry(broken, Backoff(0.0, max_delay=0.0), attempts=3)
    assert len(calls) == 3


async def test_retry_raises_at_once_an_error_it_does_not_retry() -> None:
    calls = []

    async def refused() -> None:
        calls.append(1)
        raise PermissionError("no")

    with pytest.raises(PermissionError):
        await retry(refused, Backoff(0.0, max_delay=0.0),
                    when=lambda exc: isinstance(exc, ConnectionError))
    assert len(calls) == 1
