"""Training over node agents: one trainer agent per (simulated) node, driven over the bus.

The local stack is configured as a cluster of six nodes with a trainer node agent on
each (``scope = "node"``, ``TRAINER_ROLE = "node"``) and one coordinator with
``LAUNCHER = "nodes"``: it forks nothing, it orders each placed node's agent. Three runs
share it, each over two of the nodes x 1 rank: one is left alone; one loses a node agent
to kill -9 in the middle (its torchrun and rank die with it) and restarts, with a
replacement agent as a DaemonSet would bring, from its newest checkpoint; one has a node
agent frozen (SIGSTOP) until the coordinator gives the silent node up and restarts.

The nodes share this machine's disk for checkpoints (one folder, as the single-box stack
has): each agent rebases the launch spec onto its own folders, and the checkpoint
itself is rank 0's (DDP) on node 0.

NATS runs with the generated users: the coordinator and the agents are the trainer role.
Every wait is on a KV update or a stream event, with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tandem.cli.stack import Stack
from tandem.cli.stack_config import StackConfig
from tandem.cli.train import render_status
from tandem.common import ports
from tandem.common.bus import Bus
from tandem.common.events import CheckpointWritten, RunState, TrainStatus, TrainStep
from tandem.common.runs import submit_run
from tandem.trainer.launcher import proc_state
from tests.test_train_runs import finished, ranks_of, tiny, until_event

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600),
              pytest.mark.slow]

CLUSTER = "nodes"
# The node agents' rendezvous ports, as a firewall between nodes would admit them.
RDZV = ports.band_range(ports.RENDEZVOUS)[:200]
STACK_TOML = f"""
[ports]
nats = 0
nats_monitor = 0
s3 = 0

[[clusters]]
name = "{CLUSTER}"
nodes = 6

[[processes]]
service = "trainer"
scope = "global"
name = "trainer"
cluster = "{CLUSTER}"
[processes.env]
LAUNCHER = "nodes"
CHECKPOINT_ROOT = "{{root}}/checkpoints"
# No checkpointer runs here and every agent shares this one folder: the coordinator's
# disk is the nodes' (with S3 on, the resume point is S3's committed list alone).
RESTORE_FROM_S3 = "false"
WORK_ROOT = "{{root}}/coordinator"
STATUS_EVERY_S = "0.5"
AGENT_LOST_AFTER_S = "5"

[[processes]]
service = "trainer"
scope = "node"
name = "trainer-node"
[processes.env]
TRAINER_ROLE = "node"
CHECKPOINT_ROOT = "{{root}}/checkpoints"
WORK_ROOT = "{{root}}/nodes/{{node}}"
ORPHAN_AFTER_S = "10"
RENDEZVOUS_PORTS = "{RDZV.start}-{RDZV.stop - 1}"
"""


@dataclass
class Nodes:
    stack: Stack
    runs: dict[str, asyncio.Task[dict[str, Any]]]


def agent(i: int) -> str:
    return f"{CLUSTER}/trainer-node-{i}"


async def plain_run(stack: Stack, bus: Bus) -> dict[str, Any]:
    run = "plain"
    await submit_run(bus, tiny(run, cluster=CLUSTER, nodes=["node-0", "node-1"], steps=12))
    return {"record": await finished(bus, run)}


async def past_a_checkpoint(bus: Bus, run: str, nodes: list[str],
                            steps: int) -> CheckpointWritten:
    """Submit ``run`` on ``nodes`` (rank 1 slowed, so it still trains when the test acts);
    return the first checkpoint an attempt has trained past, once it has (its
    ``attempt`` is the one the test acts on: usually 1, but a first attempt may fail
    for a reason the design accepts, such as a rendezvous port a foreign program took,
    and the run goes on in the next one)."""
    await submit_run(bus, tiny(run, cluster=CLUSTER, nodes=nodes, steps=steps,
                               faults={"slow_rank": 1, "slow_s": 0.1}))
    written: dict[int, CheckpointWritten] = {}

    def past(e: Any) -> bool:
        if isinstance(e, CheckpointWritten):
            written.setdefault(e.attempt, e)
        return (isinstance(e, TrainStep) and e.attempt in written
                and e.step > written[e.attempt].step)

    step = await until_event(bus, run, past)
    return written[step.attempt]


async def killed_agent_run(stack: Stack, bus: Bus) -> dict[str, Any]:
    """kill -9 node-3's agent once a checkpoint is whole and the run is past it; then a
    replacement agent comes up on node-3."""
    run = "killed"
    ckpt = await past_a_checkpoint(bus, run, ["node-2", "node-3"], 40)
    ranks = await ranks_of(bus, run, ckpt.attempt)
    killed = await asyncio.to_thread(stack.kill, agent(3))
    await asyncio.to_thread(stack.restart, agent(3))
    rec = await finished(bus, run)
    return {"record": rec, "killed": killed, "checkpoint": ckpt.step,
            "attempt": ckpt.attempt, "rank_on_node_3": ranks[1],
            "events": await events_until_end(bus, run)}


async def frozen_agent_run(stack: Stack, bus: Bus) -> dict[str, Any]:
    """SIGSTOP node-5's agent (its torchrun and rank train on, but it reports nothing)
    until the coordinator has given it up; then let it go on."""
    run = "frozen"
    ckpt = await past_a_checkpoint(bus, run, ["node-4", "node-5"], 100)
    frozen = stack.children[agent(5)]
    frozen.signal(signal.SIGSTOP)
    try:
        lost = await until_event(bus, run, lambda e: isinstance(e, TrainStatus)
                                 and e.state == RunState.restarting and e.incident is not None
                                 and e.incident.get("attempt") == ckpt.attempt)
    finally:
        frozen.signal(signal.SIGCONT)
    rec = await finished(bus, run)
    return {"record": rec, "lost": lost.incident, "checkpoint": ckpt.step,
            "attempt": ckpt.attempt, "events": await events_until_end(bus, run)}


async def events_until_end(bus: Bus, run: str) -> list[Any]:
    out: list[Any] = []

    def collect(ev: Any) -> bool:
        out.append(ev)
        return isinstance(ev, TrainStatus) and ev.state.terminal

    await until_event(bus, run, collect)
    return out


@contextlib.contextmanager
def agents_stack(root: Path, toml: str, services: list[str]) -> Iterator[Stack]:
    """The local stack ``toml`` describes, in ``root``, with ``services`` started and
    healthy. With auth: the coordinator and its agents log in as the trainer role (and
    checkpointers as theirs), so what they send each other must be what
    tandem.common.permissions grants."""
    (root / "stack.toml").write_text(toml)
    config = StackConfig.load(root / "stack.toml")
    with open(root / "stack.log", "w") as sink, Stack(config, root / "stack", sink,
                                                        grace=5.0, auth=True) as st:
        health = st.start(services=services, health_timeout=120)
        assert set(health.values()) == {"healthy"}, health
        yield st


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agents_stack(tmp_path_factory.mktemp("nodes"), STACK_TOML, ["trainer"]) as st:
        yield st


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nodes(stack: Stack) -> AsyncIterator[Nodes]:
    bus = await Bus.connect(stack.settings(), "test")
    tasks = {"plain": asyncio.create_task(plain_run(stack, bus)),
             "killed": asyncio.create_task(killed_agent_run(stack, bus)),
             "frozen": asyncio.create_task(frozen_agent_run(stack, bus))}
    yield Nodes(stack, tasks)
    for t in tasks.values():
        t.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    await bus.drain()


async def test_a_run_over_two_node_agents_with_one_rank_each_completes(nodes: Nodes) -> None:
    rec = (await nodes.runs["plain"])["record"]
    assert rec.state == RunState.succeeded, render_status(rec)
    assert rec.incidents == [] and rec.restarts == 0
    assert sorted(r["node"] for r in rec.ranks) == ["node-0", "node-1"]
    # Each node's torchrun ran from its own agent's folder, not the coordinator's.
    root = Path(nodes.stack.root)
    for i in (0, 1):
        folder = root / "nodes" / f"node-{i}" / "plain" / f"attempt-1-node{i}"
        spec = json.loads((folder / "launch.json").read_bytes())
        assert spec["attempt_dir"] == str(folder) and spec["rank_nodes"] == ["node-0", "node-1"]
        assert (folder / f"agent-{i}-node-{i}.log").exists()
    # Node rank 0's agent hosted the rendezvous on a port its RENDEZVOUS_PORTS admits.
    launched = [json.loads(line.split("] ", 1)[1]) for line in
                (root.parent / "stack.log").read_text().splitlines()
                if '"node_agent.launched"' in line and '"plain"' in line]
    hosts = [e for e in launched if e["node_rank"] == 0]
    assert hosts and all(int(e["master"].rsplit(":", 1)[1]) in RDZV for e in launched), launched


async def test_a_node_agent_killed_mid_run_takes_its_rank_and_the_run_resumes_from_a_checkpoint(
        nodes: Nodes) -> None:
    got = await nodes.runs["killed"]
    rec = got["record"]
    assert got["killed"] == [agent(3)]
    assert rec.state == RunState.succeeded, render_status(rec)
    killed = [i for i in rec.incidents if i["attempt"] == got["attempt"]]
    assert [i["kind"] in ("rank_exit", "node_lost") for i in killed] == [True], rec.incidents
    # The rank on the killed agent's node did not outlive it.
    assert proc_state(got["rank_on_node_3"]) in ("gone", "Z")
    assert resumed_from(got["events"], got["attempt"] + 1) >= got["checkpoint"] > 0
    assert rec.latest_step == 40


async def test_a_node_agent_gone_silent_is_given_up_and_the_run_resumes_from_a_checkpoint(
        nodes: Nodes) -> None:
    """Its reports stop (the process is frozen, its ranks still train): the coordinator
    declares the node lost, as a dead local agent, and restarts from a checkpoint."""
    got = await nodes.runs["frozen"]
    rec, lost = got["record"], got["lost"]
    assert lost["kind"] == "node_lost" and lost["node"] == "node-5", lost
    assert lost["detector"].startswith("node agent silent for ")
    assert rec.state == RunState.succeeded, render_status(rec)
    assert resumed_from(got["events"], got["attempt"] + 1) >= got["checkpoint"] > 0
    assert rec.latest_step == 100


def resumed_from(evs: list[Any], attempt: int) -> int:
    """The step ``attempt`` resumed from, as its starting status says."""
    starts = [e.reason for e in evs if isinstance(e, TrainStatus)
              and e.state == RunState.starting and e.reason.startswith(f"attempt {attempt} ")]
    assert len(starts) == 1, starts
    return int(starts[0].split("resuming from step ")[1].split()[0].rstrip(","))


async def test_a_rendezvous_port_is_drawn_in_its_own_band_below_the_kernels_range() -> None:
    """Below the ephemeral range (where ``bind(0)`` and every outgoing connection's local
    end come from, and took a suite's rendezvous port before torchrun bound it), and
    apart from the ports dev stacks hand their children (``tests/test_ports.py``)."""
    from tandem.trainer.launcher import rendezvous_port

    got = [rendezvous_port("127.0.0.1") for _ in range(200)]
    band = ports.band_range(ports.RENDEZVOUS)
    assert all(p in band for p in got) and len(set(got)) > 150
    assert not set(got) & set(ports.band_range(ports.LISTEN))


async def test_rendezvous_ports_confine_the_draw_and_a_bad_range_is_refused_naming_it() -> None:
    from tandem.common.errors import SettingsError
    from tandem.common.settings import load
    from tandem.trainer.launcher import rendezvous_port
    from tandem.trainer.service import TrainerSettings

    s = load(TrainerSettings, rendezvous_ports=f"{RDZV.start}-{RDZV.stop - 1}")
    assert s.rendezvous_port_range() == RDZV
    assert all(rendezvous_port("127.0.0.1", allowed=RDZV) in RDZV for _ in range(50))
    assert load(TrainerSettings).rendezvous_port_range() is None  # the band below the range
    with pytest.raises(SettingsError, match=r"TANDEM_RENDEZVOUS_PORTS.*1024 <= first"):
        load(TrainerSettings, rendezvous_ports="80-90")
