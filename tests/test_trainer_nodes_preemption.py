"""A coordinator with node agents (LAUNCHER=nodes) told to stop (SIGTERM: a rolling
upgrade, its pod evicted) lets the ranks save, as a local one does, against a real
nats-server, real coordinators (``python -m tandem.trainer``), two real node agents and
their real torchrun ranks.

- It sends each agent ``NodeInterrupt``: the ranks checkpoint the step they are at and
  exit, and the coordinator that adopts the run resumes from that step, not from the
  last periodic checkpoint.
- Agents older than that order refuse it ("bad order"; played by a subscriber in front
  of each real agent that decodes orders as they did): the ranks are stopped outright at
  once (``NodeStop``), and the run resumes from its last periodic checkpoint.
- Agents that answer it holding nothing of the attempt (replaced since the launch; played
  by the test) will report no exit: the coordinator stops then, not at the stop's bound.

- The agent alone (the test plays its coordinator): ``NodeInterrupt`` is answered at
  once, a retried one starts nothing twice, and torchrun's exit is reported.

Every wait is on a KV update, a stream event, a reply or a process exit, with a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.common import checkpoints as ck
from tandem.common import events, subjects
from tandem.common.backoff import Backoff, retry
from tandem.common.bus import Bus, transient
from tandem.common.errors import EventDecodeError
from tandem.common.events import (
    NodeInterrupt,
    NodeLaunch,
    NodeReply,
    NodeStop,
    RunRecord,
    RunState,
)
from tandem.common.runs import submit_run
from tandem.trainer.launcher import LaunchFailed, proc_state
from tandem.trainer.nodes import NodeLauncher
from tests.test_train_runs import until
from tests.test_trainer_lifecycle import Env, env  # noqa: F401 (fixture)
from tests.test_trainer_node_agent import (  # noqa: F401 (fixtures)
    GONE,
    Coordinator,
    agent,
    coordinator,
    order,
    started,
    until_true,
)
from tests.test_trainer_preemption import DEADLINE, adopted_and_finished, long_run, training
from tests.test_trainer_preemption import agent as node_agent

pytestmark = [pytest.mark.timeout(300)]
STEPS = 30  # ``long_run``'s
# A coordinator with node agents that gives a silent one up only after 10 minutes: an
# attempt here ends on the agents' reports.
NODES = {"launcher": "nodes", "agent_lost_after_s": "600"}
WATCHDOG = {"max_restarts": 0, "backoff_s": 0.2, "hang_floor_s": 120,
            "startup_timeout_s": 200}
# What an agent older than ``NodeInterrupt`` decodes an order as.
OLD_ORDER = NodeLaunch | NodeStop


async def stopped_mid_run(e: Env, run: str, over: dict[str, Any],
                          **settings: str) -> RunRecord:
    """Submit ``run`` (``long_run`` with ``over``), SIGTERM its coordinator
    (LAUNCHER=nodes, ``settings``) once the ranks trained past step 3, and wait for it
    to exit 0 and the run to be left ``restarting``; the record as it was when the
    SIGTERM was sent."""
    first = e.coordinator(**NODES, **settings)
    await submit_run(e.bus, long_run(run, e.cluster, steps=STEPS, watchdog=WATCHDOG, **over))
    rec, _ = await training(e, run, 3)
    first.terminate()
    assert await asyncio.to_thread(first.wait, DEADLINE) == 0
    await until(e.bus, run, lambda r: r.state == RunState.restarting, timeout=DEADLINE)
    return rec


async def test_a_nodes_coordinator_stopped_lets_its_ranks_save_for_the_one_that_adopts(
        env: Env) -> None:  # noqa: F811 (fixture)
    """Its SIGTERM interrupts the ranks through their agents: they checkpoint where they
    are (periodic checkpoints are 1000 steps apart) and the next coordinator resumes
    from that step, with nothing trained twice."""
    for node in ("n0", "n1"):
        node_agent(env, node)
    run = "sigterm-nodes-coordinator"
    rec = await stopped_mid_run(env, run, {})
    written = [step for step, _ in ck.complete_steps(env.root / "ckpt", run)]
    assert len(written) == 1, f"checkpoints written before the coordinator went: {written}"
    saved = written[0]
    assert saved >= rec.latest_step
    reasons, first = await adopted_and_finished(env, run, **NODES)
    assert f"coordinator stopping (ranks checkpointed at step {saved})" in reasons[0], reasons
    assert first == {1: 1, 2: saved + 1}, first


async def test_a_nodes_coordinator_whose_agents_hold_nothing_of_the_attempt_stops_at_once(
        env: Env) -> None:  # noqa: F811 (fixture)
    """Both agents answer the interrupt that they hold nothing of the attempt (no pid:
    agents replaced since the launch; played by the test), so no exit will ever be
    reported: the coordinator ends the attempt then, rather than waiting out
    ``STOP_CHECKPOINT_S`` (580 s here, far past this test's deadline), stops the nodes
    and leaves the run for the coordinator that adopts it."""
    orders: list[tuple[str, str]] = []
    launched: asyncio.Queue[str] = asyncio.Queue()

    async def replaced_agent(msg: Any) -> None:
        node = msg.subject.rsplit(".", 1)[-1]
        order = events.decode(msg.data, events.NodeOrder)
        orders.append((node, str(msgspec.json.decode(msg.data)["kind"])))
        # A launch is answered as a running torchrun's; what comes after finds nothing.
        reply = NodeReply(node=node, master_addr="127.0.0.1", master_port=1,
                          pid=4242 if isinstance(order, NodeLaunch) else 0)
        await msg.respond(events.encode(reply))
        if isinstance(order, NodeLaunch):
            launched.put_nowait(node)

    for node in ("n0", "n1"):
        await env.bus.nc.subscribe(subjects.trainer_node(env.cluster, node), cb=replaced_agent)
    proc = env.coordinator(**NODES, stop_checkpoint_s="580", drain_timeout="590")
    run = "held-nothing"
    await submit_run(env.bus, long_run(run, env.cluster, watchdog={
        **WATCHDOG, "startup_timeout_s": 3600}))
    assert {await asyncio.wait_for(launched.get(), DEADLINE) for _ in range(2)} == {"n0", "n1"}
    proc.terminate()
    assert await asyncio.to_thread(proc.wait, DEADLINE) == 0
    rec = await until(env.bus, run, lambda r: r.state == RunState.restarting,
                      timeout=DEADLINE)
    assert rec.attempt == 1 and rec.restarts == 0, rec
    for node in ("n0", "n1"):
        assert [k for n, k in orders if n == node] == ["launch", "interrupt", "stop"], orders
    lines = [json.loads(line) for line in (env.root / "trainer.log").read_text().splitlines()
             if line.startswith("{")]
    held_nothing = [x["node"] for x in lines if x["event"] == "run.node_interrupt_nothing_held"]
    assert sorted(held_nothing) == ["n0", "n1"], held_nothing


async def old_agent(e: Env, node: str, orders: asyncio.Queue[tuple[str, str, bool]]) -> None:
    """``node``'s agent as one older than ``NodeInterrupt``: a real agent (listening on
    another cluster's subject) behind a subscriber on ``node``'s, which decodes each
    order as the old agent did, answers what it cannot decode as the old agent did
    (``ok`` False, "bad order") and forwards the rest. Each order is put in ``orders``
    as (node, kind, forwarded)."""
    hidden = f"{e.cluster}-old"
    node_agent(dataclasses.replace(e, cluster=hidden), node)
    behind = subjects.trainer_node(hidden, node)

    async def probe() -> NodeReply:  # a stop of nothing: the real agent is subscribed
        return await e.bus.request(behind, NodeStop(run_id="probe", attempt=1), NodeReply,
                                   timeout=5.0)

    await retry(probe, Backoff(0.1, max_delay=1.0), when=transient, within=DEADLINE)

    async def on_order(msg: Any) -> None:
        kind = str(msgspec.json.decode(msg.data).get("kind"))
        try:
            events.decode(msg.data, OLD_ORDER)
        except EventDecodeError as exc:
            orders.put_nowait((node, kind, False))
            await msg.respond(events.encode(NodeReply(node=node, ok=False,
                                                      error=f"bad order: {exc.reason}")))
            return
        orders.put_nowait((node, kind, True))
        reply = await e.bus.nc.request(behind, msg.data, timeout=30.0)
        await msg.respond(reply.data)

    await e.bus.nc.subscribe(subjects.trainer_node(e.cluster, node), cb=on_order)


async def test_agents_that_refuse_the_interrupt_have_the_ranks_stopped_outright(
        env: Env) -> None:  # noqa: F811 (fixture)
    """Both agents refuse the order: the coordinator stops the ranks outright at once
    (it would otherwise wait ``STOP_CHECKPOINT_S``, 120 s here, in which the ranks
    would train to the end), and the run resumes from its newest periodic checkpoint."""
    orders: asyncio.Queue[tuple[str, str, bool]] = asyncio.Queue()
    for node in ("n0", "n1"):
        await old_agent(env, node, orders)
    run = "sigterm-old-agents"
    await stopped_mid_run(env, run, {"checkpoint_every": 3}, stop_checkpoint_s="120",
                          drain_timeout="130")
    seen: list[tuple[str, str, bool]] = []
    while not orders.empty():
        seen.append(orders.get_nowait())
    for node in ("n0", "n1"):
        kinds = [(kind, forwarded) for n, kind, forwarded in seen if n == node]
        assert ("launch", True) in kinds, seen
        # Refused, then stopped: the order of the fallback, then the attempt's end.
        after = [k for k in kinds if k[0] != "launch"]
        assert after[:2] == [("interrupt", False), ("stop", True)], seen
    written = [step for step, _ in ck.complete_steps(env.root / "ckpt", run)]
    # Periodic ones only (step 3's may not be whole yet when the ranks are killed).
    assert all(step % 3 == 0 for step in written), written
    newest = written[0] if written else 0
    assert newest < STEPS, f"the ranks trained to the end after the stop: {written}"
    reasons, first = await adopted_and_finished(env, run, **NODES)
    assert reasons[0].startswith("coordinator stopping"), reasons
    assert first == {1: 1, 2: newest + 1}, first


async def test_an_interrupt_order_is_answered_at_once_and_the_exit_reported(
        agent: str, coordinator: Coordinator, tmp_path: Path) -> None:  # noqa: F811
    """An interrupt of an attempt the agent does not run is answered with nothing; of
    the one it runs, with its torchrun's pid, the same again for a retried order; then
    torchrun passes the SIGTERM on to its rank, and the agent reports torchrun's exit
    (after a stop order it does not: that exit is the order's reply)."""
    bus = coordinator.bus
    reply, rank = await started(bus, agent, "interrupted", tmp_path)
    other = await order(bus, agent, NodeInterrupt(run_id="interrupted", attempt=2))
    assert other.ok and other.pid == 0, other
    told = [await order(bus, agent, NodeInterrupt(run_id="interrupted", attempt=1))
            for _ in range(2)]
    assert all(t.ok and t.pid == reply.pid for t in told), told
    report = await asyncio.wait_for(coordinator.heard.get(), DEADLINE)
    while report.running:
        report = await asyncio.wait_for(coordinator.heard.get(), DEADLINE)
    assert (report.attempt, report.pid) == (1, reply.pid) and report.exit_code is not None
    await until_true("the rank is gone", lambda: proc_state(rank) in GONE)


async def test_an_order_to_an_agent_that_never_answers_gives_up_within_its_bound(
        bus: Bus, uid: str) -> None:
    """``within`` bounds the order, not each try: with one request's timeout at 10
    minutes, a stop given 1 s ended after that request's timeout, not 1 s."""
    launcher = NodeLauncher(bus, f"c{uid}", order_timeout_s=600.0)
    sub = await bus.nc.subscribe(subjects.trainer_node(f"c{uid}", "mute"))  # takes, never answers
    try:
        with pytest.raises(LaunchFailed, match="no answer from its agent within 1s"):
            await asyncio.wait_for(launcher._order(
                f"c{uid}", "mute", events.NodeStop(run_id="r", attempt=1), within=1.0), 60)
    finally:
        await sub.unsubscribe()
