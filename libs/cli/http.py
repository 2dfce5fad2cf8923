"""The CLI's one HTTP helper for reading a child's endpoints, over httpx.

The local stack and every bench read the ``/healthz``, ``/metrics`` and
``/varz`` endpoints of processes they started through these functions. A child that is
not up yet, gone or answering garbage reads as ``None`` (``""``, ``False``): the callers
poll with a deadline and decide themselves when absence is an error.

One client per process, no proxies from the environment (the endpoints are on loopback)
and no keep-alive: each reading is its own connection, so a child that dies or restarts
never leaves a stale pooled connection behind, and a single-threaded endpoint is never
held open between readings.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

# What an unreachable, dying or half-started child raises: no answer, not a bug.
UNREACHABLE = (httpx.HTTPError, OSError)

_lock = threading.Lock()  # benches read from several threads at once (asyncio.to_thread)
_shared: list[httpx.Client] = []  # made on first use: importing this module stays cheap


def _client() -> httpx.Client:
    with _lock:
        if not _shared:
            _shared.append(httpx.Client(trust_env=False,
                                        limits=httpx.Limits(max_keepalive_connections=0)))
        return _shared[0]


def get(url: str, timeout: float = 2.0) -> httpx.Response | None:
    """The response of ``GET url`` (any status), or ``None`` when there was no answer."""
    try:
        return _client().get(url, timeout=timeout)
    except UNREACHABLE:
        return None


def get_bytes(url: str, timeout: float = 2.0) -> bytes | None:
    """The body of a 2xx answer, else ``None``."""
    resp = get(url, timeout)
    return resp.content if resp is not None and resp.is_success else None


def get_json(url: str, timeout: float = 2.0) -> Any:
    """The decoded JSON body of a 2xx answer, else ``None`` (also for a body not JSON)."""
    body = get_bytes(url, timeout)
    if body is None:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def get_text(url: str, timeout: float = 5.0) -> str:
    """The text of a 2xx answer, else ``""``."""
    body = get_bytes(url, timeout)
    return body.decode() if body is not None else ""


def is_ok(url: str, timeout: float = 1.0) -> bool:
    """Whether ``GET url`` answers 200."""
    resp = get(url, timeout)
    return resp is not None and resp.status_code == 200
