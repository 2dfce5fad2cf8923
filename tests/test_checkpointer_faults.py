"""The checkpointer when S3 misbehaves or is slow, against real servers: nats-server,
moto's S3, a proxy in front of S3 that injects faults or answers requests itself
(``tests/s3_proxy.py``), and one in front of NATS that records what the client sends
(``tests/nats_proxy.py``).

- a batch delete S3 refuses key by key is an error, not a prune;
- retention leaves a never-committed checkpoint alone while its upload may still run,
  and a commit whose files retention swept meanwhile is taken back and sent again;
- an S3 outage longer than the attempts hands the checkpoint back, not up; an error that
  will not heal is still ``failed``;
- the whole handling, retention included, is kept alive past AckWait.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.cli.devstack import NatsServer, S3Server
from tandem.common import checkpoints as ck
from tandem.common import storage, subjects
from tandem.common.bus import Bus
from tandem.common.checkpoints import store
from tandem.common.events import CheckpointFailed, CheckpointMirrored, CheckpointPruned
from tandem.common.settings import Settings, load
from tests.nats_proxy import NatsProxy
from tests.s3_proxy import AnsweringProxy, delete_errors, is_delete_objects, s3_error
from tests.test_checkpointer import Case, part, running, settled, until, uploads_of
from tests.test_checkpointer import case as case  # the fixture


def client(endpoint: str) -> Any:
    return storage.s3_client(load(Settings, s3_endpoint=endpoint, s3_access_key="tandem",
                                  s3_secret_key="tandem"))


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[AnsweringProxy]:
    p = AnsweringProxy(s3_server.url)
    p.start()
    yield p
    p.stop()


def names(s3: Any, bucket: str, run: str, step: int) -> set[str]:
    """The names of the objects stored under ``step``'s prefix."""
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=ck.step_prefix(run, step))
    return {o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", [])}


async def published(bus: Bus, run: str, kind: str) -> int:
    """How many ``ckpt.<run>.<kind>`` events the stream holds."""
    subject = subjects.ckpt(run, kind)
    info = await bus.js.stream_info("CKPT", subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def redelivered(bus: Bus) -> int:
    """Messages delivered again and not yet acked."""
    return (await bus.js.consumer_info("MIRROR", "checkpointer")).num_redelivered


async def deliveries(bus: Bus) -> int:
    """Deliveries so far, each redelivery counted."""
    return (await bus.js.consumer_info("MIRROR", "checkpointer")).delivered.consumer_seq


# ------------------------------------------------------------------------ deletes refused


def test_delete_raises_naming_each_key_s3_kept_and_its_code(
        s3_server: S3Server, proxy: AnsweringProxy, uid: str) -> None:
    bucket, run = f"ckpt-{uid}", f"run-{uid}"
    s3 = client(s3_server.url)
    storage.ensure_bucket(s3, bucket)
    for name in ("a.bin", "b.bin"):
        s3.put_object(Bucket=bucket, Key=ck.object_key(run, 1, name), Body=b"x")
    proxy.answer(delete_errors("InternalError"))
    with pytest.raises(store.DeleteFailed, match=r"a\.bin \(InternalError\)") as refused:
        ck.delete(client(proxy.url), bucket, run, 1)
    assert sorted(refused.value.errors) == [(ck.object_key(run, 1, "a.bin"), "InternalError"),
                                            (ck.object_key(run, 1, "b.bin"), "InternalError")]
    assert names(s3, bucket, run, 1) == {"a.bin", "b.bin"}
    proxy.answer(None)
    assert ck.delete(client(proxy.url), bucket, run, 1) == 3  # the manifest, a, b
    assert names(s3, bucket, run, 1) == set()


async def test_a_prune_s3_refuses_is_retried_and_announced_only_once_done(
        case: Case, s3_server: S3Server, proxy: AnsweringProxy) -> None:
    run, bucket, bus, events = case.run, case.bucket, case.bus, case.events
    s3 = client(s3_server.url)
    small = {"rng.bin": 100}
    # stale_upload_age: what the failed delete leaves (no manifest) is swept on the retry.
    async with running(bus, **case.config(proxy.url, keep_last=1, stale_upload_age=0.001)):
        await settled(bus, (await case.publish(*case.checkpoint(1, small))).seq)
        proxy.answer(delete_errors("InternalError"))
        second = await case.publish(*case.checkpoint(2, small))
        assert (await events.next(CheckpointMirrored)).step == 1
        assert (await events.next(CheckpointMirrored)).step == 2

        async def refused_twice_or_announced() -> bool:
            deletes = [r for r in proxy.answered if is_delete_objects(*r)]
            return len(deletes) >= 2 or await published(bus, run, "pruned") > 0

        await until(refused_twice_or_announced, what="the prune refused, then retried")
        assert await published(bus, run, "pruned") == 0  # nothing announced as removed
        assert names(s3, bucket, run, 1) >= {"rng.bin", "model.safetensors"}
        proxy.answer(None)
        pruned = await events.next(CheckpointPruned)
        await settled(bus, second.seq)
    assert pruned.names == ["step-1"]
    assert names(s3, bucket, run, 1) == set()
    assert ck.list_steps(s3, bucket, run) == {2: True}


# ------------------------------------------------------- retention beside a running upload


async def step_10_parked_and_step_20_committed(case: Case, proxy: AnsweringProxy,
                                               s3: Any) -> None:
    """Step 10's small files are stored and its big file's last part is parked; step 20
    is then committed (keep_last=1: retention has passed step 10) and its handling done."""
    proxy.hold(lambda m, p: "/step-10/" in p and part("optimizer.bin", 3)(m, p))
    await case.publish(*case.checkpoint(10))
    await until(proxy.holding.is_set, what="step 10's last part parked")
    await until(lambda: names(s3, case.bucket, case.run, 10) >=
                {"rng.bin", "data_position.json", "model.safetensors"},
                what="step 10's small files stored")
    await case.publish(*case.checkpoint(20, {"rng.bin": 100}))
    assert (await case.events.next(CheckpointMirrored)).step == 20

    async def only_step_10_held() -> bool:
        info = await case.bus.js.consumer_info("MIRROR", "checkpointer")
        return info.num_ack_pending == 1 and info.num_pending == 0

    await until(only_step_10_held, what="step 20 handled, retention included")


async def test_retention_leaves_a_never_committed_checkpoint_alone_while_it_uploads(
        case: Case, s3_server: S3Server, proxy: AnsweringProxy) -> None:
    run, bucket, bus = case.run, case.bucket, case.bus
    s3 = client(s3_server.url)
    async with running(bus, **case.config(proxy.url, keep_last=1)):
        await step_10_parked_and_step_20_committed(case, proxy, s3)
        assert names(s3, bucket, run, 10) == {"rng.bin", "data_position.json",
                                              "model.safetensors"}
        assert await published(bus, run, "pruned") == 0
        proxy.release()
        assert (await case.events.next(CheckpointMirrored)).step == 10
    assert uploads_of(proxy, "data_position.json") == 1  # step 10's, never sent again
    assert uploads_of(proxy, "rng.bin") == 2  # step 10's and step 20's


async def test_a_commit_whose_files_retention_swept_is_taken_back_and_sent_again(
        case: Case, s3_server: S3Server, proxy: AnsweringProxy, tmp_path: Path) -> None:
    run, bucket, bus, events = case.run, case.bucket, case.bus, case.events
    s3 = client(s3_server.url)

    def run_listing(method: str, path: str) -> bool:  # retention's, after a commit
        return method == "GET" and "prefix=" + ck.run_prefix(run).replace("/", "%2F") \
            in path.split("?", 1)[-1].split("&")

    # stale_upload_age: step 10's upload is taken for an abandoned one, as one slower
    # than that would be, so retention sweeps its small files while its big one uploads.
    async with running(bus, **case.config(proxy.url, keep_last=1, stale_upload_age=0.001)):
        await step_10_parked_and_step_20_committed(case, proxy, s3)
        pruned = await events.next(CheckpointPruned)
        assert pruned.names == ["step-10"] and names(s3, bucket, run, 10) == set()
        proxy.release()
        proxy.hold(run_listing)  # step 10's own retention waits: its commit stays to see
        assert (await events.next(CheckpointMirrored)).step == 10
        try:
            restored = ck.restore(s3, bucket, run, tmp_path / "restored", step=10,
                                  fallback=False)
        finally:
            proxy.release()
    assert (restored.step, restored.skipped) == (10, [])
    assert not [e for e in events.seen if isinstance(e, CheckpointFailed)]
    assert uploads_of(proxy, "rng.bin") == 3  # step 10's, step 20's, step 10's again


# --------------------------------------------------------------------------- S3 outages


async def test_an_outage_longer_than_the_attempts_hands_the_checkpoint_back_not_up(
        case: Case, s3_server: S3Server, proxy: AnsweringProxy) -> None:
    run, bucket, bus, events = case.run, case.bucket, case.bus, case.events
    async with running(bus, **case.config(proxy.url, attempts=2)):
        await settled(bus, (await case.publish(*case.checkpoint(1, {"rng.bin": 100}))).seq)
        proxy.answer(lambda m, p, b: (503, s3_error("SlowDown", "Please reduce your rate")))
        directory, manifest = case.checkpoint(2, {"rng.bin": 100})
        ack = await case.publish(directory, manifest)

        async def handed_back_or_failed() -> bool:
            return await redelivered(bus) >= 1 or await published(bus, run, "failed") > 0

        await until(handed_back_or_failed, what="step 2 handed back after its attempts")
        assert await published(bus, run, "failed") == 0
        assert ck.scan(directory, run, 2).files == manifest.files  # the local copy kept
        proxy.answer(None)  # S3 is back
        assert (await events.next(CheckpointMirrored, where=lambda e: e.step == 2)).step == 2
        await settled(bus, ack.seq)
    assert ck.committed_steps(client(s3_server.url), bucket, run) == [1, 2]
    assert await published(bus, run, "failed") == 0


async def test_an_outage_outlasting_every_delivery_is_dead_lettered_and_the_run_told(
        case: Case, s3_server: S3Server, proxy: AnsweringProxy) -> None:
    run, bus, events = case.run, case.bus, case.events
    proxy.answer(lambda m, p, b: (503, s3_error("SlowDown", "Please reduce your rate")))
    directory, manifest = case.checkpoint(3, {"rng.bin": 100})
    async with running(bus, **case.config(proxy.url, attempts=1, max_deliver=2)):
        ack = await case.publish(directory, manifest)
        failed = await events.next(CheckpointFailed)
        await settled(bus, ack.seq)
    assert failed.step == 3 and "dead-lettered (dlq.MIRROR)" in failed.reason, failed.reason
    assert "last: gave up after 1 attempts" in failed.reason and "503" in failed.reason
    letters = await bus.js.stream_info("DLQ", subjects_filter=subjects.dlq("MIRROR"))
    assert (letters.state.subjects or {}).get(subjects.dlq("MIRROR")) == 1
    assert ck.scan(directory, run, 3).files == manifest.files  # the local copy kept


async def test_an_error_that_will_not_heal_publishes_failed_and_keeps_the_local_copy(
        case: Case, s3_server: S3Server, proxy: AnsweringProxy) -> None:
    run, bucket, bus, events = case.run, case.bucket, case.bus, case.events
    directory, manifest = case.checkpoint(30, {"rng.bin": 4096})
    proxy.answer(lambda m, p, b: (403, s3_error("AccessDenied")) if m == "PUT" and
                 p.split("?")[0].endswith("/rng.bin") else None)
    async with running(bus, **case.config(proxy.url, attempts=2, local_keep=0)):
        ack = await case.publish(directory, manifest)
        failed = await events.next(CheckpointFailed)
        await settled(bus, ack.seq)
    assert failed.step == 30 and failed.attempts == 2
    assert "gave up after 2 attempts" in failed.reason and "AccessDenied" in failed.reason
    assert await deliveries(bus) == 1  # acked: retrying would not help
    assert ck.list_steps(client(s3_server.url), bucket, run).get(30) is not True
    assert ck.scan(directory, run, 30).files == manifest.files


# ----------------------------------------------------------------------------- keepalive


async def test_a_slow_prune_is_kept_alive_not_handled_twice(
        case: Case, nats_server: NatsServer, proxy: AnsweringProxy) -> None:
    nproxy = await NatsProxy(nats_server.url).start()
    svc_bus = await Bus.connect(load(Settings, nats_url=nproxy.url,
                                     cluster=case.settings.cluster, node="n0"), "ckpt")
    try:
        async with running(svc_bus, **case.config(proxy.url, keep_last=1)):
            await settled(case.bus, (await case.publish(
                *case.checkpoint(1, {"rng.bin": 100}))).seq)
            proxy.hold(is_delete_objects)  # step 2's retention of step 1 hangs
            await case.publish(*case.checkpoint(2, {"rng.bin": 100}))
            await until(proxy.holding.is_set, what="the prune parked")
            kept = nproxy.sent.count(b"+WPI")  # in-progress acks sent so far

            async def kept_past_ack_wait_or_handed_again() -> bool:
                # AckWait is 3 s, an in-progress ack goes every 1 s: four of them span
                # more than an AckWait with the message held.
                return nproxy.sent.count(b"+WPI") >= kept + 4 or \
                    await redelivered(case.bus) > 0

            await until(kept_past_ack_wait_or_handed_again, what="in-progress acks")
            assert await redelivered(case.bus) == 0
            proxy.release()
            assert (await case.events.next(CheckpointPruned)).names == ["step-1"]
        assert await deliveries(case.bus) == 2  # each checkpoint handled once
    finally:
        await svc_bus.drain()
        await nproxy.stop()
