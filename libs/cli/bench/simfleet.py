"""Many simulated nodes in one process: the agent's own ``NodeAgent``, N times, one bus.

A simulated fleet for scale tests and ``tandem bench scale`` (bench code: it lives with
the CLI, not in the cluster agent's image): each node is a real
``NodeAgent`` (the same sampling, health rules, transitions, heartbeat and drain watch
as ``python -m tandem.cluster_agent``) over a ``sim`` backend; only the process and the
NATS connection are shared. Nodes are named ``<prefix><index>`` and their first ticks
are spread over one interval, as independent hosts' would be.

    TANDEM_CLUSTER=east TANDEM_FLEET_NODES=250 python -m tandem.cli.bench.simfleet
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

from pydantic import Field

from tandem.cluster_agent.agent import NodeAgent
from tandem.cluster_agent.backend import make
from tandem.cluster_agent.clock import WallClock
from tandem.cluster_agent.service import AgentSettings
from tandem.common import fleet, subjects
from tandem.common.runner import Context, Service, main

START_BATCH = 50  # agents starting at once: each reads HEALTH and opens a drain watch


class FleetSettings(AgentSettings):
    """The agent's settings (``SIM_GPUS``, ``AGENT_INTERVAL``, ...) plus the fleet's shape."""

    fleet_nodes: int = Field(10, ge=1, le=20_000, description="Simulated nodes in this process.")
    fleet_first: int = Field(0, ge=0, description="Index of this process's first node.")
    fleet_prefix: str = Field("sim-", description="Node names are <prefix><index>.")


class SimFleet(Service):
    name = "cluster-agent-fleet"
    settings_class = FleetSettings

    def __init__(self, settings: FleetSettings) -> None:  # type: ignore[override]
        super().__init__(settings)
        self.s = settings
        self.agents: list[NodeAgent] = []
        self.running_since: float | None = None  # when every node had started
        subjects.token(f"{settings.fleet_prefix}{settings.fleet_first}", "node")

    def node_names(self) -> list[str]:
        s = self.s
        return [f"{s.fleet_prefix}{s.fleet_first + i}" for i in range(s.fleet_nodes)]

    def health(self) -> dict[str, Any]:
        return {
            "nodes": len(self.agents), "started": self.running_since is not None,
            "running_since": self.running_since,
            "samples": sum(a.samples for a in self.agents),
            "telemetry_stored": sum(a.telemetry_stored for a in self.agents),
            "telemetry_failed": sum(a.telemetry_failed for a in self.agents),
            "heartbeats": sum(a.heartbeats for a in self.agents),
            "unhealthy": sum(a.state.value != "healthy" for a in self.agents),
        }

    async def run(self, ctx: Context) -> None:
        s = self.s
        # The process's nodes share one drain watch, not an ordered consumer each.
        drains = fleet.DrainBoard(ctx.bus, s.cluster)
        self.agents = [
            NodeAgent(ctx.bus, s.cluster, node,
                      make("sim", gpus=s.sim_gpus, load=s.sim_load,
                           seed=zlib.crc32(f"{s.cluster}.{node}".encode())),
                      WallClock(), interval=s.agent_interval, auto_drain=s.agent_auto_drain,
                      drains=drains)
            for node in self.node_names()
        ]
        for i in range(0, len(self.agents), START_BATCH):
            await asyncio.gather(*(a.start() for a in self.agents[i:i + START_BATCH]))
        self.running_since = time.time()
        ctx.log.info("fleet.started", nodes=len(self.agents), gpus_per_node=s.sim_gpus,
                     interval=s.agent_interval)
        n = len(self.agents)
        async with asyncio.TaskGroup() as tg:
            for i, agent in enumerate(self.agents):
                tg.create_task(self._run(ctx, agent, s.agent_interval * i / n))
        for agent in self.agents:
            await agent.close()
        await drains.stop()

    @staticmethod
    async def _run(ctx: Context, agent: NodeAgent, offset: float) -> None:
        # Independent hosts do not tick in the same millisecond: spread the first ticks.
        if offset and await ctx.wait_stopping(offset):
            return
        await agent.run(ctx.stopping)


if __name__ == "__main__":
    main(SimFleet)
