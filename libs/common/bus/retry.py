"""Which bus errors pass, and retrying an idempotent bus operation through them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError

from tandem.common import log
from tandem.common.backoff import Backoff, Retries, retry

T = TypeVar("T")
_log = log.get("tandem.bus")

# From 50 ms, doubling to 1 s: a leader election or a reconnect takes about that long.
TRANSIENT_BACKOFF = Backoff(0.05, max_delay=1.0)
_RETRYABLE = (NatsTimeout, asyncio.TimeoutError, NoRespondersError, NoStreamResponseError,
              ConnectionClosedError)


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a bus error that passes: a timeout, no responders or a 503 while
    a stream elects a leader, a reconnect."""
    if isinstance(exc, APIError):
        return (exc.code or 0) in (503, 0)
    return isinstance(exc, _RETRYABLE)


async def retry_transient(op: Callable[[], Awaitable[T]], retry_for: float,
                          what: str = "", *, event: str = "bus.retry", **fields: Any) -> T:
    """``await op()``, again after each ``transient`` error until ``retry_for`` seconds
    have passed (then the last error is raised). ``op`` must be safe to repeat: a KV
    create, a publish with ``Nats-Msg-Id``. Each retry is logged as ``event`` with
    ``fields`` (and ``what``, when given)."""
    if what:
        fields["what"] = what

    def logged(exc: BaseException, _: Retries) -> None:
        _log.warning(event, error=repr(exc), **fields)

    return await retry(op, TRANSIENT_BACKOFF, when=transient, within=retry_for,
                       on_retry=logged)
