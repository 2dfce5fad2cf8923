"""The cluster agent when the bus or the fleet misbehaves (red-team findings, real
nats-server): a TELEMETRY stream that refuses samples, junk on the node's HEALTH subject
and a taken msg id, two agents for one node, unchecked model announcements, a backend
with no GPU and NVML without a driver."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
from nats.js.api import DiscardPolicy

from tandem.cli.devstack import NatsServer
from tandem.cluster_agent import nvml
from tandem.cluster_agent.agent import NodeAgent
from tandem.cluster_agent.announced import MAX_MODELS
from tandem.cluster_agent.backend import NoGpus, NvmlUnavailable
from tandem.cluster_agent.claim import EXIT_NODE_TAKEN, NodeTaken
from tandem.cluster_agent.clock import ManualClock
from tandem.cluster_agent.nvml import NvmlBackend
from tandem.common import fleet, subjects
from tandem.common.bus import Bus
from tandem.common.errors import EventDecodeError
from tandem.common.events import (
    Health,
    HealthTransition,
    ModelsLoaded,
    NodeHeartbeat,
    decode,
    encode,
)
from tandem.common.streams import HEALTH, KV_NODES, TELEMETRY, core_streams
from tests.conftest import PYTHON, service_env
from tests.test_agent import agent_for, start_agent, ticks, transitions, until
from tests.test_agent_nvml import FakeNvml, FakeNVMLError


@pytest.fixture
async def fleet_bus(bus: Bus) -> Bus:
    await bus.provision(core_streams())
    return bus


def errors(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [x for x in logs if x["event"] == event and x["log_level"] == "error"]


async def running(bus: Bus, cluster: str, script: str = "", samples: int = 0,
                  **options: Any) -> tuple[NodeAgent, ManualClock]:
    """An agent for node n1 of ``cluster``, started, after ``samples`` ticks."""
    agent, clock = agent_for(bus, cluster, script, **options)
    await agent.start()
    await ticks(agent, clock, samples)
    return agent, clock


# ------------------------------------------------------------------------------ telemetry


async def test_a_telemetry_stream_that_refuses_samples_holds_back_no_transition_drain_or_heartbeat(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent, clock = await running(fleet_bus, cluster, "3 xid gpu=1 code=79", 2)
    # TELEMETRY refuses new messages (full, discard new: as when its leader is away);
    # HEALTH and KV still take writes.
    info = await fleet_bus.js.stream_info(TELEMETRY)
    full = dataclasses.replace(info.config, max_msgs=info.state.messages,
                               discard=DiscardPolicy.NEW)
    await fleet_bus.js.update_stream(full)
    try:
        await ticks(agent, clock, 1)  # the sample carrying XID 79: nothing raised
        assert agent.telemetry_failed == 1
        await until(lambda: agent.state == Health.drained, what="the agent's own drain")
        trs = await transitions(fleet_bus, cluster, "n1")
        assert [(t.current, t.rule) for t in trs] == [
            (Health.unhealthy, "xid-79"), (Health.drained, "drain")]
        hb = await fleet.heartbeat(fleet_bus, cluster, "n1")
        assert hb is not None and hb.seq >= 3 and hb.findings == ["xid-79@1"]
    finally:
        await fleet_bus.js.update_stream(info.config)
    await agent.close()


# ------------------------------------------------------------------- transition numbers


async def test_a_restart_reads_past_junk_on_the_health_subject_to_the_last_transition(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    first, clock = await running(fleet_bus, cluster, "3 xid gpu=1 code=79", 4)
    await until(lambda: first.state == Health.drained, what="drained for XID 79")
    await first.close()
    await fleet_bus.js.publish(subjects.health(cluster, "n1"), b"not json at all")

    second, _ = await running(fleet_bus, cluster, "2 xid gpu=2 code=48", clock=clock)
    # Resumed from seq 2 (the drain), the latched XID 79 remembered.
    assert (second.state, second.seq, second.tracker.active()) == (
        Health.drained, 2, ["xid-79@1"])
    await ticks(second, clock, 3)
    trs = await transitions_past_junk(fleet_bus, cluster)
    assert [(t.seq, t.current, t.rule, t.gpu) for t in trs] == [
        (1, Health.unhealthy, "xid-79", 1), (2, Health.drained, "drain", None),
        (3, Health.drained, "xid-48", 2)]
    await second.close()


async def test_a_restart_finding_only_junk_numbers_on_past_every_msg_id_used(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    subject = subjects.health(cluster, "n1")
    first, clock = await running(fleet_bus, cluster, "3 xid gpu=1 code=79", 4,
                                 auto_drain=False)
    assert (first.state, first.seq) == (Health.unhealthy, 1)
    await first.close()
    # More junk than a restart reads back: its transitions are out of reach.
    await fleet_bus.publish_many([(subject, b"junk", None)] * 300)
    last = await fleet_bus.js.get_last_msg(HEALTH, subject)

    second, _ = await running(fleet_bus, cluster, "2 xid gpu=2 code=48", clock=clock,
                              auto_drain=False)
    assert second.seq == last.seq  # the junk's stream sequence: no msg id of the node's
    await ticks(second, clock, 3)
    trs = await transitions_past_junk(fleet_bus, cluster)
    assert [(t.seq, t.current, t.rule) for t in trs] == [
        (1, Health.unhealthy, "xid-79"), (last.seq + 1, Health.unhealthy, "xid-48")]
    await second.close()


async def test_a_transition_whose_msg_id_is_taken_is_a_conflict_published_under_the_next(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    # Another writer already used the node's msg id for seq 1 (here on another subject:
    # msg ids are the stream's), within the duplicate window.
    await fleet_bus.publish(subjects.health(cluster, "other"), HealthTransition(
        cluster=cluster, node="other", previous=Health.healthy, current=Health.degraded,
        rule="x", reason="x", seq=1), msg_id=f"health-{cluster}-n1-1")
    with structlog.testing.capture_logs() as logs:
        agent, _ = await running(fleet_bus, cluster, "2 xid gpu=1 code=48", 3,
                                 auto_drain=False)
    [tr] = await transitions(fleet_bus, cluster, "n1")
    assert (tr.seq, tr.current, tr.rule) == (2, Health.unhealthy, "xid-48")
    assert (agent.seq, agent.state) == (2, Health.unhealthy)
    [conflict] = errors(logs, "agent.transition_conflict")
    assert conflict["msg_id"] == f"health-{cluster}-n1-1"
    await agent.close()


async def test_a_duplicate_of_this_instances_own_earlier_try_is_no_conflict(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    with structlog.testing.capture_logs() as logs:
        agent, clock = agent_for(fleet_bus, cluster, "2 xid gpu=1 code=48", auto_drain=False)
        await agent.start()
        # As if the agent's first try of seq 1 landed and its ack was lost.
        await fleet_bus.publish(subjects.health(cluster, "n1"), HealthTransition(
            cluster=cluster, node="n1", previous=Health.healthy, current=Health.unhealthy,
            rule="xid-48", reason="earlier try", seq=1, evidence={"agent": agent.instance}),
            msg_id=f"health-{cluster}-n1-1")
        await ticks(agent, clock, 3)
    assert [(t.seq, t.reason) for t in await transitions(fleet_bus, cluster, "n1")] == [
        (1, "earlier try")]
    assert (agent.seq, agent.state) == (1, Health.unhealthy)
    assert not errors(logs, "agent.transition_conflict")
    await agent.close()


async def transitions_past_junk(bus: Bus, cluster: str) -> list[HealthTransition]:
    """The node's transitions in HEALTH, junk left out."""
    sub = await bus.js.pull_subscribe(subjects.health(cluster, "n1"), stream=HEALTH)
    try:
        pending = (await sub.consumer_info()).num_pending
        out: list[HealthTransition] = []
        seen = 0
        while seen < pending:
            for m in await sub.fetch(pending - seen, timeout=5):
                seen += 1
                try:
                    out.append(decode(m.data, HealthTransition))
                except EventDecodeError:
                    pass
        return out
    finally:
        await sub.unsubscribe()


# ------------------------------------------------------------------ one agent per node


async def test_a_second_agent_for_a_node_with_a_fresh_heartbeat_refuses_to_start(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    first, clock = await running(fleet_bus, cluster, samples=1, gpus=8)
    second, _ = agent_for(fleet_bus, cluster, gpus=4, clock=clock, claim_wait=0)
    with pytest.raises(NodeTaken) as refused:
        await second.start()
    assert "TANDEM_NODE=n1" in str(refused.value) and first.instance in str(refused.value)
    hb = await fleet.heartbeat(fleet_bus, cluster, "n1")
    assert hb is not None and (hb.instance, hb.gpus_total) == (first.instance, 8)
    await first.close()


async def test_a_replacement_agent_waits_for_the_old_one_to_stop_then_starts(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    old, clock = await running(fleet_bus, cluster, samples=1)
    new, _ = agent_for(fleet_bus, cluster, clock=clock, claim_wait=120.0)  # a hang guard
    starting = asyncio.create_task(new.start())
    await until(lambda: new.waiting_for == old.instance, what="the new agent waiting")
    await old.close()  # the old pod's graceful stop deletes its heartbeat
    assert await asyncio.wait_for(starting, timeout=30)
    await ticks(new, clock, 1)
    hb = await fleet.heartbeat(fleet_bus, cluster, "n1")
    assert hb is not None and hb.instance == new.instance
    await new.close()


async def test_an_agent_whose_heartbeat_is_taken_over_says_so_and_stops(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    with structlog.testing.capture_logs() as logs:
        agent, _ = await running(fleet_bus, cluster, samples=1)
        kv = await fleet_bus.typed(KV_NODES, NodeHeartbeat)
        await kv.put(subjects.node_key(cluster, "n1"), NodeHeartbeat(
            cluster=cluster, node="n1", gpus_total=2, instance="intruder"))
        with pytest.raises(NodeTaken) as taken:
            await asyncio.wait_for(agent.run(asyncio.Event()), timeout=30)
    assert "intruder" in str(taken.value) and agent.taken_by == "intruder"
    [said] = errors(logs, "agent.node_taken_over")
    assert said["other"] == "intruder"
    await agent.close()  # removes no heartbeat but its own
    hb = await fleet.heartbeat(fleet_bus, cluster, "n1")
    assert hb is not None and hb.instance == "intruder"


async def test_the_service_refuses_a_second_agent_for_a_node_naming_tandem_node(
        nats_server: NatsServer, fleet_bus: Bus, uid: str, tmp_path: Path) -> None:
    cluster, log = f"c{uid}", tmp_path / "second.log"
    first = start_agent(nats_server, cluster, "")
    second: subprocess.Popen[bytes] | None = None
    try:
        hb = await until(lambda: fleet.heartbeat(fleet_bus, cluster, "n1"), timeout=30,
                         what="the first agent's heartbeat")
        second = start_agent(nats_server, cluster, "", log, agent_claim_wait="0")
        assert await asyncio.to_thread(second.wait, 30) == EXIT_NODE_TAKEN == 3
        text = log.read_text()
        assert "TANDEM_NODE=n1" in text and hb.instance in text
        assert "runner.refused" in text and "runner.crashed" not in text
        again = await fleet.heartbeat(fleet_bus, cluster, "n1")
        assert again is not None and again.instance == hb.instance
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)


# --------------------------------------------------------------------- model announcements


async def test_model_announcements_not_for_this_node_malformed_or_too_many_are_ignored(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent, _ = await running(fleet_bus, cluster, models=["base"])
    subject = subjects.models(cluster, "n1")

    async def announce(worker: str, models: list[str], to: str = cluster,
                       node: str = "n1") -> None:
        await fleet_bus.emit(subject, ModelsLoaded(cluster=to, node=node, worker=worker,
                                                   models=models))

    await announce("stray", ["no-such-model"], to="elsewhere")
    await announce("lost", ["other-node-model"], node="n2")
    await announce("typo", ["good", "bad.name"])
    await announce("flood", [f"m{i}" for i in range(MAX_MODELS + 1)])
    await announce("big", ["x" * 200])
    await announce("w0", ["digits"])  # heard last: the ones before it were handled
    await fleet_bus.synced()
    await until(lambda: "digits" in agent.heartbeat_value().models, what="w0's models")
    assert agent.heartbeat_value().models == ["base", "digits"]
    await agent.close()


async def test_many_workers_announcing_many_models_keep_the_heartbeat_under_max_payload(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent, clock = await running(fleet_bus, cluster, models=["base"])
    for w in range(8):  # each at the bound, 64-character names, all different
        await fleet.announce_models(fleet_bus, cluster, "n1", f"w{w}", [
            f"w{w}-{i:03d}".ljust(64, "m") for i in range(MAX_MODELS)])
    await fleet_bus.synced()
    await fleet.announce_models(fleet_bus, cluster, "n1", "last", ["a-last"])  # sorts first
    await fleet_bus.synced()
    await until(lambda: "a-last" in agent.heartbeat_value().models, what="all heard")
    hb = agent.heartbeat_value()
    assert len(hb.models) == MAX_MODELS and "base" in hb.models
    assert len(encode(hb)) < fleet_bus.nc.max_payload
    await ticks(agent, clock, 1)  # the heartbeat is written
    stored = await fleet.heartbeat(fleet_bus, cluster, "n1")
    assert stored is not None and len(stored.models) == MAX_MODELS
    await agent.close()


# ------------------------------------------------------------------------------- backends


async def test_a_backend_that_opens_no_gpu_is_refused_and_never_heartbeats(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent = NodeAgent(fleet_bus, cluster, "n1", NvmlBackend(FakeNvml([])),
                      ManualClock(time.time()))
    with pytest.raises(NoGpus) as refused:
        await agent.start()
    assert "TANDEM_AGENT_BACKEND=nvml" in str(refused.value)
    assert await fleet.heartbeat(fleet_bus, cluster, "n1") is None


class NoDriver(FakeNvml):
    def nvmlInit(self) -> None:
        raise FakeNVMLError(12)  # NVML_ERROR_LIBRARY_NOT_FOUND


def test_nvml_that_cannot_start_is_a_clear_error_naming_the_setting() -> None:
    with pytest.raises(NvmlUnavailable) as refused:
        NvmlBackend(NoDriver([])).open(0.0)
    assert "TANDEM_AGENT_BACKEND=nvml" in str(refused.value)
    with pytest.raises(NvmlUnavailable):
        nvml.probe(NoDriver([]))


async def test_the_service_on_nvml_without_a_driver_exits_2_naming_the_setting(
        nats_server: NatsServer, fleet_bus: Bus, uid: str) -> None:
    try:
        nvml.probe()
    except NvmlUnavailable:
        pass
    else:
        pytest.skip("NVML works on this host")
    env = service_env(nats_url=nats_server.url, cluster=f"c{uid}", node="n1",
                      agent_backend="nvml", metrics_port="0")
    proc = await asyncio.to_thread(subprocess.run, [PYTHON, "-m", "tandem.cluster_agent"],
                                   env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "TANDEM_AGENT_BACKEND" in proc.stderr and "NVML is unavailable" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert await fleet.heartbeat(fleet_bus, f"c{uid}", "n1") is None
