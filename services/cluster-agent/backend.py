"""What the agent samples GPUs through: one interface, two backends chosen by config.

``nvml`` reads real GPUs through nvidia-ml-py; ``sim`` models N GPUs with noise and a
fault script. Both return one ``GpuSample`` per GPU per call, with ``None`` for what a
GPU does not report and the XIDs that arrived since the previous call.

A backend that cannot sample this node is refused at start, never run empty (both
errors are ``ValueError`` too, so a settings check names ``TANDEM_AGENT_BACKEND``):

    TandemError
    ├── NvmlUnavailable   nvml chosen, but nvidia-ml-py or the driver's NVML is missing
    └── NoGpus            the backend opened no GPU (a container started without its devices)
"""

from __future__ import annotations

from typing import Protocol

from tandem.common.errors import TandemError
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


class NvmlUnavailable(TandemError, ValueError):
    """``TANDEM_AGENT_BACKEND=nvml`` on a host where NVML cannot start; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"TANDEM_AGENT_BACKEND=nvml, but NVML is unavailable on this host ({reason}): "
            "run the agent where the NVIDIA driver's libnvidia-ml is (under Kubernetes, the "
            "nvidia runtime class), or set TANDEM_AGENT_BACKEND=sim")


class NoGpus(TandemError, ValueError):
    """Backend ``backend`` opened no GPU on ``node``: such a node is never reported."""

    def __init__(self, backend: str, node: str) -> None:
        self.backend = backend
        self.node = node
        super().__init__(
            f"TANDEM_AGENT_BACKEND={backend} sees no GPU on node {node!r}: a node with no GPU "
            "would be reported serving with nothing to serve on. Start the agent with the "
            "node's GPUs visible (NVIDIA_VISIBLE_DEVICES=all and the nvidia runtime), or "
            "not on this node")


def make(kind: str, **options: object) -> Backend:
    """The backend named ``kind`` ("nvml" or "sim") built with ``options``."""
    if kind == "nvml":
        from tandem.cluster_agent.nvml import NvmlBackend

        return NvmlBackend(**options)  # type: ignore[arg-type]
    if kind == "sim":
        from tandem.cluster_agent.sim import SimBackend

        return SimBackend(**options)  # type: ignore[arg-type]
    raise ValueError(f"unknown GPU backend {kind!r}: use 'nvml' or 'sim'")
