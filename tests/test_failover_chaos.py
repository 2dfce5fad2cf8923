"""Zero loss under chaos: tasks flow through the gateway while the clusters' agents and
workers are killed -9 and restarted at random (one target down at a time, so the gateway
always has somewhere to send them). Workers serve the no-op model, so a restart costs
about a second and the test stays short."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from tandem.cli.bench.failover import Drill, stack_config
from tandem.cli.stack import Stack
from tandem.common.events import TaskState

TASKS = 150
DEADLINE = 90.0
TARGETS = ("east/agent-0", "east/worker-0", "west/agent-0", "west/worker-0", "east", "west")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("chaos")
    config = stack_config(ttl=2.0, grace=1.0, agent_interval=0.25, ack_wait=2.0,
                          worker_env={"MAX_BATCH": "4"})
    with open(root / "stack.log", "w") as sink, Stack(config, root, sink, grace=3.0) as st:
        health = st.start(health_timeout=120)
        assert set(health.values()) == {"healthy"}, health
        yield st


async def test_random_kills_and_restarts_lose_no_task_and_each_success_has_one_result(
        stack: Stack) -> None:
    seed = int(os.environ.get("TANDEM_CHAOS_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    stop = asyncio.Event()
    kills: list[str] = []

    async def pause(lo: float, hi: float) -> None:
        # The chaos schedule's own random pauses, not a wait for anything.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(lo, hi))

    async def chaos() -> None:
        while not stop.is_set():
            target = rng.choice(TARGETS)
            await asyncio.to_thread(stack.kill, target)
            kills.append(target)
            await pause(0.2, 1.5)  # how long it stays dead
            await asyncio.to_thread(stack.restart, target)
            await pause(0.1, 0.6)

    async with Drill(stack) as d:
        await d.ready(DEADLINE)
        monkey = asyncio.create_task(chaos())
        try:
            for _ in range(TASKS):
                await d.submit(retry_for=DEADLINE, lane=rng.choice(["interactive", "batch"]))
                await pause(0.0, 0.1)  # a steady trickle rather than one burst
        finally:
            stop.set()
            await monkey
        recs = await d.terminal(d.accepted, DEADLINE)
        results = await d.results([i for i, r in recs.items() if r.state == TaskState.succeeded])

    states = Counter(r.state.value for r in recs.values())
    ran_on = Counter(r.worker for r in recs.values())
    print(f"\nchaos seed {seed}: {len(kills)} kill/restarts {dict(Counter(kills))}; "
          f"{len(d.accepted)} accepted, refused {d.refused}; states {dict(states)}; "
          f"ran on {dict(ran_on)}")
    assert len(d.accepted) == TASKS == len(set(d.accepted))
    assert all(r.state.terminal for r in recs.values())  # nothing accepted was lost
    succeeded = [i for i, r in recs.items() if r.state == TaskState.succeeded]
    assert {i: results.get(i, 0) for i in succeeded} == dict.fromkeys(succeeded, 1)
    assert states[TaskState.succeeded.value] + states[TaskState.failed.value] == TASKS
    assert not [i for i, r in recs.items() if r.state != TaskState.succeeded and results.get(i)]
