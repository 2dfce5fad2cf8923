"""Two guards of the trainer that decide whether a run restarts:

- a health transition from a state to itself (the cluster agent publishing a fault
  latched on a node already that bad) changes no run (``Trainer._on_health``), while a
  real transition of the same node restarts the run without it;
- an error of the process group in a rank's first step (a peer gone: torch's
  ``DistError``, gloo's ``RuntimeError``) is a crash, restarted, never the run's config
  (``rank.peer_lost``, ``rank.configured``), which would fail the run for good.

Why no test of a whole run for the second: a peer killed outright closes its own
connection to the coordinator, which the coordinator reads (``rank_exit``) before the
survivor's gloo error reaches it, so the run restarts on that alone whatever the
survivor says. ``peer_lost`` decides the other order (a peer's node cut off, its
connection not yet seen closed), which one machine cannot stage: what is tested is the
rank's own decision, with the errors torch raises.
"""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from tandem.common import events, subjects
from tandem.common.bus import Bus
from tandem.common.events import Health, HealthTransition, NodeLaunch, NodeReply
from tandem.common.runs import submit_run
from tests.conftest import PYTHON
from tests.test_train_runs import tiny, until
from tests.test_trainer_lifecycle import DEADLINE, Env, env  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(300)]


# ------------------------------------------------------------------ health to itself


async def play_agents(bus: Bus, cluster: str, nodes: list[str]) -> asyncio.Queue[NodeLaunch]:
    """The test as the node agents of ``nodes`` (``LAUNCHER=nodes``): every order is
    answered as an agent would, and launches nothing; the launch orders, in order."""
    orders: asyncio.Queue[NodeLaunch] = asyncio.Queue()

    async def agent(msg: Any) -> None:
        order = events.decode(msg.data, events.NodeOrder)
        if isinstance(order, NodeLaunch):
            orders.put_nowait(order)
        await msg.respond(events.encode(NodeReply(
            node=msg.subject.rsplit(".", 1)[-1], master_addr="127.0.0.1", master_port=1)))

    for node in nodes:
        await bus.nc.subscribe(subjects.trainer_node(cluster, node), cb=agent)
    return orders


async def test_a_health_transition_to_the_same_state_leaves_a_running_run_alone(
        env: Env) -> None:  # noqa: F811 (fixture)
    """The test plays both nodes' agents, so nothing launches and the attempt stays
    placed on n0 and n1. A transition of n1 from unhealthy to unhealthy is published,
    then a real one (healthy to unhealthy) on the same subject: the coordinator hears
    them in that order, so the first thing to change the run is the restart the second
    causes, and its one incident names the second event's rule and reason."""
    orders = await play_agents(env.bus, env.cluster, ["n0", "n1"])
    env.coordinator(launcher="nodes", agent_lost_after_s="600")
    await submit_run(env.bus, tiny("latched", cluster=env.cluster, nodes=["n0", "n1"],
                                   watchdog={"startup_timeout_s": 3600, "backoff_s": 0}))
    placed = [await asyncio.wait_for(orders.get(), DEADLINE) for _ in range(2)]
    assert {(o.node, o.attempt) for o in placed} == {("n0", 1), ("n1", 1)}

    def transition(previous: Health, rule: str, reason: str) -> HealthTransition:
        return HealthTransition(cluster=env.cluster, node="n1", previous=previous,
                                current=Health.unhealthy, rule=rule, reason=reason)

    await env.bus.publish(subjects.health(env.cluster, "n1"), transition(
        Health.unhealthy, "xid", "XID 79 still latched"))
    await env.bus.publish(subjects.health(env.cluster, "n1"), transition(
        Health.healthy, "ecc", "uncorrectable ECC error"))

    rec = await until(env.bus, "latched", lambda r: bool(r.incidents), timeout=DEADLINE)
    [incident] = rec.incidents
    assert incident["kind"] == "node_lost" and incident["node"] == "n1"
    assert incident["reason"] == "ecc: uncorrectable ECC error"
    assert incident["attempt"] == 1 and rec.restarts == 1
    again = await asyncio.wait_for(orders.get(), DEADLINE)  # both ranks on n0 now
    assert (again.node, again.attempt) == ("n0", 2)


# ------------------------------------------------------------ a peer lost, not the config


def _gloo_peer_closed() -> RuntimeError:
    """The error gloo raises in a collective whose peer has gone: two process groups of
    a world of 2 in this process (real gloo, over loopback TCP), one shut down, the other
    all-reducing."""
    import torch
    import torch.distributed as dist

    store, timeout = dist.HashStore(), datetime.timedelta(seconds=60)
    groups: dict[int, Any] = {}

    def join(rank: int) -> None:  # each blocks until the other has joined
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timeout)

    joins = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in joins:
        t.start()
    for t in joins:
        t.join(DEADLINE)
    assert set(groups) == {0, 1}, "the two gloo groups did not meet"
    groups.pop(1).abort()
    with pytest.raises(RuntimeError) as exc:
        groups[0].allreduce([torch.ones(4)]).wait()
    return exc.value


def _store_timeout() -> RuntimeError:
    """What the c10d store raises for a key nobody set in time (a peer that never came)."""
    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(milliseconds=10))
    with pytest.raises(RuntimeError) as exc:
        store.get("never-set")
    return exc.value


def test_errors_of_the_process_group_are_a_peer_lost() -> None:
    pytest.importorskip("torch")
    from torch.distributed import DistError, DistStoreError

    from tandem.trainer.rank import peer_lost

    gloo, store = _gloo_peer_closed(), _store_timeout()
    assert not isinstance(gloo, DistError)  # a plain RuntimeError: told by its text
    assert "gloo" in str(gloo) and peer_lost(gloo)
    assert isinstance(store, DistStoreError) and peer_lost(store)


def test_errors_of_the_runs_config_are_not_a_peer_lost() -> None:
    torch = pytest.importorskip("torch")
    from tandem.trainer.rank import peer_lost

    with pytest.raises(RuntimeError) as shapes:  # a model the data does not fit
        torch.nn.Linear(3, 4)(torch.ones(2, 5))
    with pytest.raises(RuntimeError) as memory:  # a model or batch no memory holds
        torch.empty(2**62)
    labels = ValueError("the data set has labels up to 9, past model.num_classes (5)")
    for exc in (shapes.value, memory.value, labels, FileNotFoundError("data/x")):
        assert not peer_lost(exc), exc


# A rank of a world of 2: rank 1 dies once DDP has wrapped the model, as rank 0 takes its
# first step inside ``configured`` (what ``rank.main`` does). Exit 0: the step raised (a
# crash the coordinator restarts); ``INVALID`` (4): it was taken for the run's config.
PEER_DIES = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tandem.trainer.channel import EventChannel
    from tandem.trainer.rank import configured

    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = DDP(torch.nn.Linear(4, 4))
    if rank == 1:
        os._exit(1)

    def first_step():
        model(torch.ones(2, 4)).sum().backward()

    try:
        configured(EventChannel(None), rank, first_step)
    except RuntimeError as exc:
        print("raised:", type(exc).__name__, exc, flush=True)
        os._exit(0)
    os._exit(2)
""")


def test_a_peer_dying_in_the_first_step_is_a_crash_not_an_invalid_config(
        tmp_path: Path) -> None:
    from tandem.trainer.rank import INVALID

    script = tmp_path / "peer_dies.py"
    script.write_text(PEER_DIES)
    ranks = [subprocess.Popen([PYTHON, str(script), str(r), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    try:
        out = [p.communicate(timeout=DEADLINE)[0] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert ranks[1].returncode == 1, out[1]
    assert ranks[0].returncode != INVALID, f"taken for the run's config:\n{out[0]}"
    assert ranks[0].returncode == 0 and "raised: RuntimeError" in out[0], out[0]
    assert "gloo" in out[0]
