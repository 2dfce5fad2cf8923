"""A KV watch's current values are all there before it says they ended.

nats-server may answer a consumer's info before the messages it has already pushed reach
the client; nats-py's ``KeyValue.watch`` then ends the current values before any of them
(nats-io/nats.py#842), and whatever read a snapshot with it saw an empty bucket: the
gateway's ``/metrics`` dropped a live node that way in CI (test_observer, at f54ed78).
``tests.nats_proxy`` makes that order happen every time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tandem.cli.devstack import NatsServer
from tandem.common import streams
from tandem.common.bus import Bus, MapWatch, snapshot, watch
from tandem.common.events import DrainRecord, encode
from tandem.common.settings import Settings, load
from tests.nats_proxy import NatsProxy

KEYS = {f"c.n{i}": f"value {i}".encode() for i in range(3)}


@pytest.fixture
async def proxy(nats_server: NatsServer) -> AsyncIterator[NatsProxy]:
    p = await NatsProxy(nats_server.url).start()
    yield p
    await p.stop()


@pytest.fixture
async def proxied(proxy: NatsProxy, uid: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(load(Settings, nats_url=proxy.url, cluster=f"c{uid}", node="n0"),
                          "test")
    yield b
    await b.drain()


async def filled_bucket(bus: Bus, uid: str) -> str:
    bucket = f"w{uid}"
    await bus.provision([streams.KVSpec(bucket)])
    kv = await bus.kv(bucket)
    await kv.put("c.gone", b"x")
    for key, value in KEYS.items():
        await kv.put(key, value)
    await kv.delete("c.gone")
    return bucket


async def test_the_proxy_reproduces_nats_pys_early_end_of_the_current_values(
        proxied: Bus, proxy: NatsProxy, uid: str) -> None:
    kv = await proxied.kv(await filled_bucket(proxied, uid))
    proxy.hold_deliveries(len(KEYS) + 1)  # the deleted key's marker is delivered too
    watcher = await kv.watchall()
    assert proxy.answered.is_set()
    proxy.release()
    try:
        # nats-py ends the current values before any of them: what went wrong in CI.
        assert await watcher.updates(timeout=5.0) is None
        assert (await watcher.updates(timeout=5.0)).key in KEYS
    finally:
        await watcher.stop()


async def test_a_snapshot_has_every_key_the_server_sent_behind_its_consumer_info(
        proxied: Bus, proxy: NatsProxy, uid: str) -> None:
    kv = await proxied.kv(await filled_bucket(proxied, uid))
    proxy.hold_deliveries(len(KEYS) + 1)
    assert await snapshot(kv) == KEYS
    assert proxy.reordered == 1

    proxy.hold_deliveries(len(KEYS) + 1)  # a watch: the values, the delete, then None
    watcher = await watch(kv)
    try:
        got = [await watcher.updates(timeout=5.0) for _ in range(len(KEYS) + 2)]
    finally:
        await watcher.stop()
    assert proxy.reordered == 2
    assert got[-1] is None
    assert {e.key: e.value for e in got[:-1] if e is not None and e.operation is None} == KEYS
    assert [e.key for e in got[:-1] if e is not None and e.operation == "DEL"] == ["c.gone"]


async def test_a_typed_buckets_items_and_a_map_watch_start_with_every_key(
        proxied: Bus, proxy: NatsProxy, uid: str) -> None:
    bucket = f"d{uid}"
    await proxied.provision([streams.KVSpec(bucket)])
    records = {f"c.n{i}": DrainRecord(cluster="c", node=f"n{i}", reason="r", by="t", at=1.0)
               for i in range(3)}
    kv = await proxied.kv(bucket)
    for key, rec in records.items():
        await kv.put(key, encode(rec))

    proxy.hold_deliveries(len(records))
    typed = await proxied.typed(bucket, DrainRecord)
    assert await typed.items() == records
    assert proxy.reordered == 1

    proxy.hold_deliveries(len(records))
    seen: dict[str, bytes | None] = {}
    mw = MapWatch(proxied, bucket, lambda key, value, initial: seen.__setitem__(key, value))
    await mw.start()  # ready: its picture whole, not filled in afterwards
    try:
        assert mw.keys == set(records)
        assert seen == {key: encode(rec) for key, rec in records.items()}
    finally:
        await mw.stop()
    assert proxy.reordered == 2


async def test_a_snapshot_of_an_empty_bucket_ends_at_once(bus: Bus, uid: str) -> None:
    bucket = f"e{uid}"
    await bus.provision([streams.KVSpec(bucket)])
    assert await snapshot(await bus.kv(bucket), timeout=5.0) == {}


async def test_a_snapshot_lets_its_consumer_go_soon_a_lasting_watch_does_not(
        bus: Bus, uid: str) -> None:
    """Roles may not delete consumers, so each outlives its reader by its inactivity
    threshold. A one-pass read kept a lasting watch's 5 minutes: a gateway reading three
    buckets a second (its dashboard) held ~900 consumers, and polling /v1/clusters filled
    KV nodes' consumer limit (soak red team)."""
    bucket = await filled_bucket(bus, uid)
    stream = f"KV_{bucket}"
    assert await snapshot(await bus.kv(bucket)) == KEYS
    # The snapshot's consumer is gone, or going within seconds; never kept for minutes.
    assert not [c for c in await bus.js.consumers_info(stream)
                if c.config.inactive_threshold >= 60]
    w = await watch(await bus.kv(bucket))
    try:
        (lasting,) = [c for c in await bus.js.consumers_info(stream)
                      if c.config.inactive_threshold >= 60]
        assert lasting.config.inactive_threshold == 300
    finally:
        await w.stop()


async def test_a_snapshot_whose_ordered_consumer_was_recreated_still_has_every_key(
        proxied: Bus, proxy: NatsProxy, uid: str) -> None:
    # The third value is lost on the wire and the fourth shows the gap: nats-py recreates
    # the watch's consumer from the second. The new consumer counts from 1 and has two
    # to send; the server says so before they arrive. Counted across both consumers, the
    # two values already handled looked like all the new one had to send.
    bucket = f"r{uid}"
    await proxied.provision([streams.KVSpec(bucket)])
    kv = await proxied.kv(bucket)
    values = {f"c.n{i}": f"value {i}".encode() for i in range(4)}
    for key, value in values.items():
        await kv.put(key, value)
    proxy.drop_then_hold(3, 2)
    assert await snapshot(kv) == values
    assert (proxy.dropped, proxy.reordered) == (1, 1)
