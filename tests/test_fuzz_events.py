"""Every event decoder in ``events.py``, fuzzed with hypothesis, and garbage on a real
consumer: decoding fails only with ``EventDecodeError``; bad payloads go to the DLQ with
the reason while the consumer goes on handling the good ones."""

from __future__ import annotations

import asyncio
import json
import types
import typing
import uuid
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from nats.js.api import RetentionPolicy

from tandem.cli.devstack import NatsServer
from tandem.common import events, streams
from tandem.common.bus import Bus, Delivery
from tandem.common.errors import EventDecodeError
from tandem.common.events import DeadLetter, GenerationTask
from tandem.common.settings import Settings, load


def _decodable() -> dict[str, Any]:
    """Every Struct defined in events.py and every tagged union of them."""
    out: dict[str, Any] = {}
    for name, obj in vars(events).items():
        if isinstance(obj, type) and issubclass(obj, msgspec.Struct) \
                and obj.__module__ == events.__name__:
            out[name] = obj
        elif isinstance(obj, types.UnionType):
            out[name] = obj
    return out


DECODABLE = _decodable()
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def _fields(t: Any) -> list[str]:
    members = typing.get_args(t) or (t,)
    names = {"v", "kind", "type", "extra"}
    for m in members:
        names |= set(m.__struct_fields__)
    return sorted(names)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=80)
    | st.sampled_from(["", "a b", "../x", "a.b", "*", ">", "east", "status", "result",
                       "step", "checkpoint", "mirrored", "queued", "succeeded", "healthy"]),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)


def _decode_only_fails_cleanly(data: bytes, t: Any) -> None:
    try:
        events.decode(data, t)
    except EventDecodeError as exc:
        assert exc.reason and exc.event_type


@pytest.mark.parametrize("name", sorted(DECODABLE))
def test_decoder_survives_arbitrary_bytes(name: str) -> None:
    t = DECODABLE[name]

    @FUZZ
    @given(st.binary(max_size=512))
    @example(b"[" * 100_000)
    @example(b'{"task_id": "' + b"\xff" * 8 + b'"}')
    @example(b"\x00")
    def check(data: bytes) -> None:
        _decode_only_fails_cleanly(data, t)

    check()


@pytest.mark.parametrize("name", sorted(DECODABLE))
def test_decoder_survives_json_with_the_right_field_names_and_wrong_values(name: str) -> None:
    t = DECODABLE[name]
    objects = st.dictionaries(st.sampled_from(_fields(t)), json_values, max_size=12)

    @FUZZ
    @given(objects | json_values)
    def check(value: Any) -> None:
        _decode_only_fails_cleanly(json.dumps(value).encode(), t)

    check()


# ------------------------------------------------------------------------ on a real consumer

garbage = (st.binary(max_size=200)
           | st.dictionaries(st.sampled_from(_fields(GenerationTask)), json_values,
                             max_size=8).map(lambda d: json.dumps(d).encode()))


def _bad(data: bytes) -> bool:
    try:
        events.decode(data, GenerationTask)
    except EventDecodeError:
        return True
    return False


async def _scenario(url: str, payloads: list[bytes]) -> None:
    uid = uuid.uuid4().hex[:8]
    stream = streams.StreamSpec(f"FZ_{uid}", (f"fz.{uid}",),
                                retention=RetentionPolicy.WORK_QUEUE)
    consumer = streams.ConsumerSpec(stream.name, "c", ack_wait=5, max_deliver=3)
    bus = await Bus.connect(load(Settings, nats_url=url), "fuzz")
    try:
        await bus.provision([*streams.core_streams(), stream, consumer])
        good = [f"good-{i}" for i in range(3)]
        sent: list[bytes] = []
        for i, data in enumerate(payloads):
            if i < len(good):
                ok = events.encode(GenerationTask(task_id=good[i], model="m"))
                await bus.publish(f"fz.{uid}", ok)
            await bus.publish(f"fz.{uid}", data)
            sent.append(data)
        bad = [d for d in sent if _bad(d)]
        handled: list[str] = []
        stop, all_handled = asyncio.Event(), asyncio.Event()
        want = len(good) + len(sent) - len(bad)

        async def handle(d: Delivery[GenerationTask]) -> None:
            handled.append(d.event.task_id)
            if len(handled) >= want:
                all_handled.set()

        async def letters() -> list[DeadLetter]:
            sub = await bus.js.pull_subscribe(f"dlq.{stream.name}", stream=streams.DLQ)
            out: list[DeadLetter] = []
            while len(out) < len(bad):
                for m in await sub.fetch(len(bad) - len(out), timeout=10):
                    out.append(events.decode(m.data, DeadLetter))
                    await m.ack()
            await sub.unsubscribe()
            return out

        async def run() -> None:
            await bus.consumer(consumer, GenerationTask, handle, fetch_timeout=0.2).run(stop)

        running = asyncio.create_task(run())
        dead = await asyncio.wait_for(letters(), 30)
        await asyncio.wait_for(all_handled.wait(), 30)  # it went on past every bad one
        stop.set()
        await asyncio.wait_for(running, 10)
        assert set(good) <= set(handled)
        assert sorted(d.data for d in dead) == sorted(bad)
        assert all(d.reason.startswith("undecodable: ") and len(d.reason) > 14
                   for d in dead), [d.reason for d in dead]
        info = await bus.js.stream_info(stream.name)
        assert info.state.messages == 0  # nothing left behind, nothing redelivered forever
    finally:
        await bus.drain()


def test_garbage_on_a_real_consumer_goes_to_dlq_and_the_consumer_goes_on(
        nats_server: NatsServer) -> None:
    @settings(max_examples=4, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(garbage, min_size=3, max_size=12))
    def check(payloads: list[bytes]) -> None:
        asyncio.run(_scenario(nats_server.url, payloads))

    check()
