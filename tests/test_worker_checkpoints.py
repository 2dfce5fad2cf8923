"""The worker learns the newest checkpoint from the checkpointer, not from S3 listings:
a ``ckpt.<run>.mirrored`` event and KV ``runs`` name the step, which is loaded directly;
S3 is listed only on start without a record, on a poll, or to verify after a failure.

List requests are counted with a hook on the real boto3 client talking to a real moto
server; the events go through a real nats-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.events import CheckpointMirrored, RunRecord, encode
from tandem.common.models import ModelSpec
from tandem.common.servers import S3Server
from tandem.common.settings import Settings, load
from tandem.common.storage import ensure_bucket, s3_client
from tandem.common.streams import KV_RUNS, core_streams
from tandem.inference_worker.hotswap import HotSwapper
from tests.train_serve_support import TinyTrainer, mirror

DEADLINE = 60.0


class ListCounter:
    """Counts ListObjectsV2 requests the client sends (a boto3 event hook, no fake)."""

    def __init__(self, s3: Any) -> None:
        self.n = 0
        s3.meta.events.register("before-call.s3.ListObjectsV2", self._count)

    def _count(self, **_: Any) -> None:
        self.n += 1


@pytest.fixture
def s3(s3_server: S3Server, uid: str) -> Any:
    client = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                            s3_secret_key="tandem"))
    ensure_bucket(client, f"wc-{uid}")
    return client


@pytest.fixture
def worker_s3(s3_server: S3Server) -> Any:
    """The worker's own client: only its requests are counted (the test's mirror lists)."""
    return s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                          s3_secret_key="tandem"))


@pytest.fixture
def trainer(tmp_path: Path, uid: str) -> Iterator[TinyTrainer]:
    t = TinyTrainer(tmp_path / "ckpt", f"run-{uid}")
    yield t
    t.close()


def spec_for(run_id: str) -> ModelSpec:
    return ModelSpec.model_validate({
        "name": "trained", "source": f"run:{run_id}", "conditioning": "class_label",
        "num_classes": 10, "sizes": [8], "default_width": 8, "default_height": 8})


async def committed(s3: Any, bucket: str, trainer: TinyTrainer, bus: Bus) -> int:
    """Commit the trainer's next checkpoint and announce it as the checkpointer does."""
    ev = trainer.checkpoint(1)
    await asyncio.to_thread(mirror, s3, bucket, ev)
    await bus.nc.publish(subjects.ckpt(ev.run_id, "mirrored"), encode(CheckpointMirrored(
        run_id=ev.run_id, step=ev.step, uri=ck.checkpoint_uri(bucket, ev.run_id, ev.step),
        seconds=0.0, bytes=sum(f.size for f in ev.manifest.files))))
    return ev.step


async def served(pipelines: dict[str, Any], step: int) -> None:
    """Wait until the swapper's task serves ``step``; fail after ``DEADLINE``."""
    deadline = time.monotonic() + DEADLINE
    while (p := pipelines.get("trained")) is None or p.checkpoint_step != step:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for step {step} to be served")
        await asyncio.sleep(0.05)  # re-checking a table the swapper's task changes


async def test_a_mirrored_event_is_served_without_listing_s3(
        trainer: TinyTrainer, s3: Any, worker_s3: Any, uid: str, bus: Bus) -> None:
    bucket = f"wc-{uid}"
    mirror(s3, bucket, trainer.checkpoint(1))  # committed before the worker starts
    lists = ListCounter(worker_s3)
    pipelines: dict[str, Any] = {}
    hs = HotSwapper([spec_for(trainer.run_id)], pipelines, {}, device="cpu",
                    dtype="float32", s3=worker_s3, bucket=bucket, poll=0)  # events only
    task = asyncio.create_task(hs.run(bus.nc))
    try:
        await served(pipelines, 1)
        assert lists.n == 1  # on start, with no KV record: one listing finds step 1
        for _ in range(2):
            step = await committed(s3, bucket, trainer, bus)
            await served(pipelines, step)
        assert lists.n == 1, "the worker listed S3 for a step the event named"
        assert hs.swaps == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_kv_runs_names_the_newest_on_start_and_a_failed_step_is_verified_by_listing(
        trainer: TinyTrainer, s3: Any, worker_s3: Any, uid: str, bus: Bus) -> None:
    from tests.train_serve_support import rot

    bucket = f"wc-{uid}"
    await bus.provision(core_streams())
    for _ in range(2):
        mirror(s3, bucket, trainer.checkpoint(1))
    runs = await bus.typed(KV_RUNS, RunRecord)
    await runs.put(trainer.run_id, RunRecord(run_id=trainer.run_id, latest_checkpoint_step=2))
    lists = ListCounter(worker_s3)
    pipelines: dict[str, Any] = {}
    hs = HotSwapper([spec_for(trainer.run_id)], pipelines, {}, device="cpu",
                    dtype="float32", s3=worker_s3, bucket=bucket, poll=0)
    await hs.attach(bus)
    assert await hs.check("trained", await hs.recorded("trained")) == 2
    assert lists.n == 0  # KV runs said step 2: loaded without a listing
    mirror(s3, bucket, trainer.checkpoint(1))
    mirror(s3, bucket, trainer.checkpoint(1))
    rot(s3, bucket, trainer.run_id, 4)  # the step the event names is corrupt
    assert await hs.check("trained", 4) == 3  # listed to find the newest that verifies
    assert lists.n == 1 and "sha256" in hs.status()["trained"]["skipped"]["4"]
    assert await hs.check("trained", 4) == 3 and lists.n == 1  # a known failure: no listing


def test_layout_names_local_and_s3_sides_alike(tmp_path: Path) -> None:
    assert ck.step_dir(tmp_path, "r", 7).name == ck.step_prefix("r", 7).split("/")[-2]
    assert ck.parse_step(ck.incomplete_dir(tmp_path, "r", 7).name) is None
    for name in ("step-3", "step-10", "step-10.incomplete", "step-9.corrupt", "latest"):
        (tmp_path / "r" / name).mkdir(parents=True)
    assert [s for s, _ in ck.local_steps(tmp_path / "r")] == [10, 3]
    keys = [ck.object_key("r", 5, "a.bin"), ck.manifest_key("r", 5),
            ck.object_key("r", 6, "a.bin")]
    assert ck.steps_in_listing(keys, "r") == {5: True, 6: False}
    assert ck.local_retention([1, 2, 3, 4], committed={1, 3, 4}, keep=2) == [1]
    assert ck.local_retention([1, 2], committed={1, 2}, keep=0) == [1, 2]
