"""Routing in-process against a real NATS server: heartbeats are written to KV ``nodes``
as agents write them, the gateway's API answers over ASGI."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from tandem.cli.devstack import S3Server
from tandem.common import fleet, subjects
from tandem.common.bus import Bus
from tandem.common.clusters import ClusterBoard
from tandem.common.events import Health, NodeHeartbeat, encode
from tandem.common.jobs import JobLimits
from tandem.common.models import Registry
from tandem.common.settings import Settings, load
from tandem.common.storage import s3_client
from tandem.common.streams import KV_NODES, core_streams, gen_stream
from tandem.gateway.api import create_app
from tandem.gateway.generations import Gateway
from tandem.gateway.routing import Router, RoutingError

TTL = 2.0
DEADLINE = 20.0


async def beat(bus: Bus, cluster: str, node: str = "n0", *, usable: int = 4,
               models: tuple[str, ...] = ("digits",), **fields: Any) -> None:
    hb = NodeHeartbeat(cluster=cluster, node=node, gpus_total=usable, gpus_usable=usable,
                       gpus_free=usable, models=list(models), **fields)
    await (await bus.kv(KV_NODES)).put(subjects.node_key(cluster, node), encode(hb))


async def until(cond: Callable[[], bool], timeout: float = DEADLINE) -> None:
    """Wait for ``cond`` (a read of in-memory state the KV watch keeps current)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)  # polling in-memory state fed by the KV watch


@pytest.fixture
def names(uid: str) -> list[str]:
    return [f"a{uid}", f"b{uid}", f"c{uid}"]


@pytest.fixture
async def router(bus: Bus, names: list[str]) -> AsyncIterator[Router]:
    await bus.provision([*core_streams(), *(gen_stream(c) for c in names)])
    r = await Router(bus, names, ttl=TTL, max_backlog=100, backlog_refresh=0.05).start()
    yield r
    await r.stop()


async def queue(bus: Bus, cluster: str, n: int) -> None:
    for i in range(n):
        await bus.publish(subjects.gen(cluster, "batch"), b"{}", msg_id=f"{cluster}-{i}")


async def test_a_cluster_is_healthy_only_while_an_undrained_node_has_a_fresh_heartbeat(
        bus: Bus, router: Router, names: list[str]) -> None:
    a, b, c = names
    board = router.board
    assert not board.summary(a).healthy  # never heard from: down since the board started
    await beat(bus, a)
    await beat(bus, b, health=Health.unhealthy)
    await beat(bus, c, drained=True)
    await until(lambda: board.summary(a).healthy and board.summary(c).nodes_serving == 0
                and b in board.clusters() and c in board.clusters())
    assert not board.summary(b).healthy and not board.summary(c).healthy
    # A drain record (the operator's) counts as well as the heartbeat's own flag.
    await fleet.drain(bus, a, "n0", reason="test")
    await until(lambda: not board.summary(a).healthy)
    await fleet.undrain(bus, a, "n0")
    await beat(bus, a)
    await until(lambda: board.summary(a).healthy)
    # No heartbeat within the TTL: unhealthy, and it says since when.
    await until(lambda: not board.summary(a).healthy)
    assert board.summary(a).unhealthy_since is not None


async def test_routing_prefers_the_model_then_capacity_minus_backlog_and_honours_a_pin(
        bus: Bus, router: Router, names: list[str]) -> None:
    a, b, c = names
    await beat(bus, a, usable=2, models=("tiny-text",))
    await beat(bus, b, usable=8, models=("tiny-text",))
    await beat(bus, c, usable=1, models=("digits",))
    await until(lambda: all(router.board.summary(n).healthy for n in names))
    assert router.choose(None, "digits") == c  # the only one with digits loaded
    assert router.choose(None, "tiny-text") == b  # most capacity
    assert router.choose(a, "tiny-text") == a  # a pin beats the score
    # Backlog counts against capacity: b (8 usable) with 7 queued scores under a (2).
    await queue(bus, b, 7)
    await until(lambda: router.backlog[b].depth == 7)
    assert router.choose(None, "tiny-text") == a


async def test_a_task_never_goes_to_a_cluster_known_not_to_serve_its_model(
        bus: Bus, router: Router, names: list[str]) -> None:
    """The cluster that serves the model is down: the task is refused (503, naming the
    model), not sent to a healthy cluster whose nodes announce other models only; a pin
    to such a cluster is refused the same way; a cluster announcing no models at all
    (nothing known) still takes it."""
    a, b, c = names
    await beat(bus, a, models=("digits",))
    await beat(bus, b, usable=8, models=("tiny-text",))
    await until(lambda: router.board.summary(a).healthy and router.board.summary(b).healthy)
    assert router.choose(None, "digits") == a
    await until(lambda: not router.board.summary(a).healthy)  # a's heartbeat goes stale
    await beat(bus, b, usable=8, models=("tiny-text",))
    await until(lambda: router.board.summary(b).healthy)
    for pin in (None, b):
        with pytest.raises(RoutingError) as exc:
            router.choose(pin, "digits")
        assert exc.value.status == 503 and exc.value.retry_after is not None
        assert "'digits'" in exc.value.message
    assert router.choose(None, "tiny-text") == b
    await beat(bus, c, usable=1, models=())  # nothing known about c's models
    await until(lambda: router.board.summary(c).healthy)
    assert router.choose(None, "digits") == c
    assert router.choose(c, "digits") == c


async def test_over_backlog_clusters_are_skipped_and_when_all_are_over_429(
        bus: Bus, router: Router, names: list[str]) -> None:
    a, b, _ = names
    await beat(bus, a, usable=8)
    await beat(bus, b, usable=1)
    await until(lambda: router.board.summary(a).healthy and router.board.summary(b).healthy)
    router.max_backlog = 3
    await queue(bus, a, 3)
    await until(lambda: router.backlog[a].depth == 3)
    assert router.choose(None, "digits") == b
    await queue(bus, b, 3)
    await until(lambda: router.backlog[b].depth == 3)
    with pytest.raises(Exception) as exc:
        router.choose(None, "digits")
    assert getattr(exc.value, "status", None) == 429


@pytest.fixture
async def api(bus: Bus, names: list[str],
              s3_server: S3Server) -> AsyncIterator[tuple[httpx.AsyncClient, Router]]:
    await bus.provision([*core_streams(), *(gen_stream(c) for c in names)])
    # Depths read once at the start; after that only what this gateway routes counts.
    router = await Router(bus, names, ttl=TTL, max_backlog=3, backlog_refresh=3600).start()
    s3 = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                        s3_secret_key="tandem"))
    gw = Gateway(bus, Registry.parse(""), names, s3=s3, bucket="b", url_ttl=60,
                 publish_retry_for=1.0,
                 limits=JobLimits(max_images=4, max_prompt_chars=100, max_size=512),
                 router=router)
    await gw.start()
    asgi, _ = create_app(gw, max_body_bytes=4096)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi),
                                 base_url="http://gw") as client:
        yield client, router
    await gw.stop()
    await router.stop()


async def test_no_healthy_cluster_is_503_and_all_over_backlog_is_429_with_retry_after(
        api: tuple[httpx.AsyncClient, Router], bus: Bus, names: list[str]) -> None:
    http, router = api
    a = names[0]
    body = {"model": "digits", "class_label": 1}
    r = await http.post("/v1/generations", json=body)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert "no healthy cluster" in r.json()["detail"]
    r = await http.post("/v1/generations", json={**body, "cluster": a})
    assert r.status_code == 503 and "not healthy" in r.json()["detail"]
    r = await http.post("/v1/generations", json={**body, "cluster": "mars"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "cluster"]
    await beat(bus, a)
    await until(lambda: router.board.summary(a).healthy)
    accepted = []
    for _ in range(10):  # routed tasks count at once, before the next queue depth read
        r = await http.post("/v1/generations", json=body)
        if r.status_code != 202:
            break
        accepted.append(r.json()["cluster"])
    assert accepted == [a] * 3  # max_backlog
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "at least 3 tasks queued" in r.json()["detail"]


async def test_cluster_board_reads_cost_o_clusters_not_o_nodes(bus: Bus, uid: str) -> None:
    """Many nodes in few clusters: a summary is a sum kept by the watch, not a scan."""
    await bus.provision(core_streams())
    async with ClusterBoard(bus, ttl=30.0) as board:
        kv = await bus.kv(KV_NODES)
        for i in range(200):
            hb = NodeHeartbeat(cluster=f"x{uid}", node=f"n{i}", gpus_usable=8,
                               models=["digits"] if i % 2 else [])
            await kv.put(subjects.node_key(f"x{uid}", f"n{i}"), encode(hb))
        await until(lambda: board.summary(f"x{uid}").nodes_serving == 200)
        s = board.summary(f"x{uid}")
        assert s.gpus_usable == 1600 and s.models == frozenset({"digits"})
        await kv.delete(subjects.node_key(f"x{uid}", "n1"))
        await until(lambda: board.summary(f"x{uid}").nodes_serving == 199)
        assert board.summary(f"x{uid}").models == frozenset({"digits"})
        # A new heartbeat replaces the node's old contribution, not adds to it.
        for i in range(3, 200, 2):
            hb = NodeHeartbeat(cluster=f"x{uid}", node=f"n{i}", gpus_usable=4)
            await kv.put(subjects.node_key(f"x{uid}", f"n{i}"), encode(hb))
        await until(lambda: not board.summary(f"x{uid}").models)
        assert board.summary(f"x{uid}").gpus_usable == 100 * 8 + 99 * 4


async def test_draining_one_node_keeps_its_cluster_queue_home_and_draining_all_hands_it_over(
        bus: Bus, uid: str) -> None:
    """The drain semantics of docs/failover.md, decided by the worker's own ``Failover``:
    a cluster with one node drained still serves its queue with its other nodes, so no
    other cluster adopts it; a cluster whose every node is drained serves nothing, so its
    backlog is handed over after the grace period, and taken back when it is undrained."""
    from tandem.inference_worker.failover import Failover

    home, west = f"e{uid}", f"w{uid}"
    await bus.provision([*core_streams(), gen_stream(home), gen_stream(west)])
    grace = 2.0
    east = Failover(bus, [home], [], lambda spec: None, grace=grace, ttl=30.0,  # type: ignore[arg-type, return-value]
                    candidates=[west])
    board = east.board
    await board.start()
    try:
        await beat(bus, home)
        await beat(bus, west, "n0")
        await beat(bus, west, "n1")
        await until(lambda: board.summary(home).healthy
                    and board.summary(west).nodes_serving == 2)
        # Judged as of well past the grace period, so no clock races the assertion.
        later = lambda: time.monotonic() + grace + 5  # noqa: E731
        await fleet.drain(bus, west, "n0", reason="one node out")
        await until(lambda: board.summary(west).nodes_drained == 1)
        assert board.summary(west).healthy and board.summary(west).nodes_serving == 1
        assert east.wanted(later()) == []  # n1 still serves west's queue
        await fleet.drain(bus, west, "n1", reason="whole cluster out")
        await until(lambda: board.summary(west).nodes_drained == 2)
        since = board.summary(west).unhealthy_since
        assert since is not None
        assert east.wanted(since + grace / 2) == []  # not before the grace period
        assert east.wanted(later()) == [west]
        await fleet.undrain(bus, west, "n1")
        await until(lambda: board.summary(west).healthy)
        assert east.wanted(later()) == []  # back home once a node serves it again
    finally:
        await board.stop()
