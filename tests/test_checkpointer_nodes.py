"""One checkpointer per node (``TANDEM_SCOPE=node``), nodes that share no disk: each
mirrors only the part of a sharded checkpoint its own node wrote, and the checkpoint is
committed once, when every node's part is in S3 and verified.

Two nodes, ``na`` (ranks 0 and 1, DCP's metadata and rank 0's state) and ``nb`` (ranks
2 and 3), each with a checkpoint root of its own; their checkpointers run against real
NATS and moto, ``nb``'s through the fault proxy of ``checkpoint_support``. The parts are
files as the ranks' DCP writers would leave them (random bytes: the checkpointer never
reads DCP), ``nb``'s first shard big enough to go in three parts.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.errors import BadRequestError

from tandem.checkpointer.service import Checkpointer, CheckpointerSettings
from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.errors import CheckpointNotFound
from tandem.common.events import (
    CheckpointManifest,
    CheckpointMirrored,
    CheckpointPartMirrored,
    CheckpointPruned,
    CheckpointWritten,
    DeadLetter,
    RunRecord,
    decode,
)
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_RUNS, MIRROR, checkpointer_consumer
from tests.checkpoint_support import FaultProxy, MiB, written
from tests.conftest import PYTHON, ROOT, service_env
from tests.test_checkpointer import (
    DEADLINE,
    Events,
    ckpt_events,
    part,
    running,
    until,
    uploads_of,
)

RANKS = {"na": [0, 1], "nb": [2, 3]}
STEP = 40


def write_part(root: Path, run: str, node: str, big: int = 0,
               lineage: int = 0, step: int = STEP) -> tuple[Path, CheckpointManifest]:
    """``node``'s part of a 4-rank sharded checkpoint of ``step`` (of ``lineage``),
    committed locally as the node's first rank commits it; ``big``: the size of its
    first shard."""
    tmp = ck.prepare_incomplete(root, run, step, lineage)
    (tmp / ck.SHARD_DIR).mkdir()
    for i, rank in enumerate(RANKS[node]):
        size = big if big and i == 0 else 4096
        (tmp / f"{ck.SHARD_DIR}/__{rank}_0.distcp").write_bytes(os.urandom(size))
    if 0 in RANKS[node]:
        for name in (ck.DCP_METADATA, *ck.SHARDED_STATE):
            (tmp / name).write_bytes(os.urandom(200))
    return ck.commit(run, step, tmp, world_size=4, node=node, lineage=lineage)


class Nodes:
    """The two nodes of one test: their roots, parts, events and checkpointer settings."""

    def __init__(self, bus: Bus, settings: Settings, uid: str, tmp_path: Path,
                 endpoint: str) -> None:
        self.bus, self.cluster, self.run = bus, settings.cluster, f"run-{uid}"
        self.bucket, self.endpoint = f"nodes-{uid}", endpoint
        self.roots = {n: tmp_path / n / "checkpoints" for n in RANKS}
        self.parts = {n: write_part(self.roots[n], self.run, n, big=11 * MiB if n == "nb" else 0)
                      for n in RANKS}
        self.nats_url = settings.nats_url

    def config(self, node: str, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        """Node ``node``'s checkpointer: its own root only, 5 MiB parts, short AckWait."""
        return dict(nats_url=self.nats_url, s3_endpoint=endpoint or self.endpoint,
                    s3_bucket=self.bucket, s3_access_key="tandem", s3_secret_key="tandem",
                    s3_max_attempts=2, multipart_threshold=5 * MiB, part_size=5 * MiB,
                    retry_backoff=0.1, ack_wait=3.0, scope="node", cluster=self.cluster,
                    node=node, checkpoint_root=str(self.roots[node]), **extra)

    def event(self, node: str) -> CheckpointWritten:
        return written(*self.parts[node], cluster=self.cluster, node=node)

    async def publish(self, node: str, event: CheckpointWritten | None = None) -> int:
        """Hand ``node``'s checkpointer its part (or ``event``); the MIRROR sequence."""
        ack = await self.bus.publish(subjects.mirror(self.cluster, node),
                                     event or self.event(node))
        return ack.seq

    async def settled(self, node: str, seq: int) -> None:
        """Until ``node``'s checkpointer has acked MIRROR message ``seq``."""
        durable = checkpointer_consumer(cluster=self.cluster, node=node).durable

        async def done() -> bool:
            info = await self.bus.js.consumer_info(MIRROR, durable)
            return info.ack_floor.stream_seq >= seq

        await until(done, what=f"{node}'s MIRROR seq {seq} settled")


@pytest.fixture
async def nodes(bus: Bus, settings: Settings, uid: str, tmp_path: Path,
                s3_server: Any) -> Nodes:
    return Nodes(bus, settings, uid, tmp_path, s3_server.url)


@pytest.fixture
def s3(s3_server: Any) -> Any:
    from tandem.common.storage import s3_client

    return s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                          s3_secret_key="tandem"))


async def parts_then_commit(events: Events) -> tuple[list[CheckpointPartMirrored],
                                                     CheckpointMirrored]:
    mirrored = await events.next(CheckpointMirrored)
    return [e for e in events.seen if isinstance(e, CheckpointPartMirrored)], mirrored


async def test_each_node_mirrors_only_its_own_part_and_the_last_part_commits_every_shard(
        bus: Bus, nodes: Nodes, s3: Any, tmp_path: Path) -> None:
    run, bucket = nodes.run, nodes.bucket
    events = await ckpt_events(bus, run)
    dead: asyncio.Queue[DeadLetter] = asyncio.Queue()

    async def on_dead(msg: Any) -> None:
        dead.put_nowait(decode(msg.data, DeadLetter))

    await bus.nc.subscribe(subjects.dlq(MIRROR), cb=on_dead)
    async with running(bus, **nodes.config("na")), running(bus, **nodes.config("nb")):
        # A checkpoint of node nb handed to na's checkpointer (a misrouted event) names
        # a folder outside na's root: refused unread, to the DLQ.
        await bus.publish(subjects.mirror(nodes.cluster, "na"),
                          msgspec.structs.replace(nodes.event("nb"), node="na"))
        letter = await asyncio.wait_for(dead.get(), DEADLINE)
        await nodes.publish("na")
        # nb is handed its part once na's is recorded: had both been handed theirs at
        # once, each could find the other's record and either one commit.
        await events.next(CheckpointPartMirrored)
        await nodes.publish("nb")
        parts, mirrored = await parts_then_commit(events)

    assert "outside the checkpoint root" in letter.reason
    # Each checkpointer was handed exactly its own node's checkpoint (and the misrouted one).
    for node, handed in (("na", 2), ("nb", 1)):
        info = await bus.js.consumer_info(MIRROR, checkpointer_consumer(
            cluster=nodes.cluster, node=node).durable)
        assert info.delivered.stream_seq > 0 and info.num_pending == 0
        assert info.ack_floor.consumer_seq == handed, node
    assert sorted(p.node for p in parts) == ["na", "nb"]
    assert [p.lacks == [] for p in parts] == [False, True]  # the second part completed it
    assert mirrored.step == STEP

    # The commit lists every shard of every node with its CRC32, as written on the nodes.
    committed = ck.read_manifest(s3, bucket, run, STEP)
    want = {f.name: f.crc32 for _, m in nodes.parts.values() for f in m.files}
    assert {f.name: f.crc32 for f in committed.files} == want
    assert (committed.world_size, committed.part, ck.missing(committed)) == (4, "", [])
    recorded = {o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects_v2(
        Bucket=bucket, Prefix=ck.parts_prefix(run, STEP, 1))["Contents"]}
    assert recorded == {"na.json", "nb.json"}
    restored = ck.restore(s3, bucket, run, tmp_path / "restored")
    assert (restored.step, restored.skipped) == (STEP, [])


async def test_a_nodes_checkpointer_killed_mid_upload_resumes_and_its_part_commits_it(
        bus: Bus, nodes: Nodes, s3: Any, tmp_path: Path) -> None:
    run, bucket = nodes.run, nodes.bucket
    events = await ckpt_events(bus, run)
    proxy = FaultProxy(nodes.endpoint).start()
    big = "shards/__2_0.distcp"
    try:
        values = nodes.config("nb", proxy.url)
        await bus.provision(Checkpointer(load(CheckpointerSettings, **values)).streams())
        proxy.hold(part(big, 3))
        proc = await asyncio.create_subprocess_exec(
            PYTHON, "-m", "tandem.checkpointer", cwd=ROOT,
            env=service_env(**{k: str(v) for k, v in values.items()}),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        async with running(bus, **nodes.config("na")):
            try:
                await nodes.publish("nb")
                await nodes.publish("na")
                first = await events.next(CheckpointPartMirrored)
                await until(proxy.holding.is_set, what="nb's upload parked mid-way")
                await until(lambda: uploads_of(proxy, "shards/__3_0.distcp") == 1,
                            what="nb's small shard sent")
            finally:
                proc.kill()  # SIGKILL mid-upload: no chance to clean up
                await asyncio.wait_for(proc.wait(), 10)
            proxy.release(drop=True)
            await until(lambda: proxy.inflight == 0, what="the dead process's requests gone")

            # na's part is in S3, nb's is not: nothing is committed, nothing restorable.
            assert first.node == "na" and first.lacks == ["a shard of rank 2",
                                                          "a shard of rank 3"]
            assert ck.list_steps(s3, bucket, run) == {STEP: False}
            with pytest.raises(CheckpointNotFound):
                ck.restore(s3, bucket, run, tmp_path / "early")
            sent = uploads_of(proxy, "shards/__3_0.distcp")

            async with running(bus, **values):  # nb's checkpointer back: redelivered
                mirrored = await events.next(CheckpointMirrored)
    finally:
        proxy.stop()

    last = [e for e in events.seen if isinstance(e, CheckpointPartMirrored)][-1]
    assert (last.node, last.lacks, mirrored.step) == ("nb", [], STEP)
    assert uploads_of(proxy, "shards/__3_0.distcp") == sent  # stored whole: not sent again
    assert [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == []
    restored = ck.restore(s3, bucket, run, tmp_path / "restored")
    assert (restored.step, len(restored.manifest.files)) == (STEP, 9)


async def test_a_rollbacks_sharded_step_commits_from_its_own_lineages_parts_beside_the_old(
        bus: Bus, nodes: Nodes, s3: Any, tmp_path: Path) -> None:
    """Step 40 of lineage 0 is committed from both nodes' parts (attempt 1); the run rolls
    back (KV runs forks: lineage 1 from step 39) and attempt 2 writes step 40 again, other
    bytes, DCP's ``.metadata`` included. Its parts are recorded and committed under
    ``step-40-l1``: no conflict with the old commit, never merged with the old parts, and
    the abandoned step 40 is pruned, in S3 and on both nodes' disks."""
    run, bucket = nodes.run, nodes.bucket
    events = await ckpt_events(bus, run)
    async with running(bus, **nodes.config("na")), running(bus, **nodes.config("nb")):
        runs = await bus.typed(KV_RUNS, RunRecord)
        await runs.create(run, RunRecord(run_id=run))
        acks = {n: await nodes.publish(n) for n in RANKS}
        old = await events.next(CheckpointMirrored)
        for n, seq in acks.items():
            await nodes.settled(n, seq)
        await runs.update(run, lambda r: msgspec.structs.replace(r, forks=[STEP - 1]))
        new_parts = {n: write_part(nodes.roots[n], run, n, lineage=1) for n in RANKS}
        acks = {n: await nodes.publish(n, written(*new_parts[n], cluster=nodes.cluster,
                                                   node=n, attempt=2))
                for n in ("nb", "na")}
        # Both nodes may have found the old set whole and each sent its commit's event:
        # the next one may be the old checkpoint's again.
        new = await events.next(CheckpointMirrored,
                                where=lambda e: (e.step, e.lineage) != (old.step, old.lineage))
        pruned = await events.next(CheckpointPruned)
        for n, seq in acks.items():
            await nodes.settled(n, seq)
        # Both nodes may find the set whole at once (each lists the other's record):
        # one commits, and the other's part event can come after the commit's events.
        while len(parts := [(p.node, p.attempt, p.lineage) for p in events.seen
                            if isinstance(p, CheckpointPartMirrored)]) < 4:
            await events.next(CheckpointPartMirrored)

    assert (old.step, old.lineage, new.step, new.lineage) == (STEP, 0, STEP, 1)
    assert new.uri == f"s3://{bucket}/runs/{run}/checkpoints/step-{STEP}-l1/"
    assert sorted(parts) == [("na", 1, 0), ("na", 2, 1), ("nb", 1, 0), ("nb", 2, 1)]
    # The commit is the merge of lineage 1's parts only: every shard as rewritten.
    committed = ck.read_manifest(s3, bucket, run, STEP, 1)
    want = {f.name: f.crc32 for _, m in new_parts.values() for f in m.files}
    assert {f.name: f.crc32 for f in committed.files} == want
    assert (committed.lineage, committed.world_size, ck.missing(committed)) == (1, 4, [])
    old_meta = next(f for _, m in nodes.parts.values() for f in m.files
                    if f.name == ck.DCP_METADATA)
    assert old_meta.crc32 != want[ck.DCP_METADATA]
    recorded = {o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects_v2(
        Bucket=bucket, Prefix=ck.parts_prefix(run, STEP, 2, lineage=1))["Contents"]}
    assert recorded == {"na.json", "nb.json"}
    # The abandoned lineage's step 40 is gone, its parts with it; on disk too.
    assert pruned.names == [f"step-{STEP}"] and "abandoned by a rollback" in pruned.reason
    assert ck.list_checkpoints(s3, bucket, run) == {(STEP, 1): True}
    for n in RANKS:
        assert [p.name for p in nodes.roots[n].joinpath(run).iterdir()] == [f"step-{STEP}-l1"]
    rec = (await runs.get(run))[0]  # type: ignore[index]
    assert (rec.latest_checkpoint_step, rec.latest_checkpoint_lineage) == (STEP, 1)
    restored = ck.restore(s3, bucket, run, tmp_path / "restored", line=ck.Lineage.of(rec.forks))
    assert (restored.step, restored.lineage) == (STEP, 1)


async def test_a_fleet_checkpointer_beside_per_node_ones_is_refused_by_the_server(
        bus: Bus, nodes: Nodes) -> None:
    """MIRROR is a work queue: consumers that overlap are refused, so one deployment can
    never mirror a checkpoint twice, from two checkpointers at once."""
    await bus.provision(Checkpointer(load(CheckpointerSettings,
                                          **nodes.config("na"))).streams())
    with pytest.raises(BadRequestError) as refused:
        await bus.provision([checkpointer_consumer()])
    assert refused.value.description == "filtered consumer not unique on workqueue stream"


async def test_a_part_retention_has_passed_is_not_mirrored_and_a_stranded_one_is_swept(
        bus: Bus, nodes: Nodes, s3: Any) -> None:
    # Step 40: na's part is mirrored, nb's is not (its checkpointer was down). The run
    # goes on and commits step 50 on both nodes; with keep_last=1 nothing older is worth
    # keeping. na's stranded part of 40 would never be whole: the commit of 50 deletes
    # it. nb's part of 40, handed over at last, is not uploaded, and its local copy goes.
    # stale_upload_age: na's part is as old as one that nothing was written to for that
    # long (retention leaves a younger one alone: its upload may still be running).
    run, bucket = nodes.run, nodes.bucket
    events = await ckpt_events(bus, run)
    later = {n: write_part(nodes.roots[n], run, n, step=50) for n in RANKS}
    async with running(bus, **nodes.config("na", keep_last=1, stale_upload_age=0.001)), \
            running(bus, **nodes.config("nb", keep_last=1, stale_upload_age=0.001)):
        await nodes.publish("na")
        first = await events.next(CheckpointPartMirrored)
        assert (first.step, first.node, first.lacks != []) == (STEP, "na", True)
        assert ck.list_steps(s3, bucket, run) == {STEP: False}
        for n in RANKS:
            await nodes.publish(n, written(*later[n], cluster=nodes.cluster, node=n))
            await events.next(CheckpointPartMirrored)
        assert (await events.next(CheckpointMirrored)).step == 50
        pruned = await events.next(CheckpointPruned)
        seq = await nodes.publish("nb")
        await nodes.settled("nb", seq)

    assert pruned.steps == [STEP] and "never committed" in pruned.reason
    assert ck.list_steps(s3, bucket, run) == {50: True}
    assert not s3.list_objects_v2(Bucket=bucket, Prefix=ck.step_prefix(run, STEP)).get(
        "Contents")
    assert not [e for e in events.seen + [events.queue.get_nowait() for _ in
                                          range(events.queue.qsize())]
                if isinstance(e, CheckpointPartMirrored) and e.step == STEP and e.node == "nb"]
    assert not nodes.parts["nb"][0].exists()  # nb's local part of 40: nothing will load it
    assert later["nb"][0].exists()  # the newest, committed, stays (local_keep)
