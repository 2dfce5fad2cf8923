"""Train -> serve in-process: a trainer checkpoint loads with its own architecture,
mismatches are clear errors, and the hot-swapper finds new checkpoints by polling and
skips the ones that fail while the served one stays. It learns the newest step from
``ckpt.<run>.mirrored`` and KV ``runs`` and lists S3 only on start without a record, on
a poll, or to verify after a failure: list requests are counted with a hook on the
real boto3 client (real moto, real nats-server)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.cli.devstack import S3Server, free_port
from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.errors import CheckpointError
from tandem.common.events import CheckpointMirrored, RunRecord, encode
from tandem.common.models import ModelSpec
from tandem.common.settings import Settings, load
from tandem.common.storage import ensure_bucket, s3_client
from tandem.common.streams import KV_RUNS, core_streams
from tandem.inference_worker.hotswap import HotSwapper
from tandem.inference_worker.pipelines import (
    Item,
    ModelLoadError,
    Params,
    Pipeline,
    build,
    load_run_pipeline,
)
from tests.train_serve_support import TINY_DIT, TinyTrainer, mirror, rot

DEADLINE = 60.0


@pytest.fixture
def s3(s3_server: S3Server, uid: str) -> Any:
    client = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                            s3_secret_key="tandem"))
    ensure_bucket(client, f"ts-{uid}")
    return client


@pytest.fixture
def worker_s3(s3_server: S3Server) -> Any:
    """The worker's own client: only its requests are counted (the test's mirror lists)."""
    return s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                          s3_secret_key="tandem"))


class ListCounter:
    """Counts the ListObjectsV2 requests a client sends (a boto3 event hook, no fake)."""

    def __init__(self, s3: Any) -> None:
        self.n = 0
        s3.meta.events.register("before-call.s3.ListObjectsV2", self._count)

    def _count(self, **_: Any) -> None:
        self.n += 1


@pytest.fixture
def trainer(tmp_path: Path, uid: str) -> Iterator[TinyTrainer]:
    t = TinyTrainer(tmp_path / "ckpt", f"run-{uid}")
    yield t
    t.close()


def spec_for(run_id: str, **extra: Any) -> ModelSpec:
    return ModelSpec.model_validate({
        "name": "trained", "source": f"run:{run_id}", "conditioning": "class_label",
        "num_classes": 10, "sizes": [8], "default_width": 8, "default_height": 8, **extra})


def load_step(spec: ModelSpec, s3: Any, uid: str, step: int | None = None) -> Any:
    import torch

    return load_run_pipeline(spec, "cpu", torch.float32, step=step, s3=s3, bucket=f"ts-{uid}")


def test_a_trainer_checkpoint_loads_with_its_own_architecture_and_records_its_step(
        trainer: TinyTrainer, s3: Any, uid: str) -> None:
    bucket = f"ts-{uid}"
    for steps in (1, 2):
        mirror(s3, bucket, trainer.checkpoint(steps))
    # The registry declares no architecture: the checkpoint's model_config.json decides
    # (the registry default, a 3-level 16x16 UNet, would not even take these weights).
    pipe = load_step(spec_for(trainer.run_id), s3, uid)
    assert (pipe.checkpoint, pipe.checkpoint_step) == (f"{trainer.run_id}/step-3", 3)
    assert pipe.cfg.block_out_channels == (16, 32) and pipe.cfg.sample_size == 8
    png = pipe.generate([Item(seed=1, class_label=4)], Params(8, 8, 2, 1.0), lambda s, t: None)
    assert png[0].startswith(b"\x89PNG")
    assert load_step(spec_for(trainer.run_id), s3, uid, step=1).checkpoint_step == 1


def test_a_trained_dit_is_served_and_a_size_it_cannot_make_is_a_clear_error(
        tmp_path: Path, s3: Any, uid: str) -> None:
    dit = TinyTrainer(tmp_path / "dit", f"dit-{uid}", model=TINY_DIT)
    try:
        mirror(s3, f"ts-{uid}", dit.checkpoint(2))
    finally:
        dit.close()
    pipe = load_step(spec_for(dit.run_id), s3, uid)
    assert pipe.checkpoint_step == 2 and type(pipe.cfg).__name__ == "DiTConfig"
    steps: list[int] = []
    pngs = pipe.generate([Item(seed=1, class_label=4), Item(seed=2, class_label=7)],
                         Params(8, 8, 3, 1.0), lambda s, t: steps.append(s))
    assert steps == [1, 2, 3] and len(pngs) == 2
    assert all(p.startswith(b"\x89PNG") for p in pngs) and pngs[0] != pngs[1]
    again = pipe.generate([Item(seed=1, class_label=4)], Params(8, 8, 3, 1.0),
                          lambda s, t: None)
    assert again[0] == pngs[0]  # same seed, same label: the same bytes
    with pytest.raises(CheckpointError, match=r"must declare sizes \[8\].*makes 8x8 images"):
        load_step(spec_for(dit.run_id, sizes=[8, 16]), s3, uid)


@pytest.mark.parametrize(("extra", "says"), [
    ({"config": {"block_out_channels": [32, 64, 64], "seed": 3}},
     "declares another architecture than the checkpoint's model_config.json: "
     "block_out_channels: declared [32, 64, 64], checkpoint has [16, 32]"),
    ({"config": {"in_channels": 3}}, "in_channels: declared 3, checkpoint has 1"),
    ({"num_classes": 12}, "declares num_classes=12; the checkpoint has 10 classes"),
    ({"conditioning": "text", "num_classes": 0}, "is declared text-conditioned"),
])
def test_a_registry_entry_that_does_not_match_the_checkpoint_is_a_clear_error(
        trainer: TinyTrainer, s3: Any, uid: str, extra: dict[str, Any], says: str) -> None:
    mirror(s3, f"ts-{uid}", trainer.checkpoint(1))
    spec = spec_for(trainer.run_id, **extra)
    with pytest.raises(CheckpointError) as err:
        load_step(spec, s3, uid)
    assert str(err.value).startswith(f"checkpoint of run {trainer.run_id} step 1: ")
    assert says in str(err.value)


def test_a_run_without_a_committed_checkpoint_fails_to_build_naming_the_run(
        s3_server: S3Server, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"S3_ENDPOINT": s3_server.url, "S3_BUCKET": f"none-{uid}",
                 "S3_ACCESS_KEY": "tandem", "S3_SECRET_KEY": "tandem"}.items():
        monkeypatch.setenv(f"TANDEM_{k}", v)
    with pytest.raises(ModelLoadError, match=f"cannot load model trained: checkpoint of run "
                       f"empty-{uid}: no committed checkpoint verifies") as err:
        build(spec_for(f"empty-{uid}"), "cpu", "float32")
    assert err.value.lasting  # no checkpoint of the run: its tasks fail at once
    # S3 unreachable says nothing of the run: the load may work next time.
    monkeypatch.setenv("TANDEM_S3_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("TANDEM_S3_MAX_ATTEMPTS", "1")
    with pytest.raises(ModelLoadError, match="cannot load model trained") as err:
        build(spec_for(f"empty-{uid}"), "cpu", "float32")
    assert not err.value.lasting


async def until(cond: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    """Re-check ``cond`` until it is truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # re-checking a condition the swapper's loop changes
    return value


def swapper(spec: ModelSpec, s3: Any, uid: str, pipelines: dict[str, Pipeline],
            poll: float) -> HotSwapper:
    return HotSwapper([spec], pipelines, {}, device="cpu", dtype="float32", s3=s3,
                      bucket=f"ts-{uid}", poll=poll)


async def test_hot_swapper_finds_new_checkpoints_by_polling_when_no_event_comes(
        trainer: TinyTrainer, s3: Any, uid: str, bus: Bus) -> None:
    spec = spec_for(trainer.run_id)
    pipelines: dict[str, Pipeline] = {}
    hs = swapper(spec, s3, uid, pipelines, poll=0.1)
    task = asyncio.create_task(hs.run(bus.nc))  # subscribed, but no event is ever sent
    try:
        await asyncio.to_thread(mirror, s3, f"ts-{uid}", trainer.checkpoint(1))
        first = await until(lambda: pipelines.get("trained"), "the first checkpoint")
        assert first.checkpoint_step == 1 and hs.swaps == 0
        await asyncio.to_thread(mirror, s3, f"ts-{uid}", trainer.checkpoint(1))
        await until(lambda: pipelines["trained"].checkpoint_step == 2, "the swap to step 2")
        assert hs.swaps == 1 and hs.status()["trained"] == {
            "run": trainer.run_id, "step": 2, "lineage": 0, "skipped": {}}
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_newer_checkpoints_that_fail_are_skipped_and_the_served_one_stays(
        trainer: TinyTrainer, s3: Any, uid: str) -> None:
    bucket = f"ts-{uid}"
    spec = spec_for(trainer.run_id)
    pipelines: dict[str, Pipeline] = {}
    hs = swapper(spec, s3, uid, pipelines, poll=0)
    assert await hs.check("trained") is None  # nothing committed yet: nothing served
    mirror(s3, bucket, trainer.checkpoint(1))
    assert await hs.check("trained") == 1
    served = pipelines["trained"]
    mirror(s3, bucket, trainer.checkpoint(1))
    rot(s3, bucket, trainer.run_id, 2)  # bytes changed after the commit
    mirror(s3, bucket, trainer.checkpoint(1, poison=True))  # checksums fine, NaN weights
    assert await hs.check("trained") == 1
    assert pipelines["trained"] is served
    skipped = hs.status()["trained"]["skipped"]
    assert "model.safetensors: crc32" in skipped["2"]
    assert "non-finite values" in skipped["3"]
    assert await hs.check("trained") == 1 and hs.swaps == 0  # not tried again
    mirror(s3, bucket, trainer.checkpoint(1))
    assert await hs.check("trained") == 4 and hs.swaps == 1
    assert pipelines["trained"].checkpoint == f"{trainer.run_id}/step-4"


async def test_each_checkpoint_is_warmed_before_it_is_served_and_a_failed_warm_up_is_no_verdict(
        trainer: TinyTrainer, s3: Any, uid: str) -> None:
    bucket = f"ts-{uid}"
    spec = spec_for(trainer.run_id)
    pipelines: dict[str, Pipeline] = {}
    warmed: list[tuple[int | None, bool]] = []  # (its step, served already?)
    fail = False

    async def warm(pipe: Pipeline) -> None:
        warmed.append((pipe.checkpoint_step, pipelines.get("trained") is pipe))
        if fail:
            raise RuntimeError("out of memory at a full batch")

    hs = HotSwapper([spec], pipelines, {}, device="cpu", dtype="float32", s3=s3,
                    bucket=bucket, poll=0, warm=warm)
    mirror(s3, bucket, trainer.checkpoint(1))
    assert await hs.check("trained") == 1
    mirror(s3, bucket, trainer.checkpoint(1))
    assert await hs.check("trained") == 2 and hs.swaps == 1
    assert warmed == [(1, False), (2, False)]  # the first load and the swap, before either
    fail = True
    mirror(s3, bucket, trainer.checkpoint(1))
    assert await hs.check("trained") == 3 and served(pipelines, 3)  # served all the same
    assert warmed[-1] == (3, False) and hs.status()["trained"]["skipped"] == {}


async def announced(s3: Any, bucket: str, trainer: TinyTrainer, bus: Bus,
                    steps: int = 1) -> int:
    """Commit the trainer's checkpoint ``steps`` on and announce it as the checkpointer
    does."""
    ev = trainer.checkpoint(steps)
    lineage = ev.manifest.lineage
    await asyncio.to_thread(mirror, s3, bucket, ev)
    await bus.nc.publish(subjects.ckpt(ev.run_id, "mirrored"), encode(CheckpointMirrored(
        run_id=ev.run_id, step=ev.step, lineage=lineage,
        uri=ck.checkpoint_uri(bucket, ev.run_id, ev.step, lineage),
        seconds=0.0, bytes=sum(f.size for f in ev.manifest.files))))
    return ev.step


def served(pipelines: dict[str, Pipeline], step: int) -> bool:
    p = pipelines.get("trained")
    return p is not None and p.checkpoint_step == step


async def test_a_mirrored_event_is_served_without_listing_s3(
        trainer: TinyTrainer, s3: Any, worker_s3: Any, uid: str, bus: Bus) -> None:
    bucket = f"ts-{uid}"
    mirror(s3, bucket, trainer.checkpoint(1))  # committed before the worker starts
    lists = ListCounter(worker_s3)
    pipelines: dict[str, Pipeline] = {}
    hs = swapper(spec_for(trainer.run_id), worker_s3, uid, pipelines, poll=0)  # events only
    task = asyncio.create_task(hs.run(bus.nc))
    try:
        await until(lambda: served(pipelines, 1), "step 1 served")
        assert lists.n == 1  # on start, with no KV record: one listing finds step 1
        for _ in range(2):
            step = await announced(s3, bucket, trainer, bus)
            await until(lambda s=step: served(pipelines, s), f"step {step} served")
        assert lists.n == 1, "the worker listed S3 for a step the event named"
        assert hs.swaps == 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_kv_runs_names_the_newest_on_start_and_a_failed_step_is_verified_by_listing(
        trainer: TinyTrainer, s3: Any, worker_s3: Any, uid: str, bus: Bus) -> None:
    bucket = f"ts-{uid}"
    await bus.provision(core_streams())
    for _ in range(2):
        mirror(s3, bucket, trainer.checkpoint(1))
    runs = await bus.typed(KV_RUNS, RunRecord)
    await runs.put(trainer.run_id, RunRecord(run_id=trainer.run_id, latest_checkpoint_step=2))
    lists = ListCounter(worker_s3)
    pipelines: dict[str, Pipeline] = {}
    hs = swapper(spec_for(trainer.run_id), worker_s3, uid, pipelines, poll=0)
    await hs.attach(bus)
    assert await hs.check("trained", await hs.recorded("trained")) == 2
    assert lists.n == 0  # KV runs said step 2: loaded without a listing
    mirror(s3, bucket, trainer.checkpoint(1))
    mirror(s3, bucket, trainer.checkpoint(1))
    rot(s3, bucket, trainer.run_id, 4)  # the step the event names is corrupt
    assert await hs.check("trained", 4) == 3  # listed to find the newest that verifies
    assert lists.n == 1 and "crc32" in hs.status()["trained"]["skipped"]["4"]
    assert await hs.check("trained", 4) == 3 and lists.n == 1  # a known failure: no listing


class Placed(dict[str, Pipeline]):
    """The worker's pipelines, remembering every checkpoint ever put in service."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[str] = []

    def __setitem__(self, model: str, pipe: Pipeline) -> None:
        self.history.append(pipe.checkpoint)
        super().__setitem__(model, pipe)


async def test_after_a_rollback_only_checkpoints_of_the_runs_current_lineage_are_served(
        trainer: TinyTrainer, s3: Any, uid: str, bus: Bus, tmp_path: Path) -> None:
    """Step 2 of lineage 0 is served when the run rolls back to step 1 (lineage 1): the
    worker goes back to step 1, never loads lineage 0's late step 3, serves lineage 1's
    step 2, and serves nothing once a rollback to scratch leaves no checkpoint."""
    bucket, run = f"ts-{uid}", trainer.run_id
    await bus.provision(core_streams())
    runs = await bus.typed(KV_RUNS, RunRecord)
    await runs.put(run, RunRecord(run_id=run))
    pipelines = Placed()
    hs = swapper(spec_for(run), s3, uid, pipelines, poll=0)  # events and records only
    await hs.attach(bus)
    task = asyncio.create_task(hs.run(bus.nc))
    rolled = TinyTrainer(tmp_path / "ckpt", run, seed=9)  # the new lineage's own weights
    rolled.writer.line = ck.Lineage((1,))
    try:
        for _ in range(2):
            await announced(s3, bucket, trainer, bus)
        await until(lambda: served(pipelines, 2), "step 2 served")
        await runs.update(run, lambda r: msgspec.structs.replace(r, forks=[1]))
        await until(lambda: served(pipelines, 1), "back to step 1 after the rollback")
        await announced(s3, bucket, trainer, bus)  # lineage 0's step 3, written late
        await announced(s3, bucket, rolled, bus, steps=2)  # lineage 1's step 2
        await until(lambda: pipelines["trained"].checkpoint_lineage == 1, "lineage 1")
        assert pipelines.history == [f"{run}/step-1", f"{run}/step-2", f"{run}/step-1",
                                     f"{run}/step-2-l1"]
        assert hs.status()["trained"] == {"run": run, "step": 2, "lineage": 1,
                                          "skipped": {}}
        await runs.update(run, lambda r: msgspec.structs.replace(r, forks=[1, 0]))
        await until(lambda: "trained" not in pipelines, "nothing served")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        rolled.close()
