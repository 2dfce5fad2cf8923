"""Where a new task goes: ``choose_cluster`` is the one seam for routing.

Today it honours a request's pin (one of the configured clusters) and otherwise takes
the first configured cluster. Routing by health and capacity (fresh heartbeats, free
slots minus backlog, 503/429 with Retry-After) replaces the body of this function, not
its callers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RoutingError(Exception):
    """No cluster can take the task; ``status`` is the HTTP status to answer with."""

    status: int
    message: str
    field: str | None = None  # the request field at fault (a bad pin), if any
    retry_after: float | None = None

    def __str__(self) -> str:
        return self.message


async def choose_cluster(clusters: list[str], pin: str | None, model: str) -> str:
    """The cluster for a new task of ``model``; raises ``RoutingError``."""
    if pin is not None:
        if pin not in clusters:
            raise RoutingError(422, f"unknown cluster {pin!r}; known: {', '.join(clusters)}",
                               field="cluster")
        return pin
    if not clusters:
        raise RoutingError(503, "no cluster is configured", retry_after=5.0)
    return clusters[0]
