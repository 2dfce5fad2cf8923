"""The fleet view (KV nodes + drains), its live ClusterBoard, and the `tandem clusters` /
`tandem node` commands against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import msgspec

from tandem.cli.devstack import NatsServer, free_port
from tandem.cluster_agent.agent import NodeAgent
from tandem.cluster_agent.clock import ManualClock
from tandem.cluster_agent.sim import SimBackend
from tandem.common import fleet
from tandem.common.bus import Bus
from tandem.common.clusters import ClusterBoard
from tandem.common.events import DrainRecord, Health, NodeHeartbeat
from tandem.common.streams import core_streams
from tests.conftest import PYTHON, service_env
from tests.test_agent import until


async def _agents(bus: Bus, nodes: list[tuple[str, str, float]]) -> list[NodeAgent]:
    clock = ManualClock(time.time())
    agents = []
    for cluster, node, load in nodes:
        a = NodeAgent(bus, cluster, node, SimBackend(gpus=2, load=load, seed=1), clock)
        await a.start()
        clock.advance(1.0)
        await a.tick()
        agents.append(a)
    return agents


async def test_read_fleet_reports_each_cluster_and_node_with_gpu_metrics(
        bus: Bus, uid: str) -> None:
    await bus.provision(core_streams())
    east, west = f"east{uid}", f"west{uid}"
    agents = await _agents(bus, [(east, "n1", 0.9), (east, "n2", 0.0), (west, "n1", 0.0)])
    await fleet.drain(bus, west, "n1", "maintenance", by="ops")
    await fleet.drain(bus, west, "gone", "dead PSU", by="ops")  # no agent at all
    await until(lambda: agents[2].state == Health.drained)
    await agents[2].heartbeat()

    view = await fleet.read_fleet(bus)
    e, w = view.cluster(east), view.cluster(west)
    assert e is not None and w is not None
    assert (e.healthy, e.nodes_total, e.nodes_up, e.nodes_serving, e.gpus_total) == (
        True, 2, 2, 2, 4)
    assert e.gpus_free == 2  # n1's GPUs are busy (memory in use), n2's are idle
    n1 = e.nodes[0]
    assert (n1.node, n1.status, n1.up, n1.serving) == ("n1", "healthy", True, True)
    assert n1.age_s is not None and n1.age_s < view.heartbeat_ttl
    assert len(n1.gpus) == 2 and n1.gpus[0].util is not None and n1.gpus[0].temp is not None
    # west: one drained node with an agent, one drained node without: no serving node.
    assert (w.healthy, w.nodes_total, w.nodes_up, w.nodes_drained, w.gpus_free) == (
        False, 2, 1, 2, 0)
    by_name = {n.node: n for n in w.nodes}
    assert (by_name["n1"].status, by_name["n1"].drain_reason) == ("drained", "maintenance")
    assert (by_name["gone"].status, by_name["gone"].drained, by_name["gone"].health) == (
        "down", True, None)
    assert json.loads(json.dumps(view.to_dict()))["clusters"][0]["name"] == east
    for a in agents:
        await a.close()


def test_summarize_counts_a_stale_heartbeat_as_down_and_unhealthy_as_not_serving() -> None:
    hb = [(NodeHeartbeat(cluster="c", node="a", gpus_total=8, gpus_free=8), 1.0),
          (NodeHeartbeat(cluster="c", node="b", gpus_total=8, gpus_free=8), 60.0),
          (NodeHeartbeat(cluster="c", node="c", health=Health.unhealthy, gpus_free=8), 1.0)]
    view = fleet.summarize(hb, [DrainRecord(cluster="d", node="x", reason="r")], ttl=6.0)
    c = view.cluster("c")
    assert c is not None
    assert [(n.node, n.status, n.serving) for n in c.nodes] == [
        ("a", "healthy", True), ("b", "down", False), ("c", "unhealthy", False)]
    assert (c.healthy, c.gpus_free, c.gpus_total) == (True, 8, 8)
    assert view.cluster("d").healthy is False  # type: ignore[union-attr]


async def test_cluster_board_view_follows_heartbeats_and_drains_live(bus: Bus, uid: str) -> None:
    await bus.provision(core_streams())
    async with ClusterBoard(bus) as watch:
        assert watch.view().clusters == []
        [agent] = await _agents(bus, [(f"c{uid}", "n1", 0.0)])
        await until(lambda: watch.view().cluster(f"c{uid}"), what="the node in the view")
        assert watch.view().cluster(f"c{uid}").nodes_serving == 1  # type: ignore[union-attr]
        await fleet.drain(bus, f"c{uid}", "n1", "rack move")
        await until(lambda: not watch.view().cluster(f"c{uid}").healthy,  # type: ignore[union-attr]
                    what="the drain in the view")
        await agent.close()  # a graceful stop deletes the heartbeat
        await until(lambda: not watch.view().cluster(f"c{uid}").nodes_up,  # type: ignore[union-attr]
                    what="the node to leave")


async def test_nodes_sharing_a_drain_board_each_see_only_their_own_drains(
        bus: Bus, uid: str) -> None:
    """One process hosting many nodes: one consumer on KV drains, not one per node, and
    each node's watch still sees exactly its own state and changes."""
    from tandem.common.streams import KV_DRAINS

    await bus.provision(core_streams())
    cluster = f"c{uid}"
    await fleet.drain(bus, cluster, "n0", "drained before the start")
    seen: dict[str, list[str]] = {n: [] for n in ("n0", "n1", "n2")}

    def recorder(node: str):  # type: ignore[no-untyped-def]
        async def on_change(record: DrainRecord | None) -> None:
            seen[node].append(record.reason if record else "undrained")
        return on_change

    before = (await bus.js.stream_info(f"KV_{KV_DRAINS}")).state.consumer_count
    board = fleet.DrainBoard(bus, cluster)
    watches = {n: fleet.DrainWatch(bus, cluster, n, on_change=recorder(n), board=board)
               for n in seen}
    for w in watches.values():
        await w.start()
    assert [w.drained for w in watches.values()] == [True, False, False]
    assert (await bus.js.stream_info(f"KV_{KV_DRAINS}")).state.consumer_count == before + 1
    await fleet.drain(bus, cluster, "n2", "rack move")
    await fleet.undrain(bus, cluster, "n0")
    await until(lambda: watches["n2"].drained and not watches["n0"].drained,
                what="the drain of n2 and the undrain of n0")
    assert seen == {"n0": ["undrained"], "n1": [], "n2": ["rack move"]}
    for w in watches.values():
        await w.stop()
    await board.stop()


@contextlib.asynccontextmanager
async def _beating(agent: NodeAgent) -> AsyncIterator[None]:
    """The agent heartbeats every second meanwhile, as a running agent does: a CLI start
    can take longer than the heartbeat TTL on a busy box (it read one node as down)."""
    stop = asyncio.Event()

    async def beat() -> None:
        while not stop.is_set():
            await agent.heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)  # the agent's period

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        stop.set()
        await task


async def _cli(server_url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-m", "tandem.cli.main", *args, env=service_env(nats_url=server_url),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_clusters_and_node_drain_commands_print_and_change_the_fleet(
        nats_server: NatsServer, bus: Bus, uid: str) -> None:
    await bus.provision(core_streams())
    cluster = f"c{uid}"
    [agent] = await _agents(bus, [(cluster, "n1", 0.9)])

    code, out, err = await _cli(nats_server.url, "node", "drain", cluster, "n1",
                                "--reason", "bad fan")
    assert code == 0, err
    assert f"drained {cluster}/n1: bad fan" in out
    await until(lambda: agent.state == Health.drained)

    async with _beating(agent):
        code, out, err = await _cli(nats_server.url, "clusters", "--gpus")
    assert code == 0, err
    assert cluster in out and "UNHEALTHY (no serving node)" in out
    assert "drained: bad fan" in out and "gpu1" in out and "util" in out

    async with _beating(agent):
        code, out, err = await _cli(nats_server.url, "clusters", "--json")
    assert code == 0, err
    [node] = json.loads(out)["clusters"][0]["nodes"]
    assert (node["node"], node["status"], node["drain_reason"]) == ("n1", "drained", "bad fan")

    code, out, err = await _cli(nats_server.url, "node", "undrain", cluster, "n1")
    assert code == 0, err
    assert f"undrained {cluster}/n1" in out
    await until(lambda: agent.state == Health.healthy)

    # A Kubernetes node name is named as its pods' TANDEM_NODE maps it; garbage is refused.
    code, out, err = await _cli(nats_server.url, "node", "drain", cluster, "n1.ec2.internal",
                                "--reason", "x")
    assert code == 0 and f"drained {cluster}/n1_ec2_internal: x" in out, err
    code, _, err = await _cli(nats_server.url, "node", "drain", cluster, "n.*", "--reason", "x")
    assert code == 2 and "invalid node 'n.*'" in err
    await agent.close()


async def test_commands_say_how_to_start_the_stack_when_nats_is_unreachable() -> None:
    code, _, err = await _cli(f"nats://127.0.0.1:{free_port()}", "clusters")
    assert code == 1
    assert "cannot reach NATS" in err and "tandem dev up" in err


def test_fleet_view_is_plain_json_for_the_gateway() -> None:
    view = fleet.summarize([(NodeHeartbeat(cluster="c", node="a"), 0.5)], [], ttl=6.0)
    assert msgspec.json.decode(msgspec.json.encode(view))["clusters"][0]["nodes"][0]["up"] is True
