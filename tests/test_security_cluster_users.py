"""A NATS user per GPU cluster for the roles on its training nodes, and a password rotated
with no outage, against a real nats-server running the generated config.

Every training node of a cluster holds its trainer's and checkpointer's passwords, so
those users are per cluster (``permissions.cluster_users``): an east node's credentials
are refused on west's orders, reports, health, mirror orders, heartbeats, durable and
replies, and still do an east trainer's whole job (the last test runs a training run to
its committed checkpoint with the real coordinator, node agent and checkpointer logged
in as east's users). What no grant can narrow (run ids, MIRROR's durables) is asserted
as it holds, as docs/security.md states it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
import structlog
from nats.errors import TimeoutError as NatsTimeout

from tandem.cli.devstack import NatsServer, S3Server, logged_metrics_port
from tandem.cli.stack import Stack
from tandem.cli.stack_config import StackConfig
from tandem.common import accounts, permissions, streams, subjects
from tandem.common.bus import Bus
from tandem.common.events import RunState
from tandem.common.runs import submit_run
from tandem.common.settings import Settings, load
from tests.conftest import PYTHON, service_env
from tests.test_security_nats import allowed, cli_config, until
from tests.test_train_runs import finished, stop_process, tiny
from tests.test_train_runs import until as until_run

CLUSTERS = ["east", "west"]
TIMEOUT = 20


# ---------------------------------------------------------------------------- the declaration


def test_a_clusters_users_grants_name_only_their_cluster_where_the_layout_lets_them() -> None:
    users = permissions.users(CLUSTERS)
    trainer, ckpt = users["trainer-east"], users["checkpointer-east"]
    assert trainer.name == permissions.cluster_user("trainer", "east")
    # west's (and the control plane's) orders, reports, mirror orders, durable, heartbeats
    for subject in ("trainer.node.west.n0", "trainer.report.west.r1", "mirror.west.n0",
                    "$JS.API.CONSUMER.MSG.NEXT.TRAIN.trainer-west",
                    "$JS.API.CONSUMER.DURABLE.CREATE.TRAIN.trainer-west",
                    "$JS.API.CONSUMER.MSG.NEXT.TRAIN.trainer-control",
                    "$JS.ACK.TRAIN.trainer-west.1.1.1.1.1",
                    "$JS.API.DIRECT.GET.KV_nodes.$KV.nodes.west.n0",
                    "$JS.API.CONSUMER.CREATE.KV_nodes",  # a watch of every node
                    "$KV.nodes.east.n0"):
        assert not allowed(trainer.publish, subject), subject
    for subject in ("health.west.n0", "trainer.node.west.n0", "trainer.report.west.r1",
                    "_SERVICE_INBOX.trainer.x", "_SERVICE_INBOX_trainer-west.x", "_INBOX.x"):
        assert not allowed(trainer.subscribe, subject), subject
    for subject in ("trainer.node.east.n0", "trainer.report.east.r1", "mirror.east.n0",
                    "train.r1.status", "$KV.runs.r1", "dlq.TRAIN",
                    "$JS.API.CONSUMER.MSG.NEXT.TRAIN.trainer-east",
                    "$JS.API.DIRECT.GET.KV_nodes.$KV.nodes.east.n0"):
        assert allowed(trainer.publish, subject), subject
    for subject in ("health.east.n0", "trainer.node.east.n0", "trainer.report.east.r1",
                    "_SERVICE_INBOX_trainer-east.x"):
        assert allowed(trainer.subscribe, subject), subject
    assert trainer.may_provision(streams.trainer_consumer("east"))
    assert not trainer.may_provision(streams.trainer_consumer("west"))
    assert ckpt.may_provision(streams.checkpointer_consumer(cluster="east", node="n0"))
    assert not ckpt.may_provision(streams.checkpointer_consumer(cluster="west", node="n0"))
    assert not ckpt.may_provision(streams.checkpointer_consumer())  # the fleet's
    for subject in ("_SERVICE_INBOX.checkpointer.x", "_SERVICE_INBOX_checkpointer-west.x",
                    "_INBOX.x"):
        assert not allowed(ckpt.subscribe, subject), subject
    # What no grant can narrow (docs/security.md): a run's events and record are keyed by
    # its id, and a per-node durable's name holds its cluster inside one token.
    assert allowed(trainer.publish, "train.west1.status")
    assert allowed(trainer.publish, "$KV.runs.west1") and allowed(ckpt.publish, "$KV.runs.w1")
    assert allowed(ckpt.publish, "ckpt.west1.mirrored")
    assert allowed(ckpt.publish, "$JS.API.CONSUMER.MSG.NEXT.MIRROR.checkpointer-west-n0")
    # Each is a user of the generated configs: compose's and the hub's accounts.
    conf = permissions.compose_config()
    accounts_conf = accounts.compose_config()
    for c in CLUSTERS:
        for role in permissions.CLUSTER_USER_ROLES:
            user = permissions.cluster_user(role, c)
            assert conf.count(f'user: "{user}"') == 1, user
            assert f"password: ${permissions.password_env(user)}\n" in conf, user
            assert accounts_conf.count(f'user: "{user}"') == 1, user
            assert user in accounts.users(CLUSTERS)


def test_a_rotation_login_has_the_grants_of_the_user_it_replaces_and_its_own_replies() -> None:
    users = permissions.users(CLUSTERS)
    out = permissions.with_logins(users, {"trainer-east-2": "trainer-east",
                                          "gateway-2": "gateway", "client-2": "client"},
                                  drop=["trainer-east"])
    assert "trainer-east" not in out and "trainer-east-2" in out
    for new, old in (("trainer-east-2", "trainer-east"), ("gateway-2", "gateway")):
        assert out[new].publish == users[old].publish
        assert (set(out[new].subscribe) - set(users[old].subscribe)
                == {f"{permissions.own_inbox(new)}.>"})
        assert not allowed(out[new].subscribe, "_INBOX.x")  # a new login: no legacy grant
    assert out["client-2"].subscribe == users["client"].subscribe  # programs use _INBOX
    for add, drop, said in (({"gateway": "admin"}, (), "login 'gateway' is already a user"),
                            ({"x": "trainer-eats"}, (), "no user 'trainer-eats' to copy"),
                            ({}, ["trainer-eats"], "no user 'trainer-eats' to drop")):
        with pytest.raises(ValueError, match=said):
            permissions.with_logins(users, add, drop)
    conf = accounts.accounts_config(CLUSTERS, add={"leaf-east-2": "leaf-east",
                                                   "trainer-east-2": "trainer-east"},
                                    drop=["leaf-east", "trainer-east"])
    assert 'users: [ { user: "leaf-east-2", password: $TANDEM_NATS_PASSWORD_LEAF_EAST_2 } ]' \
        in conf
    assert 'user: "trainer-east-2"' in conf and 'user: "trainer-east"' not in conf
    with pytest.raises(ValueError, match="login 'leaf-west' is already a user"):
        accounts.accounts_config(CLUSTERS, add={"leaf-west": "leaf-east"})
    # two users whose passwords would come from one variable: refused, naming both
    twins = permissions.with_logins(users, {"trainer-east_2": "trainer",
                                            "trainer-east-2": "trainer"})
    with pytest.raises(ValueError, match="'trainer-east-2' and 'trainer-east_2' would both "
                       r"read their password from \$TANDEM_NATS_PASSWORD_TRAINER_EAST_2"):
        permissions.nats_config(twins)


def test_the_cli_generates_a_rotation_with_add_login_and_drop(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """docs/security.md's rotation by the CLI: ``--add-login B=A`` and ``--drop A`` give
    what ``with_logins`` and ``accounts_config(add=, drop=)`` make of them, for one
    server's users and for the hub's accounts, where a login of a leaf or of sys is in
    that user's account; the accounts pass ``nats-server -t`` with B's passwords."""
    add = {"trainer-east-2": "trainer-east", "leaf-east-2": "leaf-east", "sys-2": "sys"}
    drop = ["trainer-east", "leaf-east", "sys"]
    flags = [*(a for n, o in add.items() for a in ("--add-login", f"{n}={o}")),
             *(a for u in drop for a in ("--drop", u))]
    acc = cli_config(capsys, "--accounts", "--clusters", "east,west", *flags)
    assert acc == accounts.accounts_config(CLUSTERS, add=add, drop=drop)
    assert 'users: [ { user: "sys-2", password: $TANDEM_NATS_PASSWORD_SYS_2 } ]' in acc
    assert 'user: "leaf-east-2"' in acc and 'user: "trainer-east-2"' in acc
    assert not {'user: "sys"', 'user: "leaf-east"', 'user: "trainer-east"'} & set(
        re.findall(r'user: "[^"]+"', acc))
    (tmp_path / "auth.conf").write_text(acc)
    env = {name: f"pw-{name}" for name in re.findall(r"password: \$(\w+)", acc)}
    check = subprocess.run([str(Path(PYTHON).parent / "nats-server"), "-c",
                            str(tmp_path / "auth.conf"), "-t"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr + check.stdout
    one = {"trainer-east-2": "trainer-east"}
    plain = cli_config(capsys, "--clusters", "east,west", "--add-login",
                       "trainer-east-2=trainer-east", "--drop", "trainer-east")
    assert plain == permissions.nats_config(
        permissions.with_logins(permissions.users(CLUSTERS), one, ["trainer-east"]))


def test_dev_up_auth_has_each_clusters_trainer_and_checkpointer_user(tmp_path: Path) -> None:
    """``tandem dev up --auth`` (one server) runs every user of a deployment with the
    stack's clusters (``permissions.users``), each with a password it generated: a
    process placed as a cluster's trainer or checkpointer logs in as that cluster's
    user, and a wrong password is refused."""
    config = StackConfig.load().free_ports()
    clusters = [c.name for c in config.clusters]
    with (tmp_path / "stack.log").open("w") as sink, \
            Stack(config, tmp_path / "root", sink, grace=5, auth=True) as stack:
        stack.start(services=[])
        assert set(stack.passwords) == set(permissions.users(clusters))

        async def login(user: str, password: str) -> None:
            nc = await nats.connect(stack.nats_url, user=user, password=password,
                                    inbox_prefix=permissions.own_inbox(user),
                                    allow_reconnect=False, connect_timeout=5)
            await nc.close()

        for cluster in clusters:
            for role in permissions.CLUSTER_USER_ROLES:
                user = permissions.cluster_user(role, cluster)
                asyncio.run(login(user, stack.passwords[user]))
        with pytest.raises(Exception, match=r"[Aa]uthorization"):
            asyncio.run(login(user, "wrong"))


# ------------------------------------------------------------------------------ the server


def passwords_of(users: dict[str, permissions.Role]) -> dict[str, str]:
    return {u: f"pw-{u}" for u in users}


def start_server(tmp_path: Path, users: dict[str, permissions.Role]) -> NatsServer:
    conf = tmp_path / "nats.conf"
    write_config(conf, tmp_path, users)
    return NatsServer(name="auth", log_path=tmp_path / "nats.log", config_path=conf).start()


def write_config(conf: Path, tmp_path: Path, users: dict[str, permissions.Role]) -> None:
    conf.write_text(permissions.server_config(str(tmp_path / "js"), users, passwords_of(users),
                                              server_name="auth"))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    srv = start_server(tmp_path, permissions.users(CLUSTERS))
    yield srv
    srv.stop()


def as_user(srv: NatsServer, user: str, **more: Any) -> Settings:
    """The settings a process logging in as ``user`` runs with: a cluster's user names
    its own inbox prefix (``permissions.own_inbox``), as its pods set it."""
    if user not in permissions.SERVICE_ROLES and user != permissions.ADMIN:
        more.setdefault("nats_inbox_prefix", permissions.own_inbox(user))
    return load(Settings, nats_url=srv.url, nats_user=user, nats_password=f"pw-{user}",
                **{"cluster": "east", "node": "n0", **more})


@pytest.fixture
async def admin(server: NatsServer) -> AsyncIterator[Bus]:
    bus = await Bus.connect(as_user(server, "admin"), "admin")
    await bus.provision([*streams.core_streams(), *streams.cluster_streams(CLUSTERS),
                         streams.trainer_consumer("west")])
    yield bus
    await bus.drain()


async def test_an_east_trainer_does_its_job_on_east_and_is_refused_on_west(
        server: NatsServer, admin: Bus, uid: str) -> None:
    user = permissions.cluster_user("trainer", "east")
    heard: dict[str, list[str]] = {"admin": [], "coordinator": []}
    health = asyncio.Event()

    async def on_admin(msg: Any) -> None:
        heard["admin"].append(msg.subject)

    async def on_health(msg: Any) -> None:
        heard["coordinator"].append(msg.subject)
        health.set()

    west = [await admin.nc.subscribe(s, cb=on_admin)
            for s in ("trainer.node.west.>", "trainer.report.west.>", "mirror.west.>")]
    nodes = await admin.kv(streams.KV_NODES)
    for c in CLUSTERS:
        await nodes.put(subjects.node_key(c, uid), f"{c}'s heartbeat".encode())
    await admin.synced()
    with structlog.testing.capture_logs() as logs:
        coordinator = await Bus.connect(as_user(server, user), "trainer")
        agent = await Bus.connect(as_user(server, user), "trainer-node")
        try:
            def denied(op: str, subject: str) -> bool:
                return any(e["event"] == "nats.permission_denied" and e["operation"] == op
                           and e["subject"] == subject.lower() and e["user"] == user
                           for e in logs)

            assert coordinator.nc.new_inbox().startswith(permissions.own_inbox(user) + ".")
            # orders: to its own cluster's node agent, answered; not to west's, nor may it
            # stand in for west's agents or hear the other users' replies
            async def answer(msg: Any) -> None:
                await msg.respond(b"done")

            await agent.nc.subscribe(subjects.trainer_node("east", uid), cb=answer)
            await agent.synced()
            got = await coordinator.nc.request(subjects.trainer_node("east", uid), b"go",
                                               timeout=5)
            assert got.data == b"done"
            for subject in ("trainer.node.west.*", "trainer.report.west.*", "health.west.*",
                            "_SERVICE_INBOX.trainer.>", "_SERVICE_INBOX_trainer-west.>",
                            "_INBOX.>"):
                await agent.nc.subscribe(subject)
                await until(lambda s=subject: denied("subscribe", s))
            for subject in (subjects.trainer_node("west", uid),
                            subjects.trainer_report("west", uid)):
                await coordinator.emit(subject, b"go")
                await until(lambda s=subject: denied("publish", s))
            # health: east's heard, west's refused above
            await coordinator.nc.subscribe(subjects.HEALTH.filter(cluster="east"),
                                           cb=on_health)
            await coordinator.synced()
            await admin.emit(subjects.health("east", uid), b"{}")
            await asyncio.wait_for(health.wait(), TIMEOUT)
            # mirror orders: to east's nodes' checkpointers only
            ack = await coordinator.publish(subjects.mirror("east", uid), b"{}")
            assert ack.stream == streams.MIRROR
            with pytest.raises(NatsTimeout):
                await coordinator.publish(subjects.mirror("west", uid), b"{}", timeout=0.5)
            await until(lambda: denied("publish", subjects.mirror("west", uid)))
            # KV: an east node's heartbeat by its key; a west node's refused
            east_nodes = await coordinator.kv(streams.KV_NODES)
            entry = await east_nodes.get(subjects.node_key("east", uid))
            assert entry.value == b"east's heartbeat"
            with pytest.raises(NatsTimeout):
                await east_nodes.get(subjects.node_key("west", uid))
            await until(lambda: denied("publish", "$JS.API.DIRECT.GET.KV_nodes.$KV.nodes."
                                       + subjects.node_key("west", uid)))
            # its cluster's durable: provisioned and pulled; west's refused
            await coordinator.provision([streams.trainer_consumer("east")])
            await admin.publish(subjects.train(f"r{uid}", "status"), b"{}")
            own = await coordinator.js.pull_subscribe_bind(durable="trainer-east",
                                                           stream=streams.TRAIN)
            [msg] = await own.fetch(1, timeout=5)
            assert msg.subject == subjects.train(f"r{uid}", "status")
            await msg.ack_sync()
            theirs = await coordinator.js.pull_subscribe_bind(durable="trainer-west",
                                                              stream=streams.TRAIN)
            with pytest.raises(NatsTimeout):
                await theirs.fetch(1, timeout=0.5)
            await until(lambda: denied("publish",
                                       "$JS.API.CONSUMER.MSG.NEXT.TRAIN.trainer-west"))
        finally:
            await agent.drain()
            await coordinator.drain()
    await admin.synced()
    assert heard["admin"] == [] and heard["coordinator"] == [subjects.health("east", uid)]
    info = await admin.js.stream_info(streams.MIRROR, subjects_filter="mirror.west.>")
    assert not info.state.subjects
    # west's durable still holds the status event east could not take
    assert (await admin.js.consumer_info(streams.TRAIN, "trainer-west")).num_pending == 1
    for sub in west:
        await sub.unsubscribe()


async def test_the_trainer_user_of_the_release_before_still_pulls_its_clusters_durable(
        server: NatsServer, admin: Bus, uid: str) -> None:
    """Transitional: a GPU cluster's pods not yet rolled log in as ``trainer`` (every
    cluster's grants, this release only) and go on claiming their cluster's runs."""
    old = await Bus.connect(as_user(server, "trainer"), "trainer")
    try:
        await old.provision([streams.trainer_consumer("east")])
        await admin.publish(subjects.train(f"r{uid}", "status"), b"{}")
        sub = await old.js.pull_subscribe_bind(durable="trainer-east", stream=streams.TRAIN)
        [msg] = await sub.fetch(1, timeout=5)
        await msg.ack_sync()
    finally:
        await old.drain()


async def test_a_password_rotates_with_no_outage_add_b_roll_clients_remove_a(
        tmp_path: Path) -> None:
    """"Add user B, roll clients, remove user A" on one server whose config is reloaded:
    A works throughout until it is removed, B from when it is added; removing A closes
    A's connections and refuses new ones."""
    users = permissions.users(CLUSTERS)
    srv = start_server(tmp_path, users)
    conf = tmp_path / "nats.conf"
    try:
        admin = await Bus.connect(as_user(srv, "admin"), "admin")
        await admin.provision(streams.core_streams())
        await (await admin.kv(streams.KV_RUNS)).put("r1", b"kept")
        await admin.drain()

        async def reload(new: dict[str, permissions.Role]) -> None:
            before = srv.varz()["config_load_time"]
            write_config(conf, tmp_path, new)
            srv.reload()
            deadline = time.monotonic() + TIMEOUT
            while srv.varz()["config_load_time"] == before:  # polling the server's /varz
                assert time.monotonic() < deadline, "nats-server did not reload"
                await asyncio.sleep(0.05)

        async def reads(bus: Bus) -> bytes:
            return (await (await bus.kv(streams.KV_RUNS)).get("r1")).value

        closed = asyncio.Event()

        async def on_closed() -> None:
            closed.set()

        a = await Bus.connect(as_user(srv, "trainer-east"), "trainer",
                              allow_reconnect=False, closed_cb=on_closed)
        assert await reads(a) == b"kept"
        # 1. add B: A still works, B works
        await reload(permissions.with_logins(users, {"trainer-east-b": "trainer-east"}))
        b = await Bus.connect(as_user(srv, "trainer-east-b"), "trainer")
        assert await reads(a) == b"kept" and await reads(b) == b"kept"
        # 2. clients rolled onto B; 3. remove A: its connection closes, a new one is refused
        await reload(permissions.with_logins(users, {"trainer-east-b": "trainer-east"},
                                             drop=["trainer-east"]))
        await asyncio.wait_for(closed.wait(), TIMEOUT)
        with pytest.raises(Exception, match=r"[Aa]uthorization"):
            await nats.connect(srv.url, user="trainer-east", password="pw-trainer-east",
                               allow_reconnect=False, connect_timeout=3)
        assert await reads(b) == b"kept"
        await b.drain()
    finally:
        srv.stop()


# --------------------------------------------------------------- the east trainer, end to end


def start_service(module: str, log: Path, **settings: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([PYTHON, "-m", module], env=service_env(**settings),
                                stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen[bytes], log: Path) -> None:
    port = logged_metrics_port(proc, log, timeout=120)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)  # polling the service's own readiness endpoint


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_east_trainer_and_checkpointer_run_a_run_to_its_committed_checkpoint_as_east(
        server: NatsServer, admin: Bus, s3_server: S3Server, tmp_path: Path, uid: str) -> None:
    """The coordinator and its node agent as ``trainer-east``, the node's checkpointer as
    ``checkpointer-east``: a run on east's node trains, its checkpoint is mirrored and
    committed, and the server refuses nothing."""
    node, run = f"n{uid}", f"r{uid}"
    common = dict(nats_url=server.url, cluster="east", metrics_port="0",
                  checkpoint_root=str(tmp_path / "ckpt"), s3_endpoint=s3_server.url,
                  s3_bucket=f"b{uid}", s3_access_key="tandem", s3_secret_key="tandem")

    def login(role: str) -> dict[str, str]:
        user = permissions.cluster_user(role, "east")
        return dict(nats_user=user, nats_password=f"pw-{user}",
                    nats_inbox_prefix=permissions.own_inbox(user))

    (tmp_path / "ckpt").mkdir()
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "agent", "ckpt")}
    procs = {
        "coordinator": start_service(
            "tandem.trainer", logs["coordinator"], **common, **login("trainer"),
            node="coordinator", launcher="nodes", work_root=str(tmp_path / "coordinator"),
            restore_from_s3="false", status_every_s="0.5"),
        "agent": start_service(
            "tandem.trainer", logs["agent"], **common, **login("trainer"), node=node,
            trainer_role="node", work_root=str(tmp_path / "agent"),
            rendezvous_host="127.0.0.1"),
        "ckpt": start_service("tandem.checkpointer", logs["ckpt"], **common,
                              **login("checkpointer"), node=node, scope="node"),
    }
    try:
        for name, proc in procs.items():
            await asyncio.to_thread(wait_healthy, proc, logs[name])
        await submit_run(admin, tiny(run, cluster="east", nodes=[node], ranks=1, steps=6,
                                     checkpoint_every=3))
        record = await finished(admin, run)
        assert record.state == RunState.succeeded, record
        # mirrored by east's node's checkpointer and committed to the run's record
        record = await until_run(admin, run, lambda r: r.latest_checkpoint_step is not None)
        assert record.latest_checkpoint_uri, record
    finally:
        for proc in procs.values():
            await asyncio.to_thread(stop_process, proc)
    assert "Violation" not in server.log_path.read_text()
    for name, log in logs.items():
        assert "permission_denied" not in log.read_text(), name
