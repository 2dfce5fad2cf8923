"""The measuring side of ``tandem bench train --sharded``: one rank of an FSDP2 world
whose nodes are torchrun groups on loopback, each with a checkpoint folder of its own.

Bench code, kept out of the trainer service: it drives the trainer's own ``TrainLoop``
and rank helpers (``after_step``, ``checkpoint_writer``) as ``tandem.trainer.rank`` does.

``torchrun ... -m tandem.cli.bench.train_sharded_rank <node's launch.json>`` (beside it
``<launch>.bench.json``: segment length, repeats, warm-up steps, S3 settings, where to
write the result) trains segments of steps, their order from ``stats.schedule`` (plain,
tandem; tandem, plain; ...):

- *plain*: ``train_step`` only: the FSDP2 loop with no checkpoints and no events;
- *tandem*: the same steps plus what a rank adds (``after_step``: the step report to the
  coordinator's relay, which publishes it, and a DCP ``async_save`` of every rank's
  shards every ``checkpoint_every`` steps; the driver lines the steps up so that a
  tandem segment's first step is a checkpoint step). The segment's clock stops only
  when every save of it is committed on its node's disk and its node's mirror (the
  bench driver, a process beside the ranks as a node's checkpointer is) has put the
  node's last checkpoint of the segment in S3 with its manifest: all the background
  work is inside the segment's time, the last checkpoint's overlapping only the steps
  after it.

Then every rank saves the same state synchronously (``dcp.save``, the same writer
options), as many times as there were checkpoints: the baseline of the time a checkpoint
blocks training. Rank 0 gathers every rank's figures and writes them to the result file;
per checkpoint the slowest rank's time counts (the next step waits for it).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec

from tandem.common.runs import RunConfig
from tandem.trainer.spec import LaunchSpec

MIRROR_WAIT_S = 1800.0  # a node's checkpoint not in S3 by then: the bench fails


def node_run(run_id: str, node: str) -> str:
    """The run id a node's checkpoints are mirrored under (each node's folder is its own
    file set here; the commit of one manifest over every node's is not part of it)."""
    return f"{run_id}-{node}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(Path(args[0]).read_bytes(), type=LaunchSpec)
    extra = msgspec.json.decode(Path(args[0]).with_suffix(".bench.json").read_bytes())
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The c10d rendezvous, not the order of the launch, assigns node ranks: a rank's node
    # is its torchrun's (TANDEM_NODE), as in tandem.trainer.rank.
    node = os.environ.get("TANDEM_NODE") or spec.rank_nodes[rank]

    import torch
    import torch.distributed as dist

    from tandem.cli.bench import stats
    from tandem.trainer.channel import EventChannel
    from tandem.trainer.loop import TrainLoop
    from tandem.trainer.rank import after_step, checkpoint_writer, pick_device, threads

    cfg = RunConfig.model_validate(spec.config)
    torch.set_num_threads(threads(spec.threads))
    device, backend = pick_device(cfg, local_rank)
    dist.init_process_group(backend, timeout=timedelta(minutes=30))
    nodes: list[str] = [""] * world
    dist.all_gather_object(nodes, node)  # every rank's node, for the step reports
    loop = TrainLoop(cfg, rank=rank, world=world, device=device, distributed=True)
    channel = EventChannel(spec.events or None)
    writer = checkpoint_writer(spec, channel, node, pin=device.type == "cuda", rank=rank,
                               local_rank=local_rank, world=world)
    s3 = _s3(extra) if local_rank == 0 else None
    steps, rounds = int(extra["steps"]), int(extra["rounds"])
    every = cfg.checkpoint_every
    samples = cfg.batch_size * world
    for _ in range(int(extra["warmup"])):
        loop.train_step()
    blocked: list[float] = []
    node_bytes = 0

    def plain() -> None:
        for _ in range(steps):
            loop.train_step()

    tails: list[float] = []  # per tandem segment: its last step's end to the segment's

    def tandem() -> None:
        nonlocal node_bytes
        last = 0
        for _ in range(steps):
            r = loop.train_step()
            b = after_step(loop, r, channel, writer, samples, nodes)
            if r.step % every == 0 or r.step == cfg.steps:
                blocked.append(b)
                last = r.step
        t = time.perf_counter()
        writer.wait()  # committed on the node's disk
        if s3 is not None and last:
            node_bytes = _wait_mirrored(s3, extra["bucket"], node_run(spec.run_id, node),
                                        last, writer.line.owner(last))
        tails.append(time.perf_counter() - t)

    times: dict[str, list[float]] = {"plain": [], "tandem": []}
    cpu = {"plain": 0.0, "tandem": 0.0}  # this rank's CPU seconds in each side's segments
    wall = {"plain": 0.0, "tandem": 0.0}
    for _, side in stats.schedule(rounds, ["plain", "tandem"]):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        (plain if side == "plain" else tandem)()
        t1 = time.perf_counter()
        dist.barrier()  # every rank, and every node's mirror, done
        took = time.perf_counter() - t0
        if side == "tandem":  # the wait for the slowest rank and node counts as tail too
            tails[-1] += took - (t1 - t0)
        times[side].append(steps / took)
        cpu[side] += time.process_time() - c0
        wall[side] += took
    writer.close()

    sync = _sync_saves(loop, Path(spec.checkpoint_root), max(3, len(blocked)), local_rank)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"blocked": blocked, "sync": sync, "node": node,
                                      "node_bytes": node_bytes, "cpu": cpu, "tails": tails})
    if rank == 0:
        out = {
            "plain_steps_per_s": times["plain"], "tandem_steps_per_s": times["tandem"],
            # per checkpoint, the slowest rank: the next step's collectives wait for it
            "blocked_s": [max(g["blocked"][i] for g in gathered)
                          for i in range(len(blocked))],
            "sync_save_s": [max(g["sync"][i] for g in gathered) for i in range(len(sync))],
            "rank_blocked_s": [g["blocked"] for g in gathered],
            "node_bytes": {g["node"]: g["node_bytes"] for g in gathered if g["node_bytes"]},
            "checkpoints": len(blocked), "world": world,
            # per tandem segment, the longest any rank waited after its last step for the
            # segment's saves and mirrors (work a run's later steps would overlap)
            "tail_s": [max(g["tails"][i] for g in gathered) for i in range(len(tails))],
            # every rank's CPU over the segments' wall time: the cores the ranks kept busy
            "rank_cores": {side: round(sum(g["cpu"][side] for g in gathered) / wall[side], 3)
                           for side in ("plain", "tandem") if wall[side]},
        }
        Path(extra["out"]).write_bytes(msgspec.json.encode(out))
    channel.close()
    dist.barrier()
    dist.destroy_process_group()
    from tandem.trainer.rank import leave

    leave(0)


def _s3(extra: dict[str, Any]) -> Any:
    from tandem.common.settings import Settings, load
    from tandem.common.storage import s3_client

    return s3_client(load(Settings, s3_endpoint=extra["s3_endpoint"],
                          s3_access_key=extra["s3_key"], s3_secret_key=extra["s3_key"]))


def _wait_mirrored(s3: Any, bucket: str, run: str, step: int, lineage: int) -> int:
    """Until the node's checkpoint ``step`` is committed in S3 (its manifest is there);
    returns its size in bytes. Polling: the bench's mirror runs in another process and
    S3 is what it writes to."""
    from tandem.common import checkpoints as ck
    from tandem.common.errors import CheckpointNotFound

    deadline = time.monotonic() + MIRROR_WAIT_S
    while True:
        try:
            m = ck.read_manifest(s3, bucket, run, step, lineage)
            return sum(f.size for f in m.files)
        except CheckpointNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)  # polling S3 for the other process's commit


def _sync_saves(loop: Any, root: Path, n: int, local_rank: int) -> list[float]:
    """``n`` synchronous ``dcp.save`` of this rank's state into its node's folder, each
    timed on this rank (collective: every rank calls it)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from tandem.trainer.sharded_ckpt import state_of

    out = []
    for i in range(n):
        folder = root / f"sync-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state_of(loop.model, loop.optimizer, loop.ema),
                 storage_writer=FileSystemWriter(folder, single_file_per_rank=True,
                                                 thread_count=1, sync_files=True))
        out.append(time.perf_counter() - t0)
        dist.barrier()
        if local_rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
