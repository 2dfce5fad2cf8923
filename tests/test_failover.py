"""Two clusters on the local stack (real nats-server, S3, gateway, agents, workers as child
processes): kill -9 all of east with tasks queued and running, watch west take them, bring
east back. Short TTL, grace and AckWait keep it fast; the default-settings figures are
``tandem bench failover``'s."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from tandem.cli.bench.failover import Drill, failover_time, stack_config
from tandem.cli.stack import Stack
from tandem.common import fleet, subjects
from tandem.common.events import GenerationTask, TaskState

TTL, GRACE, ACK_WAIT = 2.0, 1.0, 3.0
DEADLINE = 90.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("failover")
    # One task at a time, one more held: the rest of a cluster's tasks stay queued.
    config = stack_config(ttl=TTL, grace=GRACE, agent_interval=0.25, ack_wait=ACK_WAIT,
                          serve="digits,noop", worker_env={"MAX_BATCH": "1", "PREFETCH": "1"})
    with open(root / "stack.log", "w") as sink, Stack(config, root, sink, grace=5.0) as st:
        health = st.start(health_timeout=120)
        assert set(health.values()) == {"healthy"}, health
        yield st


@pytest.fixture
async def drill(stack: Stack) -> AsyncIterator[Drill]:
    async with Drill(stack) as d:
        yield d


async def all_up(stack: Stack, d: Drill) -> None:
    """Every process running (restarting any an earlier test left dead) and ready."""
    for name in [c.name for c in stack if not c.running]:
        stack.restart(name)
    await d.ready(DEADLINE)


async def test_killing_every_process_of_east_moves_its_queued_and_running_tasks_to_west(
        stack: Stack, drill: Drill) -> None:
    d = drill
    await all_up(stack, d)
    # 400 steps: each call lasts seconds, so a poll of east's /healthz (every 0.25 s at
    # most, each a blocking GET) cannot miss both held. At 40 steps the first call took
    # 0.41 s and the polls missed it (fresh clone at 5947211, 2026-12-07).
    running = [(await d.submit(model="digits", class_label=i, steps=400, cluster="east"))["id"]
               for i in range(2)]

    def east_holds_both() -> bool:  # polled: the worker's own /healthz says what it holds
        return set(running) <= set(d.health("east/worker-0").get("running", []))

    # One in its pipeline call, one prefetched behind it (a record says running only
    # once its task has run for the progress interval: the worker itself is asked).
    await d.until(east_holds_both, DEADLINE, "east runs (and holds) both")
    # Frozen mid-run, so however fast the model, both are still in its hands at the kill
    # and the tasks queued next stay queued.
    east_worker = stack.children["east/worker-0"]
    east_worker.signal(signal.SIGSTOP)
    queued = [(await d.submit(cluster="east"))["id"] for _ in range(4)]
    assert stack.kill("east") == ["east/agent-0", "east/worker-0"]
    died_at = time.time()

    recs = await d.terminal(running + queued, DEADLINE)
    results = await d.results(running + queued)
    # started_at of a redelivered task is its first start (on east): time the queued ones.
    took = failover_time({i: recs[i] for i in queued}, died_at, "west-")
    print(f"\nfailover: first queued task started on west {took:.3f} s after east died "
          f"(heartbeat TTL {TTL:g} s, grace {GRACE:g} s, AckWait {ACK_WAIT:g} s; west "
          "may run the redelivered ones first)")
    for i, r in recs.items():
        assert r.state == TaskState.succeeded, (i, r.reason)
        assert r.worker == "west-w0" and results.get(i) == 1
    # The running ones were redelivered after AckWait, and ran again on west.
    assert all(recs[i].attempts >= 2 for i in running)
    assert all(len(recs[i].images) == 1 for i in running)


async def test_when_east_returns_new_tasks_route_to_it_and_west_stops_pulling_its_queue(
        stack: Stack, drill: Drill) -> None:
    d = drill
    if stack.children["east/agent-0"].running:  # else: left dead by the failover test
        await all_up(stack, d)
        stack.kill("east")
    await d.poll(lambda: not d.routable("east"), DEADLINE, "east down")
    west = d.worker_of("west")
    await d.poll(lambda: "east" in d.pulling(west), DEADLINE, "west pulls east")
    stack.restart("east")
    await d.ready(DEADLINE)
    await d.poll(lambda: "east" not in d.pulling(west), DEADLINE, "west stops pulling east")
    sent = [await d.submit() for _ in range(4)]  # unpinned: the router decides
    to_east = [s["id"] for s in sent if s["cluster"] == "east"]
    assert to_east, [s["cluster"] for s in sent]
    recs = await d.terminal([s["id"] for s in sent], DEADLINE)
    assert all(recs[i].state == TaskState.succeeded and recs[i].worker == "east-w0"
               for i in to_east)


async def test_a_cluster_with_every_node_drained_gets_no_tasks_and_hands_its_queue_over(
        stack: Stack, drill: Drill) -> None:
    """West has one node: drained, it serves nothing, so the gateway sends it nothing and,
    after the grace period, east takes the task queued on west; west's worker never
    starts it. Undrained, west serves again. (One node drained in a cluster that has
    others keeps its queue home: tests/test_failover_routing.py.)"""
    d = drill
    await all_up(stack, d)
    assert d.bus is not None
    west = d.worker_of("west")
    task = GenerationTask(task_id=f"drained{time.time_ns()}", model="noop", cluster="west",
                          steps=1, noop=True)
    await fleet.drain(d.bus, "west", "node-0", reason="failover test")
    try:
        await d.poll(lambda: not d.routable("west") and d.metric(west, "tandem_worker_drained")
                     == 1, DEADLINE, "west drained for the gateway and its worker")
        r = await d.http.post("/v1/generations", json={"model": "noop", "cluster": "west"})
        assert r.status_code == 503 and "retry-after" in r.headers
        # Queued on west as if accepted before the drain: east adopts west's queue.
        await d.bus.publish(subjects.gen("west", "interactive"), task, msg_id=task.task_id)
        recs = await d.terminal([task.task_id], DEADLINE)
        assert recs[task.task_id].state == TaskState.succeeded
        assert recs[task.task_id].worker == "east-w0"
    finally:
        await fleet.undrain(d.bus, "west", "node-0")
    east = d.worker_of("east")
    # Serving again: routable, its worker pulling, and east no longer pulling its queue
    # (east's failover releases west when its own board sees the undrain).
    await d.poll(lambda: d.routable("west") and d.metric(west, "tandem_worker_drained") == 0
                 and "west" not in d.pulling(east), DEADLINE, "west serving again")
    again = (await d.submit(cluster="west"))["id"]
    recs = await d.terminal([again], DEADLINE)
    assert recs[again].worker == "west-w0"
