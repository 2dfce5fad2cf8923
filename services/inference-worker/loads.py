"""Loads off the event loop that a stopping worker does not wait for.

A model or checkpoint load may take minutes (a download of many GB). ``asyncio.to_thread``
would run it in the loop's default executor, whose threads the process joins when it
exits: a worker told to stop while it loads would outlive its drain timeout by the rest
of the load. ``detached`` runs it on a thread of its own, a daemon outside every
executor, and tells it to stop when nobody waits for it any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


async def detached(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, stop=<a threading.Event>, **kwargs)`` on a daemon thread of its own.
    Cancelled, ``stop`` is set (a checkpoint's download stops at its next chunk:
    ``checkpoints.restore``) and what the thread still returns or raises is dropped."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[R] = loop.create_future()
    stop = threading.Event()
    context = contextvars.copy_context()  # the caller's log context, as to_thread keeps

    def settle(value: Any, exc: BaseException | None) -> None:
        if done.done():  # cancelled: nobody waits for it
            return
        if exc is None:
            done.set_result(value)
        else:
            done.set_exception(exc)

    def load() -> None:
        value, exc = None, None
        try:
            value = context.run(fn, *args, stop=stop, **kwargs)
        except BaseException as err:
            exc = err
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(settle, value, exc)

    threading.Thread(target=load, name="model-load", daemon=True).start()
    try:
        return await done
    finally:
        stop.set()
