"""What the agent samples GPUs through: one interface, two backends chosen by config.

``nvml`` reads real GPUs through nvidia-ml-py; ``sim`` models N GPUs with noise and a
fault script. Both return one ``GpuSample`` per GPU per call, with ``None`` for what a
GPU does not report and the XIDs that arrived since the previous call.
"""

from __future__ import annotations

from typing import Protocol

from tandem.common.events import GpuSample


class Backend(Protocol):
    name: str
    # True when sample() makes blocking calls (NVML); the agent then runs it in a thread.
    blocking: bool

    def open(self, now: float) -> int:
        """Start sampling; return the number of GPUs."""
        ...

    def sample(self, now: float) -> list[GpuSample]:
        """One sample of every GPU. Raises ``AgentDeath`` when the sim script says so."""
        ...

    def close(self) -> None: ...


class AgentDeath(Exception):
    """The sim fault script's ``agent-die``: the agent process must die like a kill -9."""


def make(kind: str, **options: object) -> Backend:
    """The backend named ``kind`` ("nvml" or "sim") built with ``options``."""
    if kind == "nvml":
        from tandem.cluster_agent.nvml import NvmlBackend

        return NvmlBackend(**options)  # type: ignore[arg-type]
    if kind == "sim":
        from tandem.cluster_agent.sim import SimBackend

        return SimBackend(**options)  # type: ignore[arg-type]
    raise ValueError(f"unknown GPU backend {kind!r}: use 'nvml' or 'sim'")
