"""The production topology on loopback: a control-plane JetStream cluster holding every
stream and KV bucket, and one leaf-node server per GPU cluster through which that
cluster's services reach it. Real nats-servers, a real gateway and real workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.common import streams, subjects
from tandem.common.bus import Bus
from tandem.common.errors import ServerStartError
from tandem.common.events import TaskRecord, TaskState, decode
from tandem.common.servers import LeafNode, S3Server, Topology, free_port
from tandem.common.settings import Settings, load
from tandem.common.streams import GEN_EVENTS, KV_NODES, KV_TASKS
from tests.serving_stack import Child, count_on, gateway, worker

CLUSTERS = ["east", "west"]
DEADLINE = 90.0
ACK_WAIT = 2.0  # what a task delivered into a dead leaf waits before redelivery


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    topo = Topology(tmp_path_factory.mktemp("topology"), CLUSTERS).start()
    yield topo
    topo.stop()


async def connect(topo: Topology, cluster: str | None, name: str) -> Bus:
    values = topo.env_for(cluster)
    return await Bus.connect(load(Settings, cluster=cluster or "control", **values), name)


@pytest.fixture
async def hub(topology: Topology) -> AsyncIterator[Bus]:
    bus = await connect(topology, None, "test-hub")
    await bus.provision([*streams.core_streams(),
                         *(s for c in CLUSTERS for s in (streams.gen_stream(c),
                                                         *streams.gen_consumers(c, ACK_WAIT)))])
    yield bus
    await bus.drain()


# ------------------------------------------------------------------------------ the wiring


def test_leaf_node_without_hub_urls_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match="leaf-node URLs"):
        LeafNode(name="leaf-x", log_path=tmp_path / "leaf.log").start()


async def test_services_behind_a_leaf_use_the_control_planes_streams_and_kv(
        topology: Topology, hub: Bus, uid: str) -> None:
    """Streams and KV live only in the hub; a leaf client reads and writes them through
    the hub's JetStream domain: publish with ack, KV put/create/compare-and-set/delete,
    watch, and a pull consumer with acks."""
    assert [s.name for s in topology.servers] == ["n0", "n1", "n2", "leaf-east", "leaf-west"]
    leaf = await connect(topology, "east", "test-leaf")
    try:
        ack = await leaf.publish(subjects.telemetry("east", f"n{uid}"), b"{}")
        assert ack.stream == streams.TELEMETRY and ack.domain == topology.domain
        kv = await leaf.kv(KV_NODES)
        key = subjects.node_key("east", f"n{uid}")
        watcher = await (await hub.kv(KV_NODES)).watch(key)
        await kv.put(key, b"one")
        rev = await kv.update(key, b"two", last=await kv.put(key, b"one-b"))
        assert (await (await hub.kv(KV_NODES)).get(key)).value == b"two"
        seen = []
        async with asyncio.timeout(10):
            async for entry in watcher:
                if entry is not None:
                    seen.append(entry.value)
                if entry is not None and entry.revision == rev:
                    break
        await watcher.stop()
        assert seen[-1] == b"two"
        await kv.delete(key)
        # A work queue drained through the leaf: fetched and acked there, gone from the hub.
        await hub.publish(subjects.gen("east", "batch"), b'{"task_id":"x"}')
        sub = await leaf.js.pull_subscribe_bind(durable="workers-east-batch",
                                                 stream=subjects.gen_stream_name("east"))
        [msg] = await sub.fetch(1, timeout=10)
        await msg.ack_sync()
        await sub.unsubscribe()
        info = await hub.js.stream_info(subjects.gen_stream_name("east"))
        assert info.state.messages == 0
    finally:
        await leaf.drain()


# ------------------------------------------------------------------------------ leaf loss


class Results:
    """Task ids whose ``gen.status`` said succeeded, seen on the hub as they happen."""

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.changed = asyncio.Event()

    async def on_status(self, msg: Any) -> None:
        if b'"succeeded"' in msg.data:
            self.done.add(msg.subject.rsplit(".", 1)[-1])
            self.changed.set()

    async def wait(self, ids: set[str] | list[str], what: str,
                   timeout: float = DEADLINE) -> None:
        want = set(ids)
        try:
            async with asyncio.timeout(timeout):
                while not want <= self.done:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            missing = sorted(want - self.done)
            raise AssertionError(f"{what}: {len(missing)} of {len(want)} not done in "
                                 f"{timeout:g}s, e.g. {missing[:3]}") from None


class Load:
    """Submits no-op tasks to east and west in turn through the gateway, until stopped."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.sent: dict[str, list[str]] = {c: [] for c in CLUSTERS}
        self.stop = asyncio.Event()
        self.errors: list[str] = []
        self.sent_one = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            for cluster in CLUSTERS:
                r = await self.http.post("/v1/generations",
                                         json={"model": "noop", "cluster": cluster})
                if r.status_code != 202:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                self.sent[cluster].append(r.json()["id"])
                self.sent_one.set()
            await asyncio.sleep(0.02)  # load pacing (~100 tasks/s), not synchronisation

    def mark(self) -> dict[str, int]:
        return {c: len(ids) for c, ids in self.sent.items()}

    async def more(self, cluster: str, after: dict[str, int], n: int) -> list[str]:
        """Wait (bounded) until ``n`` more tasks went to ``cluster`` after ``after``."""
        async with asyncio.timeout(DEADLINE):
            while len(self.sent[cluster]) < after[cluster] + n:
                self.sent_one.clear()
                await self.sent_one.wait()
        return self.sent[cluster][after[cluster]:after[cluster] + n]


@dataclass
class Services:
    children: dict[str, Child]  # "gateway" and one worker per cluster
    url: str  # the gateway's


@pytest.fixture
def services(topology: Topology, s3_server: S3Server, tmp_path: Path) -> Iterator[Services]:
    common = {"s3_endpoint": s3_server.url, "s3_bucket": "topology", "s3_access_key": "tandem",
              "s3_secret_key": "tandem", "log_level": "warning"}
    port = free_port()
    children = {
        "gateway": gateway(tmp_path, "gateway", port, cluster="control", clusters="east,west",
                           **topology.env_for(None), **common),
        **{c: worker(tmp_path, f"w-{c}", cluster=c, node="node-0", serve="noop",
                     ack_wait=str(ACK_WAIT), idle_poll="0.2", **topology.env_for(c), **common)
           for c in CLUSTERS},
    }
    try:
        for child in children.values():
            child.start()
        children["gateway"].wait_healthy(url=f"http://127.0.0.1:{port}/healthz")
        for c in CLUSTERS:
            children[c].wait_healthy(lambda h: bool(h.get("models_loaded")))
        yield Services(children, f"http://127.0.0.1:{port}")
    finally:
        for child in children.values():
            child.kill()


async def test_killed_leaf_loses_no_task_and_the_other_cluster_keeps_serving(
        topology: Topology, hub: Bus, services: Services) -> None:
    results = Results()
    sub = await hub.nc.subscribe(subjects.GEN_STATUS.wildcard, cb=results.on_status)
    east_leaf = topology.leaf("east")
    async with httpx.AsyncClient(base_url=services.url, timeout=30) as http:
        load = Load(http)
        loading = asyncio.create_task(load.run())
        try:
            # Both clusters serve through their leaves.
            start = {c: 0 for c in CLUSTERS}
            await results.wait([*await load.more("east", start, 20),
                                *await load.more("west", start, 20)], "before the kill")

            east_leaf.kill()  # SIGKILL, under load: east's workers lose their server
            at_kill = load.mark()
            queued_east = await load.more("east", at_kill, 20)
            # West keeps serving while east's leaf is down...
            await results.wait(await load.more("west", at_kill, 40), "west during the outage")
            # ... and east's new tasks wait in the hub's stream, not lost with the leaf.
            assert not east_leaf.running
            assert not results.done & set(queued_east)
            backlog = await hub.js.stream_info(subjects.gen_stream_name("east"))
            assert backlog.state.messages >= len(queued_east)

            east_leaf.restart()  # same port: the same worker process reconnects
            await results.wait(queued_east, "east's backlog after the leaf returned")
            await results.wait(await load.more("east", load.mark(), 20), "east after return")
        finally:
            load.stop.set()
            await loading
    await sub.unsubscribe()

    assert load.errors == []  # the gateway accepted every task throughout
    sent = {c: ids for c, ids in load.sent.items()}
    every = [i for ids in sent.values() for i in ids]
    await results.wait(every, "every accepted task")
    tasks = await hub.kv(KV_TASKS)
    for cluster, ids in sent.items():
        for task_id in ids:
            rec = decode((await tasks.get(task_id)).value, TaskRecord)
            assert rec.state == TaskState.succeeded and rec.cluster == cluster, rec
            assert rec.worker == f"w-{cluster}"  # the one worker, reconnected, not replaced
    # Exactly one result each (redelivered tasks republish under the same msg id).
    assert await count_on(hub, GEN_EVENTS, subjects.GEN_RESULT.wildcard) == len(every)
    assert services.children["east"].running  # reconnected, never restarted
