"""An operator's undrain of a node whose GPU is still broken, on a real nats-server."""

from __future__ import annotations

from tandem.common import fleet
from tandem.common.bus import Bus
from tandem.common.events import Health
from tandem.common.streams import core_streams
from tests.test_agent import agent_for, ticks, transitions, until


async def test_an_undrain_of_a_node_whose_gpu_is_still_lost_never_reports_it_healthy(
        bus: Bus, uid: str) -> None:
    await bus.provision(core_streams())
    cluster = f"c{uid}"
    agent, clock = agent_for(bus, cluster, "2 off-bus gpu=1")
    await agent.start()
    await ticks(agent, clock, 3)
    await until(lambda: agent.state == Health.drained, what="the agent's own drain")

    await fleet.undrain(bus, cluster, "n1")
    await until(lambda: len(agent.published) >= 3, what="the transition for the undrain")
    await ticks(agent, clock, 3)

    trs = await transitions(bus, cluster, "n1")
    assert [(t.current, t.rule) for t in trs[:3]] == [
        (Health.unhealthy, "xid-79"), (Health.drained, "drain"), (Health.unhealthy, "undrain")]
    assert trs[2].evidence["cleared"] == ["xid-79@1"]  # the event; the lost GPU stays
    assert Health.healthy not in [t.current for t in trs]  # a trainer would take it back
    assert agent.tracker.active() == ["gpu-lost@1"]
    assert agent.heartbeat_value().gpus_usable == 3
    # ... and drained again at once: no worker pulls onto it, no run is placed on it.
    await until(lambda: agent.state == Health.drained, what="drained again")
    rec = await fleet.drain_record(bus, cluster, "n1")
    assert rec is not None and rec.by == "agent" and rec.reason.startswith("gpu-lost on GPU 1")
    await agent.close()
