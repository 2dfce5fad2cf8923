"""What the worker serves of a training run while its checkpoints load (``hotswap``,
``InferenceWorker.pipeline``): a rollback heard during a load, a checkpoint whose bytes
verify but whose contents are broken, and a stop during a load.

A load is held on a ``threading.Event`` (a wrapper around the real loader), so each
interleaving is made, not waited for: nothing is ordered by sleeping."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.cli.devstack import NatsServer, S3Server
from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.events import CheckpointMirrored, CheckpointWritten, RunRecord, encode
from tandem.common.settings import load
from tandem.common.streams import KV_RUNS, core_streams
from tandem.inference_worker import hotswap, pipelines
from tandem.inference_worker.loads import detached
from tandem.inference_worker.pipelines import ModelLoadError, Pipeline, build
from tandem.inference_worker.service import InferenceWorker, WorkerSettings
from tests import test_train_serve_loading as loading
from tests.conftest import PYTHON, ROOT, service_env
from tests.test_train_serve_loading import (
    DEADLINE,
    Placed,
    announced,
    served,
    spec_for,
    swapper,
    until,
)
from tests.train_serve_support import TinyTrainer, mirror

s3, trainer = loading.s3, loading.trainer  # fixtures: S3's client, a run's checkpoints


class Gate:
    """Holds the first load ``wanted`` picks (by step and lineage) until released; counts
    the loads it picks."""

    def __init__(self, wanted: Callable[[int | None, ck.Lineage | None], bool]) -> None:
        self.wanted = wanted
        self.entered = threading.Event()
        self.release = threading.Event()
        self.picked = 0

    def wrap(self, real: Any) -> Any:
        def load(spec: Any, dev: Any, dtype: Any, *, step: int | None = None,
                 line: ck.Lineage | None = None, **kw: Any) -> Any:
            if self.wanted(step, line):
                self.picked += 1
                self.entered.set()
                assert self.release.wait(DEADLINE)
            return real(spec, dev, dtype, step=step, line=line, **kw)
        return load

    async def entered_in_time(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, DEADLINE), "the load never started"


def of_step(step: int, lineage: int = 0) -> Callable[[int | None, ck.Lineage | None], bool]:
    return lambda s, line: s == step and line is not None and line.owner(step) == lineage


async def rolled_back(bus: Bus, run: str) -> None:
    """The run rolls back to step 1 (lineage 1): lineage 0's later steps are abandoned."""
    runs = await bus.typed(KV_RUNS, RunRecord)
    await runs.update(run, lambda r: msgspec.structs.replace(r, forks=[1]))


async def run_record(bus: Bus, run: str) -> None:
    await bus.provision(core_streams())
    runs = await bus.typed(KV_RUNS, RunRecord)
    await runs.put(run, RunRecord(run_id=run))


def worker_for(run: str, s3_server: S3Server, bucket: str, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch, preload: bool) -> InferenceWorker:
    """A worker serving ``run`` (not running: its models load as its batches load them);
    a first load reads S3 from ``TANDEM_S3_*`` as the worker's does."""
    s3_env = {"S3_ENDPOINT": s3_server.url, "S3_BUCKET": bucket, "S3_ACCESS_KEY": "tandem",
              "S3_SECRET_KEY": "tandem"}
    for k, v in s3_env.items():
        monkeypatch.setenv(f"TANDEM_{k}", v)
    models = json.dumps([spec_for(run).model_dump(mode="json")])
    return InferenceWorker(load(WorkerSettings, models=models, device="cpu",
                                dtype="float32", preload=preload, max_batch=1,
                                calls_dir=str(tmp_path / "calls"), checkpoint_poll=0))


# ------------------------------------------------------------------- a rollback mid-load


async def test_a_rollback_heard_during_a_swap_never_installs_the_abandoned_checkpoint(
        trainer: TinyTrainer, s3: Any, uid: str, bus: Bus,
        monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, run = f"ts-{uid}", trainer.run_id
    await run_record(bus, run)
    gate = Gate(of_step(3))
    monkeypatch.setattr(hotswap, "load_run_pipeline", gate.wrap(hotswap.load_run_pipeline))
    placed = Placed()
    hs = swapper(spec_for(run), s3, uid, placed, poll=0)
    await hs.attach(bus)
    task = asyncio.create_task(hs.run(bus.nc))
    try:
        for _ in range(2):
            await announced(s3, bucket, trainer, bus)
        await until(lambda: served(placed, 2), "step 2 served")
        await announced(s3, bucket, trainer, bus)  # lineage 0's step 3: its load is held
        await gate.entered_in_time()
        await rolled_back(bus, run)
        await until(lambda: hs.watched["trained"].heard == (1,), "the rollback heard")
        gate.release.set()
        await until(lambda: served(placed, 1), "back to step 1 after the rollback")
        assert placed.history == [f"{run}/step-1", f"{run}/step-2", f"{run}/step-1"]
    finally:
        gate.release.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_an_abandoned_checkpoint_is_not_served_while_its_replacement_loads(
        trainer: TinyTrainer, s3: Any, s3_server: S3Server, uid: str, bus: Bus,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the check finds the served step 2 abandoned, a batch looking the model up
    waits for the replacement (the model's lock), and gets it: never step 2, never an
    error, never a load of its own."""
    bucket, run = f"ts-{uid}", trainer.run_id
    await run_record(bus, run)
    worker = worker_for(run, s3_server, bucket, tmp_path, monkeypatch, preload=True)
    hs = worker.hotswap
    hs.s3 = s3
    await hs.attach(bus)
    for _ in range(2):
        mirror(s3, bucket, trainer.checkpoint(1))
    assert await hs.check("trained", 2) == 2
    gate = Gate(of_step(1))
    monkeypatch.setattr(hotswap, "load_run_pipeline", gate.wrap(hotswap.load_run_pipeline))
    own: list[int | None] = []  # the loads a batch's look-up makes itself
    real = pipelines.load_run_pipeline

    def first_load(*args: Any, **kw: Any) -> Any:
        own.append(kw.get("step"))
        return real(*args, **kw)

    monkeypatch.setattr(pipelines, "load_run_pipeline", first_load)
    await rolled_back(bus, run)
    checking = asyncio.create_task(hs.check("trained"))
    try:
        await gate.entered_in_time()
        assert "trained" not in worker.pipelines, "abandoned step 2 served while step 1 loads"
        looked_up = asyncio.create_task(worker.pipeline("trained"))  # a batch's look-up
    finally:
        gate.release.set()
        assert await checking == 1
    got = await looked_up
    assert got is worker.pipelines["trained"] and got.checkpoint_step == 1
    assert own == [] and gate.picked == 1  # the batch waited for the swap's load


async def test_a_first_load_whose_checkpoint_is_abandoned_meanwhile_is_loaded_again(
        trainer: TinyTrainer, s3: Any, s3_server: S3Server, uid: str, bus: Bus,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``PRELOAD=false``: a run's model loads on its first task, from the history read
    before the load; a rollback during the load is read again after it, and what it made
    abandoned is loaded again from the new history."""
    bucket, run = f"ts-{uid}", trainer.run_id
    await run_record(bus, run)
    worker = worker_for(run, s3_server, bucket, tmp_path, monkeypatch, preload=False)
    await worker.hotswap.attach(bus)
    for _ in range(2):
        mirror(s3, bucket, trainer.checkpoint(1))
    gate = Gate(lambda step, line: line is not None and line.forks == ())
    monkeypatch.setattr(pipelines, "load_run_pipeline", gate.wrap(pipelines.load_run_pipeline))
    loading = asyncio.create_task(worker.pipeline("trained"))
    try:
        await gate.entered_in_time()  # lineage 0's newest, step 2, is loading
        await rolled_back(bus, run)
    finally:
        gate.release.set()
    got = await loading
    assert (got.checkpoint_step, got.checkpoint_lineage) == (1, 0)
    assert worker.pipelines["trained"] is got


# ------------------------------------------------- checksums that pass, contents that fail


def tampered(ev: CheckpointWritten, name: str, change: Callable[[bytes], bytes]
             ) -> CheckpointWritten:
    """The checkpoint with ``name`` changed and a manifest that matches the new bytes
    (what a buggy trainer would commit: every checksum passes)."""
    path = Path(ev.path)
    f = path / name
    f.write_bytes(change(f.read_bytes()))
    m = ck.scan(path, ev.run_id, ev.step, ev.manifest.lineage)
    (path / ck.MANIFEST).write_bytes(ck.encode_manifest(m))
    return msgspec.structs.replace(ev, manifest=m)


BROKEN = {
    "truncated-safetensors": (ck.MODEL_WEIGHTS, lambda b: b[: len(b) // 2]),
    "config-not-an-object": (ck.MODEL_CONFIG, lambda b: b"[1, 2]"),
    "config-inconsistent": (ck.MODEL_CONFIG, lambda b: json.dumps(
        {**json.loads(b), "block_out_channels": [16]}).encode()),
    "config-wrong-type": (ck.MODEL_CONFIG, lambda b: json.dumps(
        {**json.loads(b), "block_out_channels": 16}).encode()),
}


class GetCounter:
    """Counts the GetObject requests a client sends (a boto3 event hook, no fake)."""

    def __init__(self, client: Any) -> None:
        self.n = 0
        client.meta.events.register("before-call.s3.GetObject", self._count)

    def _count(self, **_: Any) -> None:
        self.n += 1


@pytest.mark.parametrize("case", list(BROKEN))
async def test_a_newer_checkpoint_with_broken_contents_is_skipped_once_and_named(
        trainer: TinyTrainer, s3: Any, uid: str, case: str) -> None:
    bucket = f"ts-{uid}"
    placed: dict[str, Pipeline] = {}
    hs = swapper(spec_for(trainer.run_id), s3, uid, placed, poll=0)
    mirror(s3, bucket, trainer.checkpoint(1))
    assert await hs.check("trained") == 1
    served_before = placed["trained"]
    name, change = BROKEN[case]
    mirror(s3, bucket, tampered(trainer.checkpoint(1), name, change))
    assert await hs.check("trained") == 1 and placed["trained"] is served_before
    skipped = hs.status()["trained"]["skipped"]
    assert f"step 2: {name}: " in skipped["2"], skipped
    gets = GetCounter(s3)
    assert await hs.check("trained") == 1
    assert gets.n == 0, f"step 2 downloaded again ({gets.n} GETs)"


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_first_load_falls_back_past_a_checkpoint_with_broken_contents(
        trainer: TinyTrainer, s3: Any, s3_server: S3Server, uid: str, case: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = f"ts-{uid}"
    for k, v in {"S3_ENDPOINT": s3_server.url, "S3_BUCKET": bucket,
                 "S3_ACCESS_KEY": "tandem", "S3_SECRET_KEY": "tandem"}.items():
        monkeypatch.setenv(f"TANDEM_{k}", v)
    mirror(s3, bucket, trainer.checkpoint(1))
    name, change = BROKEN[case]
    mirror(s3, bucket, tampered(trainer.checkpoint(1), name, change))
    assert build(spec_for(trainer.run_id), "cpu", "float32").checkpoint_step == 1
    # With nothing older, it is a verdict on the run's checkpoints: its tasks fail at once.
    ck.delete(s3, bucket, trainer.run_id, 1)
    with pytest.raises(ModelLoadError, match=f"step 2: {name}: ") as err:
        build(spec_for(trainer.run_id), "cpu", "float32")
    assert err.value.lasting


async def test_a_start_whose_record_names_a_broken_newest_serves_the_good_one_before(
        trainer: TinyTrainer, s3: Any, uid: str, bus: Bus) -> None:
    """The worker's preload: ``check(model, recorded(model))`` with KV ``runs`` naming a
    step whose weights are truncated."""
    bucket, run = f"ts-{uid}", trainer.run_id
    await bus.provision(core_streams())
    mirror(s3, bucket, trainer.checkpoint(1))
    mirror(s3, bucket, tampered(trainer.checkpoint(1), *BROKEN["truncated-safetensors"]))
    runs = await bus.typed(KV_RUNS, RunRecord)
    await runs.put(run, RunRecord(run_id=run, latest_checkpoint_step=2))
    placed: dict[str, Pipeline] = {}
    hs = swapper(spec_for(run), s3, uid, placed, poll=0)
    await hs.attach(bus)
    assert await hs.check("trained", await hs.recorded("trained")) == 1
    assert served(placed, 1) and "2" in hs.status()["trained"]["skipped"]


# ------------------------------------------------------------------- a stop mid-load

# The real worker, but a load of checkpoint step 2 never ends (it stands for a download
# of many GB): only the process's exit ends it.
HELD_LOAD = """
import os, pathlib, threading
from tandem.inference_worker import hotswap

real = hotswap.load_run_pipeline

def load(spec, dev, dtype, *, step, **kw):
    if step == 2:
        pathlib.Path(os.environ["HELD_MARK"]).touch()
        threading.Event().wait()
    return real(spec, dev, dtype, step=step, **kw)

hotswap.load_run_pipeline = load
from tandem.common.runner import main
from tandem.inference_worker.service import InferenceWorker
main(InferenceWorker)
"""


async def test_a_worker_stopped_during_a_swaps_load_exits_without_waiting_for_it(
        nats_server: NatsServer, s3_server: S3Server, s3: Any, trainer: TinyTrainer,
        tmp_path: Path, uid: str) -> None:
    bucket, run = f"ts-{uid}", trainer.run_id
    mirror(s3, bucket, trainer.checkpoint(1))
    models = json.dumps([spec_for(run).model_dump(mode="json")])
    mark, out = tmp_path / "held", tmp_path / "worker.log"
    env = service_env(nats_url=nats_server.url, s3_endpoint=s3_server.url, s3_bucket=bucket,
                      s3_access_key="tandem", s3_secret_key="tandem", models=models,
                      cluster=f"c{uid}", node="n0", calls_dir=str(tmp_path / "calls"),
                      drain_timeout="3", checkpoint_poll="0", metrics_port="0",
                      device="cpu")
    env["HELD_MARK"] = str(mark)
    proc = held_worker(env, out)
    try:
        deadline = time.monotonic() + 180
        while b"worker.started" not in out.read_bytes():
            assert proc.poll() is None, out.read_text()[-2000:]
            assert time.monotonic() < deadline, "the worker never started"
            await asyncio.sleep(0.1)  # polling the child's log for its readiness
        ev = trainer.checkpoint(1)
        await asyncio.to_thread(mirror, s3, bucket, ev)
        await bus_publish(nats_server, subjects.ckpt(run, "mirrored"), encode(
            CheckpointMirrored(run_id=run, step=ev.step,
                               uri=ck.checkpoint_uri(bucket, run, ev.step))))
        while not mark.exists():
            assert proc.poll() is None, out.read_text()[-2000:]
            assert time.monotonic() < deadline, "the load of step 2 never started"
            await asyncio.sleep(0.05)  # polling the hook's marker file
        proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(proc.wait, DEADLINE)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker waits for its load after SIGTERM: "
                        + out.read_text()[-1500:])
        assert code == 0, out.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def held_worker(env: dict[str, str], out: Path) -> subprocess.Popen[bytes]:
    with open(out, "wb") as log:
        return subprocess.Popen([PYTHON, "-c", HELD_LOAD], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)


async def bus_publish(nats_server: NatsServer, subject: str, data: bytes) -> None:
    from tandem.common.settings import Settings

    bus = await Bus.connect(load(Settings, nats_url=nats_server.url), "test")
    try:
        await bus.nc.publish(subject, data)
        await bus.nc.flush()
    finally:
        await bus.drain()


def test_a_download_told_to_stop_stops_and_leaves_no_files(
        trainer: TinyTrainer, s3: Any, uid: str, tmp_path: Path) -> None:
    bucket = f"ts-{uid}"
    mirror(s3, bucket, trainer.checkpoint(1))
    stop = threading.Event()
    stop.set()
    dest = tmp_path / "dest"
    with pytest.raises(ck.Stopped):
        ck.restore(s3, bucket, trainer.run_id, dest, stop=stop)
    assert list(dest.iterdir()) == []


async def test_a_detached_load_that_nobody_waits_for_any_more_is_told_to_stop() -> None:
    started, told = threading.Event(), threading.Event()

    def load(*, stop: threading.Event) -> None:
        started.set()
        if stop.wait(DEADLINE):
            told.set()

    task = asyncio.create_task(detached(load))
    assert await asyncio.to_thread(started.wait, DEADLINE)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(told.wait, DEADLINE)
