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


# JetStream's "insufficient resources" (10023), memory (10028) and storage (10047)
# limits exceeded: the server or account has no room for the write, and will not have
# any until something is deleted or purged. Also a 503, but one that does not pass.
NO_ROOM = (10023, 10028, 10047)


def no_room(exc: BaseException) -> bool:
    """Whether ``exc`` is JetStream refusing a write for want of storage."""
    return isinstance(exc, APIError) and exc.err_code in NO_ROOM


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a bus error that passes: a timeout, no responders or a 503 while
    a stream elects a leader, a reconnect. Not a full store (``no_room``): waiting out a
    retry window for it would only hold the caller."""
    if isinstance(exc, APIError):
        return (exc.code or 0) in (503, 0) and not no_room(exc)
    return isinstance(exc, _RETRYABLE)


def describe(exc: BaseException) -> str:
    """``exc`` for a message a person reads: a JetStream error's own description and
    codes (its repr is only the class name), else its repr."""
    if isinstance(exc, APIError):
        what = exc.description or type(exc).__name__
        return f"{what} (JetStream error {exc.code}/{exc.err_code})"
    return repr(exc)


async def retry_transient(op: Callable[[], Awaitable[T]], retry_for: float,
                          what: str = "", *, event: str = "bus.retry", **fields: Any) -> T:
    """``await op()``, again after each ``transient`` error until ``retry_for`` seconds
    have passed (then the last error is raised). ``op`` must be safe to repeat: a KV
    create, a publish with ``Nats-Msg-Id``. Each retry is logged as ``event`` with
    ``fields`` (and ``what``, when given)."""
    if what:
        fields["what"] = what

    def logged(exc: BaseException, _: Retries) -> None:
        _log.warning(event, error=describe(exc), **fields)

    return await retry(op, TRANSIENT_BACKOFF, when=transient, within=retry_for,
                       on_retry=logged)
