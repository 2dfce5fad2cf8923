"""FSDP over nodes that share no disk: 2 nodes x 2 ranks, one trainer agent and one
checkpointer per node, checkpoints committed once in S3, a node killed mid-checkpoint.

The local stack is a cluster of three simulated nodes. Each node has its own trainer node
agent and its own checkpointer (``SCOPE=node``), both rooted in that node's folder
(``<root>/nodes/<node>/checkpoints``); the coordinator (``LAUNCHER=nodes``) has a folder
of its own that no rank writes to. The agents' torchruns meet in a c10d rendezvous on
loopback hosted by the first node's agent. NATS runs with the generated users, so the
per-node consumers and the trainer's orders are what the roles grant.

One run (4 ranks, a checkpoint every 2 steps, on ``node-0``..``node-2``) is the drill,
shared by the tests below, each of which checks one behaviour of it:

1. steps 2 and 4 are committed (each node's part mirrored by its own checkpointer);
2. the test corrupts one shard of step 4 in S3;
3. at step 6, the node holding rank 2 never commits its part (the fault hook
   ``stall_checkpoint_at_step``), while the other node's part of step 6 reaches S3;
4. the test kills -9 that node's trainer agent (its torchrun and ranks die with it)
   and does not bring it back;
5. the coordinator restarts on the remaining node and the spare (``node-2``, whose disk
   is empty); each node fetches the newest committed checkpoint that every node
   verifies from S3: step 6 was never committed, step 4 fails its CRC32, so step 2;
   the run then completes.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tandem.cli.stack import Stack
from tandem.cli.train import render_status
from tandem.common import checkpoints as ck
from tandem.common.bus import Bus
from tandem.common.events import (
    CheckpointMirrored,
    CheckpointPartMirrored,
    CkptEvent,
    RunRecord,
    RunState,
    TrainStatus,
    decode,
)
from tandem.common.runs import submit_run
from tandem.common.storage import s3_client
from tests.test_checkpoints import flip_byte
from tests.test_train_nodes import agents_stack, events_until_end
from tests.test_train_runs import RUN_TIMEOUT, TINY_DIT, finished, until, until_event

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900),
              pytest.mark.slow]

CLUSTER = "shard"
NODES = ["node-0", "node-1", "node-2"]
RUN = "sharded"
STEPS = 10
CORRUPT = "shards/__3_0.distcp"  # the shard of step 4 the test corrupts in S3
STACK_TOML = f"""
[ports]
nats = 0
nats_monitor = 0
s3 = 0

[[clusters]]
name = "{CLUSTER}"
nodes = {len(NODES)}

[[processes]]
service = "trainer"
scope = "global"
name = "trainer"
cluster = "{CLUSTER}"
[processes.env]
LAUNCHER = "nodes"
CHECKPOINT_ROOT = "{{root}}/coordinator/checkpoints"
WORK_ROOT = "{{root}}/coordinator/work"
STATUS_EVERY_S = "0.5"
AGENT_LOST_AFTER_S = "5"
LAUNCH_WITHIN_S = "10"

[[processes]]
service = "trainer"
scope = "node"
name = "trainer-node"
[processes.env]
TRAINER_ROLE = "node"
CHECKPOINT_ROOT = "{{root}}/nodes/{{node}}/checkpoints"
WORK_ROOT = "{{root}}/nodes/{{node}}/work"
ORPHAN_AFTER_S = "10"

[[processes]]
service = "checkpointer"
scope = "node"
name = "checkpointer"
[processes.env]
SCOPE = "node"
CHECKPOINT_ROOT = "{{root}}/nodes/{{node}}/checkpoints"
"""


def config() -> dict[str, Any]:
    return {
        "run_id": RUN, "cluster": CLUSTER, "nodes": NODES, "ranks": 4, "steps": STEPS,
        "parallelism": "fsdp", "model": TINY_DIT, "device": "cpu", "batch_size": 4,
        "checkpoint_every": 2, "warmup_steps": 1, "lr": 1e-3, "ema_decay": 0.9, "seed": 7,
        "data": {"kind": "synthetic", "synthetic_size": 64},
        # The stalled node holds every rank at step 8's save until the kill: no hang call.
        "watchdog": {"hang_floor_s": 300, "backoff_s": 0.2, "startup_timeout_s": 400,
                     "max_restarts": 3},
        "faults": {"stall_checkpoint_at_step": 6, "stall_checkpoint_rank": 2},
    }


@dataclass
class Drill:
    stack: Stack
    s3: Any
    bucket: str
    victim: str  # the node killed (it held rank 2)
    survivor: str  # the other node of attempt 1 (it held rank 0)
    partial: CheckpointPartMirrored  # the survivor's part of step 6, before the kill
    at_restart: dict[int, bool]  # S3's steps (committed or not) once the restart began
    record: RunRecord
    events: list[Any]
    ckpt: list[Any]

    def root(self, node: str) -> Path:
        return Path(self.stack.root) / "nodes" / node / "checkpoints"


async def ckpt_until(bus: Bus, run: str, pred: Callable[[Any], bool], seen: list[Any],
                     timeout: float = RUN_TIMEOUT) -> Any:
    """The first ``ckpt.<run>.*`` event (from the stream's start) that ``pred`` holds for;
    every event read on the way is appended to ``seen``."""
    from nats.js.api import DeliverPolicy

    sub = await bus.js.subscribe(f"ckpt.{run}.*", ordered_consumer=True,
                                 deliver_policy=DeliverPolicy.ALL)
    try:
        async with asyncio.timeout(timeout):
            seen.clear()
            while True:
                ev = decode((await sub.next_msg(timeout=timeout)).data, CkptEvent)
                seen.append(ev)
                if pred(ev):
                    return ev
    finally:
        await sub.unsubscribe()


async def drill(stack: Stack, bus: Bus) -> Drill:
    settings = stack.settings()
    s3 = s3_client(settings)
    bucket = settings.s3_bucket
    seen: list[Any] = []
    await submit_run(bus, config())
    await ckpt_until(bus, RUN, lambda e: isinstance(e, CheckpointMirrored) and e.step == 4,
                     seen)
    await asyncio.to_thread(flip_byte, s3, bucket, ck.object_key(RUN, 4, CORRUPT))
    rec = await until(bus, RUN, lambda r: len(r.ranks) == 4)
    node_of = {int(r["rank"]): str(r["node"]) for r in rec.ranks}
    victim, survivor = node_of[2], node_of[0]
    partial = await ckpt_until(bus, RUN, lambda e: isinstance(e, CheckpointPartMirrored)
                               and e.step == 6, seen)
    stack.kill(f"{CLUSTER}/trainer-node-{NODES.index(victim)}")
    await until_event(bus, RUN, lambda e: isinstance(e, TrainStatus)
                      and e.state == RunState.starting and e.reason.startswith("attempt 2 "))
    at_restart = await asyncio.to_thread(ck.list_steps, s3, bucket, RUN)
    record = await finished(bus, RUN)
    await ckpt_until(bus, RUN, lambda e: isinstance(e, CheckpointMirrored) and e.step == STEPS,
                     seen)
    return Drill(stack, s3, bucket, victim, survivor, partial, at_restart, record,
                 await events_until_end(bus, RUN), list(seen))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with agents_stack(tmp_path_factory.mktemp("sharded"), STACK_TOML,
                      ["trainer", "checkpointer"]) as st:
        yield st


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ran(stack: Stack) -> AsyncIterator[Drill]:
    bus = await Bus.connect(stack.settings(), "test")
    try:
        yield await drill(stack, bus)
    finally:
        await bus.drain()


def statuses(d: Drill, state: RunState) -> list[str]:
    return [e.reason for e in d.events if isinstance(e, TrainStatus) and e.state == state]


def launch_specs(d: Drill, node: str) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint root, committed steps to fetch) of every launch spec ``node``'s agent
    ran ranks with."""
    out = []
    for path in Path(d.stack.root, "nodes", node, "work", RUN).glob("*/launch.json"):
        spec = json.loads(path.read_bytes())
        out.append((spec["checkpoint_root"], tuple(spec.get("resume_steps", ()))))
    return out


def log_lines(d: Drill, name: str) -> list[dict[str, Any]]:
    (path,) = Path(d.stack.root).glob(f"**/logs/{CLUSTER}/{name}.log")
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


async def test_each_node_writes_and_mirrors_only_its_own_ranks_shards_on_its_own_disk(
        ran: Drill) -> None:
    d = ran
    assert d.record.state == RunState.succeeded, render_status(d.record)
    # The last attempt's parts of the final step, as each node's checkpointer recorded
    # them in S3: a node's part is the shards of the ranks that ran on it (rank 0's node
    # also holds DCP's metadata and rank 0's state), nothing of the other node's.
    attempt = int(d.record.ranks[0]["attempt"])
    for node in {str(r["node"]) for r in d.record.ranks}:
        ranks = sorted(int(r["rank"]) for r in d.record.ranks if r["node"] == node)
        key = ck.part_key(RUN, STEPS, attempt, node)
        part = ck.parse_manifest(d.s3.get_object(Bucket=d.bucket, Key=key)["Body"].read())
        assert {f.name for f in part.files} == {f"shards/__{r}_0.distcp" for r in ranks} | (
            {ck.DCP_METADATA, *ck.SHARDED_STATE} if 0 in ranks else set()), node
    # Every checkpointer handled only folders of its own node's disk, and each node's
    # agent launched its ranks on its own folder.
    for i, node in enumerate(NODES):
        handled = [r["dir"] for r in log_lines(d, f"checkpointer-{i}")
                   if r.get("event") in ("checkpoint.part_mirrored", "checkpoint.committed")]
        assert handled and all(Path(p).is_relative_to(d.root(node)) for p in handled), \
            (node, handled)  # every node trained in one attempt or the other
        launched = {root for root, _ in launch_specs(d, node)}
        assert launched == {str(d.root(node))}, (node, launched)
    # The final checkpoint's commit lists every shard of every rank with its CRC32.
    final = ck.read_manifest(d.s3, d.bucket, RUN, STEPS)
    shards = sorted(f.name for f in final.files if ck.shard_rank(f.name) is not None)
    assert shards == [f"shards/__{r}_0.distcp" for r in range(4)]
    assert (final.world_size, final.part, ck.missing(final)) == (4, "", [])
    assert d.record.latest_checkpoint_step == STEPS


async def test_a_node_killed_mid_checkpoint_leaves_it_uncommitted_and_the_run_resumes_from_a_commit(
        ran: Drill) -> None:
    d = ran
    # The survivor's part of step 6 reached S3 before the kill; the victim's never did.
    assert (d.partial.node, d.partial.attempt) == (d.survivor, 1)
    assert d.partial.lacks == ["a shard of rank 2", "a shard of rank 3"]
    assert d.at_restart[6] is False and d.at_restart[4] is True  # never committed
    first = d.record.incidents[0]
    assert first["attempt"] == 1 and first["kind"] in ("rank_exit", "node_lost"), first
    # Restarted without the dead node, on the spare, every node fetching from S3.
    last_nodes = [r["node"] for r in d.record.ranks]
    assert d.victim not in last_nodes and set(last_nodes) == {d.survivor, "node-2"}
    assert any(r.startswith("attempt 2 ") and "fetching from S3" in r
               for r in statuses(d, RunState.starting))
    resumed = [r for r in statuses(d, RunState.starting) if " resumed from step " in r]
    assert resumed and resumed[-1].endswith("resumed from step 2, fetched from S3 by every node")
    # node-2 never trained before step 2: the step-2 folder its checkpointer later found
    # committed and deleted on its disk is the one its ranks fetched from S3.
    assert set(launch_specs(d, "node-2")) == {(str(d.root("node-2")), (4, 2))}
    deleted = [r for r in log_lines(d, "checkpointer-2")
               if r.get("event") == "checkpoint.local_deleted"]
    assert any("step-2" in r["checkpoints"] and r["dir"] == str(ck.run_dir(d.root("node-2"), RUN))
               for r in deleted), deleted
    # Step 6 was committed later, by the run's later attempt, from its own parts only.
    committed = ck.read_manifest(d.s3, d.bucket, RUN, 6)
    assert ck.part_key(RUN, 6, 1, d.victim) not in {
        o["Key"] for o in d.s3.list_objects_v2(Bucket=d.bucket, Prefix=ck.step_prefix(
            RUN, 6))["Contents"]}
    assert not ck.missing(committed)
    assert d.record.state == RunState.succeeded and d.record.latest_step == STEPS


async def test_a_corrupted_shard_in_s3_is_found_on_restore_and_the_previous_checkpoint_taken(
        ran: Drill) -> None:
    d = ran
    corrupt = [c for c in d.record.corrupt_checkpoints if c["step"] == 4]
    assert corrupt, d.record.corrupt_checkpoints
    assert f"{CORRUPT}: crc32 " in corrupt[0]["reason"]
    skipped = [r for r in statuses(d, RunState.starting)
               if r.startswith("corrupt checkpoint(s) skipped: step 4: ")]
    assert skipped, statuses(d, RunState.starting)
    # Every node of attempt 2 found it corrupt (each fetches the whole checkpoint), so
    # all of them took step 2, the previous committed one.
    for node in (d.survivor, "node-2"):
        assert f"{node}: {CORRUPT}: crc32 " in skipped[0], skipped
    resumed = [r for r in statuses(d, RunState.starting) if " resumed from step " in r]
    assert re.fullmatch(r"attempt \d+ resumed from step 2, fetched from S3 by every node",
                        resumed[-1]), resumed
