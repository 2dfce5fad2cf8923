"""The cluster agent on a real nats-server: telemetry, transitions, heartbeats, drains,
restarts without duplicate transitions, kill -9, and its node's GPU gauges on /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import time
import types
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import DiscardPolicy

from tandem.cli.devstack import NatsServer, logged_metrics_port
from tandem.cluster_agent import clock as clock_mod
from tandem.cluster_agent import faults
from tandem.cluster_agent.agent import NodeAgent
from tandem.cluster_agent.clock import ManualClock, WallClock
from tandem.cluster_agent.sim import SimBackend
from tandem.common import fleet, subjects
from tandem.common.bus import Bus
from tandem.common.events import Health, HealthTransition, NodeHeartbeat, NodeTelemetry, decode
from tandem.common.streams import (
    HEALTH,
    HEARTBEAT_TTL,
    KV_DRAINS,
    KV_NODES,
    TELEMETRY,
    core_streams,
)
from tests.conftest import PYTHON, service_env
from tests.observability_support import scrape


async def until(cond: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    """Wait for ``cond()`` (sync or async) to be truthy, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.02)  # polling a condition, with the deadline above


async def transitions(bus: Bus, cluster: str, node: str) -> list[HealthTransition]:
    """Every transition stored in HEALTH for one node, oldest first."""
    sub = await bus.js.pull_subscribe(subjects.health(cluster, node), stream=HEALTH)
    try:
        pending = (await sub.consumer_info()).num_pending
        out: list[HealthTransition] = []
        while len(out) < pending:
            out += [decode(m.data, HealthTransition)
                    for m in await sub.fetch(pending - len(out), timeout=5)]
        return out
    finally:
        await sub.unsubscribe()


async def stored(bus: Bus, stream: str, subject: str) -> int:
    info = await bus.js.stream_info(stream, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


@pytest.fixture
async def fleet_bus(bus: Bus) -> Bus:
    await bus.provision(core_streams())
    return bus


def agent_for(bus: Bus, cluster: str, script: str = "", gpus: int = 4, node: str = "n1",
              clock: ManualClock | None = None, **options: Any) -> tuple[NodeAgent, ManualClock]:
    clock = clock or ManualClock(time.time())
    sim = SimBackend(gpus=gpus, load=0.95, faults=faults.parse(script), seed=3)
    return NodeAgent(bus, cluster, node, sim, clock, **options), clock


async def ticks(agent: NodeAgent, clock: ManualClock, n: int) -> None:
    for _ in range(n):
        clock.advance(1.0)
        await agent.tick()


async def test_agent_publishes_telemetry_and_a_transition_with_evidence_then_auto_drains(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent, clock = agent_for(fleet_bus, cluster, "3 xid gpu=1 code=79")
    await agent.start()
    await ticks(agent, clock, 5)
    await until(lambda: agent.state == Health.drained, what="the agent's own drain")

    trs = await transitions(fleet_bus, cluster, "n1")
    assert [(t.previous, t.current, t.rule) for t in trs] == [
        (Health.healthy, Health.unhealthy, "xid-79"), (Health.unhealthy, Health.drained, "drain")]
    bad = trs[0]
    assert (bad.gpu, bad.action, bad.seq, bad.active) == (1, "replace", 1, ["xid-79@1"])
    assert bad.evidence["values"] == {"xid": 79} and bad.evidence["at"] == bad.at
    assert "fallen off the bus" in bad.reason

    subject = subjects.telemetry(cluster, "n1")
    assert await stored(fleet_bus, TELEMETRY, subject) == 5
    last = decode((await fleet_bus.js.get_last_msg(TELEMETRY, subject)).data, NodeTelemetry)
    assert len(last.gpus) == 4 and last.seq == 5 and all(g.util is not None for g in last.gpus)

    record = await fleet.drain_record(fleet_bus, cluster, "n1")
    assert record is not None and record.by == "agent" and "xid-79 on GPU 1" in record.reason
    hb = await until(lambda: fleet.heartbeat(fleet_bus, cluster, "n1"))
    await until(lambda: agent.heartbeats and agent.heartbeat_value().drained)
    await agent.heartbeat()
    hb = await fleet.heartbeat(fleet_bus, cluster, "n1")
    assert hb is not None
    assert (hb.health, hb.drained, hb.gpus_total, hb.gpus_usable, hb.gpus_free) == (
        Health.drained, True, 4, 3, 0)
    assert hb.findings == ["xid-79@1"] and len(hb.gpus) == 4

    await agent.close()
    assert await fleet.heartbeat(fleet_bus, cluster, "n1") is None  # graceful stop: gone now


async def test_an_agent_restart_resumes_without_duplicate_transitions(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    # A lasting fault (thermal) and a one-off event (XID 79, latched) before the restart.
    first, clock = agent_for(fleet_bus, cluster, "1 thermal gpu=2; 25 xid gpu=0 code=79",
                             auto_drain=False)
    await first.start()
    await ticks(first, clock, 30)
    before = await transitions(fleet_bus, cluster, "n1")
    assert [t.current for t in before] == [Health.degraded, Health.unhealthy]
    await first.close(remove_heartbeat=False)  # as if it died

    # After the restart the thermal fault is still there; the XID is not repeated.
    second, _ = agent_for(fleet_bus, cluster, "0 thermal gpu=2", clock=clock, auto_drain=False)
    await second.start()
    assert (second.state, second.seq) == (Health.unhealthy, 2)
    await ticks(second, clock, 60)
    assert await transitions(fleet_bus, cluster, "n1") == before
    assert not second.published
    assert "xid-79@0" in second.tracker.active()
    await second.close()


async def test_drain_and_undrain_move_the_node_and_workers_watch_it(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent, clock = agent_for(fleet_bus, cluster, "2 xid gpu=3 code=63")
    await agent.start()
    changes: list[bool] = []

    async def on_change(record: Any) -> None:
        changes.append(record is not None)

    async with fleet.DrainWatch(fleet_bus, cluster, "n1", on_change=on_change) as worker:
        assert not worker.drained
        await ticks(agent, clock, 3)
        assert agent.state == Health.degraded  # XID 63: reset pending, latched

        await fleet.drain(fleet_bus, cluster, "n1", "swap the PSU", by="ops")
        assert await worker.wait(True, timeout=10)
        assert worker.record is not None and worker.record.reason == "swap the PSU"
        await until(lambda: agent.state == Health.drained, what="drained transition")
        await agent.heartbeat()
        hb = await fleet.heartbeat(fleet_bus, cluster, "n1")
        assert hb is not None and hb.drained and hb.drain_reason == "swap the PSU"
        assert hb.gpus_free == 0

        assert (await fleet.undrain(fleet_bus, cluster, "n1")).reason == "swap the PSU"
        assert await worker.wait(False, timeout=10)
        # The undrain also tells the agent the latched XID 63 was dealt with.
        await until(lambda: agent.state == Health.healthy, what="undrained transition")
        assert changes == [True, False]

    trs = await transitions(fleet_bus, cluster, "n1")
    assert [(t.current, t.rule) for t in trs] == [
        (Health.degraded, "xid-63"), (Health.drained, "drain"), (Health.healthy, "undrain")]
    assert trs[1].evidence["by"] == "ops"
    assert trs[2].evidence["cleared"] == ["xid-63@3"]
    await agent.close()


async def test_the_agent_and_its_drain_watch_survive_a_nats_server_kill_9(
        nats_server: NatsServer, fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent, clock = agent_for(fleet_bus, cluster)
    await agent.start()
    await ticks(agent, clock, 1)
    nats_server.kill()
    nats_server.start()  # same port and file store
    await until(lambda: fleet_bus.nc.is_connected, timeout=20, what="the reconnect")
    await until(lambda: _tick_ok(agent, clock), timeout=20, what="a tick after the restart")
    await fleet.drain(fleet_bus, cluster, "n1", "after the restart")
    await until(lambda: agent.state == Health.drained, timeout=20, what="the drain seen")
    assert await stored(fleet_bus, TELEMETRY, subjects.telemetry(cluster, "n1")) >= 2
    await agent.close()


async def _tick_ok(agent: NodeAgent, clock: ManualClock) -> bool:
    stored = agent.telemetry_stored
    try:
        await ticks(agent, clock, 1)
    except Exception:
        return False
    # A tick whose telemetry the stream refused does not raise (it is logged): whole
    # only when its telemetry was stored too.
    return agent.telemetry_stored > stored


async def test_a_garbage_drain_record_counts_as_drained(fleet_bus: Bus, uid: str) -> None:
    kv = await fleet_bus.kv("drains")
    await kv.put(subjects.node_key(f"c{uid}", "n1"), b"\x00not json")
    async with fleet.DrainWatch(fleet_bus, f"c{uid}", "n1") as watch:
        assert watch.drained and "unreadable drain record" in watch.record.reason  # type: ignore[union-attr]


async def test_models_announced_by_workers_appear_in_the_heartbeat(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent, _ = agent_for(fleet_bus, cluster, models=["base"])
    await agent.start()
    await fleet.announce_models(fleet_bus, cluster, "n1", "worker-0", ["digits", "tiny"])
    await fleet_bus.synced()
    await until(lambda: agent.heartbeat_value().models == ["base", "digits", "tiny"])
    await agent.close()


# ------------------------------------------------------------------------------ processes


def start_agent(server: NatsServer, cluster: str, script: str, log: Path | None = None,
                **settings: str) -> subprocess.Popen[bytes]:
    env = service_env(**{"nats_url": server.url, "cluster": cluster, "node": "n1",
                         "agent_backend": "sim", "sim_gpus": "2", "sim_load": "0.9",
                         "agent_interval": "0.2", "sim_faults": script, **settings})
    if log is None:
        return subprocess.Popen([PYTHON, "-m", "tandem.cluster_agent"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with log.open("ab") as out:
        return subprocess.Popen([PYTHON, "-m", "tandem.cluster_agent"], env=env,
                                stdout=out, stderr=subprocess.STDOUT)


async def test_heartbeat_expires_after_kill_9_and_a_restart_adds_no_transition(
        nats_server: NatsServer, fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    script = "0.5 xid gpu=0 code=79"
    proc = start_agent(nats_server, cluster, script)
    try:
        await until(lambda: transitions(fleet_bus, cluster, "n1"), timeout=30,
                    what="the first transition")
        await until(lambda: fleet.heartbeat(fleet_bus, cluster, "n1"), what="a heartbeat")
        await until(lambda: _count(fleet_bus, cluster, 2), what="the drained transition")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        # Nothing deletes it now: the key's TTL in KV nodes removes it (the deadline is a
        # hang guard, many TTLs long; how soon it goes is the server's timer, not ours).
        await until(lambda: _gone(fleet_bus, cluster), timeout=HEARTBEAT_TTL * 10,
                    what="the heartbeat to expire")

        proc = start_agent(nats_server, cluster, script)  # the same script: XID 79 again
        await until(lambda: _beats(fleet_bus, cluster, 15), timeout=30, what="15 heartbeats")
        trs = await transitions(fleet_bus, cluster, "n1")
        assert [(t.current, t.seq) for t in trs] == [(Health.unhealthy, 1), (Health.drained, 2)]

        proc.send_signal(signal.SIGTERM)  # a graceful stop removes the heartbeat at once
        assert proc.wait(timeout=30) == 0
        assert await fleet.heartbeat(fleet_bus, cluster, "n1") is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _count(bus: Bus, cluster: str, n: int) -> bool:
    return await stored(bus, HEALTH, subjects.health(cluster, "n1")) == n


async def _gone(bus: Bus, cluster: str) -> bool:
    return await fleet.heartbeat(bus, cluster, "n1") is None


async def _beats(bus: Bus, cluster: str, n: int) -> bool:
    hb = await fleet.heartbeat(bus, cluster, "n1")
    return hb is not None and hb.seq >= n


async def test_the_agent_die_fault_kills_the_agent_like_kill_9(
        nats_server: NatsServer, fleet_bus: Bus, uid: str) -> None:
    proc = start_agent(nats_server, f"c{uid}", "1 agent-die")
    try:
        assert await asyncio.to_thread(proc.wait, 30) == -signal.SIGKILL
        # Nothing graceful ran: the heartbeat is left to expire.
        assert await fleet.heartbeat(fleet_bus, f"c{uid}", "n1") is not None
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


async def test_the_agents_metrics_carry_its_gpus_as_its_last_telemetry_event_says(
        nats_server: NatsServer, fleet_bus: Bus, uid: str, tmp_path: Path) -> None:
    cluster, log = f"c{uid}", tmp_path / "agent.log"
    sub = await fleet_bus.nc.subscribe(subjects.telemetry(cluster, "n1"))
    # One sample at start, the next a minute later: the event read is the last one.
    proc = start_agent(nats_server, cluster, "", log, agent_interval="60", metrics_port="0")
    try:
        port = await asyncio.to_thread(logged_metrics_port, proc, log)
        sample = decode((await sub.next_msg(timeout=30)).data, NodeTelemetry)
        series = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
        gpus = {(name, labels): value for (name, labels), value in series.items()
                if name.startswith("tandem_gpu_")}
        expected = {}
        for g in sample.gpus:
            labels = (("cluster", cluster), ("gpu", str(g.index)), ("node", "n1"))
            expected.update({("tandem_gpu_utilization_percent", labels): g.util,
                             ("tandem_gpu_temperature_celsius", labels): g.temp,
                             ("tandem_gpu_power_watts", labels): g.power,
                             ("tandem_gpu_memory_used_bytes", labels): g.mem_used})
        assert len(sample.gpus) == 2 and None not in expected.values()
        assert gpus == expected
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        await sub.unsubscribe()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_an_xid_sampled_while_nats_is_down_is_classified_published_and_drained_later(
        nats_server: NatsServer, fleet_bus: Bus, uid: str) -> None:
    # The sim hands the XID over once, on the sample taken while the server is away: the
    # agent must classify it before the publish that fails, and publish what it owes later.
    cluster = f"c{uid}"
    agent, clock = agent_for(fleet_bus, cluster, "3 xid gpu=1 code=48")
    await agent.start()
    await ticks(agent, clock, 2)
    nats_server.kill()
    with pytest.raises(Exception):  # noqa: B017 - whatever the client raises with no server
        await ticks(agent, clock, 1)  # the sample carrying XID 48
    assert agent.tracker.active() == ["xid-48@1"]
    nats_server.start()  # same port and file store
    await until(lambda: fleet_bus.nc.is_connected, timeout=20, what="the reconnect")
    await until(lambda: _tick_ok(agent, clock), timeout=20, what="a tick after the restart")

    trs = await transitions(fleet_bus, cluster, "n1")
    assert [(t.previous, t.current, t.rule, t.gpu) for t in trs][:1] == [
        (Health.healthy, Health.unhealthy, "xid-48", 1)]
    record = await until(lambda: fleet.drain_record(fleet_bus, cluster, "n1"), what="the drain")
    assert record.by == "agent" and "xid-48 on GPU 1" in record.reason
    await agent.close()


async def test_a_failed_health_publish_keeps_the_cause_and_the_auto_drain_for_the_next_tick(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    agent, clock = agent_for(fleet_bus, cluster, "3 xid gpu=1 code=79")
    await agent.start()
    await ticks(agent, clock, 2)
    # The server refuses new HEALTH messages (a full stream, discard new) for one tick:
    # telemetry lands, the transition's publish fails on the tick XID 79 fires.
    await fleet_bus.publish(subjects.health(cluster, "other"), NodeTelemetry(
        cluster=cluster, node="other", gpus=[], at=0.0, seq=0))  # the stream is not empty
    info = await fleet_bus.js.stream_info(HEALTH)
    full = dataclasses.replace(info.config, max_msgs=info.state.messages, discard=DiscardPolicy.NEW)
    await fleet_bus.js.update_stream(full)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the server's "maximum messages exceeded"
            await ticks(agent, clock, 1)
        assert agent.tracker.active() == ["xid-79@1"] and agent.state == Health.healthy
    finally:
        await fleet_bus.js.update_stream(info.config)
    await ticks(agent, clock, 1)

    await until(lambda: agent.state == Health.drained, what="the agent's own drain")
    trs = await transitions(fleet_bus, cluster, "n1")
    assert [(t.previous, t.current, t.rule) for t in trs] == [
        (Health.healthy, Health.unhealthy, "xid-79"), (Health.unhealthy, Health.drained, "drain")]
    assert trs[0].gpu == 1 and "fallen off the bus" in trs[0].reason
    record = await fleet.drain_record(fleet_bus, cluster, "n1")
    assert record is not None and record.by == "agent" and "xid-79 on GPU 1" in record.reason
    await agent.close()


async def test_an_agent_killed_between_unhealthy_and_its_drain_drains_when_it_restarts(
        fleet_bus: Bus, uid: str) -> None:
    cluster = f"c{uid}"
    await fleet.drain(fleet_bus, cluster, "other", "keeps the bucket non-empty")
    drains = await fleet_bus.js.stream_info(f"KV_{KV_DRAINS}")
    full = dataclasses.replace(drains.config, max_msgs=drains.state.messages,
                               discard=DiscardPolicy.NEW)
    first, clock = agent_for(fleet_bus, cluster, "3 xid gpu=1 code=79")
    await first.start()
    await ticks(first, clock, 2)
    # The drain write is refused (a full bucket) on the tick XID 79 fires; the agent dies.
    await fleet_bus.js.update_stream(full)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the server's "maximum messages exceeded"
            await ticks(first, clock, 1)
        assert first.state == Health.unhealthy and not first.drain.drained
        await first.close(remove_heartbeat=False)  # as if it died
    finally:
        await fleet_bus.js.update_stream(drains.config)
    assert await fleet.drain_record(fleet_bus, cluster, "n1") is None

    second, _ = agent_for(fleet_bus, cluster, clock=clock)
    await second.start()
    await until(lambda: second.state == Health.drained, what="the drain owed at the restart")
    record = await fleet.drain_record(fleet_bus, cluster, "n1")
    assert record is not None and record.by == "agent" and "xid-79 on GPU 1" in record.reason
    await second.close(remove_heartbeat=False)

    # Undrained by the operator, the latched XID is cleared; a restart drains nothing again.
    await fleet.undrain(fleet_bus, cluster, "n1")
    third, _ = agent_for(fleet_bus, cluster, clock=clock)
    await third.start()
    await until(lambda: third.state == Health.healthy, what="the undrain seen at start")
    await ticks(third, clock, 3)
    assert await fleet.drain_record(fleet_bus, cluster, "n1") is None
    trs = await transitions(fleet_bus, cluster, "n1")
    assert [(t.current, t.rule) for t in trs] == [
        (Health.unhealthy, "xid-79"), (Health.drained, "drain"), (Health.healthy, "undrain")]
    assert (trs[0].handled, trs[1].handled) == ([], ["xid-79@1"])
    await third.close()


async def test_a_fault_that_never_heals_on_a_node_already_drained_survives_a_restart(
        fleet_bus: Bus, uid: str) -> None:
    """A second XID while the node is drained for the first changes no state, but it is
    noted (a transition from drained to drained, with the evidence), so a restarted agent
    still knows both GPUs are bad: its findings and usable GPUs say so until an undrain."""
    cluster = f"c{uid}"
    first, clock = agent_for(fleet_bus, cluster, "3 xid gpu=1 code=79; 8 xid gpu=3 code=79")
    await first.start()
    await ticks(first, clock, 5)
    await until(lambda: first.state == Health.drained, what="the drain for GPU 1")
    await ticks(first, clock, 5)
    trs = await transitions(fleet_bus, cluster, "n1")
    assert [(t.previous, t.current, t.rule, t.gpu) for t in trs] == [
        (Health.healthy, Health.unhealthy, "xid-79", 1),
        (Health.unhealthy, Health.drained, "drain", None),
        (Health.drained, Health.drained, "xid-79", 3)]
    assert trs[-1].active == ["xid-79@1", "xid-79@3"] and trs[-1].reason.startswith("also: ")
    await first.close(remove_heartbeat=False)  # as if it died

    second, _ = agent_for(fleet_bus, cluster, clock=clock)
    await second.start()
    assert second.tracker.active() == ["xid-79@1", "xid-79@3"]
    await ticks(second, clock, 3)
    assert second.heartbeat_value().gpus_usable == 2  # of 4: GPUs 1 and 3 held
    assert len(await transitions(fleet_bus, cluster, "n1")) == 3  # nothing again
    await second.close()


async def test_a_backward_wall_clock_step_does_not_stop_ticks_or_heartbeats(
        fleet_bus: Bus, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # NTP steps this host's wall clock back an hour while the agent runs on WallClock.
    step = {"s": 0.0}
    monkeypatch.setattr(clock_mod, "time", types.SimpleNamespace(
        time=lambda: time.time() - step["s"], monotonic=time.monotonic))
    sim = SimBackend(gpus=2, load=0.5, faults=[], seed=1)
    agent = NodeAgent(fleet_bus, f"c{uid}", "n1", sim, WallClock(), interval=0.05)
    await agent.start()
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await until(lambda: agent.samples >= 2, what="ticks before the step")
        step["s"] = 3600.0
        samples, heartbeats = agent.samples, agent.heartbeats
        await until(lambda: agent.samples >= samples + 3 and agent.heartbeats >= heartbeats + 3,
                    what="ticks and heartbeats after the step")
    finally:
        stop.set()
        await task
        await agent.close()


async def test_read_fleet_counts_a_present_heartbeat_up_whatever_the_agents_clock(
        fleet_bus: Bus, uid: str) -> None:
    # An agent whose clock lags this host's by more than the TTL: its entry is fresh (the
    # KV's TTL has not removed it), so the node is up; its age comes from the server.
    cluster = f"c{uid}"
    kv = await fleet_bus.typed(KV_NODES, NodeHeartbeat)
    await kv.put(subjects.node_key(cluster, "n1"), NodeHeartbeat(
        cluster=cluster, node="n1", health=Health.healthy, gpus_total=4,
        at=time.time() - 10 * HEARTBEAT_TTL))
    view = await fleet.read_fleet(fleet_bus)
    c = view.cluster(cluster)
    assert c is not None
    [n] = c.nodes
    assert (n.status, n.up, n.serving) == ("healthy", True, True)
    assert n.age_s is not None and n.age_s < HEARTBEAT_TTL
