"""The trainer's node agent alone: a real ``python -m tandem.trainer`` in the node role
and a real nats-server; the test plays the coordinator (orders it, answers its reports
or stays silent) and watches the torchrun it starts, and that torchrun's rank, in /proc.

Every wait is on a reply or on a process condition, with a deadline.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.cli.devstack import NatsServer
from tandem.common import events, subjects
from tandem.common.backoff import Backoff, retry
from tandem.common.bus import Bus, transient
from tandem.common.events import NodeLaunch, NodeReply, NodeReport, NodeReportReply, NodeStop
from tandem.common.runs import parse_run_config
from tandem.common.settings import Settings, load
from tandem.trainer.launcher import children, proc_state
from tandem.trainer.spec import LaunchSpec
from tests.conftest import PYTHON, service_env
from tests.test_train_runs import stop_process, tiny

pytestmark = [pytest.mark.timeout(300)]
DEADLINE = 120.0
NODE = "n1"
GONE = ("gone", "Z")


async def until_true(what: str, pred: Callable[[], bool], timeout: float = DEADLINE) -> None:
    """Until ``pred()`` holds (a process condition read from /proc); fails at the deadline."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        await asyncio.sleep(0.05)  # polling /proc: there is no event to wait on


@pytest.fixture
def agent(nats_server: NatsServer, tmp_path: Path, uid: str) -> Iterator[str]:
    """A node agent on node n1 of its own cluster; yields the cluster."""
    cluster = f"c{uid}"
    env = service_env(nats_url=nats_server.url, cluster=cluster, node=NODE, trainer_role="node",
                      checkpoint_root=str(tmp_path / "ckpt"), work_root=str(tmp_path / "work"),
                      orphan_after_s="2")
    with open(tmp_path / "agent.log", "ab") as out:
        proc = subprocess.Popen([PYTHON, "-m", "tandem.trainer"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        yield cluster
    finally:
        stop_process(proc)


class Coordinator:
    """The test's side of the protocol: orders, and answers to the agent's reports by
    ``mode``: ``keep`` (the attempt is wanted), ``disown`` (keep=False) or ``silent``."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.mode = "keep"
        self.heard: asyncio.Queue[NodeReport] = asyncio.Queue()

    async def answer(self, msg: Any) -> None:
        if self.mode == "silent":
            return
        self.heard.put_nowait(events.decode(msg.data, NodeReport))
        await msg.respond(events.encode(NodeReportReply(keep=self.mode == "keep")))


@pytest.fixture
async def coordinator(nats_server: NatsServer, agent: str) -> AsyncIterator[Coordinator]:
    b = await Bus.connect(load(Settings, nats_url=nats_server.url), "test")
    c = Coordinator(b)
    await b.nc.subscribe(subjects.TRAINER_REPORT.filter(cluster=agent), cb=c.answer)
    yield c
    await b.drain()


async def order(bus: Bus, cluster: str, message: Any) -> NodeReply:
    """An order, retried while the agent is not subscribed yet (it is starting)."""
    async def send() -> NodeReply:
        return await bus.request(subjects.trainer_node(cluster, NODE), message, NodeReply,
                                 timeout=10.0)

    return await retry(send, Backoff(0.1, max_delay=1.0), when=transient, within=DEADLINE)


def launch(cluster: str, run: str, tmp_path: Path) -> NodeLaunch:
    """A one-node, one-rank attempt of a long run that reports to nobody (``events``)."""
    config = parse_run_config(tiny(run, ranks=1, steps=100_000, cluster=cluster))
    spec = LaunchSpec(run_id=run, attempt=1, config=config.model_dump(mode="json"),
                      checkpoint_root=str(tmp_path / "coordinator-ckpt"),
                      attempt_dir=str(tmp_path / "coordinator-work"), rank_nodes=[NODE],
                      cluster=cluster)
    return NodeLaunch(run_id=run, attempt=1, node=NODE, node_rank=0, nnodes=1, per_node=1,
                      spec=msgspec.to_builtins(spec), report_every_s=0.2)


async def started(bus: Bus, cluster: str, run: str, tmp_path: Path) -> tuple[NodeReply, int]:
    """Launch, then wait for torchrun's rank to exist; the reply and the rank's pid."""
    reply = await order(bus, cluster, launch(cluster, run, tmp_path))
    assert reply.ok, reply.error
    assert reply.master_addr == "127.0.0.1" and reply.master_port > 0
    await until_true("torchrun forked its rank", lambda: bool(children(reply.pid)))
    return reply, children(reply.pid)[0]


async def test_a_stop_order_kills_torchrun_and_its_rank(
        agent: str, coordinator: Coordinator, tmp_path: Path) -> None:
    bus = coordinator.bus
    reply, rank = await started(bus, agent, "stopped", tmp_path)
    # the spec it ran is rebased onto the agent's own folders
    spec = msgspec.json.decode((Path(reply.log_path).parent / "launch.json").read_bytes(),
                               type=LaunchSpec)
    assert spec.checkpoint_root == str((tmp_path / "ckpt").resolve())
    assert spec.attempt_dir.startswith(str((tmp_path / "work").resolve()))
    again = await order(bus, agent, launch(agent, "stopped", tmp_path))
    assert again.pid == reply.pid  # a repeated order starts nothing twice
    report = await asyncio.wait_for(coordinator.heard.get(), DEADLINE)
    assert (report.node, report.attempt, report.running) == (NODE, 1, True)
    stop = await order(bus, agent, NodeStop(run_id="stopped", attempt=1))
    assert stop.exit_code is not None and stop.exit_code < 0  # killed by a signal
    assert proc_state(reply.pid) in GONE
    await until_true("the rank is gone", lambda: proc_state(rank) in GONE)


async def test_an_agent_that_loses_its_coordinator_kills_its_ranks(
        agent: str, coordinator: Coordinator, tmp_path: Path) -> None:
    """Its reports go unanswered: after ``orphan_after_s`` it kills torchrun and rank."""
    reply, rank = await started(coordinator.bus, agent, "orphan", tmp_path)
    coordinator.mode = "silent"
    await until_true("torchrun is gone", lambda: proc_state(reply.pid) in GONE)
    await until_true("the rank is gone", lambda: proc_state(rank) in GONE)


async def test_an_agent_disowned_by_its_coordinator_kills_its_ranks(
        agent: str, coordinator: Coordinator, tmp_path: Path) -> None:
    """The coordinator answers a report ``keep=False`` (the attempt is not its current
    one, e.g. a stop the agent missed): the agent kills what it runs."""
    reply, rank = await started(coordinator.bus, agent, "disowned", tmp_path)
    coordinator.mode = "disown"
    await until_true("torchrun is gone", lambda: proc_state(reply.pid) in GONE)
    await until_true("the rank is gone", lambda: proc_state(rank) in GONE)


def test_a_role_or_launcher_that_does_not_exist_is_refused_naming_the_variable() -> None:
    for name, value in (("trainer_role", "worker"), ("launcher", "k8s")):
        env = service_env(**{name: value})
        res = subprocess.run([PYTHON, "-m", "tandem.trainer"], env=env, capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 2, res.stderr
        assert f"TANDEM_{name.upper()}" in res.stderr


async def test_the_same_attempt_ordered_by_another_coordinator_replaces_what_runs(
        agent: str, coordinator: Coordinator, tmp_path: Path) -> None:
    """A coordinator restarted while its attempt started orders it again, with its own
    relay: the torchrun held (whose ranks report to the old relay) is killed and the new
    order run, where a retry of the very same order is answered from what runs."""
    bus = coordinator.bus
    reply, rank = await started(bus, agent, "moved", tmp_path)
    first = launch(agent, "moved", tmp_path)
    other = msgspec.structs.replace(first, spec={**first.spec, "events": "127.0.0.1:9"})
    again = await order(bus, agent, other)
    assert again.ok and again.pid != reply.pid
    await until_true("the first torchrun is gone", lambda: proc_state(reply.pid) in GONE)
    await until_true("its rank is gone", lambda: proc_state(rank) in GONE)
    await order(bus, agent, NodeStop(run_id="moved", attempt=1))


async def test_an_order_with_a_run_id_not_a_token_or_no_positive_report_interval_is_refused(
        agent: str, coordinator: Coordinator, tmp_path: Path) -> None:
    """The run id names a folder under the agent's work root; the interval, its waits."""
    good = launch(agent, "fine", tmp_path)
    for bad, why in ((msgspec.structs.replace(good, run_id="../escape"), "run id"),
                     (msgspec.structs.replace(good, report_every_s=0.0), "report_every_s")):
        reply = await order(coordinator.bus, agent, bad)
        assert not reply.ok and why in reply.error, reply
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "work" / "fine").exists()
