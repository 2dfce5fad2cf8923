"""The trainer's run lifecycle at its edges, against a real nats-server and a real
coordinator (``python -m tandem.trainer``, or one ``RunSupervisor`` in this process):
a coordinator restarted while node agents start an attempt, a run record grown past the
bus's max_payload, a run waiting for a ``MAX_RUNS`` slot that is cancelled or whose
coordinator stops, a run the coordinator refuses, and torchrun dying with a local
coordinator killed -9.

Most launch nothing: the test plays the node agents, or the run's only node is drained
(``no_healthy_nodes``). Every wait is on a KV update, a bus message or a process
condition, with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.cli.devstack import NatsServer
from tandem.common import events, log, subjects
from tandem.common.bus import Bus
from tandem.common.events import NodeLaunch, NodeReply, RunRecord, RunState
from tandem.common.runs import cancel_run, parse_run_config, submit_run
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_DRAINS, KV_RUNS, core_streams
from tandem.trainer import supervisor
from tandem.trainer.launcher import LocalLauncher, proc_state
from tandem.trainer.supervisor import RunSupervisor, SupervisorConfig
from tests.test_train_runs import start_coordinator, stop_process, tiny, until

pytestmark = [pytest.mark.timeout(300)]
DEADLINE = 120.0


@dataclass
class Env:
    bus: Bus
    cluster: str
    root: Path
    procs: list[subprocess.Popen[bytes]]
    nats: NatsServer

    def coordinator(self, **settings: str) -> subprocess.Popen[bytes]:
        proc = start_coordinator(self.nats, self.cluster, self.root,
                                 self.root / "trainer.log", **settings)
        self.procs.append(proc)
        return proc

    async def drain(self, node: str) -> None:
        drains = await self.bus.kv(KV_DRAINS)
        await drains.put(subjects.node_key(self.cluster, node), b"maintenance")


@pytest.fixture
async def env(nats_server: NatsServer, tmp_path: Path, uid: str) -> AsyncIterator[Env]:
    bus = await Bus.connect(load(Settings, nats_url=nats_server.url), "test")
    await bus.provision(core_streams())
    e = Env(bus=bus, cluster=f"c{uid}", root=tmp_path, procs=[], nats=nats_server)
    try:
        yield e
    finally:
        for p in e.procs:
            # NOTE: in a thread, so this loop goes on serving what the test plays (node
            # agents answering the stopping coordinator's orders): blocked, it answered
            # nothing, and each stop waited out its orders' timeouts or the drain.
            await asyncio.to_thread(stop_process, p)
        await bus.drain()


def idle(run_id: str, cluster: str, **over: Any) -> dict[str, Any]:
    """A one-rank run on node n9 (drained by the tests that use it: nothing launches),
    retrying slowly and for long."""
    return tiny(run_id, cluster=cluster, ranks=1, nodes=["n9"], **{
        "watchdog": {"max_restarts": 1000, "backoff_s": 3, "backoff_max_s": 3}, **over})


async def record(bus: Bus, run_id: str) -> RunRecord:
    got = await (await bus.typed(KV_RUNS, RunRecord)).get(run_id)
    assert got is not None
    return got[0]


# ------------------------------------------------------------- a coordinator restarted


async def test_a_coordinator_restarted_while_node_agents_start_an_attempt_orders_the_next(
        env: Env) -> None:
    """LAUNCHER=nodes: the coordinator is killed -9 once both nodes were ordered attempt
    1, before any rank said hello. The coordinator that adopts the run orders attempt 2
    (a node agent answers a repeated attempt 1 with the torchrun it holds, whose ranks
    report to the dead coordinator), and the restart is not counted against
    ``max_restarts`` (0 here)."""
    orders: asyncio.Queue[NodeLaunch] = asyncio.Queue()

    async def agent(msg: Any) -> None:  # the test plays both nodes' agents
        order = events.decode(msg.data, events.NodeOrder)
        if isinstance(order, NodeLaunch):
            orders.put_nowait(order)
        await msg.respond(events.encode(NodeReply(
            node=msg.subject.rsplit(".", 1)[-1], master_addr="127.0.0.1", master_port=1)))

    for node in ("n0", "n1"):
        await env.bus.nc.subscribe(subjects.trainer_node(env.cluster, node), cb=agent)
    first = env.coordinator(launcher="nodes", agent_lost_after_s="600")
    await submit_run(env.bus, tiny("adopt", cluster=env.cluster, nodes=["n0", "n1"],
                                   watchdog={"max_restarts": 0, "startup_timeout_s": 200}))
    ordered = [await asyncio.wait_for(orders.get(), DEADLINE) for _ in range(2)]
    assert {(o.node, o.attempt) for o in ordered} == {("n0", 1), ("n1", 1)}
    first.kill()
    first.wait()

    env.coordinator(launcher="nodes", agent_lost_after_s="600")
    again = await asyncio.wait_for(orders.get(), DEADLINE)
    assert again.attempt == 2, f"the adopting coordinator ordered attempt {again.attempt}"
    rec = await until(env.bus, "adopt", lambda r: r.attempt == 2, timeout=DEADLINE)
    assert rec.restarts == 0 and not rec.state.terminal
    assert [i["kind"] for i in rec.incidents] == ["coordinator_restart"]


# --------------------------------------------------------------- the record's size


@pytest.mark.parametrize("grown", ["incidents", "stragglers"])
async def test_a_run_record_grown_to_max_payload_still_reaches_its_end(
        env: Env, grown: str) -> None:
    """A run adopted with a record a few bytes under max_payload (``incidents``: many
    long ones, as a run restarting for long made them; ``stragglers``: a list its
    supervisor does not rewrite): every write must still land, the run's end included.
    Incidents are kept the newest ``MAX_INCIDENTS``, the older with long fields cut; a
    terminal write that does not fit even so is written with every list cut harder."""
    await env.drain("n9")
    config = parse_run_config(idle("big", env.cluster, watchdog={
        "max_restarts": 1, "backoff_s": 0, "backoff_max_s": 0}))
    long = {"kind": "hang", "attempt": 1, "stacks": {str(r): {"stack": "x" * 3000}
                                                     for r in range(8)}}
    base = RunRecord(run_id="big", config=config.model_dump(mode="json"),
                     state=RunState.restarting, coordinator=f"{env.cluster}.n0")
    limit = env.bus.nc.max_payload
    entries = (limit - len(events.encode(base))) // (len(events.encode(long)) + 1)
    rec = msgspec.structs.replace(base, **{grown: [long] * entries})
    free = limit - 64 - len(events.encode(rec))  # filled up to 64 bytes short of it
    rec = msgspec.structs.replace(rec, nodes=["n" * (free - 2)])
    kv = await env.bus.typed(KV_RUNS, RunRecord)
    await kv.put("big", rec)
    assert len(events.encode(rec)) == limit - 64

    sup = RunSupervisor(env.bus, SupervisorConfig(
        checkpoint_root=env.root / "ckpt", work_root=env.root / "work",
        cluster=env.cluster, node="n0", record_retry_s=2.0), "big", config,
        LocalLauncher(), log.get("test"))
    state = await asyncio.wait_for(sup.run(asyncio.Event(), adopted=True), DEADLINE)
    assert state == RunState.failed
    got = await record(env.bus, "big")
    assert got.state == RunState.failed, "the record never reached the run's end"
    assert len(events.encode(got)) < limit
    kinds = [i["kind"] for i in got.incidents]
    assert kinds[-2:] == (["no_healthy_nodes", "no_healthy_nodes"] if grown == "incidents"
                          else ["no_healthy_nodes", "record_cut"])
    assert len(got.incidents) <= supervisor.MAX_INCIDENTS
    if grown == "incidents":
        hang = got.incidents[0]["stacks"]["0"]["stack"]
        assert len(hang) < 3000 and "characters cut" in hang
    else:
        assert len(got.stragglers) <= 2
        assert "gave up after 1 restarts" in got.incidents[-1]["reason"]


# ------------------------------------------------------------- slots, cancel, stop


async def holding_the_slot(env: Env) -> subprocess.Popen[bytes]:
    """A coordinator with MAX_RUNS=1 whose one slot a run holds (its node drained: it
    restarts slowly, launching nothing), and a second run claimed, waiting for it."""
    await env.drain("n9")
    proc = env.coordinator(max_runs="1")
    await submit_run(env.bus, idle("holder", env.cluster))
    await until(env.bus, "holder", lambda r: r.restarts >= 1, timeout=DEADLINE)
    await submit_run(env.bus, tiny("queued", cluster=env.cluster, ranks=1, nodes=["n0"]))
    await until(env.bus, "queued", lambda r: r.state == RunState.starting, timeout=DEADLINE)
    return proc


async def test_a_run_cancelled_while_it_waits_for_a_slot_ends_cancelled(env: Env) -> None:
    await holding_the_slot(env)
    await cancel_run(env.bus, "queued", "changed my mind")
    rec = await until(env.bus, "queued", lambda r: r.state.terminal, timeout=DEADLINE)
    assert rec.state == RunState.cancelled
    assert (await record(env.bus, "holder")).state == RunState.restarting  # still going
    assert not (env.root / "work" / "queued").exists()  # never launched


async def test_a_stopping_coordinator_launches_no_run_that_waited_for_a_slot(
        env: Env) -> None:
    proc = await holding_the_slot(env)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(DEADLINE) == 0
    rec = await record(env.bus, "queued")
    assert not (env.root / "work" / "queued").exists(), "launched by a stopping coordinator"
    # left as it was claimed, for the coordinator that adopts it
    assert (rec.state, rec.attempt, rec.incidents) == (RunState.starting, 0, [])


# ----------------------------------------------------------------- a refused run


async def test_a_run_the_coordinator_refuses_ends_failed_with_the_reason(env: Env) -> None:
    (env.root / "data").mkdir()
    env.coordinator(data_root=str(env.root / "data"))
    await submit_run(env.bus, tiny("escape", cluster=env.cluster, ranks=1, data={
        "kind": "image_folder", "path": "../../../etc"}))
    rec = await until(env.bus, "escape", lambda r: r.state.terminal, timeout=DEADLINE)
    assert rec.state == RunState.failed
    [incident] = rec.incidents
    assert incident["kind"] == "invalid_config"
    assert "outside this trainer's data root" in incident["reason"]


# ------------------------------------------------------- torchrun dies with it


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def pending_sigterm(pid: int) -> bool:
    """Whether SIGTERM waits, undelivered, on process ``pid`` (it is stopped)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


async def until_true(what: str, pred: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE
    while not pred():
        assert time.monotonic() < deadline, f"not within {DEADLINE:g}s: {what}"
        await asyncio.sleep(0.05)  # polling /proc: there is no event to wait on


async def test_a_local_coordinator_killed_outright_takes_its_torchrun_with_it(
        env: Env) -> None:
    """LAUNCHER=local: kill -9 of the coordinator sends its torchrun SIGTERM
    (``PR_SET_PDEATHSIG``), which torchrun passes on to its ranks. The rank is stopped
    first (SIGSTOP), so only torchrun can tell it: its SIGTERM waits on it, pending."""
    proc = env.coordinator()
    await submit_run(env.bus, tiny("orphan", cluster=env.cluster, ranks=1, steps=100_000,
                                   nodes=["n0"]))
    rec = await until(env.bus, "orphan", lambda r: bool(r.ranks), timeout=DEADLINE * 2)
    rank = int(rec.ranks[0]["pid"])
    torchrun = parent(rank)
    try:
        os.kill(rank, signal.SIGSTOP)
        await until_true("the rank is stopped", lambda: proc_state(rank) in ("T", "t"))
        proc.kill()
        proc.wait()
        await until_true("torchrun told its rank to stop", lambda: pending_sigterm(rank))
    finally:
        for pid in (rank, torchrun):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
