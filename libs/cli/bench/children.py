"""What every bench shares: its services as child processes, their readiness, percentiles.

A bench starts real services (``python -m tandem.<service>``) on free loopback ports,
waits on each one's own ``/healthz`` (polled, with a deadline: never a fixed sleep), and
reports latencies as p50/p99 in milliseconds.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.cli import http
from tandem.cli.devstack import Process


@dataclass
class ServiceProcess(Process):
    """A Tandem service (or any module of the project) run as a child process."""

    def start(self, module: str, env: dict[str, str]) -> ServiceProcess:
        """``python -m module`` with exactly ``env`` on top of this process's environment."""
        self._spawn([sys.executable, "-m", module], env=env)
        return self


def child_env(**values: str) -> dict[str, str]:
    """This process's environment without its own ``TANDEM_*``, plus ``values`` as
    ``TANDEM_<NAME>`` settings: a child sees only the settings its bench gives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env.update({f"TANDEM_{k.upper()}": v for k, v in values.items()})
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def wait_ready(url: str, proc: Process,
                     pred: Callable[[dict[str, Any]], Any] | None = None,
                     timeout: float = 120) -> None:
    """Poll ``url`` (a child's ``/healthz``) until it answers JSON for which ``pred``
    holds. Raises ``RuntimeError`` naming the log when the child exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.running:
            raise RuntimeError(f"{proc.name} exited; see {proc.log_path}")
        got = await asyncio.to_thread(http.get_json, url)
        if got is not None and (pred is None or pred(got)):
            return
        await asyncio.sleep(0.05)  # polling the child's readiness endpoint
    raise RuntimeError(f"{proc.name} not ready at {url}; see {proc.log_path}")


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; ``values`` not empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def ms(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 of ``values`` (seconds) in milliseconds; ``None`` for no values."""
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    return {"p50_ms": round(pct(values, 0.5) * 1e3, 3),
            "p99_ms": round(pct(values, 0.99) * 1e3, 3)}
