"""Accounts per cluster in the leaf topology: a real hub (3 servers) with one NATS
account per GPU cluster and one for the control plane, each leaf bound to its cluster's
account (``tandem.common.accounts``). What east's leaf lets east do to west is measured
here against the servers themselves; failover across accounts on the whole stack."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NoStreamResponseError

from tandem.cli.bench.failover import Drill, stack_config
from tandem.cli.stack import Stack
from tandem.cli.topology import Topology
from tandem.common import accounts, permissions, streams, subjects
from tandem.common.bus import Bus
from tandem.common.events import GenerationTask, TaskState
from tandem.common.settings import Settings, load
from tests.conftest import ROOT

CLUSTERS = ["east", "west"]
DEADLINE = 90.0
REFUSED = (NoStreamResponseError, NoRespondersError, NatsTimeout)


# ------------------------------------------------------------------------------ the config


def test_accounts_follow_the_permissions_declaration() -> None:
    """Imports come from the roles that run in a cluster, narrowed to that cluster."""
    east = {i.subject: i for i in accounts.imports(CLUSTERS, "east")}
    assert {"telemetry.east.*", "health.east.*", "$KV.nodes.east.>"} <= set(east)
    assert not any(".west." in s or s.startswith("$KV.nodes.west") for s in east)
    # nothing that provisions, deletes, purges or walks the tasks bucket
    assert not any(t in s for s in east for t in ("STREAM.CREATE.", ".DELETE.", ".PURGE.",
                                                  "CONSUMER.CREATE.KV_tasks", "MSG.GET.KV_tasks"))
    assert f"{permissions.API}.DIRECT.GET.KV_tasks" not in east  # by sequence: no
    # failover: east may pull (not create) west's lanes
    nxt = east[f"{permissions.API}.CONSUMER.MSG.NEXT.GEN_WEST.workers-west-batch"]
    assert nxt.response == "stream" and nxt.to == f"{accounts.JS_API}.CONSUMER.MSG.NEXT." \
        "GEN_WEST.workers-west-batch"
    # A task's record is written through the control plane; cancels are watched there.
    assert east["$KV.tasks.>"].kind == "service"
    assert east["$KV.tasks.>"].to == f"{accounts.JS_API}.$KV.tasks.>"
    assert east[f"{permissions.API}.CONSUMER.CREATE.KV_cancels"].kind == "service"
    assert not any(s.startswith("$KV.cancels") for s in east)  # read, never written
    assert east["_INBOX_east.>"].kind == "stream"
    assert "models.east.*" in east and east["models.east.*"].kind == "service"
    for role in accounts.CLUSTER_ROLES:  # every grant of theirs is imported, or provisioning
        for p in permissions.declaration(CLUSTERS, home="east")[role].publish:
            assert p.startswith(f"{permissions.API}.STREAM.CREATE.") or any(
                accounts.covers(s, p) for s in east), p


def test_deploy_accounts_conf_is_generated_valid_and_what_compose_leaf_mounts(
        tmp_path: Path) -> None:
    assert (ROOT / "deploy/nats/accounts.conf").read_text() == accounts.compose_config()
    leaf = (ROOT / "compose.leaf.yaml").read_text()
    for n in (1, 2, 3):
        assert f"nats-{n}: {{ <<: *hub" in leaf
    assert '"./deploy/nats/accounts.conf:/etc/nats/auth.conf:ro"' in leaf
    # compose.leaf.yaml's hub has every user's password (compose.yaml's and its own), or
    # nats-server stops at start on the variable it cannot find
    for user in accounts.users(CLUSTERS):
        assert f"{permissions.password_env(user)}:" in (ROOT / "compose.yaml").read_text() \
            + leaf, user
    # cluster.conf with accounts.conf as its auth.conf, as compose.leaf.yaml runs it
    shutil.copy(ROOT / "deploy/nats/cluster.conf", tmp_path / "cluster.conf")
    shutil.copy(ROOT / "deploy/nats/accounts.conf", tmp_path / "auth.conf")
    env = {**os.environ, "SERVER_NAME": "nats-1",
           **{permissions.password_env(u): f"pw-{u}" for u in accounts.users(CLUSTERS)}}
    nats_server = str(Path(sys.executable).parent / "nats-server")
    check = subprocess.run([nats_server, "-c", str(tmp_path / "cluster.conf"), "-t"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr + check.stdout
    # and the hub config the local topology writes, passwords inline
    conf = tmp_path / "hub.conf"
    conf.write_text('jetstream { store_dir: "js", domain: hub }\n'
                    'leafnodes { listen: "127.0.0.1:-1" }\n'
                    + accounts.accounts_config(CLUSTERS, {u: "pw" for u in
                                                          accounts.users(CLUSTERS)}))
    check = subprocess.run([nats_server, "-c", str(conf), "-t"], capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, check.stderr + check.stdout


# ------------------------------------------------------------------------------ the servers


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    topo = Topology(tmp_path_factory.mktemp("accounts"), CLUSTERS, accounts=True).start()
    yield topo
    topo.stop()


@pytest.fixture
async def admin(topology: Topology) -> AsyncIterator[Bus]:
    bus = await Bus.connect(load(Settings, nats_url=topology.hub_url, nats_user="admin",
                                 nats_password=topology.passwords["admin"]), "test-admin")
    await bus.provision([*streams.core_streams(), *streams.cluster_streams(CLUSTERS)])
    yield bus
    await bus.drain()


@pytest.fixture
async def east(topology: Topology, admin: Bus) -> AsyncIterator[Bus]:
    """A process behind east's leaf, as east's agents and workers connect."""
    bus = await Bus.connect(load(Settings, cluster="east", **topology.env_for("east")),
                            "test-east")
    yield bus
    await bus.drain()


def test_each_leaf_is_bound_to_its_clusters_account(topology: Topology) -> None:
    assert topology.hub is not None
    leafs = []
    for srv in topology.hub.servers:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.monitor_port}/leafz",
                                    timeout=5) as resp:
            leafs += json.load(resp).get("leafs") or []
    assert sorted((lf["account"], lf["name"]) for lf in leafs) == [
        ("cluster-east", "leaf-east"), ("cluster-west", "leaf-west")]


async def test_sys_gets_every_hub_server_s_jetstream_report_and_a_tandem_user_none(
        topology: Topology) -> None:
    """The leaf topology's hub (as `tandem dev up --topology leaf --auth` runs it) has the
    generated system account: its user sys, whose password is generated with the others',
    gets a JetStream report from each hub server (``$SYS.REQ.SERVER.PING.JSZ``, what `nats
    server report jetstream` asks); admin, who may publish anything in the control
    plane's account, reaches no server's."""
    assert topology.hub is not None
    servers = {srv.name for srv in topology.hub.servers}
    nc = await nats.connect(topology.hub_url.split(","), user="sys",
                            password=topology.passwords["sys"], allow_reconnect=False)
    try:
        reports: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_report(msg: Any) -> None:
            await reports.put(json.loads(msg.data))

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=on_report)
        await nc.publish("$SYS.REQ.SERVER.PING.JSZ", b"{}", reply=inbox)
        answered: set[str] = set()
        while answered != servers:
            report = await asyncio.wait_for(reports.get(), DEADLINE)
            assert report["data"]["config"]["domain"] == "hub", report
            answered.add(report["server"]["name"])
    finally:
        await nc.close()
    admin = await nats.connect(topology.hub_url.split(","), user=permissions.ADMIN,
                               password=topology.passwords[permissions.ADMIN],
                               allow_reconnect=False)
    try:
        with pytest.raises(NoRespondersError):
            await admin.request("$SYS.REQ.SERVER.PING.JSZ", b"{}", timeout=DEADLINE)
    finally:
        await admin.close()


async def test_a_clusters_credentials_cannot_publish_on_another_clusters_subjects(
        admin: Bus, east: Bus, uid: str) -> None:
    """East's leaf: no JetStream publish to west's queue, telemetry, health or heartbeat
    keys is stored, and no core publish on them reaches the control plane; east's own
    subjects work on the same connection."""
    heard: list[str] = []
    own = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        heard.append(msg.subject)
        if msg.subject == subjects.telemetry("east", uid):
            own.set()

    subs = [await admin.nc.subscribe(s, cb=on_msg)
            for s in ("gen.west.>", "telemetry.>", "health.>", "$KV.nodes.west.>")]
    await admin.synced()
    task = GenerationTask(task_id=f"t{uid}", model="noop", cluster="west", steps=1, noop=True)
    for subject, data in ((subjects.gen("west", "batch"), task),
                          (subjects.gen("west", "interactive"), task),
                          (subjects.telemetry("west", uid), b"{}"),
                          (subjects.health("west", uid), b"{}")):
        with pytest.raises(REFUSED):
            await east.publish(subject, data, timeout=1)
        await east.emit(subject, b"{}")  # core NATS: goes nowhere
    nodes = await east.kv(streams.KV_NODES)
    with pytest.raises(REFUSED):
        await nodes.put(subjects.node_key("west", uid), b"forged heartbeat")
    # what east may do, after the refusals, on the same connection
    ack = await east.publish(subjects.telemetry("east", uid), b"{}")
    assert ack.stream == streams.TELEMETRY
    await east.emit(subjects.telemetry("east", uid), b"{}")
    await nodes.put(subjects.node_key("east", uid), b"own heartbeat")
    await asyncio.wait_for(own.wait(), 10)
    for sub in subs:
        await sub.unsubscribe()
    assert [s for s in heard if ".west." in s] == []
    for name in ("GEN_WEST", streams.HEALTH):
        assert (await admin.js.stream_info(name)).state.messages == 0, name
    info = await admin.js.stream_info(streams.TELEMETRY, subjects_filter="telemetry.west.>")
    assert not info.state.subjects
    hub_nodes = await admin.kv(streams.KV_NODES)
    assert (await hub_nodes.get(subjects.node_key("east", uid))).value == b"own heartbeat"
    with pytest.raises(Exception, match="not found"):
        await hub_nodes.get(subjects.node_key("west", uid))


async def test_a_cluster_cannot_walk_the_tasks_or_read_another_clusters_queue(
        admin: Bus, east: Bus, uid: str) -> None:
    """Task records carry no cluster in their key, and a failover worker must read and
    write the records of the tasks it adopts, so east may get a record by its id; it
    may not list, watch or page through the bucket, read west's queue by sequence, make
    a consumer of its own on it, or purge or delete anything."""
    tasks = await admin.kv(streams.KV_TASKS)
    await tasks.put(f"west{uid}", b"west's record")
    task = GenerationTask(task_id=f"q{uid}", model="noop", cluster="west", steps=1, noop=True)
    await admin.publish(subjects.gen("west", "batch"), task)
    js = accounts.JS_API
    walk = json.dumps({"seq": 1}).encode()
    spy = json.dumps({"stream_name": "GEN_WEST", "config": {
        "name": "spy", "filter_subject": "gen.west.batch", "ack_policy": "none"}}).encode()
    for subject, body in (
            (f"{js}.CONSUMER.CREATE.KV_tasks", b"{}"),  # a watch, or keys()
            (f"{js}.STREAM.MSG.GET.KV_tasks", walk),  # by sequence
            (f"{js}.DIRECT.GET.KV_tasks", walk),
            (f"{js}.STREAM.INFO.TRAIN", b""),  # another role's stream
            (f"{js}.STREAM.MSG.GET.GEN_WEST", walk),
            (f"{js}.DIRECT.GET.GEN_WEST", walk),
            (f"{js}.CONSUMER.CREATE.GEN_WEST", spy),
            (f"{js}.CONSUMER.CREATE.GEN_WEST.spy.gen.west.batch", spy),
            (f"{js}.STREAM.PURGE.GEN_WEST", b""),
            (f"{js}.STREAM.DELETE.KV_tasks", b""),
            (f"{js}.STREAM.CREATE.SPY", json.dumps({"name": "SPY",
                                                    "subjects": ["gen.progress.*"]}).encode())):
        with pytest.raises(NoRespondersError):
            await east.nc.request(subject, body, timeout=2)
    # what holds by design: a record by its id (the worker's read before its first move)
    assert (await (await east.kv(streams.KV_TASKS)).get(f"west{uid}")).value == b"west's record"
    info = await admin.js.stream_info("GEN_WEST")
    assert info.state.messages == 1 and info.state.consumer_count == 2
    [msg] = await (await admin.js.pull_subscribe_bind(
        durable="workers-west-batch", stream="GEN_WEST")).fetch(1, timeout=5)
    await msg.ack_sync()


async def test_a_control_plane_service_of_the_release_before_gets_its_replies(
        topology: Topology, admin: Bus, uid: str) -> None:
    """Rolling the hub's accounts first: the gateway, trainer and checkpointer of the
    release before take their replies on ``_INBOX`` and must go on reading KV
    (transitional, ``permissions.LEGACY_REPLIES``); no cluster account imports ``_INBOX``
    for it (a cluster's processes have their own prefix)."""
    await (await admin.kv(streams.KV_RUNS)).put(f"r{uid}", b"kept")
    for role in ("gateway", "trainer", "checkpointer"):
        old = await Bus.connect(load(Settings, nats_url=topology.hub_url, nats_user=role,
                                     nats_password=topology.passwords[role],
                                     nats_inbox_prefix="_INBOX"),
                                f"old-{role}", allow_reconnect=False)
        try:
            assert old.nc.new_inbox().startswith("_INBOX."), role
            assert (await (await old.kv(streams.KV_RUNS)).get(f"r{uid}")).value == b"kept"
        finally:
            await old.drain()
    for cluster in CLUSTERS:
        assert not [i for i in accounts.imports(CLUSTERS, cluster)
                    if i.subject.startswith("_INBOX.")], cluster


# ------------------------------------------------------------------- tandem dev up --auth


TTL, GRACE, ACK_WAIT = 2.0, 1.0, 3.0


def test_dev_up_leaf_with_auth_serves_and_fails_over_across_accounts(tmp_path: Path) -> None:
    """``tandem dev up --topology leaf --auth``: gateway on the hub as its role's user,
    each cluster's agent and worker behind its leaf in its own account. West serves its
    own task; with west killed, east's worker drains the task stranded in west's queue
    (pulling west's lane through east's account) and it succeeds once."""
    config = stack_config(ttl=TTL, grace=GRACE, agent_interval=0.25, ack_wait=ACK_WAIT)
    with open(tmp_path / "stack.log", "w") as sink, Stack(
            config, tmp_path / "stack", sink, grace=5.0, auth=True, topology="leaf") as stack:
        health = stack.start(health_timeout=120)
        assert set(health.values()) == {"healthy"}, health
        topo = stack.topology
        assert topo is not None and topo.accounts
        for child in stack.children.values():
            env = child.spec.env
            if child.spec.cluster in CLUSTERS:
                assert env["TANDEM_NATS_URL"] == topo.leaf(child.spec.cluster).url
                assert env["TANDEM_NATS_INBOX_PREFIX"] == f"_INBOX_{child.spec.cluster}"
                assert "TANDEM_NATS_USER" not in env or not env["TANDEM_NATS_USER"]
            else:
                assert env["TANDEM_NATS_USER"] == child.spec.service
        asyncio.run(_serve_then_fail_over(stack))
    logs = tmp_path / "stack" / "logs"
    for log in logs.glob("*.log"):
        assert "permission_denied" not in log.read_text(), log.name
    for log in (tmp_path / "stack" / "nats").rglob("*.log"):
        assert "Violation" not in log.read_text(), log.name


async def _serve_then_fail_over(stack: Stack) -> None:
    async with Drill(stack) as d:
        await d.ready(DEADLINE)
        own = (await d.submit(cluster="west"))["id"]
        assert (await d.terminal([own], DEADLINE))[own].worker == "west-w0"
        stack.kill("west")
        assert d.bus is not None
        # Queued on west as if accepted just before it died (the gateway now refuses a pin
        # to west): nobody of west is left to pull it.
        task = GenerationTask(task_id=f"stranded{time.time_ns()}", model="noop",
                              cluster="west", steps=1, noop=True)
        await d.bus.publish(subjects.gen("west", "interactive"), task, msg_id=task.task_id)
        rec = (await d.terminal([task.task_id], DEADLINE))[task.task_id]
        assert rec.state == TaskState.succeeded and rec.worker == "east-w0", rec
        counts = await d.results([task.task_id])
        assert counts[task.task_id] == 1
