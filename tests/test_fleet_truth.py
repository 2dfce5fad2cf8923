"""What the fleet's readers believe of a heartbeat, against a real nats-server.

- its KV key says whose it is, not its body (a forged entry cannot make another cluster
  healthy);
- its age is the server's, never the agent's clock (an agent an hour behind is not dead
  to a gateway that starts, or watches again, beside it);
- routing and ``/metrics`` judge freshness by the same TTL, which the bucket can honour;
- a node up but out of service, and a node gone, are visible to the alert rules.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from fastapi import FastAPI

from tandem.common import fleet, subjects
from tandem.common.bus import Bus
from tandem.common.bus.kv import entries
from tandem.common.clusters import ClusterBoard
from tandem.common.errors import SettingsError
from tandem.common.events import DrainRecord, Health, NodeHeartbeat, encode
from tandem.common.settings import load
from tandem.common.streams import HEARTBEAT_TTL, KV_DRAINS, KV_NODES, core_streams
from tandem.gateway import observe
from tandem.gateway.observe import Observer
from tandem.gateway.routing import Router
from tandem.gateway.service import GatewaySettings
from tandem.gateway.training import add_fleet_routes

from .test_agent import until
from .test_alerts import rules
from .test_observer import Clock, exposed


async def put(bus: Bus, key: str, hb: NodeHeartbeat) -> None:
    await (await bus.kv(KV_NODES)).put(key, encode(hb))


def health_series(text: str, cluster: str) -> dict[tuple[str, str], float]:
    """(node, state) -> value of ``tandem_node_health`` for ``cluster``."""
    out = {}
    for m in re.finditer(r'^tandem_node_health\{cluster="([^"]+)",node="([^"]+)",'
                         r'state="([^"]+)"\} (\S+)$', text, re.M):
        if m[1] == cluster:
            out[(m[2], m[3])] = float(m[4])
    return out


async def test_a_heartbeat_counts_for_its_key_not_for_the_cluster_its_body_names(
        bus: Bus, uid: str) -> None:
    await bus.provision(core_streams())
    known, ghost = f"known{uid}", f"ghost{uid}"
    forged = NodeHeartbeat(cluster=known, node="n1", gpus_total=1000, gpus_usable=1000,
                           gpus_free=1000)
    await put(bus, subjects.node_key(ghost, "n9"), forged)
    board = await ClusterBoard(bus, clusters=(known,)).start()
    try:
        # Loaded at start, then written while the board watches: neither counts.
        await put(bus, subjects.node_key(ghost, "n8"), forged)
        await put(bus, subjects.node_key(f"marker{uid}", "m"),
                  NodeHeartbeat(cluster=f"marker{uid}", node="m"))
        await until(lambda: board.summary(f"marker{uid}").healthy, what="the marker")
        s = board.summary(known)
        assert (s.healthy, s.gpus_usable, s.nodes_total) == (False, 0, 0)
        assert board.summary(ghost).nodes_total == 0
        assert board.view().cluster(known) is None
    finally:
        await board.stop()
    view = await fleet.read_fleet(bus)
    assert view.cluster(known) is None and view.cluster(ghost) is None
    assert await fleet.heartbeat(bus, ghost, "n9") is None


async def test_a_drain_whose_body_names_another_node_drains_the_node_of_its_key(
        bus: Bus, uid: str) -> None:
    """Stopping work is the safe side, and a worker's DrainWatch of that key says drained:
    every reader of the fleet says so too, unreadable drains included."""
    await bus.provision(core_streams())
    c = f"dr{uid}"
    drains = await bus.kv(KV_DRAINS)
    await drains.put(subjects.node_key(c, "n1"), encode(DrainRecord(
        cluster=f"other{uid}", node="x", reason="misfiled")))
    await drains.put(subjects.node_key(c, "n2"), b"\x00garbage")
    view = await fleet.read_fleet(bus)
    cluster = view.cluster(c)
    assert cluster is not None and view.cluster(f"other{uid}") is None
    assert [(n.node, n.drained) for n in cluster.nodes] == [("n1", True), ("n2", True)]
    async with ClusterBoard(bus) as board:
        assert board.summary(c).nodes_drained == 2


@pytest.mark.parametrize("skew", [-3600.0, -30.0])
async def test_a_board_starting_beside_an_agent_whose_clock_is_behind_counts_it_up(
        bus: Bus, uid: str, skew: float) -> None:
    """A gateway started (or watching again after a reconnect) just after a heartbeat was
    written: the agent's clock said 30 s, or an hour, ago."""
    await bus.provision(core_streams())
    c = f"sk{uid}"
    await put(bus, subjects.node_key(c, "n1"), NodeHeartbeat(
        cluster=c, node="n1", gpus_usable=2, at=time.time() + skew))
    async with ClusterBoard(bus, clusters=(c,)) as board:
        s = board.summary(c)
        assert (s.healthy, s.nodes_up, s.gpus_usable) == (True, 1, 2)
        view = board.view().cluster(c)
        assert view is not None
        (node,) = view.nodes
        assert node.up and node.age_s is not None and node.age_s < board.ttl


async def test_a_board_dates_a_loaded_heartbeat_by_when_the_server_stored_it(
        bus: Bus, uid: str) -> None:
    """An agent whose clock runs ahead cannot make a stale heartbeat fresh."""
    await bus.provision(core_streams())
    c = f"ahead{uid}"
    ttl = 0.3
    key = subjects.node_key(c, "n1")
    await put(bus, key, NodeHeartbeat(cluster=c, node="n1", at=time.time() + 3600))
    stored = (await entries(await bus.kv(KV_NODES)))[key].created
    assert stored is not None
    await until(lambda: time.time() - stored.timestamp() > ttl, what="older than the ttl")
    async with ClusterBoard(bus, ttl=ttl, clusters=(c,)) as board:
        s = board.summary(c)
        assert (s.healthy, s.nodes_total, s.nodes_up) == (False, 1, 0)


def test_a_heartbeat_ttl_longer_than_the_buckets_is_refused_naming_the_setting() -> None:
    with pytest.raises(SettingsError) as err:
        load(GatewaySettings, heartbeat_ttl=30)
    assert "TANDEM_HEARTBEAT_TTL" in str(err.value) and "KV nodes' (6 s)" in str(err.value)
    with pytest.raises(ValueError, match="longer than KV nodes'"):
        Router(None, ["c"], ttl=30)  # type: ignore[arg-type]
    assert load(GatewaySettings, heartbeat_ttl=HEARTBEAT_TTL / 2).heartbeat_ttl == 3
    # A worker judges other clusters' health for failover by the same bucket.
    from tandem.inference_worker.service import WorkerSettings
    with pytest.raises(SettingsError) as err:
        load(WorkerSettings, heartbeat_ttl=30)
    assert "TANDEM_HEARTBEAT_TTL" in str(err.value) and "KV nodes' (6 s)" in str(err.value)


async def test_metrics_say_a_node_down_when_routing_does_not_when_the_bucket_does(
        bus: Bus, uid: str) -> None:
    """A gateway's TANDEM_HEARTBEAT_TTL shorter than the bucket's: its router stops
    routing to a silent node's cluster, and its /metrics say so at the same time rather
    than when the bucket drops the key."""
    c = f"ttl{uid}"
    ttl = 0.5
    await bus.provision(core_streams())
    router = await Router(bus, [c], ttl=ttl, backlog_refresh=3600).start()
    try:
        await put(bus, subjects.node_key(c, "n1"), NodeHeartbeat(cluster=c, node="n1"))
        await until(lambda: router.board.summary(c).healthy, what="the heartbeat")
        await until(lambda: not router.board.summary(c).healthy, what="stale by the ttl")
        obs = Observer(bus, [c], heartbeat_ttl=ttl)
        await obs.refresh()
        # Still in the bucket after the refresh: the ttl said down, not the bucket.
        assert await fleet.heartbeat(bus, c, "n1") is not None
        text = exposed()
        assert f'tandem_node_up{{cluster="{c}",node="n1"}} 0.0' in text
        assert f'tandem_cluster_healthy{{cluster="{c}"}} 0.0' in text
        # And GET /v1/clusters, which the docs say shows health as the gateway routes on it.
        app = FastAPI()
        add_fleet_routes(app, bus, ttl)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as http:
            body = (await http.get("/v1/clusters")).json()
        (cluster,) = [x for x in body["clusters"] if x["name"] == c]
        assert cluster["healthy"] is False, cluster
    finally:
        await router.stop()


async def test_a_node_up_but_drained_in_a_healthy_cluster_reads_out_of_service(
        bus: Bus, uid: str) -> None:
    """The agent drained n1 (a GPU to replace) while n2 serves: the cluster is healthy
    and n1 is up, so only its health says it serves nothing; the rule on it fires for n1
    alone. Gone from the view, n1 reads down for the grace, then its series go."""
    await bus.provision(core_streams())
    c = f"oos{uid}"
    await put(bus, subjects.node_key(c, "n1"), NodeHeartbeat(
        cluster=c, node="n1", health=Health.drained, drained=True, gpus_total=8,
        findings=["xid-79@3"]))
    await put(bus, subjects.node_key(c, "n2"), NodeHeartbeat(
        cluster=c, node="n2", gpus_total=8, gpus_usable=8))
    await put(bus, subjects.node_key(c, "n3"), NodeHeartbeat(
        cluster=c, node="n3", health=Health.degraded, gpus_total=8, gpus_usable=8))
    clock = Clock()
    obs = Observer(bus, [c], clock=clock)
    await obs.refresh()
    text = exposed()
    assert f'tandem_cluster_healthy{{cluster="{c}"}} 1.0' in text
    assert f'tandem_node_up{{cluster="{c}",node="n1"}} 1.0' in text
    states = health_series(text, c)
    assert {k for k, v in states.items() if v == 1} == {
        ("n1", "drained"), ("n2", "healthy"), ("n3", "degraded")}
    assert len(states) == 3 * 5  # every state of every node, 0 but one

    (rule,) = [r for r in rules() if r["alert"] == "TandemNodeOutOfService"]
    wanted = re.fullmatch(r'max by \(cluster, node\) \(tandem_node_health\{state=~"([^"]+)"\}'
                          r'\) == 1', rule["expr"])
    assert wanted is not None, rule["expr"]
    firing = {n for (n, state), v in states.items() if v == 1 and re.fullmatch(wanted[1], state)}
    assert firing == {"n1"}

    await (await bus.kv(KV_NODES)).delete(subjects.node_key(c, "n1"))  # its agent died
    await obs.refresh()
    assert {k for k, v in health_series(exposed(), c).items() if v == 1} == {
        ("n1", "down"), ("n2", "healthy"), ("n3", "degraded")}
    clock.now += observe.GONE_GRACE + 1
    await obs.refresh()
    assert {n for n, _ in health_series(exposed(), c)} == {"n2", "n3"}
