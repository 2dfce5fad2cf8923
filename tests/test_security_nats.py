"""Least privilege on the bus: one declaration, the server enforcing it, TLS.

A nats-server runs with the config ``tandem.common.permissions`` generates; clients
connect as the service roles. Refusals come from the server itself and ``Bus`` logs
them as ``nats.permission_denied`` naming the operation, subject and user.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import structlog
from nats.errors import TimeoutError as NatsTimeout

from tandem.cli.certs import dev_certs
from tandem.cli.devstack import NatsServer
from tandem.cli.main import main
from tandem.cli.stack import Stack
from tandem.cli.stack_config import StackConfig
from tandem.common import permissions, streams, subjects
from tandem.common.bus import Bus, Delivery
from tandem.common.events import GenerationTask, TaskRecord
from tandem.common.events import encode as encodejson
from tandem.common.settings import Settings, load
from tests.conftest import PYTHON, ROOT, service_env

CLUSTERS = ["east", "west"]
TIMEOUT = 20


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def allowed(patterns: tuple[str, ...], subject: str) -> bool:
    return any(matches(p, subject) for p in patterns)


async def until(cond: Callable[[], bool], timeout: float = TIMEOUT,
                seen: Callable[[], object] = lambda: None) -> None:
    """Wait for ``cond`` with a deadline (re-checked as the loop runs other tasks); a miss
    says what ``seen`` shows of the state it waited on."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"condition not met in time; seen: {seen()!r}"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------------------- the declaration


def test_deploy_auth_conf_is_the_generated_declaration_and_compose_uses_it() -> None:
    """compose mounts deploy/nats/auth.conf: it must be exactly what the declaration makes."""
    assert (ROOT / "deploy/nats/auth.conf").read_text() == permissions.compose_config()
    assert "include ./auth.conf" in (ROOT / "deploy/nats/cluster.conf").read_text()
    compose = (ROOT / "compose.yaml").read_text()
    assert compose.count("./deploy/nats/auth.conf:/etc/nats/auth.conf:ro") == 3
    # every user's password, or nats-server stops at start: "variable reference ... can
    # not be found" (each cluster's trainer and checkpointer users too)
    for user in permissions.users(CLUSTERS):
        assert f"{permissions.password_env(user)}:" in compose, user
    for role in permissions.SERVICE_ROLES:
        assert f"TANDEM_NATS_USER: {role}\n" in compose, role


def cli_config(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What ``tandem security nats-config ARGV`` prints; it must exit 0."""
    with pytest.raises(SystemExit) as end:
        main(["security", "nats-config", *argv])
    out = capsys.readouterr()
    assert end.value.code == 0, out.err
    return out.out


def test_nats_config_prints_every_user_of_the_clusters_it_is_given(
        capsys: pytest.CaptureFixture[str]) -> None:
    """For clusters other than compose's, ``tandem security nats-config`` prints every
    user of such a deployment (``permissions.users``), each cluster's trainer and
    checkpointer users too, as the ``authorization`` block and as ``--roles``; for
    compose's, the committed auth.conf."""
    users = permissions.users(["north"])
    assert {"trainer-north", "checkpointer-north"} <= set(users)
    conf = cli_config(capsys, "--clusters", "north")
    assert conf == permissions.nats_config(users)
    assert sorted(re.findall(r'user: "([^"]+)"', conf)) == sorted(users)
    roles = json.loads(cli_config(capsys, "--clusters", "north", "--roles"))
    assert roles == {n: {"publish": list(r.publish), "subscribe": list(r.subscribe)}
                     for n, r in users.items()}
    assert cli_config(capsys) == (ROOT / "deploy/nats/auth.conf").read_text()


def test_each_role_may_do_only_what_its_service_does() -> None:
    roles = permissions.declaration(CLUSTERS)
    worker, agent = roles["inference-worker"], roles["cluster-agent"]
    for subject in ("train.r1.status", "train.r1.checkpoint", "ckpt.r1.mirrored",
                    "telemetry.east.n0", "health.east.n0", "gen.east.interactive",
                    "$JS.API.STREAM.INFO.TELEMETRY", "$JS.API.CONSUMER.CREATE.TELEMETRY.x",
                    "$JS.API.STREAM.MSG.GET.TELEMETRY", "$KV.runs.r1", "$KV.nodes.east.n0",
                    "$JS.API.STREAM.DELETE.GEN_EAST", "$JS.API.STREAM.PURGE.GEN_EAST",
                    "$KV.cancels.t1"):  # only the gateway cancels
        assert not allowed(worker.publish, subject), f"worker may publish {subject}"
    assert allowed(worker.publish, "$KV.tasks.t1")  # a task's record: its state and result
    assert allowed(worker.publish, "$JS.API.CONSUMER.MSG.NEXT.GEN_WEST.workers-west-batch")
    assert not allowed(worker.subscribe, "telemetry.east.n0")
    for subject in ("gen.east.interactive", "$KV.cancels.t1", "$JS.API.STREAM.INFO.GEN_EAST",
                    "$JS.API.CONSUMER.MSG.NEXT.GEN_EAST.workers-east",
                    "$JS.ACK.GEN_EAST.workers-east.1.2.3.4.5", "$KV.tasks.t1", "train.r.step"):
        assert not allowed(agent.publish, subject), f"agent may publish {subject}"
    assert not any("GEN_" in p or p.startswith("gen.") for p in agent.publish + agent.subscribe)
    assert allowed(agent.publish, "telemetry.east.n0")
    for name in permissions.SERVICE_ROLES:
        role = roles[name]
        assert ">" not in role.publish and ">" not in role.subscribe, name
        # no role may delete or purge a stream or delete a consumer; only KV tasks' owner
        # may reshape one, that bucket (to bring one made by the release before up to date)
        assert not any(re.search(r"\.(DELETE|PURGE)\.", p) for p in role.publish), name
        updates = [p for p in role.publish if ".UPDATE." in p]
        assert updates == (["$JS.API.STREAM.UPDATE.KV_tasks"] if name == "gateway" else []), \
            (name, updates)
        # nor name a consumer into being on a stream other than its own durables' (the
        # checkpointer: any name on MIRROR, whose per-node durables no wildcard can spell)
        named = [p for p in role.publish if re.match(r"\$JS\.API\.CONSUMER\.CREATE\.\w+\.", p)]
        assert all(p.split(".")[5].startswith(("workers-", "trainer-", "checkpointer"))
                   or (name, p.split(".")[4:6]) == ("checkpointer", ["MIRROR", "*"])
                   for p in named), (name, named)
    assert roles["admin"].publish == (">",)


def test_every_declared_stream_and_bucket_is_some_roles_to_provision() -> None:
    """Under auth each service provisions only its own: together they cover everything."""
    roles = permissions.declaration(CLUSTERS)
    specs = [*streams.core_streams(), *streams.cluster_streams(CLUSTERS),
             streams.checkpointer_consumer(), streams.trainer_consumer("control"),
             streams.checkpointer_consumer(cluster="east", node="n0")]
    for spec in specs:
        owners = [n for n in permissions.SERVICE_ROLES if roles[n].may_provision(spec)]
        assert owners, f"no service role provisions {spec}"
    assert not roles["cluster-agent"].may_provision(streams.gen_stream("east"))
    assert not roles["inference-worker"].may_provision(streams.core_streams()[2])  # TELEMETRY


# ------------------------------------------------------------------------------ the server


@pytest.fixture
def auth_nats(tmp_path: Path) -> Iterator[tuple[NatsServer, dict[str, str]]]:
    roles = permissions.declaration(CLUSTERS)
    passwords = {r: f"pw-{r}" for r in roles}
    conf = tmp_path / "nats.conf"
    conf.write_text(permissions.server_config(str(tmp_path / "js"), roles, passwords))
    srv = NatsServer(name="auth", log_path=tmp_path / "nats.log", config_path=conf).start()
    yield srv, passwords
    srv.stop()


def as_role(srv: NatsServer, passwords: dict[str, str], role: str, **more: object) -> Settings:
    return load(Settings, nats_url=srv.url, nats_user=role, nats_password=passwords[role],
                cluster="east", node="n0", **more)


@pytest.fixture
async def admin(auth_nats: tuple[NatsServer, dict[str, str]]) -> AsyncIterator[Bus]:
    srv, passwords = auth_nats
    bus = await Bus.connect(as_role(srv, passwords, "admin"), "admin")
    await bus.provision([*streams.core_streams(), *streams.cluster_streams(CLUSTERS)])
    yield bus
    await bus.drain()


async def test_forbidden_publish_and_subscribe_are_refused_and_logged_clearly(
        auth_nats: tuple[NatsServer, dict[str, str]], admin: Bus) -> None:
    srv, passwords = auth_nats
    with structlog.testing.capture_logs() as logs:
        worker = await Bus.connect(as_role(srv, passwords, "inference-worker"), "worker")
        try:
            def denied(op: str, subject: str) -> bool:
                # nats-py lowercases the server's error text; the server log keeps the case
                return any(e["event"] == "nats.permission_denied" and e["operation"] == op
                           and e["subject"] == subject.lower() and e["user"] == "inference-worker"
                           and e["log_level"] == "error" for e in logs)

            seen: list[bytes] = []

            async def on_train(msg: Any) -> None:
                seen.append(msg.data)

            watcher = await admin.nc.subscribe("train.>", cb=on_train)
            await admin.synced()
            await worker.nc.subscribe("telemetry.>")
            await until(lambda: denied("subscribe", "telemetry.>"))
            await worker.emit("train.r1.status", b"{}")  # core NATS: refused, never delivered
            await until(lambda: denied("publish", "train.r1.status"))
            with pytest.raises(NatsTimeout):  # JetStream: no ack ever comes
                await worker.publish(subjects.train("r1", "checkpoint"), b"{}", timeout=0.5)
            await until(lambda: denied("publish", "train.r1.checkpoint"))
            with pytest.raises(NatsTimeout):  # nor may it read TELEMETRY's API
                await worker.nc.request("$JS.API.STREAM.INFO.TELEMETRY", b"", timeout=0.5)
            await until(lambda: denied("publish", "$JS.API.STREAM.INFO.TELEMETRY"))
            # what it may do still works on the same connection
            ack = await worker.publish(subjects.task_record("t1"), TaskRecord(
                task=GenerationTask(task_id="t1", model="noop")), timeout=5)
            assert ack.stream == f"KV_{streams.KV_TASKS}"
            await admin.synced()
            assert seen == []
            await watcher.unsubscribe()
        finally:
            await worker.drain()


async def test_an_agent_cannot_touch_generation_queues(
        auth_nats: tuple[NatsServer, dict[str, str]], admin: Bus) -> None:
    srv, passwords = auth_nats
    with structlog.testing.capture_logs() as logs:
        agent = await Bus.connect(as_role(srv, passwords, "cluster-agent"), "agent")
        try:
            with pytest.raises(NatsTimeout):
                await agent.publish(subjects.gen("east", "interactive"),
                                    GenerationTask(task_id="x", model="noop"), timeout=0.5)
            queue = await agent.js.pull_subscribe_bind(durable="workers-east-interactive",
                                                       stream="GEN_EAST")
            with pytest.raises(NatsTimeout):
                await queue.fetch(1, timeout=0.5)
            await until(lambda: {e.get("subject") for e in logs} >= {
                "gen.east.interactive",
                "$JS.API.CONSUMER.MSG.NEXT.GEN_EAST.workers-east-interactive".lower()})
        finally:
            await agent.drain()
    info = await admin.js.stream_info("GEN_EAST")
    assert info.state.messages == 0


async def test_a_client_may_use_the_job_service_and_follow_jobs_and_nothing_else(
        auth_nats: tuple[NatsServer, dict[str, str]], admin: Bus) -> None:
    from nats.micro import add_service

    srv, passwords = auth_nats
    with structlog.testing.capture_logs() as logs:
        gateway = await Bus.connect(as_role(srv, passwords, "gateway"), "gateway")
        client = await Bus.connect(as_role(srv, passwords, "client"), "client")
        try:
            def denied(subject: str) -> bool:
                return any(e["event"] == "nats.permission_denied" and e["user"] == "client"
                           and e["subject"] == subject.lower() for e in logs)

            async def accepted(req: Any) -> None:  # the gateway's role serves the endpoint
                await req.respond(b'{"id": "t1"}')

            svc = await add_service(gateway.nc, name="tandem-jobs", version="1.0.0")
            await svc.add_group(name="tandem.jobs").add_endpoint(name="generate",
                                                                 handler=accepted)
            await gateway.synced()  # its subscriptions are on the server before a request
            reply = await client.nc.request(subjects.jobs("generate"), b"{}", timeout=5)
            assert reply.data == b'{"id": "t1"}'
            info = await client.nc.request("$SRV.INFO.tandem-jobs", b"", timeout=5)
            assert b'"tandem.jobs.generate"' in info.data
            writes: list[tuple[str, bytes, str]] = []

            async def on_write(msg: Any) -> None:
                writes.append((msg.subject, msg.data, (msg.headers or {}).get("Nats-Subject")))

            # Following a job: each stored write of its record is announced, headers only;
            # the record (another tenant's prompt, owner and images) never reaches a client.
            await client.nc.subscribe(subjects.TASK_WRITTEN.wildcard, cb=on_write)
            await client.synced()
            record = encodejson(TaskRecord(task=GenerationTask(
                task_id="t1", model="noop", prompt="bob's secret prompt", owner="bob")))
            await admin.publish(subjects.task_record("t1"), record)  # as a worker writes it
            # A miss says what arrived and what the connections went through (a client
            # disconnected while the record was written would never see it).
            await until(lambda: writes == [("tasks.written.t1", b"", "$KV.tasks.t1")],
                        seen=lambda: (writes, [e for e in logs
                                               if e["event"].startswith("nats.")]))
            # Nothing else: no queue, no stream API, no KV write, nobody's telemetry, no
            # task's record as written.
            with pytest.raises(NatsTimeout):
                await client.publish(subjects.gen("east", "interactive"),
                                     GenerationTask(task_id="x", model="noop"), timeout=0.5)
            for subject in ("$KV.tasks.t1", "$JS.API.STREAM.INFO.GEN_EAST"):
                await client.emit(subject, b"{}")
            await client.nc.subscribe("telemetry.>")
            await client.nc.subscribe(subjects.TASK_RECORD.wildcard)
            await until(lambda: all(denied(s) for s in (
                "gen.east.interactive", "$KV.tasks.t1", "$JS.API.STREAM.INFO.GEN_EAST",
                "telemetry.>", subjects.TASK_RECORD.wildcard)))
            await svc.stop()
        finally:
            await client.drain()
            await gateway.drain()
    assert (await admin.js.stream_info("GEN_EAST")).state.messages == 0


async def test_a_client_hears_no_services_replies_on_its_inbox(
        auth_nats: tuple[NatsServer, dict[str, str]], admin: Bus) -> None:
    """Every program outside Tandem subscribes to ``_INBOX.>`` for its replies. The
    services used the same prefix, so a client subscribed to ``_INBOX.>`` heard their
    replies: the records the gateway read from KV (every tenant's prompt), the tasks a
    worker pulled. A service's replies now come on its role's own prefix."""
    srv, passwords = auth_nats
    tasks = await admin.typed(streams.KV_TASKS, TaskRecord)
    await tasks.put("t1", TaskRecord(task=GenerationTask(
        task_id="t1", model="noop", prompt="bob's secret prompt", owner="bob")))
    gateway = await Bus.connect(as_role(srv, passwords, "gateway"), "gateway")
    client = await Bus.connect(as_role(srv, passwords, "client"), "client")
    heard: list[bytes] = []
    try:
        async def on_reply(msg: Any) -> None:
            heard.append(msg.data)

        await client.nc.subscribe("_INBOX.>", cb=on_reply)
        await client.synced()
        got = await (await gateway.typed(streams.KV_TASKS, TaskRecord)).get("t1")
        assert got is not None and got[0].task.prompt == "bob's secret prompt"
        # The server queued any copy for the client when it routed the reply, before
        # the gateway had it: a round trip of the client's comes back after that copy.
        await client.nc.flush()
        assert not [d for d in heard if b"secret" in d], heard
    finally:
        await client.drain()
        await gateway.drain()


async def test_a_service_of_the_release_before_gets_its_kv_replies_on_the_new_config(
        auth_nats: tuple[NatsServer, dict[str, str]], admin: Bus) -> None:
    """The rolling upgrade rolls the hub's config first: a service of the release before
    takes its replies on ``_INBOX``, not its role's ``_SERVICE_INBOX.<role>``, and must
    go on reading KV until it is replaced (transitional: ``permissions.LEGACY_REPLIES``)."""
    srv, passwords = auth_nats
    buckets = {"gateway": streams.KV_TASKS, "inference-worker": streams.KV_TASKS,
               "cluster-agent": streams.KV_DRAINS, "trainer": streams.KV_RUNS,
               "checkpointer": streams.KV_RUNS}
    assert set(buckets) == set(permissions.SERVICE_ROLES)
    for bucket in set(buckets.values()):
        await (await admin.kv(bucket)).put("east.old", b"kept")
    with structlog.testing.capture_logs() as logs:
        for role, bucket in buckets.items():
            old = await Bus.connect(as_role(srv, passwords, role, nats_inbox_prefix="_INBOX"),
                                    f"old-{role}", allow_reconnect=False)
            try:
                assert old.nc.new_inbox().startswith("_INBOX."), role  # as it connected before
                entry = await (await old.kv(bucket)).get("east.old")
                assert entry.value == b"kept", role
            finally:
                await old.drain()
    assert not [e for e in logs if e["event"] == "nats.permission_denied"]


async def test_a_tasks_bucket_made_without_its_announcement_gets_it_from_the_gateway_role(
        auth_nats: tuple[NatsServer, dict[str, str]]) -> None:
    """KV tasks made by the release before has no republish: the gateway's role brings it
    up to date as it provisions (no admin step in a rolling upgrade); a role that may not
    update it leaves it without a request the server would refuse (a timeout a start)."""
    from dataclasses import replace

    srv, passwords = auth_nats
    spec = next(s for s in streams.core_streams() if isinstance(s, streams.KVSpec)
                and s.bucket == streams.KV_TASKS)
    admin = await Bus.connect(as_role(srv, passwords, "admin"), "admin")
    try:
        await admin.provision([replace(spec, announce="")])  # as the release before made it
        assert (await admin.js.stream_info("KV_tasks")).config.republish is None

        async def provision_as(role: str) -> None:
            bus = await Bus.connect(as_role(srv, passwords, role), role)
            try:
                await bus.provision(permissions.provisionable(
                    permissions.role_for(role, role), [spec]))  # type: ignore[arg-type]
            finally:
                await bus.drain()

        with structlog.testing.capture_logs() as logs:
            await provision_as("inference-worker")
        assert not [e for e in logs if e["event"] in (
            "nats.permission_denied", "streams.kv_update_refused")], logs
        assert [e["bucket"] for e in logs if e["event"] == "streams.kv_update_left"] == ["tasks"]
        assert (await admin.js.stream_info("KV_tasks")).config.republish is None
        with structlog.testing.capture_logs() as logs:
            await provision_as("gateway")
        assert not [e for e in logs if e["event"] in (
            "nats.permission_denied", "streams.kv_update_refused")], logs
        assert (await admin.js.stream_info("KV_tasks")).config.republish == spec.republish()
        # and a client hears each write of a task's record again, at once
        client = await Bus.connect(as_role(srv, passwords, "client"), "client")
        try:
            heard = await client.nc.subscribe(subjects.TASK_WRITTEN.wildcard)
            await client.synced()
            await (await admin.kv(streams.KV_TASKS)).put("t1", b"{}")
            assert (await heard.next_msg(timeout=TIMEOUT)).subject == "tasks.written.t1"
        finally:
            await client.drain()
    finally:
        await admin.drain()


async def test_what_the_dashboard_and_failover_read_is_allowed(
        auth_nats: tuple[NatsServer, dict[str, str]], admin: Bus) -> None:
    """Reads the end-to-end test does not reach: a run's step history replayed by the
    gateway's dashboard, the worker's discovery of every cluster's queue."""
    from nats.js.api import DeliverPolicy

    from tandem.common.events import TrainStep
    from tandem.inference_worker.failover import work_queues

    srv, passwords = auth_nats
    await admin.publish(subjects.train("r1", "step"), TrainStep(run_id="r1", step=1, loss=0.5))
    with structlog.testing.capture_logs() as logs:
        gateway = await Bus.connect(as_role(srv, passwords, "gateway"), "gateway")
        worker = await Bus.connect(as_role(srv, passwords, "inference-worker"), "worker")
        try:
            sub = await gateway.js.subscribe(subjects.train("r1", "step"), ordered_consumer=True,
                                             deliver_policy=DeliverPolicy.ALL)
            assert (await sub.next_msg(timeout=5)).subject == "train.r1.step"
            await sub.unsubscribe()
            assert {"east", "west"} <= set(await work_queues(worker))
            await worker.nc.subscribe(subjects.ckpt_kind_filter("mirrored"))
            await worker.synced()
        finally:
            await gateway.drain()
            await worker.drain()
    assert not [e for e in logs if e["event"] == "nats.permission_denied"]


async def test_wrong_or_missing_password_is_refused_at_connect(
        auth_nats: tuple[NatsServer, dict[str, str]]) -> None:
    srv, _ = auth_nats
    for creds in ({}, {"user": "gateway", "password": "wrong"}):
        with pytest.raises(Exception, match=r"[Aa]uthorization"):
            await nats.connect(srv.url, allow_reconnect=False, connect_timeout=3, **creds)


def test_a_service_with_another_roles_credentials_logs_each_refusal(
        auth_nats: tuple[NatsServer, dict[str, str]], tmp_path: Path) -> None:
    """A real cluster-agent given the worker's user: refused, and it says so in its log."""
    srv, passwords = auth_nats
    env = service_env(nats_url=srv.url, nats_user="inference-worker",
                      nats_password=passwords["inference-worker"], cluster="east",
                      node="n0", agent_interval="0.2", sim_gpus="1")
    proc = subprocess.Popen([PYTHON, "-m", "tandem.cluster_agent"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    refusals: list[dict] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not refusals:
            line = proc.stdout.readline()
            if not line:
                break
            with_json = line.decode(errors="replace").strip()
            if with_json.startswith("{") and '"nats.permission_denied"' in with_json:
                refusals.append(json.loads(with_json))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert refusals, "the agent never logged a refusal"
    first = refusals[0]
    assert first["level"] == "error" and first["user"] == "inference-worker"
    assert first["operation"] in ("publish", "subscribe") and first["subject"]
    assert first["service"] == "cluster-agent"


# --------------------------------------------------------------------------- the whole stack


def test_every_service_runs_as_its_own_user_and_serves_without_a_refusal(
        tmp_path: Path) -> None:
    """``tandem dev up --auth``: each process is its own NATS user; a generation goes
    through gateway, worker and agent heartbeats with no permission violation."""
    sink = (tmp_path / "stack.log").open("w")
    config = StackConfig.load().free_ports()
    services = ["gateway", "cluster-agent", "inference-worker", "checkpointer", "trainer"]
    try:
        with Stack(config, tmp_path / "root", sink, grace=5, auth=True) as stack:
            health = stack.start(services=services, health_timeout=120)
            assert set(health.values()) == {"healthy"}, health
            monitor = f"http://127.0.0.1:{stack.ports['nats_monitor']}/connz?auth=true"
            with urllib.request.urlopen(monitor, timeout=5) as resp:
                conns = json.load(resp)["connections"]
            ours = [c for c in conns if c.get("name", "").startswith("tandem-")]
            for c in ours:  # the connection name starts with its service: same as its user
                assert c["name"].startswith(f"tandem-{c.get('authorized_user')}-"), c
            assert {c["authorized_user"] for c in ours} == set(services)
            url = stack.url("gateway")
            with httpx.Client(base_url=str(url), timeout=10) as http:
                tid = http.post("/v1/generations", json={"model": "noop"}).json()["id"]
                with http.stream("GET", f"/v1/generations/{tid}/events",
                                 timeout=60) as events:
                    lines = [ln for ln in events.iter_lines() if ln.startswith("data:")]
                final = json.loads(lines[-1].removeprefix("data:"))
                assert final["state"] == "succeeded", final
            # the stack's own admin settings reach the same server
            assert stack.settings().nats_user == "admin"
            assert os.stat(tmp_path / "root" / "nats.conf").st_mode & 0o077 == 0
            # A regenerated config is taken with a reload (SIGHUP): the written config
            # names the server as its command line does. The server logs the outcome.
            assert stack.nats is not None
            stack.nats.reload()
            log = stack.nats.log_path
            outcome = re.compile(r"Reloaded server configuration|Failed to reload.*")
            deadline = time.monotonic() + TIMEOUT
            while not (found := outcome.search(log.read_text())):
                assert time.monotonic() < deadline, "nats-server logged no reload"
                time.sleep(0.05)  # polling the server's log for its answer
            assert found.group(0) == "Reloaded server configuration", found.group(0)
    finally:
        sink.close()
    nats_log = (tmp_path / "root" / "logs" / "nats.log").read_text()
    assert "Violation" not in nats_log
    for log in (tmp_path / "root" / "logs").glob("*.log"):
        assert "permission_denied" not in log.read_text(), log.name


# ---------------------------------------------------------------------------------- TLS


async def test_bus_runs_over_mutual_tls_with_a_generated_ca(tmp_path: Path, uid: str) -> None:
    certs = dev_certs(tmp_path / "certs")
    roles = permissions.declaration(["east"])
    passwords = {r: f"pw-{r}" for r in roles}
    conf = tmp_path / "tls.conf"
    conf.write_text(permissions.server_config(
        str(tmp_path / "js"), roles, passwords, tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key), tls_ca=str(certs.ca), verify_clients=True))
    srv = NatsServer(name="tls", log_path=tmp_path / "nats.log", config_path=conf).start()
    try:
        url = f"tls://127.0.0.1:{srv.port}"
        tls = dict(nats_url=url, nats_tls_ca=str(certs.ca), nats_tls_cert=str(certs.client_cert),
                   nats_tls_key=str(certs.client_key), nats_user="admin",
                   nats_password=passwords["admin"])
        bus = await Bus.connect(load(Settings, **tls), "tls")
        try:
            stream = streams.StreamSpec(f"T_{uid}", (f"t.{uid}.*",))
            consumer = streams.ConsumerSpec(stream.name, "c")
            await bus.provision([*streams.core_streams(), stream, consumer])
            await bus.publish(f"t.{uid}.a", GenerationTask(task_id="over-tls", model="m"))
            got: list[str] = []
            stop = asyncio.Event()

            async def handle(d: Delivery[GenerationTask]) -> None:
                got.append(d.event.task_id)
                stop.set()

            await asyncio.wait_for(bus.consumer(consumer, GenerationTask, handle,
                                                fetch_timeout=0.2).run(stop), TIMEOUT)
            assert got == ["over-tls"]
            assert bus.nc.connected_url is not None and bus.nc.connected_url.scheme == "tls"
        finally:
            await bus.drain()
        # without a client certificate, or trusting another CA, no connection is made
        other = dev_certs(tmp_path / "other")
        for bad in ({"nats_tls_cert": None, "nats_tls_key": None},
                    {"nats_tls_ca": str(other.ca)}):
            with pytest.raises(Exception):  # noqa: B017 - TLS or closed-connection error
                await Bus.connect(load(Settings, **{**tls, **bad}), "tls",
                                  allow_reconnect=False, connect_timeout=3)
    finally:
        srv.stop()
