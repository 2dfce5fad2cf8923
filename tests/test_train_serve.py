"""Train -> serve end to end: checkpoints written by the trainer's own code, committed by
the real checkpointer, served by a real inference worker that hot-swaps between batches;
one of them a sharded (FSDP, DCP) checkpoint, consolidated by the worker on load.

The worker polls only every 600 s here, so every swap in these tests comes from the
``ckpt.<run>.mirrored`` event (the poll has its own test in test_train_serve_loading).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.cli.devstack import NatsServer, S3Server
from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import (
    CheckpointMirrored,
    CheckpointWritten,
    GenerationTask,
    TaskRecord,
    TaskState,
)
from tandem.common.settings import Settings, load
from tandem.common.storage import ensure_bucket, s3_client
from tandem.common.streams import DLQ, KV_TASKS
from tandem.inference_worker.pipelines import Item, Params
from tests.serving_stack import Child, Progress, count_on, terminal, worker
from tests.train_serve_support import TinyTrainer, mirror, rot, sharded_checkpoint

CLUSTER = "trainserve"


def model(name: str, run_id: str, num_classes: int = 10) -> dict[str, Any]:
    return {"name": name, "source": f"run:{run_id}", "conditioning": "class_label",
            "num_classes": num_classes, "sizes": [8], "default_width": 8,
            "default_height": 8, "max_steps": 1000}


class Stack:
    """NATS, the session's S3, the checkpointer and one worker serving three runs' models:
    ``hot`` (run ``hot-*``, step 1 committed before the worker starts), ``rot``
    (run ``rot-*``, nothing committed when the worker starts) and ``shard`` (run
    ``shard-*``, an FSDP run's DiT of 4 classes, nothing committed at start)."""

    def __init__(self, root: Path, s3: S3Server) -> None:
        uid = uuid.uuid4().hex[:8]
        self.root = root
        self.nats = NatsServer(name="trainserve", log_path=root / "nats.log",
                               store_dir=root / "js")
        self.s3_server = s3
        self.bucket = f"trainserve-{uid}"
        self.hot = TinyTrainer(root / "ckpt", f"hot-{uid}", seed=1)
        self.rot = TinyTrainer(root / "ckpt", f"rot-{uid}", seed=2)
        self.runs = {"hot": self.hot.run_id, "rot": self.rot.run_id, "shard": f"shard-{uid}"}
        self.models = [model("hot", self.hot.run_id), model("rot", self.rot.run_id),
                       model("shard", self.runs["shard"], num_classes=4)]
        self.children: list[Child] = []

    def env(self, **extra: str) -> dict[str, str]:
        return {"nats_url": self.nats.url, "s3_endpoint": self.s3_server.url,
                "s3_bucket": self.bucket, "s3_access_key": "tandem",
                "s3_secret_key": "tandem", "cluster": CLUSTER, **extra}

    def settings(self) -> Settings:
        return load(Settings, **self.env())

    def start(self) -> None:
        self.nats.start()
        s3 = s3_client(self.settings())
        ensure_bucket(s3, self.bucket)
        mirror(s3, self.bucket, self.hot.checkpoint(2))  # step 2, before the worker starts
        ckpt = Child(name="checkpointer", log_path=self.root / "checkpointer.log",
                     module="tandem.checkpointer",
                     env=self.env(node="ckpt", checkpoint_root=str(self.root / "ckpt")))
        self.children.append(ckpt.start())
        self.worker = worker(self.root, "w-trainserve", **self.env(
            node="w-trainserve", models=json.dumps(self.models), serve="hot,rot,shard",
            max_batch="4",
            checkpoint_poll="600"))
        self.children.append(self.worker.start())
        ckpt.wait_healthy()

    async def served(self, name: str, pred: Any) -> dict[str, Any]:
        """The worker's /healthz view of model ``name``, once ``pred`` holds for it."""
        h = await asyncio.to_thread(self.worker.wait_healthy,
                                    lambda h: pred(h["checkpoints"][name]))
        return h["checkpoints"][name]

    def stop(self) -> None:
        for c in self.children:
            c.kill()
        self.hot.close()
        self.rot.close()
        self.nats.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Stack]:
    st = Stack(tmp_path_factory.mktemp("trainserve"), s3_server)
    try:
        st.start()
        yield st
    finally:
        st.stop()


@pytest.fixture
async def bus(stack: Stack) -> AsyncIterator[Bus]:
    b = await Bus.connect(stack.settings(), "test")
    yield b
    await b.drain()


async def submit(bus: Bus, name: str, *, steps: int, seed: int, label: int) -> str:
    """Enqueue a task as the gateway does: a queued record, then the message."""
    task_id = uuid.uuid4().hex
    task = GenerationTask(task_id=task_id, model=name, class_label=label, width=8, height=8,
                          steps=steps, seed=seed, cluster=CLUSTER)
    kv = await bus.typed(KV_TASKS, TaskRecord)
    await kv.create(task_id, moves.queued(task, CLUSTER))
    await bus.publish(subjects.gen(CLUSTER, "interactive"), task, msg_id=task_id)
    return task_id


async def commit(bus: Bus, ev: CheckpointWritten) -> None:
    """Hand a written checkpoint to the checkpointer, as the trainer's coordinator does."""
    await bus.publish(subjects.mirror(ev.cluster, ev.node), ev,
                      msg_id=f"mirror-{ev.run_id}-{ev.step}")


async def succeeded(bus: Bus, task_id: str) -> TaskRecord:
    """The task's final record, which must be succeeded: its result, which names the
    checkpoint its images came from."""
    rec = await terminal(bus, task_id)
    assert rec.state == TaskState.succeeded, rec.reason
    assert rec.checkpoint == f"{rec.checkpoint.split('/')[0]}/step-{rec.checkpoint_step}"
    return rec


def image(stack: Stack, rec: TaskRecord) -> bytes:
    s3 = s3_client(stack.settings())
    return s3.get_object(Bucket=stack.bucket, Key=rec.images[0])["Body"].read()


def made_by(stack: Stack, name: str, step: int, rec: TaskRecord) -> bytes:
    """What checkpoint ``step`` makes of ``rec``'s task, generated here in-process."""
    import torch

    from tandem.common.models import ModelSpec
    from tandem.inference_worker.pipelines import load_run_pipeline

    spec = ModelSpec.model_validate(next(m for m in stack.models if m["name"] == name))
    pipe = load_run_pipeline(spec, "cpu", torch.float32, step=step,
                             s3=s3_client(stack.settings()), bucket=stack.bucket)
    t = rec.task
    return pipe.generate([Item(seed=t.seed, class_label=t.class_label)],
                         Params(t.width, t.height, t.steps, t.guidance), lambda s, n: None)[0]


def log_events(child: Child, event: str) -> list[dict[str, Any]]:
    out = []
    for line in child.log_path.read_text(errors="replace").splitlines():
        if f'"{event}"' in line:
            out.append(json.loads(line))
    return out


async def test_worker_serves_newest_checkpoint_and_hot_swaps_between_batches_losing_no_task(
        stack: Stack, bus: Bus) -> None:
    run = stack.hot.run_id
    assert (await stack.served("hot", lambda m: m["step"] == 2))["skipped"] == {}
    first = await succeeded(bus, await submit(bus, "hot", steps=4, seed=7, label=3))
    assert (first.checkpoint, first.checkpoint_step) == (f"{run}/step-2", 2)

    # A long task is running and more wait behind it (separate batches: other step
    # counts) when the trainer writes step 5 and the checkpointer commits it.
    long_id = await submit(bus, "hot", steps=300, seed=1, label=1)
    progress = await Progress().start(bus, long_id)
    try:
        await progress.wait(1)
    finally:
        await progress.stop()
    queued = [await submit(bus, "hot", steps=s, seed=s, label=2) for s in (20, 20, 21, 22)]
    await commit(bus, stack.hot.checkpoint(3))
    assert (await stack.served("hot", lambda m: m["step"] == 5))["skipped"] == {}
    after = [await submit(bus, "hot", steps=4, seed=7, label=3) for _ in range(2)]

    recs = {t: await succeeded(bus, t) for t in [long_id, *queued, *after]}
    # It started on step 2, so it finished on step 2: a swap never relabels a batch.
    assert recs[long_id].checkpoint_step == 2
    assert {recs[t].checkpoint_step for t in queued} <= {2, 5}
    assert [recs[t].checkpoint for t in after] == [f"{run}/step-5"] * 2
    assert await count_on(bus, DLQ, subjects.dlq(subjects.gen_stream_name(CLUSTER))) == 0
    # The recorded step is the one that made the images.
    assert image(stack, recs[long_id]) == await asyncio.to_thread(
        made_by, stack, "hot", 2, recs[long_id])
    assert image(stack, recs[after[0]]) == await asyncio.to_thread(
        made_by, stack, "hot", 5, recs[after[0]])
    assert image(stack, recs[after[0]]) != image(stack, first)  # same seed, new weights
    swaps = log_events(stack.worker, "worker.checkpoint_swapped")
    assert [(e["run"], e["previous"], e["step"]) for e in swaps] == [(run, 2, 5)]


async def test_corrupt_newest_checkpoint_is_skipped_and_the_worker_keeps_serving_the_last_good(
        stack: Stack, bus: Bus) -> None:
    run, trainer = stack.rot.run_id, stack.rot
    s3 = s3_client(stack.settings())
    # The worker started before this run had any checkpoint; the first commit loads.
    await commit(bus, trainer.checkpoint(1))
    await stack.served("rot", lambda m: m["step"] == 1)

    # Step 2 rots in S3 after its commit (the event comes after the damage).
    bad = trainer.checkpoint(1)
    await asyncio.to_thread(mirror, s3, stack.bucket, bad)
    await asyncio.to_thread(rot, s3, stack.bucket, run, 2)
    await bus.publish(subjects.ckpt(run, "mirrored"), CheckpointMirrored(
        run_id=run, step=2, uri=ck.checkpoint_uri(stack.bucket, run, 2)),
        msg_id=f"ckpt-{run}-2-mirrored")
    # Step 3 is committed whole by the checkpointer, but its weights are NaN.
    await commit(bus, trainer.checkpoint(1, poison=True))
    view = await stack.served("rot", lambda m: {"2", "3"} <= set(m["skipped"]))
    assert view["step"] == 1
    assert "model.safetensors: crc32" in view["skipped"]["2"]
    assert "non-finite values" in view["skipped"]["3"]
    logged = {e["step"]: e for e in log_events(stack.worker, "worker.checkpoint_skipped")
              if e["run"] == run}
    assert sorted(logged) == [2, 3] and logged[2]["serving"] == 1
    rec = await succeeded(bus, await submit(bus, "rot", steps=3, seed=5, label=6))
    assert (rec.checkpoint, rec.checkpoint_step) == (f"{run}/step-1", 1)

    # The next good checkpoint is served as usual.
    await commit(bus, trainer.checkpoint(1))
    await stack.served("rot", lambda m: m["step"] == 4)
    rec = await succeeded(bus, await submit(bus, "rot", steps=3, seed=5, label=6))
    assert rec.checkpoint_step == 4


async def test_an_fsdp_runs_sharded_checkpoint_is_committed_and_served_consolidated(
        stack: Stack, bus: Bus) -> None:
    run = stack.runs["shard"]
    ev = await asyncio.to_thread(sharded_checkpoint, stack.root / "ckpt", run,
                                 stack.root / "fsdp-out")
    assert (ev.manifest.kind, ev.manifest.world_size) == (ck.SHARDED, 2)
    await commit(bus, ev)
    assert (await stack.served("shard", lambda m: m["step"] == 2))["skipped"] == {}
    rec = await succeeded(bus, await submit(bus, "shard", steps=4, seed=3, label=1))
    assert (rec.checkpoint, rec.checkpoint_step) == (f"{run}/step-2", 2)
    # What the worker made is what the checkpoint makes (whose weights test_fsdp shows
    # are bitwise the ranks' gathered state).
    assert image(stack, rec) == await asyncio.to_thread(made_by, stack, "shard", 2, rec)
