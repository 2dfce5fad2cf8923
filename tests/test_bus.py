"""The bus against a real nats-server: provisioning, tracing across processes, DLQ,
server crash and restart, and graceful shutdown of a service on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import pytest
from nats.js.api import RetentionPolicy
from nats.js.errors import APIError

from tandem.cli.devstack import NatsServer
from tandem.common import streams, subjects
from tandem.common.bus import Bus, Consumer, Delivery, Poller
from tandem.common.errors import Reject, StreamConflict
from tandem.common.events import DeadLetter, GenerationTask, decode, struct_replace
from tandem.common.settings import Settings
from tests.conftest import PYTHON, ROOT, service_env

TIMEOUT = 20


def _work(uid: str, ack_wait: float = 5) -> tuple[streams.StreamSpec, streams.ConsumerSpec]:
    stream = streams.StreamSpec(f"W_{uid}", (f"w.{uid}.*",), retention=RetentionPolicy.WORK_QUEUE)
    return stream, streams.ConsumerSpec(stream.name, "w", ack_wait=ack_wait, max_deliver=3)


async def _collect(bus: Bus, consumer: streams.ConsumerSpec, want: int,
                   handler=None) -> list[GenerationTask]:  # type: ignore[no-untyped-def]
    """Run a consumer until ``want`` events were handled; return them in order."""
    seen: list[GenerationTask] = []
    stop = asyncio.Event()

    async def handle(d: Delivery[GenerationTask]) -> None:
        if handler is not None:
            await handler(d)
        seen.append(d.event)
        if len(seen) >= want:
            stop.set()

    c = bus.consumer(consumer, GenerationTask, handle, fetch_timeout=0.2)
    await asyncio.wait_for(c.run(stop), TIMEOUT)
    return seen


async def test_provisioning_twice_changes_nothing(bus: Bus, uid: str) -> None:
    specs = [*streams.core_streams(), *streams.cluster_streams([f"c{uid}"])]
    first = await bus.provision(specs)
    assert "KV_tasks" in first and f"GEN_C{uid.upper()}" in first
    before = await bus.js.stream_info(f"GEN_C{uid.upper()}")
    assert await bus.provision(specs) == []
    after = await bus.js.stream_info(f"GEN_C{uid.upper()}")
    assert after.config == before.config


async def test_conflicting_stream_is_reported_by_name_and_field_and_kept(
        bus: Bus, uid: str) -> None:
    spec = streams.StreamSpec(f"S_{uid}", (f"s.{uid}",), max_age=600.0)
    await bus.provision([spec])
    await bus.publish(f"s.{uid}", GenerationTask(task_id="keep", model="m"))
    changed = streams.StreamSpec(f"S_{uid}", (f"s.{uid}",), max_age=1200.0)
    with pytest.raises(StreamConflict) as err:
        await bus.provision([changed])
    assert err.value.name == f"S_{uid}"
    assert [d.field for d in err.value.differences] == ["max_age"]
    assert "max_age is 600.0, declared 1200.0" in str(err.value)
    info = await bus.js.stream_info(f"S_{uid}")
    assert info.config.max_age == 600.0 and info.state.messages == 1


async def test_event_published_by_another_process_keeps_its_trace_id(
        bus: Bus, uid: str, settings: Settings) -> None:
    stream, consumer = _work(uid)
    await bus.provision([*streams.core_streams(), stream, consumer])
    script = f"""
import asyncio
from opentelemetry import trace
from tandem.common import tracing
from tandem.common.bus import Bus
from tandem.common.events import GenerationTask
from tandem.common.settings import Settings, load
async def main():
    tracing.configure("producer")
    bus = await Bus.connect(load(Settings), "producer")
    with tracing.tracer().start_as_current_span("submit") as span:
        await bus.publish("w.{uid}.x", GenerationTask(task_id="traced", model="m"))
        print("TRACE=" + format(span.get_span_context().trace_id, "032x"), flush=True)
    await bus.drain()
asyncio.run(main())
"""
    out = await asyncio.to_thread(
        subprocess.run, [PYTHON, "-c", script], capture_output=True, text=True, timeout=60,
        env=service_env(nats_url=settings.nats_url), cwd=ROOT, check=True)
    [producer_trace] = [line[6:] for line in out.stdout.splitlines() if line.startswith("TRACE=")]
    inside: list[str] = []

    async def handler(d: Delivery[GenerationTask]) -> None:
        from opentelemetry import trace

        inside.append(format(trace.get_current_span().get_span_context().trace_id, "032x"))
        assert d.trace_id == producer_trace

    [event] = await _collect(bus, consumer, 1, handler)
    assert event.task_id == "traced"
    assert inside == [producer_trace]
    # A publish made while handling joins the same trace.
    assert bus.headers()["traceparent"].split("-")[1] != producer_trace


async def test_poison_message_goes_to_dlq_and_loop_continues(bus: Bus, uid: str) -> None:
    stream, consumer = _work(uid)
    await bus.provision([*streams.core_streams(), stream, consumer])
    await bus.publish(f"w.{uid}.x", b"\x00garbage")
    await bus.publish(f"w.{uid}.x", GenerationTask(task_id="bad-model", model="m"))
    await bus.publish(f"w.{uid}.x", GenerationTask(task_id="good", model="m"))

    async def handler(d: Delivery[GenerationTask]) -> None:
        if d.event.task_id == "bad-model":
            raise Reject("model m is not served here")

    seen = await _collect(bus, consumer, 1, handler)
    assert [e.task_id for e in seen] == ["good"]
    sub = await bus.js.pull_subscribe(subjects.dlq(stream.name), durable=None, stream="DLQ")
    letters = [decode(m.data, DeadLetter) for m in await sub.fetch(2, timeout=5)]
    reasons = sorted(letter.reason.split(":")[0] for letter in letters)
    assert reasons == ["rejected", "undecodable"]
    assert {letter.data for letter in letters} >= {b"\x00garbage"}
    assert all(letter.stream == stream.name for letter in letters)
    info = await bus.js.stream_info(stream.name)
    assert info.state.messages == 0  # all settled: nothing left behind in the work queue


@pytest.mark.parametrize(("error", "told"), [
    (RuntimeError("worker blew up"), "RuntimeError('worker blew up')"),
    # A JetStream error's repr is its bare class name: the reason gives its description.
    (APIError(code=503, err_code=10023, description="insufficient resources"),
     "insufficient resources (JetStream error 503/10023)"),
], ids=["python", "jetstream"])
async def test_failing_handler_is_dead_lettered_after_max_deliver(
        bus: Bus, uid: str, error: Exception, told: str) -> None:
    stream, consumer = _work(uid)
    await bus.provision([*streams.core_streams(), stream, consumer])
    await bus.publish(f"w.{uid}.x", GenerationTask(task_id="boom", model="m"))
    await bus.publish(f"w.{uid}.x", GenerationTask(task_id="fine", model="m"))
    attempts: list[int] = []

    async def handler(d: Delivery[GenerationTask]) -> None:
        if d.event.task_id == "boom":
            attempts.append(d.num_delivered)
            raise error

    dead = asyncio.Event()
    reasons: list[str] = []

    async def on_dead(msg, reason: str) -> None:  # type: ignore[no-untyped-def]
        reasons.append(reason)
        dead.set()

    stop = asyncio.Event()
    c = bus.consumer(consumer, GenerationTask, handler, fetch_timeout=0.2, on_dead=on_dead)
    task = asyncio.create_task(c.run(stop))
    await asyncio.wait_for(dead.wait(), TIMEOUT)
    stop.set()
    await asyncio.wait_for(task, TIMEOUT)
    # max_deliver=3: the handler runs on deliveries 1 and 2; the 2nd failure dead-letters.
    assert attempts == [1, 2]
    assert c.handled == 1
    assert reasons == [f"failed 2 times: {told}"]


async def test_a_message_held_past_its_ack_wait_is_kept_and_never_redelivered(
        bus: Bus, uid: str) -> None:
    stream = streams.StreamSpec(f"K_{uid}", (f"k.{uid}",), retention=RetentionPolicy.WORK_QUEUE)
    consumer = streams.ConsumerSpec(stream.name, "k", ack_wait=1, max_deliver=3)
    await bus.provision([*streams.core_streams(), stream, consumer])
    # The in-progress acks, as the server receives them (a core subscriber sees each).
    kept: list[bytes] = []
    enough, acked = asyncio.Event(), asyncio.Event()

    async def on_ack(msg) -> None:  # type: ignore[no-untyped-def]
        kept.append(msg.data)
        if kept.count(b"+WPI") >= 8:  # 8 x 0.2 s: held well past the 1 s AckWait
            enough.set()
        if msg.data in (b"", b"+ACK"):  # nats-py acks with an empty body
            acked.set()

    sub = await bus.nc.subscribe(f"$JS.ACK.{stream.name}.k.>", cb=on_ack)
    await bus.publish(f"k.{uid}", GenerationTask(task_id="long", model="m"))
    deliveries: list[int] = []

    async def hold(d: Delivery[GenerationTask]) -> None:
        deliveries.append(d.num_delivered)
        async with d.keepalive(0.2):
            await enough.wait()

    stop = asyncio.Event()
    c = bus.consumer(consumer, GenerationTask, hold, fetch_timeout=0.2, concurrency=2)
    task = asyncio.create_task(c.run(stop))
    await asyncio.wait_for(enough.wait(), TIMEOUT)
    stop.set()  # the loop ends once the handler has returned and its message is acked
    await asyncio.wait_for(task, TIMEOUT)
    await asyncio.wait_for(acked.wait(), TIMEOUT)
    await sub.unsubscribe()
    info = await bus.js.consumer_info(stream.name, "k")
    assert deliveries == [1] and info.num_redelivered == 0 and info.num_ack_pending == 0
    assert c.handled == 1


async def test_consumer_resumes_after_server_kill_and_no_acked_publish_is_lost(
        nats_server: NatsServer, settings: Settings, uid: str) -> None:
    bus = await Bus.connect(settings, "test")
    stream, consumer = _work(uid)
    await bus.provision([stream, consumer])
    total = 40
    acked: list[str] = []
    seen: set[str] = set()
    stop = asyncio.Event()

    async def handle(d: Delivery[GenerationTask]) -> None:
        seen.add(d.event.task_id)
        if len(seen) == total:
            stop.set()

    c = bus.consumer(consumer, GenerationTask, handle, fetch_timeout=0.2)
    run = asyncio.create_task(c.run(stop))
    for i in range(total):
        if i == total // 2:
            nats_server.kill()
            nats_server.start()  # same port, same file store
        tid = f"t{i}"
        await bus.publish(f"w.{uid}.x", GenerationTask(task_id=tid, model="m"),
                          msg_id=tid, retry_for=TIMEOUT)
        acked.append(tid)
    await asyncio.wait_for(run, TIMEOUT * 2)
    assert seen == set(acked)
    await bus.drain()


async def test_sigterm_finishes_in_flight_work_and_exits_zero(
        bus: Bus, settings: Settings, uid: str, tmp_path: Path) -> None:
    started: asyncio.Queue[int] = asyncio.Queue()
    done: list[int] = []

    async def on_started(m) -> None:  # type: ignore[no-untyped-def]
        started.put_nowait(json.loads(m.data)["n"])

    await bus.nc.subscribe(f"echo.started.{uid}", cb=on_started)

    async def on_done(m) -> None:  # type: ignore[no-untyped-def]
        done.append(json.loads(m.data)["n"])

    await bus.nc.subscribe(f"echo.done.{uid}", cb=on_done)
    env = service_env(nats_url=settings.nats_url, echo_name=uid, echo_delay="1.0",
                      drain_timeout="15")
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-m", "tests.support.echo_service", cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        from tests.support.echo_service import Echo

        for n in range(3):
            # The stream is provisioned by the service at start; retry until it exists.
            await bus.publish(f"echo.{uid}", Echo(n=n), retry_for=TIMEOUT)
        first = await asyncio.wait_for(started.get(), TIMEOUT)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), TIMEOUT)
        output = (await proc.stdout.read()).decode() if proc.stdout else ""
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0, output
    await bus.synced()
    assert first in done  # the in-flight message finished before exit
    assert "runner.drained" in output
    # What was not started is still in the stream for the next worker (handed back).
    info = await bus.js.consumer_info(f"ECHO_{uid}", "echo")
    assert info.num_pending + info.num_ack_pending + len(done) == 3


async def test_pipelined_publish_returns_each_ack_in_order_and_flags_duplicates(
        bus: Bus, uid: str) -> None:
    stream, _ = _work(uid)
    await bus.provision([stream])
    tasks = [GenerationTask(task_id=f"t{i}", model="digits", class_label=i) for i in range(3)]
    first = await bus.publish_many([(f"w.{uid}.a", t, f"id-{t.task_id}") for t in tasks])
    assert [a.seq for a in first] == [1, 2, 3] and not any(a.duplicate for a in first)
    again = await bus.publish_many([(f"w.{uid}.a", tasks[1], "id-t1"),
                                    (f"w.{uid}.a", tasks[2], None)])
    assert again[0].duplicate and again[0].seq == 2
    assert again[1].seq == 4 and not again[1].duplicate


async def test_pipelined_publish_to_a_subject_without_stream_raises(bus: Bus, uid: str) -> None:
    from nats.js.errors import NoStreamResponseError

    with pytest.raises(NoStreamResponseError):
        await bus.publish_many([(f"nostream.{uid}", b"{}", None)])


async def test_concurrent_sends_each_get_their_own_acks_and_errors(bus: Bus, uid: str) -> None:
    # Sends of one loop turn go out as one group; a failing one must not fail the others.
    from nats.js.errors import NoStreamResponseError

    stream, _ = _work(uid)
    await bus.provision([stream])
    good = [(f"w.{uid}.a", b"{}", None)] * 3
    got = await asyncio.gather(bus.send(good), bus.send([(f"nostream.{uid}", b"{}", None)]),
                               bus.send(good[:2]), return_exceptions=True)
    assert isinstance(got[1], NoStreamResponseError)
    seqs = sorted(a.seq for a in [*got[0], *got[2]])  # type: ignore[misc]
    assert seqs == [1, 2, 3, 4, 5]


async def test_concurrent_sends_each_wait_only_for_their_own_acks_and_timeout(
        bus: Bus, uid: str) -> None:
    from nats.errors import TimeoutError as NatsTimeout

    stream, _ = _work(uid)
    await bus.provision([stream])
    # A core subscriber that never answers: a publish there gets no ack at all.
    silent = await bus.nc.subscribe(f"silent.{uid}")
    # All three in one loop turn: one group, one inbox, one timer.
    quick = asyncio.ensure_future(bus.send([(f"silent.{uid}", b"{}", None)], timeout=0.3))
    slow = asyncio.ensure_future(bus.send([(f"silent.{uid}", b"{}", None)], timeout=30))
    good = asyncio.ensure_future(bus.send([(f"w.{uid}.a", b"{}", None)], timeout=30))
    # Each returns on its own: the good one with its ack, the quick one at its own 0.3 s,
    # both while the slow one (the group's end, 30 s away) is still waiting.
    assert (await good)[0].seq == 1
    with pytest.raises(NatsTimeout):
        await quick
    assert not slow.done()
    slow.cancel()
    await silent.unsubscribe()


async def test_publish_once_stores_a_subject_once_however_late_the_repeat(
        bus: Bus, uid: str) -> None:
    stream, _ = _work(uid)
    await bus.provision([stream])
    assert await bus.publish_once(f"w.{uid}.r1", b'{"n": 1}')
    assert not await bus.publish_once(f"w.{uid}.r1", b'{"n": 2}')  # a redelivery's repeat
    assert await bus.publish_once(f"w.{uid}.r2", b'{"n": 3}')
    info = await bus.js.stream_info(stream.name, subjects_filter=f"w.{uid}.>")
    assert info.state.subjects == {f"w.{uid}.r1": 1, f"w.{uid}.r2": 1}
    first = await bus.js.get_last_msg(stream.name, f"w.{uid}.r1")
    assert first.data == b'{"n": 1}'


async def test_fetch_returns_a_late_message_at_once_not_after_its_timeout(
        bus: Bus, uid: str) -> None:
    # The batch (64) is not filled and the timeout (120 s) is far off: the fetch must
    # still hand over the one message as soon as it comes.
    stream, consumer = _work(uid)
    await bus.provision([stream, consumer])
    c = bus.consumer(consumer, GenerationTask, _nothing)
    waiting = asyncio.create_task(c.fetch(64, 120))
    await bus.publish(f"w.{uid}.a", GenerationTask(task_id="late", model="digits"))
    msgs = await asyncio.wait_for(waiting, TIMEOUT)
    assert [decode(m.data, GenerationTask).task_id for m in msgs] == ["late"]
    await c.close()


async def test_fetch_takes_a_partial_batch_then_reports_an_empty_queue(
        bus: Bus, uid: str) -> None:
    c = await _queued(bus, uid, 5)
    got = await asyncio.wait_for(c.fetch(3, 5), TIMEOUT)
    got += await asyncio.wait_for(c.fetch(64, 5), TIMEOUT)
    assert [decode(m.data, GenerationTask).task_id for m in got] == [f"t{i}" for i in range(5)]
    for m in got:
        await m.ack()
    assert await asyncio.wait_for(c.fetch(8, 0.3), TIMEOUT) == []
    await c.close()


async def test_fetch_from_a_deleted_consumer_raises_rather_than_waiting(
        bus: Bus, uid: str) -> None:
    from nats.errors import NoRespondersError

    stream, consumer = _work(uid)
    await bus.provision([stream, consumer])
    c = bus.consumer(consumer, GenerationTask, _nothing)
    await bus.js.delete_consumer(stream.name, consumer.durable)
    with pytest.raises(NoRespondersError):
        await asyncio.wait_for(c.fetch(8, 60), TIMEOUT)
    await c.close()


async def test_closing_a_consumer_hands_back_what_it_fetched_but_never_took(
        bus: Bus, uid: str) -> None:
    c = await _queued(bus, uid, 4, ack_wait=120)  # far past the test's deadline
    consumer = c.spec
    assert len(await asyncio.wait_for(c.fetch(1, 5), TIMEOUT)) == 1
    # Ask the server for the rest on this consumer's inbox, but never fetch them.
    pull = c._sub
    assert pull is not None
    await pull._request(3)
    while len(pull.buf) < 3:  # delivered into the inbox, not yet taken
        await asyncio.wait_for(_next_delivery(pull), TIMEOUT)
    await c.close()
    # Handed back (nak), so another consumer gets them now, not after AckWait (120 s).
    # The server takes the naks in turn: a fetch may find some back before the rest.
    other = bus.consumer(consumer, GenerationTask, _nothing)
    async with asyncio.timeout(TIMEOUT):
        got = await other.fetch(3, 4)
        while len(got) < 3:
            got += await other.fetch(3 - len(got), 4)
    assert sorted(decode(m.data, GenerationTask).task_id for m in got) == ["t1", "t2", "t3"]
    await other.close()


async def _queued(bus: Bus, uid: str, n: int, ack_wait: float = 5) -> Consumer[GenerationTask]:
    """A work queue holding tasks t0..t<n-1>, and a consumer of it (not running)."""
    stream, consumer = _work(uid, ack_wait)
    await bus.provision([stream, consumer])
    await bus.publish_many([(f"w.{uid}.a", GenerationTask(task_id=f"t{i}", model="digits"),
                             None) for i in range(n)])
    return bus.consumer(consumer, GenerationTask, _nothing)


async def _next_delivery(pull) -> None:  # type: ignore[no-untyped-def]
    pull.waiter = asyncio.get_running_loop().create_future()
    try:
        await pull.waiter
    finally:
        pull.waiter = None


async def _nothing(d: Delivery[GenerationTask]) -> None:
    return None


async def test_typed_kv_writes_through_the_bus_keep_compare_and_set(bus: Bus, uid: str) -> None:
    from nats.js.errors import InvalidKeyError

    from tandem.common.events import TaskRecord
    from tandem.common.streams import KVSpec

    await bus.provision([KVSpec(f"cas_{uid}")])
    kv = await bus.typed(f"cas_{uid}", TaskRecord)
    rec = TaskRecord(task=GenerationTask(task_id="t", model="digits"))
    assert await kv.create("t", rec) == 1
    assert await kv.create("t", rec) is None  # exists: refused, not overwritten

    def bump(cur: TaskRecord | None) -> TaskRecord | None:
        assert cur is not None
        return struct_replace(cur, attempts=cur.attempts + 1)

    # 20 writers race on one key: every increment must land exactly once.
    await asyncio.gather(*(kv.update("t", bump) for _ in range(20)))
    got = await kv.get("t")
    assert got is not None and got[0].attempts == 20 and got[1] == 21
    assert await kv.put("t", rec) == 22  # a plain put overwrites, whatever the revision
    got = await kv.get("t")
    assert got is not None and got[0].attempts == 0
    with pytest.raises(InvalidKeyError):
        await kv.create("bad key", rec)


async def test_an_expected_value_spares_the_read_until_the_key_has_moved_on(
        bus: Bus, uid: str) -> None:
    from tandem.common.events import TaskRecord
    from tandem.common.streams import KVSpec

    await bus.provision([KVSpec(f"exp_{uid}")])
    kv = await bus.typed(f"exp_{uid}", TaskRecord)
    rec = TaskRecord(task=GenerationTask(task_id="t", model="digits"))
    rev = await kv.create("t", rec)
    assert rev is not None
    seen: list[int] = []

    def bump(cur: TaskRecord | None) -> TaskRecord | None:
        assert cur is not None
        seen.append(cur.attempts)
        return struct_replace(cur, attempts=cur.attempts + 1)

    # Current: the guess is the base, one write, no read.
    assert (await kv.update("t", bump, expect=(rec, rev))).attempts == 1  # type: ignore[union-attr]
    # Stale (the key moved on): the guess's write is refused, the stored value decides.
    stale = struct_replace(rec, attempts=40)
    assert (await kv.update("t", bump, expect=(stale, rev))).attempts == 2  # type: ignore[union-attr]
    assert seen == [0, 40, 1]
    got = await kv.get("t")
    assert got is not None and got[0].attempts == 2


async def test_provisioning_lets_an_older_bucket_be_read_directly_keeping_its_data(
        bus: Bus, uid: str) -> None:
    from nats.js.api import KeyValueConfig

    from tandem.common.streams import KVSpec

    kv = await bus.js.create_key_value(KeyValueConfig(bucket=f"old_{uid}", direct=False))
    await kv.put("k", b"kept")
    assert not (await bus.js.stream_info(f"KV_old_{uid}")).config.allow_direct
    # Made before its writes were announced, too: provisioning adds that as well.
    spec = KVSpec(f"old_{uid}", announce=f"written_{uid}.>")
    assert await bus.provision([spec]) == []  # nothing created
    config = (await bus.js.stream_info(f"KV_old_{uid}")).config
    assert config.allow_direct and config.republish == spec.republish()
    fresh = await bus.js.key_value(f"old_{uid}")  # opened anew: reads by direct get
    assert (await fresh.get("k")).value == b"kept"
    heard = await bus.nc.subscribe(f"written_{uid}.*")
    await fresh.put("k", b"new")
    msg = await heard.next_msg(timeout=5)
    assert (msg.subject, msg.data, msg.headers["Nats-Subject"]) == (
        f"written_{uid}.k", b"", f"$KV.old_{uid}.k")  # headers only: never the value


async def test_a_fetch_handler_settles_each_message_by_its_own_outcome_as_it_comes(
        bus: Bus, uid: str) -> None:
    """A whole fetch's handler: each message is settled as it is yielded, in any order,
    by its own outcome (ack, a retry, the DLQ); one it never yields is settled by what
    ended the handler; one whose outcome is not yet known stays held."""
    from tandem.common.errors import Retry

    stream, consumer = _work(uid)
    await bus.provision([*streams.core_streams(), stream, consumer])
    ids = ["ok", "later", "retry", "reject", "lost"]
    await bus.publish_many([(f"w.{uid}.a", GenerationTask(task_id=i, model="m"), None)
                            for i in ids])
    release = asyncio.Event()  # "later" ends only once the others are settled
    fetches: list[list[str]] = []
    acked: list[str] = []
    all_acked = asyncio.Event()
    stop = asyncio.Event()

    async def handle(ds):  # type: ignore[no-untyped-def]
        fetches.append([d.event.task_id for d in ds])
        by_id = {d.event.task_id: d for d in ds}
        if "ok" not in by_id:  # those handed back, delivered again
            for d in ds:
                yield d, None
            return
        yield by_id["ok"], None
        yield by_id["retry"], Retry("not now", delay=0.2)
        yield by_id["reject"], Reject("never")
        await asyncio.wait_for(release.wait(), TIMEOUT)
        yield by_id["later"], None
        raise RuntimeError("handler broke before lost")

    c = bus.consumer(consumer, GenerationTask, fetch_handler=handle, fetch_timeout=0.2,
                     concurrency=8, batch=8)
    original_ack = c.policy.ack

    async def ack(msg):  # type: ignore[no-untyped-def]
        acked.append(decode(msg.data, GenerationTask).task_id)
        if len(acked) == 1:
            release.set()  # "later" waits until "ok" was acked on its own
        await original_ack(msg)
        if len(acked) == 4:
            all_acked.set()

    c.policy.ack = ack  # type: ignore[method-assign]
    task = asyncio.create_task(c.run(stop))
    await asyncio.wait_for(all_acked.wait(), TIMEOUT)
    stop.set()
    await asyncio.wait_for(task, TIMEOUT)
    assert fetches[0] == ids
    assert acked[:2] == ["ok", "later"]
    # "retry" came back after its nak; "lost" after the handler's error (a nak too).
    assert sorted(acked[2:]) == ["lost", "retry"]
    assert sorted(i for f in fetches[1:] for i in f) == ["lost", "retry"]
    sub = await bus.js.pull_subscribe(subjects.dlq(stream.name), durable=None, stream="DLQ")
    [letter] = [decode(m.data, DeadLetter) for m in await sub.fetch(1, timeout=5)]
    assert letter.reason == "rejected: never"
    assert (await bus.js.stream_info(stream.name)).state.messages == 0


async def test_a_cancelled_fetch_handler_hands_back_what_it_had_not_settled(
        bus: Bus, uid: str) -> None:
    c = await _queued(bus, uid, 3, ack_wait=120)  # far past the test's deadline
    started = asyncio.Event()
    closed: list[bool] = []

    async def handle(ds):  # type: ignore[no-untyped-def]
        try:
            yield ds[0], None
            started.set()
            await asyncio.Event().wait()  # the others never end
            yield ds[1], None
        finally:
            closed.append(True)

    fc = bus.consumer(c.spec, GenerationTask, fetch_handler=handle, fetch_timeout=0.2,
                      concurrency=8, batch=8)
    stop = asyncio.Event()
    task = asyncio.create_task(fc.run(stop))
    await asyncio.wait_for(started.wait(), TIMEOUT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]  # the handler's own cleanup ran
    # Handed back (nak): another consumer gets them now, not after AckWait (120 s).
    async with asyncio.timeout(TIMEOUT):
        got = await c.fetch(2, 4)
        while len(got) < 2:
            got += await c.fetch(2 - len(got), 4)
    assert sorted(decode(m.data, GenerationTask).task_id for m in got) == ["t1", "t2"]
    await c.close()


async def test_send_each_gives_each_message_its_own_ack_or_error(bus: Bus, uid: str) -> None:
    from nats.js.api import PubAck
    from nats.js.errors import APIError, NoStreamResponseError

    stream, _ = _work(uid)
    await bus.provision([stream])
    got = await bus.send_each([(f"w.{uid}.a", b"{}", None),
                               (f"nostream.{uid}", b"{}", None),
                               (f"w.{uid}.a", b"{}", {"Nats-Expected-Last-Subject-Sequence": "7"}),
                               (f"w.{uid}.a", b"{}", None)])
    assert isinstance(got[0], PubAck) and got[0].seq == 1
    assert isinstance(got[1], NoStreamResponseError)
    assert isinstance(got[2], APIError) and got[2].err_code == 10071  # wrong last sequence
    assert isinstance(got[3], PubAck) and got[3].seq == 2


async def test_move_many_writes_known_keys_in_one_send_and_reads_only_those_moved_on(
        bus: Bus, uid: str) -> None:
    from nats.js.errors import InvalidKeyError

    from tandem.common.events import TaskRecord
    from tandem.common.streams import KVSpec

    await bus.provision([KVSpec(f"many_{uid}")])
    kv = await bus.typed(f"many_{uid}", TaskRecord)
    recs = {k: TaskRecord(task=GenerationTask(task_id=k, model="digits"))
            for k in ("a", "b", "c")}
    revs = {k: await kv.create(k, r) for k, r in recs.items()}
    bumped = await kv.put("b", struct_replace(recs["b"], attempts=10))  # b moved on
    seen: dict[str, list[int]] = {}

    def bump(key: str):  # type: ignore[no-untyped-def]
        def fn(cur: TaskRecord | None) -> TaskRecord | None:
            seen.setdefault(key, []).append(cur.attempts if cur else -1)
            return struct_replace(cur, attempts=cur.attempts + 1) if cur else None
        return fn

    got = await kv.move_many([("a", bump("a"), (recs["a"], revs["a"])),
                              ("b", bump("b"), (recs["b"], revs["b"])),
                              ("c", bump("c"), None),
                              ("nope", bump("nope"), None),
                              ("bad key", bump("bad key"), (recs["a"], 1))])
    assert got[0] == (struct_replace(recs["a"], attempts=1), bumped + 1)  # the send's first
    # b: the guess was refused and the stored value decided: 10 -> 11, no lost write.
    assert got[1] is not None and not isinstance(got[1], BaseException)
    assert got[1][0].attempts == 11 and got[1][1] > bumped
    assert seen["a"] == [0] and seen["b"] == [0, 10] and seen["c"] == [0]
    assert got[3] is None  # no such key, and fn declined to create it
    assert isinstance(got[4], InvalidKeyError)
    assert (await kv.get("c"))[0].attempts == 1  # type: ignore[index]


async def test_synced_covers_a_subscription_made_just_before_it(
        nats_server: NatsServer) -> None:
    """nats-py's ``flush`` writes its PING ahead of a SUB still in the client's buffer, so
    its PONG can come back before the server has the SUB (another connection's request
    then finds no responder: test_security_nats met it). ``synced`` returns only once a
    PING behind the SUB has been answered; the proxy shows the order the server got."""
    import nats

    from tandem.common.bus import synced
    from tests.nats_proxy import NatsProxy

    proxy = await NatsProxy(nats_server.url).start()
    nc = await nats.connect(proxy.url)
    try:
        await synced(nc)
        proxy.sent.clear()
        await nc.subscribe("synced.test")
        await synced(nc)
        sent = bytes(proxy.sent)
        assert b"SUB synced.test" in sent, sent
        assert sent.rindex(b"PING") > sent.index(b"SUB synced.test"), sent
    finally:
        await nc.close()
        await proxy.stop()


def test_a_dead_letter_too_large_for_max_payload_keeps_the_start_of_its_body() -> None:
    """A letter carries its body base64 (a third larger): one that would not fit keeps
    the start of the body and says so with the body's length and sha256; one that fits
    is left as it is."""
    import hashlib

    from tandem.common.bus.connect import fitting
    from tandem.common.events import encode

    small = DeadLetter(stream="S", subject="s", seq=1, num_delivered=1, reason="r",
                       data=b"x" * 100, headers={"h": "v"})
    assert fitting(small, 1 << 20) is small
    data = bytes(range(256)) * 4000  # 1,024,000 bytes
    cut = fitting(struct_replace(small, data=data), 1 << 20)
    assert len(encode(cut)) < 1 << 20 and cut.headers == {"h": "v"}
    assert 0 < len(cut.data) < len(data) and data.startswith(cut.data)
    assert cut.reason == (f"r [dead letter cut: it holds the first {len(cut.data)} of the "
                          f"body's {len(data)} bytes (sha256 {hashlib.sha256(data).hexdigest()}"
                          f"); the whole would exceed max_payload {1 << 20}]")


async def test_a_lower_priority_consumer_is_asked_before_the_first_is_long_polled(
        bus: Bus, uid: str) -> None:
    """The first consumer (the interactive lane) was long-polled, and a lower one (batch)
    asked only once that poll came back empty: a steady trickle of interactive tasks,
    one every idle_poll, held a batch queue for minutes while the worker sat idle (soak
    red team). Now each consumer is asked for what it holds, in order, before the first
    is long-polled: with an hour's long poll, a batch message is still taken at once."""
    stream = streams.StreamSpec(f"L_{uid}", (f"l.{uid}.*",),
                                retention=RetentionPolicy.WORK_QUEUE)
    first = streams.ConsumerSpec(stream.name, "interactive",
                                 filter_subjects=(f"l.{uid}.interactive",))
    lower = streams.ConsumerSpec(stream.name, "batch", filter_subjects=(f"l.{uid}.batch",))
    await bus.provision([stream, first, lower])
    await bus.publish(f"l.{uid}.batch", GenerationTask(task_id="b1", model="noop"))
    taken: list[str] = []
    stop = asyncio.Event()

    async def handle(d: Delivery[GenerationTask]) -> None:
        taken.append(d.event.task_id)
        stop.set()

    poller = Poller([bus.consumer(first, GenerationTask, handle),
                     bus.consumer(lower, GenerationTask, handle)], idle_poll=3600.0)
    await asyncio.wait_for(poller.run(stop), TIMEOUT)
    assert taken == ["b1"]


async def test_a_fetch_whose_consumer_was_released_meanwhile_is_handed_back_not_run(
        bus: Bus, uid: str) -> None:
    """Failover releases a recovered cluster's consumers while the pull loop may be
    fetching from one: what that fetch brings back is the recovered cluster's again.
    It ran on the adopter instead (CI: a task sent to a just-undrained cluster ran on the
    other one). Now it is handed back (nak): redelivered at once, never handled here."""
    stream = streams.StreamSpec(f"R_{uid}", (f"r.{uid}.*",),
                                retention=RetentionPolicy.WORK_QUEUE)
    own = streams.ConsumerSpec(stream.name, "own", filter_subjects=(f"r.{uid}.own",))
    adopted = streams.ConsumerSpec(stream.name, "adopted",
                                   filter_subjects=(f"r.{uid}.adopted",))
    await bus.provision([stream, own, adopted])
    await bus.publish(f"r.{uid}.adopted", GenerationTask(task_id="theirs", model="noop"))
    taken: list[str] = []
    stop, released = asyncio.Event(), asyncio.Event()

    async def handle(d: Delivery[GenerationTask]) -> None:
        taken.append(d.event.task_id)

    first = bus.consumer(own, GenerationTask, handle)
    lower = bus.consumer(adopted, GenerationTask, handle)
    poller = Poller([first, lower], idle_poll=3600.0)
    fetch_first, fetch_lower = first.fetch, lower.fetch

    async def released_while_fetching(n: int, wait: float):  # type: ignore[no-untyped-def]
        msgs = await fetch_lower(n, wait)
        if msgs:
            poller.consumers.remove(lower)  # as Failover._rebuild does, in place
            released.set()
        return msgs

    async def next_round(n: int, wait: float):  # type: ignore[no-untyped-def]
        if released.is_set():  # the round after the release: the fetch was dealt with
            stop.set()
            return []
        return await fetch_first(n, wait)

    lower.fetch = released_while_fetching  # type: ignore[method-assign]
    first.fetch = next_round  # type: ignore[method-assign]
    await asyncio.wait_for(poller.run(stop), TIMEOUT)
    assert taken == []
    again = await fetch_lower(1, 5.0)
    assert [decode(m.data, GenerationTask).task_id for m in again] == ["theirs"]
    assert again[0].metadata.num_delivered == 2


async def test_a_paused_loop_told_to_resume_pulls_at_once_not_after_its_nap(
        bus: Bus, uid: str) -> None:
    """A drained worker's loop naps ``idle_poll`` between looks at ``paused()``; an
    undrain calls ``resume()``, so it pulls now. With an hour's nap, the message waiting
    is still taken."""
    stream, consumer = _work(uid)
    await bus.provision([stream, consumer])
    await bus.publish(f"w.{uid}.a", GenerationTask(task_id="waiting", model="noop"))
    paused, napping = [True], asyncio.Event()
    taken: list[str] = []
    stop = asyncio.Event()

    def is_paused() -> bool:
        if paused[0]:
            napping.set()
        return paused[0]

    async def handle(d: Delivery[GenerationTask]) -> None:
        taken.append(d.event.task_id)
        stop.set()

    poller = Poller([bus.consumer(consumer, GenerationTask, handle)], idle_poll=3600.0,
                    paused=is_paused)
    run = asyncio.create_task(poller.run(stop))
    await asyncio.wait_for(napping.wait(), TIMEOUT)
    paused[0] = False
    poller.resume()
    await asyncio.wait_for(run, TIMEOUT)
    assert taken == ["waiting"]


async def test_a_stop_ends_the_long_poll_under_way_and_loses_nothing(
        bus: Bus, uid: str) -> None:
    """Every service's stop waited out the long poll under way (a second by default, a
    test's teardown each time): now the stop ends it. With an hour's poll the consumer
    still stops, and a task published after it is there for the next one."""
    stream, consumer = _work(uid)
    await bus.provision([stream, consumer])
    polling, stop = asyncio.Event(), asyncio.Event()

    async def handle(d: Delivery[GenerationTask]) -> None:
        raise AssertionError(f"nothing was published before the stop: {d.event}")

    c = bus.consumer(consumer, GenerationTask, handle, fetch_timeout=3600.0)
    fetch = c.fetch

    async def noted(n: int, wait: float):  # type: ignore[no-untyped-def]
        polling.set()
        return await fetch(n, wait)

    c.fetch = noted  # type: ignore[method-assign]
    run = asyncio.create_task(c.run(stop))
    await asyncio.wait_for(polling.wait(), TIMEOUT)
    stop.set()
    await asyncio.wait_for(run, TIMEOUT)
    await bus.publish(f"w.{uid}.a", GenerationTask(task_id="after", model="noop"))
    assert [t.task_id for t in await _collect(bus, consumer, 1)] == ["after"]
