"""The gateway's observer: its series say what is true now, and only for what it shows.

A gateway runs for months while nodes come and go and runs finish: a node whose heartbeat
key expired reads down for ``GONE_GRACE``, then loses its series, as does a run that left
the view; a node that is down must not keep showing its GPUs' last figures, and a cluster
with no heartbeat left must read unhealthy, not its last value.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.errors import ConnectionClosedError

from tandem.common import fleet, metrics, streams, subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import (
    CheckpointManifest,
    CheckpointWritten,
    GenerationTask,
    GpuBrief,
    NodeHeartbeat,
    TaskRecord,
    encode,
)
from tandem.common.runs import submit_run
from tandem.gateway import observe
from tandem.gateway.observe import Observer


def exposed() -> str:
    return metrics.exposition()[0].decode()


class Clock:
    """Monotonic seconds the test moves (a true edge: how long a node has been gone)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def beat(bus: Bus, cluster: str, node: str, gpus: list[GpuBrief] | None = None) -> None:
    nodes = await bus.kv(streams.KV_NODES)
    await nodes.put(subjects.node_key(cluster, node), encode(NodeHeartbeat(
        cluster=cluster, node=node, gpus_total=1, gpus_usable=1, gpus=gpus or [])))


async def test_nodes_gone_read_down_for_the_grace_then_lose_their_series(
        bus: Bus, uid: str) -> None:
    await bus.provision(streams.core_streams())
    cluster = f"obs{uid}"
    nodes = await bus.kv(streams.KV_NODES)
    gpus = [GpuBrief(index=0, util=50.0, temp=60.0, power=300.0, mem_used=1)]

    for node in ("n1", "n2"):
        await beat(bus, cluster, node, gpus)
    clock = Clock()
    obs = Observer(bus, [cluster], clock=clock)
    await obs.refresh()
    text = exposed()
    for node in ("n1", "n2"):
        assert f'tandem_node_up{{cluster="{cluster}",node="{node}"}} 1.0' in text
        assert (f'tandem_gpu_utilization_percent{{cluster="{cluster}",gpu="0",node="{node}"}}'
                ' 50.0') in text

    await nodes.delete(subjects.node_key(cluster, "n2"))  # its key expired
    # n1 drained, then its agent gone (its key expired too): in the view, down.
    await fleet.drain(bus, cluster, "n1", reason="test: drained, then its agent died")
    await nodes.delete(subjects.node_key(cluster, "n1"))
    await obs.refresh()
    text = exposed()
    for node in ("n1", "n2"):  # n2 left the view: down (not vanished) for the grace
        assert f'tandem_node_up{{cluster="{cluster}",node="{node}"}} 0.0' in text
        assert f'tandem_node_serving{{cluster="{cluster}",node="{node}"}} 0.0' in text
        assert (f'tandem_gpu_utilization_percent{{cluster="{cluster}",gpu="0",node="{node}"}}'
                not in text)
    assert f'tandem_cluster_healthy{{cluster="{cluster}"}} 0.0' in text

    clock.now += observe.GONE_GRACE - 1
    await obs.refresh()
    assert f'tandem_node_up{{cluster="{cluster}",node="n2"}} 0.0' in exposed()
    clock.now += 2  # past the grace: its series go; n1, kept in the view by its drain, stays
    await obs.refresh()
    text = exposed()
    assert not [ln for ln in text.splitlines() if f'cluster="{cluster}"' in ln
                and 'node="n2"' in ln]
    assert f'tandem_node_up{{cluster="{cluster}",node="n1"}} 0.0' in text


async def test_a_node_back_within_the_grace_reads_up_and_its_grace_starts_anew(
        bus: Bus, uid: str) -> None:
    await bus.provision(streams.core_streams())
    cluster = f"back{uid}"
    nodes = await bus.kv(streams.KV_NODES)
    await beat(bus, cluster, "n1")
    clock = Clock()
    obs = Observer(bus, [cluster], clock=clock)
    await obs.refresh()
    await nodes.delete(subjects.node_key(cluster, "n1"))
    await obs.refresh()
    clock.now += observe.GONE_GRACE - 1
    await beat(bus, cluster, "n1")
    await obs.refresh()
    assert f'tandem_node_up{{cluster="{cluster}",node="n1"}} 1.0' in exposed()
    await nodes.delete(subjects.node_key(cluster, "n1"))
    clock.now += 2  # gone again: its grace counts from now, not from its first leaving
    await obs.refresh()
    assert f'tandem_node_up{{cluster="{cluster}",node="n1"}} 0.0' in exposed()


async def test_a_cluster_whose_every_heartbeat_expired_reads_unhealthy(
        bus: Bus, uid: str) -> None:
    """The cluster is gone from the fleet view (no key of it in KV ``nodes``): its last
    value (1) must not stand, and a configured cluster never seen reads 0 too."""
    await bus.provision(streams.core_streams())
    east, never = f"east{uid}", f"never{uid}"
    nodes = await bus.kv(streams.KV_NODES)
    await beat(bus, east, "n1")
    obs = Observer(bus, [east, never])
    await obs.refresh()
    text = exposed()
    assert f'tandem_cluster_healthy{{cluster="{east}"}} 1.0' in text
    assert f'tandem_cluster_healthy{{cluster="{never}"}} 0.0' in text
    await nodes.delete(subjects.node_key(east, "n1"))  # its agent stopped: the key expired
    await obs.refresh()
    assert [c["name"] for c in obs.fleet["clusters"]] == []  # what /v1/clusters shows
    text = exposed()
    assert f'tandem_cluster_healthy{{cluster="{east}"}} 0.0' in text
    assert f'tandem_node_up{{cluster="{east}",node="n1"}} 0.0' in text


async def test_the_last_refresh_time_is_exported_and_stays_while_refreshes_fail(
        bus: Bus, uid: str) -> None:
    """An alert on ``time() - tandem_observer_last_refresh_timestamp_seconds`` catches
    gauges gone stale: a failed refresh (the bus unreadable) leaves the time as it was."""
    await bus.provision(streams.core_streams())
    obs = Observer(bus, [f"c{uid}"])
    before = time.time()
    await obs.refresh()
    refreshed = metrics.REGISTRY.get_sample_value(
        "tandem_observer_last_refresh_timestamp_seconds")
    assert refreshed is not None and before <= refreshed <= time.time()
    await bus.nc.close()  # nothing can be read any more
    with pytest.raises(ConnectionClosedError):
        await obs.refresh()
    assert metrics.REGISTRY.get_sample_value(
        "tandem_observer_last_refresh_timestamp_seconds") == refreshed


async def test_a_run_that_leaves_the_view_loses_its_series(
        bus: Bus, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    await bus.provision(streams.core_streams())
    monkeypatch.setattr(observe, "MAX_RUNS", 1)  # the view keeps the newest run only
    old, new = f"old{uid}", f"new{uid}"
    await submit_run(bus, {"run_id": old, "steps": 5, "ranks": 1, "cluster": "nowhere"})
    metrics.train_step(old, 3, 0.5, 10.0, 0.1)
    obs = Observer(bus, [])
    await obs.refresh()
    assert f'tandem_train_loss{{run="{old}"}} 0.5' in exposed()
    assert f'tandem_train_run_state{{run="{old}",state="pending"}} 1.0' in exposed()
    assert f'tandem_train_run_state{{run="{old}",state="failed"}} 0.0' in exposed()
    await submit_run(bus, {"run_id": new, "steps": 5, "ranks": 1, "cluster": "nowhere"})
    await obs.refresh()
    assert set(obs.runs) == {new}
    assert f'run="{old}"' not in exposed()


async def test_a_success_the_bucket_refused_is_never_shown(bus: Bus, uid: str) -> None:
    """The observer hears every write of a task's record on core NATS, one the bucket
    refused too: a stale worker's second success, a success after a cancel. Only what
    is stored shows, once a task."""
    await bus.provision(streams.core_streams())
    kv = await bus.typed(streams.KV_TASKS, TaskRecord)
    obs = Observer(bus, [], interval=0.05)
    stop = asyncio.Event()
    running = asyncio.create_task(obs.run(stop))
    tasks = {name: GenerationTask(task_id=f"{name}{uid}", model="noop", noop=True, steps=1,
                                  cluster="c") for name in ("done", "cancelled", "last")}

    def success(name: str, worker: str) -> TaskRecord | None:
        return moves.to_succeeded([f"images/{name}/{worker}.png"], cluster="c",
                                  worker=worker, attempt=1, started_at=time.time())(
            moves.queued(tasks[name], "c"))

    async def refused(name: str, worker: str) -> None:  # its revision moved on: refused
        await bus.nc.publish(f"$KV.{streams.KV_TASKS}.{tasks[name].task_id}",
                             encode(success(name, worker)),
                             headers={"Nats-Expected-Last-Subject-Sequence": "1"})

    try:
        await asyncio.wait_for(obs.ready.wait(), 30)
        for name in tasks:
            await kv.put(tasks[name].task_id, moves.queued(tasks[name], "c"))
        await kv.update(tasks["done"].task_id, lambda r: success("done", "w1"))
        await kv.update(tasks["cancelled"].task_id, moves.to_cancelled())
        await refused("done", "w2")
        await refused("cancelled", "w1")
        await bus.nc.flush()
        await kv.update(tasks["last"].task_id, lambda r: success("last", "w1"))
        # Heard after the refused ones (one connection, in order): once it shows, they
        # have been read and judged.
        deadline = time.monotonic() + 30
        while not any(g["id"] == tasks["last"].task_id for g in obs.generations):
            assert time.monotonic() < deadline, obs.generations
            await asyncio.sleep(0.02)  # polling the view, refreshed every 0.05 s
        shown = [(g["id"], g["worker"]) for g in obs.snapshot()["generations"]]
        assert shown == [(tasks["last"].task_id, "w1"), (tasks["done"].task_id, "w1")]
    finally:
        stop.set()
        await running


async def test_checkpoint_marks_are_one_per_step_and_only_from_their_runs_subject(
        bus: Bus, uid: str) -> None:
    """A sharded run reports each step once per node and a restart writes steps again: the
    view keeps one mark per step, the newest ``MAX_POINTS``. An event naming another run
    than its subject's is not that run's."""
    await bus.provision(streams.core_streams())
    run, other = f"ck{uid}", f"forged{uid}"
    await submit_run(bus, {"run_id": run, "steps": 5, "ranks": 1, "cluster": "nowhere"})
    obs = Observer(bus, [], interval=3600)
    stop = asyncio.Event()
    task = asyncio.create_task(obs.run(stop))
    await asyncio.wait_for(obs.ready.wait(), 10)

    def written(run_id: str, step: int) -> bytes:
        manifest = CheckpointManifest(run_id=run_id, step=step, files=[])
        return encode(CheckpointWritten(run_id=run_id, step=step, path="/x", manifest=manifest))

    try:
        steps = [*range(1, observe.MAX_POINTS + 50), *[7] * 500]
        for step in steps:
            await bus.nc.publish(subjects.train(run, "checkpoint"), written(run, step))
        await bus.nc.publish(subjects.train(run, "checkpoint"), written(other, 10**6))
        await bus.nc.publish(subjects.train(run, "checkpoint"), written(run, 10**6 + 1))
        deadline = time.monotonic() + 10
        while 10**6 + 1 not in obs.runs[run].checkpoints:  # the last event, heard
            assert time.monotonic() < deadline, "the observer never heard the last checkpoint"
            await asyncio.sleep(0.02)  # polling the view, with the deadline above
        marks = obs.runs[run].checkpoints
        assert marks == sorted(set(marks)) and len(marks) == observe.MAX_POINTS
        assert 10**6 not in marks and other not in obs.runs
    finally:
        stop.set()
        await task
