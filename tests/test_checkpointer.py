"""The checkpointer service against real servers: nats-server, moto's S3, and a
fault-injecting proxy between the checkpointer and S3 (``tests/checkpoint_support.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.checkpointer.service import Checkpointer, CheckpointerSettings, delete_local
from tandem.cli.devstack import S3Server
from tandem.common import checkpoints as ck
from tandem.common import log, subjects
from tandem.common.bus import Bus
from tandem.common.events import (
    CheckpointFailed,
    CheckpointManifest,
    CheckpointMirrored,
    CheckpointPruned,
    CkptEvent,
    DeadLetter,
    FileEntry,
    RunRecord,
    decode,
)
from tandem.common.runner import Context
from tandem.common.settings import Settings, load
from tandem.common.storage import s3_client
from tandem.common.streams import KV_RUNS
from tests.checkpoint_support import FaultProxy, MiB, mirror_subject, write_checkpoint, written
from tests.conftest import PYTHON, ROOT, service_env

DEADLINE = 60.0


async def until(cond: Callable[[], Any], timeout: float = DEADLINE, what: str = "") -> Any:
    """Poll ``cond`` (sync or async) until truthy, with a deadline."""
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.05)  # polling interval of a condition, not synchronisation


class Events:
    """Every ``ckpt.<run>.*`` event, as it is published."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.seen: list[Any] = []

    async def next(self, kind: type, timeout: float = DEADLINE,
                   where: Callable[[Any], bool] = lambda ev: True) -> Any:
        """The next event of ``kind`` that ``where`` accepts (what comes before it is in
        ``seen``). A core subscription sees every publish: an event two checkpointers
        both sent (one commit, found whole by both nodes) comes twice, though the stream
        stored it once (its ``Nats-Msg-Id``)."""
        async with asyncio.timeout(timeout):
            while True:
                ev = await self.queue.get()
                self.seen.append(ev)
                if isinstance(ev, kind) and where(ev):
                    return ev


async def ckpt_events(bus: Bus, run: str) -> Events:
    events = Events()

    async def on(msg: Any) -> None:
        events.queue.put_nowait(decode(msg.data, CkptEvent))

    await bus.nc.subscribe(f"ckpt.{run}.*", cb=on)
    await bus.synced()
    return events


@dataclass
class Case:
    """One test's run: its bucket, local checkpoint root and ``ckpt.<run>.*`` events."""

    bus: Bus
    settings: Settings
    run: str
    bucket: str
    root: Path
    events: Events

    def config(self, endpoint: str, **extra: Any) -> dict[str, Any]:
        """Checkpointer settings: 5 MiB parts, fast retries, short AckWait."""
        return dict(nats_url=self.settings.nats_url, s3_endpoint=endpoint,
                    s3_bucket=self.bucket, s3_access_key="tandem", s3_secret_key="tandem",
                    s3_max_attempts=2, multipart_threshold=5 * MiB, part_size=5 * MiB,
                    retry_backoff=0.1, ack_wait=3.0,
                    **{"checkpoint_root": str(self.root.parent), **extra})

    def checkpoint(self, step: int, sizes: dict[str, int] | None = None,
                   lineage: int = 0) -> tuple[Path, CheckpointManifest]:
        return write_checkpoint(self.root, self.run, step, sizes, lineage)

    async def publish(self, directory: Path, manifest: CheckpointManifest) -> Any:
        ev = written(directory, manifest)
        return await self.bus.publish(mirror_subject(ev), ev)


@pytest.fixture
async def case(bus: Bus, settings: Settings, uid: str, tmp_path: Path) -> Case:
    run = f"run-{uid}"
    return Case(bus, settings, run, f"ckpt-{uid}", tmp_path / run, await ckpt_events(bus, run))


@contextlib.asynccontextmanager
async def running(bus: Bus, **values: Any) -> AsyncIterator[Checkpointer]:
    """The checkpointer service in this process, as the runner would run it."""
    svc = Checkpointer(load(CheckpointerSettings, "checkpointer", **values))
    await bus.provision(svc.streams())
    ctx = Context(bus=bus, settings=svc.settings, stopping=asyncio.Event(),
                  log=log.get("tandem.checkpointer"))
    task = asyncio.create_task(svc.run(ctx))
    try:
        yield svc
    finally:
        ctx.stopping.set()
        await asyncio.wait_for(task, 30)


@pytest.fixture
def s3(s3_server: S3Server) -> Any:
    return s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                          s3_secret_key="tandem"))


@pytest.fixture
def proxy(s3_server: S3Server) -> Any:
    p = FaultProxy(s3_server.url).start()
    yield p
    p.stop()


def uploads_of(proxy: FaultProxy, key: str) -> int:
    return sum(1 for _, path in proxy.uploads() if path.split("?")[0].endswith("/" + key))


def part(name: str, number: int) -> Callable[[str, str], bool]:
    """Matches the UploadPart request of part ``number`` of file ``name``."""
    def match(method: str, path: str) -> bool:
        key, _, query = path.partition("?")
        return method == "PUT" and key.endswith("/" + name) and \
            f"partNumber={number}" in query.split("&")
    return match


def multipart_uploads(s3: Any, bucket: str) -> list[str]:
    return [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


async def settled(bus: Bus, seq: int, ack_wait: float = 3.0) -> None:
    """Wait until the checkpointer acked (or terminated) MIRROR message ``seq``."""
    async def done() -> bool:
        info = await bus.js.consumer_info("MIRROR", "checkpointer")
        return info.ack_floor.stream_seq >= seq

    await until(done, what=f"MIRROR seq {seq} settled")


# ------------------------------------------------------------------------------------ tests


async def test_checkpoint_is_uploaded_verified_and_committed_with_the_manifest_last(
        bus: Bus, case: Case, s3: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    run, bucket, events = case.run, case.bucket, case.events
    directory, manifest = case.checkpoint(100)
    async with running(bus, **case.config(proxy.url)):
        await case.publish(directory, manifest)
        mirrored = await events.next(CheckpointMirrored)

    assert mirrored.step == 100
    assert mirrored.uri == f"s3://{bucket}/runs/{run}/checkpoints/step-100/"
    assert mirrored.bytes == sum(f.size for f in manifest.files)
    record = await (await bus.typed(KV_RUNS, RunRecord)).get(run)
    assert record is not None
    assert (record[0].latest_checkpoint_step, record[0].latest_checkpoint_uri) == \
        (100, mirrored.uri)

    # The big file went in three parts; every file was sent before the manifest.
    requests = proxy.requests
    parts = [p for m, p in requests if m == "PUT" and "optimizer.bin?" in p]
    assert len(parts) == 3 and all("partNumber=" in p for p in parts)
    uploads = [p.split("?")[0].rsplit("/", 1)[1] for _, p in proxy.uploads()]
    assert uploads[-1] == "manifest.json" and uploads.count("manifest.json") == 1
    assert set(uploads[:-1]) == {f.name for f in manifest.files}

    # Committed means verified and whole; the commit cannot be overwritten.
    restored = ck.restore(s3, bucket, run, tmp_path / "restored")
    assert (restored.step, restored.skipped) == (100, [])
    with pytest.raises(s3.exceptions.ClientError, match="PreconditionFailed"):
        s3.put_object(Bucket=bucket, Key=ck.manifest_key(run, 100), Body=b"{}",
                      IfNoneMatch="*")


async def test_redelivered_checkpoint_uploads_nothing_and_commits_once(
        bus: Bus, case: Case, s3: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    run, events = case.run, case.events
    directory, manifest = case.checkpoint(5)
    event = written(directory, manifest)
    async with running(bus, **case.config(proxy.url)) as svc:
        await bus.publish(mirror_subject(event), event)
        await events.next(CheckpointMirrored)
        before = len(proxy.uploads())
        again = await bus.publish(mirror_subject(event), event)
        await settled(bus, again.seq)
        assert svc.committed == 1

    assert len(proxy.uploads()) == before  # nothing re-uploaded, no second commit
    info = await bus.js.stream_info("CKPT", subjects_filter=subjects.ckpt(run, "mirrored"))
    assert info.state.messages == 1  # the repeated "mirrored" was deduplicated


async def test_crash_mid_upload_leaves_no_commit_and_the_redelivery_completes_it(
        bus: Bus, case: Case, s3: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    run, bucket, events = case.run, case.bucket, case.events
    directory, manifest = case.checkpoint(9)
    values = case.config(proxy.url)
    # The small files get through whole; the big file's last part is parked.
    proxy.hold(part("optimizer.bin", 3))
    await bus.provision(Checkpointer(load(CheckpointerSettings, **values)).streams())
    env = service_env(**{k: str(v) for k, v in values.items()})
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-m", "tandem.checkpointer", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await case.publish(directory, manifest)
        await until(proxy.holding.is_set, what="an upload parked mid-checkpoint")
        await until(lambda: len(proxy.uploads()) >= 6, what="the other uploads sent")
    finally:
        proc.kill()  # SIGKILL: a crash, no chance to clean up
        await asyncio.wait_for(proc.wait(), 10)
    proxy.release(drop=True)
    await until(lambda: proxy.inflight == 0, what="requests of the dead process drained")

    assert ck.list_steps(s3, bucket, run) in ({}, {9: False})  # nothing committed
    assert multipart_uploads(s3, bucket)  # the crash left a multipart upload behind
    whole = {o["Key"].rsplit("/", 1)[1]
             for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert whole == {"rng.bin", "data_position.json", "model.safetensors"}
    sent_before = {name: uploads_of(proxy, name) for name in whole}

    async with running(bus, **values):  # redelivered after AckWait
        await events.next(CheckpointMirrored)
    assert ck.restore(s3, bucket, run, tmp_path / "restored").step == 9
    assert multipart_uploads(s3, bucket) == []  # the stale upload was aborted
    for name in whole:  # files stored whole before the crash were not sent again
        assert uploads_of(proxy, name) == sent_before[name], name


async def test_s3_killed_mid_upload_and_restarted_empty_still_ends_committed_whole(
        bus: Bus, case: Case, tmp_path: Path) -> None:
    run, bucket, events = case.run, case.bucket, case.events
    server = S3Server(name="s3-kill", log_path=tmp_path / "s3.log").start()
    proxy = FaultProxy(server.url).start()
    try:
        directory, manifest = case.checkpoint(300)
        proxy.hold(part("optimizer.bin", 2))
        async with running(bus, **case.config(proxy.url, attempts=30)):
            await case.publish(directory, manifest)
            await until(proxy.holding.is_set, what="an upload parked mid-checkpoint")
            server.kill()
            proxy.release()  # the parked uploads now meet a dead endpoint
            await until(lambda: proxy.failures >= 2, what="requests meeting a dead endpoint")
            server.start()  # moto is in memory: it comes back empty, bucket and all
            mirrored = await events.next(CheckpointMirrored)
        assert not [e for e in events.seen if isinstance(e, CheckpointFailed)]
        s3 = s3_client(load(Settings, s3_endpoint=server.url, s3_access_key="tandem",
                            s3_secret_key="tandem"))
        assert mirrored.step == 300
        restored = ck.restore(s3, bucket, run, tmp_path / "restored")
        assert (restored.step, restored.skipped) == (300, [])
        assert directory.exists()  # local_keep=2: the only local copy stays
    finally:
        proxy.stop()
        server.stop()


async def test_upload_corrupted_in_transit_is_detected_and_sent_again(
        bus: Bus, case: Case, s3: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    run, bucket, events = case.run, case.bucket, case.events
    directory, manifest = case.checkpoint(20)
    # One part of the multipart file and one single-request file get a byte flipped.
    proxy.corrupt(2, lambda m, p: part("optimizer.bin", 2)(m, p) or (
        m == "PUT" and p.endswith("/rng.bin")))
    async with running(bus, **case.config(proxy.url)):
        await case.publish(directory, manifest)
        await events.next(CheckpointMirrored)

    assert len(proxy.corrupted) == 2
    assert uploads_of(proxy, "rng.bin") == 2
    restored = ck.restore(s3, bucket, run, tmp_path / "restored")
    assert (restored.step, restored.skipped) == (20, [])


async def test_corruption_outlasting_the_attempts_hands_the_checkpoint_back_not_up(
        bus: Bus, case: Case, s3: Any, proxy: FaultProxy, tmp_path: Path) -> None:
    """A transfer that did not verify can heal: once the attempts are spent the event is
    handed back (redelivered later), never ``failed``; an error that will not heal is
    (``test_checkpointer_faults``)."""
    run, bucket, events = case.run, case.bucket, case.events
    directory, manifest = case.checkpoint(30, sizes={"rng.bin": 4096})
    proxy.corrupt(3, lambda m, p: m == "PUT" and p.endswith("/rng.bin"))
    async with running(bus, **case.config(proxy.url, attempts=2, local_keep=0)):
        ack = await case.publish(directory, manifest)
        mirrored = await events.next(CheckpointMirrored)
        await settled(bus, ack.seq)
        info = await bus.js.consumer_info("MIRROR", "checkpointer")

    assert mirrored.step == 30 and info.delivered.consumer_seq == 2  # handed back once
    assert len(proxy.corrupted) == 3 and uploads_of(proxy, "rng.bin") == 4
    assert not [e for e in events.seen if isinstance(e, CheckpointFailed)]
    restored = ck.restore(s3, bucket, run, tmp_path / "restored")
    assert (restored.step, restored.skipped) == (30, [])


async def test_retention_keeps_last_n_and_every_kth_and_deletes_local_copies_after_commit(
        bus: Bus, case: Case, s3: Any, s3_server: S3Server) -> None:
    run, bucket, events = case.run, case.bucket, case.events
    root = case.root
    small = {"rng.bin": 100}
    case.checkpoint(3, small)  # written but never mirrored: must stay
    pruned: list[list[int]] = []
    values = case.config(s3_server.url, keep_last=2, keep_every=4, local_keep=1)
    async with running(bus, **values):
        for step in (2, 4, 6, 8, 10):
            directory, manifest = case.checkpoint(step, small)
            await case.publish(directory, manifest)
            assert (await events.next(CheckpointMirrored)).step == step
            if step in (6, 10):  # [2,4,6] keeps 4,6; [4,6,8,10] keeps 4,8,10
                pruned.append((await events.next(CheckpointPruned)).steps)

    assert pruned == [[2], [6]]
    assert ck.committed_steps(s3, bucket, run) == [4, 8, 10]
    assert ck.list_steps(s3, bucket, run) == {4: True, 8: True, 10: True}  # files gone too
    assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-3"]


async def test_a_rollbacks_checkpoint_of_a_step_gets_keys_events_and_record_of_its_own(
        bus: Bus, case: Case, s3: Any, s3_server: S3Server) -> None:
    """Lineage 1 forks at step 2 while lineage 0 has committed step 4: its own step 4 is
    committed beside it (not a conflict, not deduplicated), becomes the latest, and the
    abandoned step 4 is pruned; a late checkpoint of lineage 0 is never mirrored."""
    run, bucket, events = case.run, case.bucket, case.events
    small = {"rng.bin": 100}
    async with running(bus, **case.config(s3_server.url, keep_last=5)):
        runs = await bus.typed(KV_RUNS, RunRecord)
        await runs.create(run, RunRecord(run_id=run))
        for step in (2, 4):
            ack = await case.publish(*case.checkpoint(step, small))
            assert (await events.next(CheckpointMirrored)).step == step
            await settled(bus, ack.seq)  # its retention is done too
        # The coordinator rolls back to step 2 (KV runs forks); the old lineage's write
        # of step 6 was still queued.
        await runs.update(run, lambda r: msgspec.structs.replace(r, forks=[2]))
        late = await case.publish(*case.checkpoint(6, small))
        await settled(bus, late.seq)
        await case.publish(*case.checkpoint(4, small, lineage=1))
        mirrored = await events.next(CheckpointMirrored)
        pruned = await events.next(CheckpointPruned)

    assert (mirrored.step, mirrored.lineage) == (4, 1)
    assert mirrored.uri == f"s3://{bucket}/runs/{run}/checkpoints/step-4-l1/"
    assert pruned.names == ["step-4"] and "abandoned by a rollback" in pruned.reason
    assert [(e.step, e.lineage) for e in events.seen if isinstance(e, CheckpointMirrored)] \
        == [(2, 0), (4, 0), (4, 1)]  # no step 6: abandoned before it was mirrored
    rec = (await runs.get(run))[0]  # type: ignore[index]
    assert (rec.latest_checkpoint_step, rec.latest_checkpoint_lineage) == (4, 1)
    assert ck.list_checkpoints(s3, bucket, run) == {(2, 0): True, (4, 1): True}
    line = ck.Lineage.of(rec.forks)
    assert ck.committed_steps(s3, bucket, run, line) == [2, 4]
    assert sorted(p.name for p in case.root.iterdir()) == ["step-2", "step-4-l1"]


async def test_invalid_checkpoint_event_goes_to_the_dlq_and_the_next_one_commits(
        bus: Bus, case: Case, s3: Any, s3_server: S3Server) -> None:
    run, bucket, events = case.run, case.bucket, case.events
    dead: asyncio.Queue[DeadLetter] = asyncio.Queue()

    async def on_dead(msg: Any) -> None:
        dead.put_nowait(decode(msg.data, DeadLetter))

    await bus.nc.subscribe(subjects.dlq("MIRROR"), cb=on_dead)
    directory, manifest = case.checkpoint(1, {"rng.bin": 10})
    bad = msgspec.structs.replace(manifest, files=[
        *manifest.files, FileEntry(name="../../etc/passwd", size=1, sha256="0" * 64)])
    async with running(bus, **case.config(s3_server.url)):
        await case.publish(directory, bad)
        letter = await asyncio.wait_for(dead.get(), DEADLINE)
        await bus.publish(subjects.mirror("local", "node-0"), b'{"kind": "checkpoint"}')
        letter2 = await asyncio.wait_for(dead.get(), DEADLINE)
        await case.publish(directory, manifest)
        assert (await events.next(CheckpointMirrored)).step == 1

    assert "invalid checkpoint file name '../../etc/passwd'" in letter.reason
    assert letter2.reason.startswith("undecodable")
    assert ck.committed_steps(s3, bucket, run) == [1]


def test_local_copies_beyond_local_keep_go_only_once_committed(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        (tmp_path / f"step-{step}").mkdir()
    (tmp_path / "step-5.incomplete").mkdir()  # still being written: never touched
    lg = log.get("test")
    assert delete_local(tmp_path, {1, 2, 3, 4}, 10, lg) == []
    assert delete_local(tmp_path, {2, 3}, 1, lg) == [(2, 0), (3, 0)]  # 1 never committed: kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-4", "step-5.incomplete"]
    assert delete_local(tmp_path, {1, 4}, 0, lg) == [(1, 0), (4, 0)]


def test_local_copies_a_rollback_abandoned_go_committed_or_not(tmp_path: Path) -> None:
    for name in ("step-2", "step-4", "step-6", "step-4-l1", "step-6-l2"):
        (tmp_path / name).mkdir()
    lg = log.get("test")
    # Lineage 1 forked at 2 (abandoning 4 and 6 of lineage 0); lineage 2 is newer than
    # this record knows, so nothing is decided about it.
    line = ck.Lineage((2,))
    assert delete_local(tmp_path, set(), 5, lg, line) == [(6, 0), (4, 0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4-l1", "step-6-l2"]
