"""What the bus tells of a delivery that failed, and what it never tells (a password).

A consumer span ends with its delivery's outcome: ERROR, with the exception, when the
handler failed it or it was dead on arrival; UNSET for an ack, a ``Retry`` or a cancel.
A dead letter's log line names the message's ``Nats-Msg-Id`` (a generation's task id).
Spans are exported by a child process (the tracer provider is global to a process).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import structlog

from tandem.cli.devstack import NatsServer
from tandem.common.bus import Bus
from tandem.common.settings import Settings, load

from .conftest import ROOT, service_env
from .observability_support import CONSUMER, ERROR, UNSET, Receiver

PROBE = """
import asyncio, sys
from nats.js.api import RetentionPolicy
from tandem.common import log, streams, tracing
from tandem.common.bus import Bus
from tandem.common.errors import Reject, Retry
from tandem.common.events import GenerationTask
from tandem.common.settings import Settings, load

IDS = ("ok", "bad", "later", "boom")


async def main(url: str, uid: str) -> None:
    bus = await Bus.connect(load(Settings, nats_url=url, cluster="c", node="n"), "probe")
    stream = streams.StreamSpec(f"T_{uid}", (f"t.{uid}.*",),
                                retention=RetentionPolicy.WORK_QUEUE)
    specs = {way: streams.ConsumerSpec(stream.name, way, filter_subjects=(f"t.{uid}.{way}",),
                                       max_deliver=3) for way in ("one", "whole")}
    await bus.provision([*streams.core_streams(), stream, *specs.values()])
    for way in specs:
        for i in IDS:
            await bus.publish(f"t.{uid}.{way}", GenerationTask(task_id=i, model="m"),
                              msg_id=f"{way}-{i}")
        await bus.publish(f"t.{uid}.{way}", b"\\x00garbage", msg_id=f"{way}-garbage")
    settled = {way: asyncio.Event() for way in specs}
    done: dict[str, list[str]] = {way: [] for way in specs}
    seen: set[str] = set()

    def outcome(way: str, d) -> BaseException | None:
        i = d.event.task_id
        if i == "bad":
            return Reject("no model m here")
        if i == "boom":  # nak'd, then dead-lettered on its second failure
            return RuntimeError("the pipeline blew up")
        if i == "later" and (way, i) not in seen:
            seen.add((way, i))
            return Retry("not now", delay=0.05)
        done[way].append(i)
        if len(done[way]) == 2:
            settled[way].set()
        return None

    async def one(d) -> None:
        error = outcome("one", d)
        if error is not None:
            raise error

    async def whole(ds):
        for d in ds:
            yield d, outcome("whole", d)

    stop = asyncio.Event()
    consumers = [bus.consumer(specs["one"], GenerationTask, one, fetch_timeout=0.2),
                 bus.consumer(specs["whole"], GenerationTask, fetch_handler=whole,
                              fetch_timeout=0.2)]
    running = [asyncio.create_task(c.run(stop)) for c in consumers]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in settled.values())), 60)
    dead = await bus.js.stream_info("DLQ")
    while dead.state.messages < 6:  # bad, boom, garbage per consumer: all letters written
        await asyncio.sleep(0.05)  # polling the DLQ's count, bounded by the test's timeout
        dead = await bus.js.stream_info("DLQ")
    stop.set()
    await asyncio.gather(*running)
    await bus.drain()


log.configure("json")
tracing.configure("probe", sys.argv[3])
asyncio.run(main(sys.argv[1], sys.argv[2]))
tracing.shutdown()
"""


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_a_failed_delivery_s_span_is_an_error_and_its_dead_letter_names_its_msg_id(
        nats_server: NatsServer, uid: str, receiver: Receiver) -> None:
    res = subprocess.run([sys.executable, "-c", PROBE, nats_server.url, uid, receiver.url],
                         cwd=ROOT, env=service_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    # shutdown() flushed synchronously: every span is here once the child has exited.
    spans: dict[str, list[tuple[int, str, list[str]]]] = {}
    for s in receiver.spans:
        if s["kind"] == CONSUMER and s["name"] == f"T_{uid} process":
            spans.setdefault(s["attrs"]["messaging.message.id"].string_value, []).append(
                (s["status"][0], s["status"][1], [name for name, _ in s["events"]]))
    for way in ("one", "whole"):  # a handler per delivery, and one per fetch
        assert spans[f"{way}-ok"] == [(UNSET, "", [])]
        assert spans[f"{way}-later"] == [(UNSET, "", []), (UNSET, "", [])]  # Retry, then ok
        assert spans[f"{way}-bad"] == [(ERROR, "Reject: no model m here", ["exception"])]
        assert spans[f"{way}-boom"] == 2 * [(ERROR, "RuntimeError: the pipeline blew up",
                                             ["exception"])]
        [(code, why, events)] = spans[f"{way}-garbage"]  # dead on arrival: no handler
        assert code == ERROR and why.startswith("undecodable") and events == []
    letters = [json.loads(line) for line in res.stdout.splitlines()
               if '"bus.dead_letter"' in line]
    assert sorted(x["msg_id"] for x in letters) == sorted(
        f"{way}-{i}" for way in ("one", "whole") for i in ("bad", "boom", "garbage"))


async def test_a_reconnect_logs_the_server_s_host_and_port_never_its_credentials(
        nats_server: NatsServer) -> None:
    """nats-server without authorization takes any credentials: the URL carries some, as
    TANDEM_NATS_URL may, and the reconnect's log line must not repeat them."""
    url = nats_server.url.replace("nats://", "nats://tandem:s3cret-pw@")
    bus = await Bus.connect(load(Settings, nats_url=url, cluster="c", node="n"), "probe")
    back = asyncio.Event()

    async def reconnected() -> None:  # runs after the reconnect was logged
        back.set()

    bus.reconnected.append(reconnected)
    try:
        with structlog.testing.capture_logs() as logs:
            nats_server.stop()
            nats_server.start()  # same port and store
            await asyncio.wait_for(back.wait(), 30)
        [line] = [x for x in logs if x["event"] == "nats.reconnected"]
        assert line["url"] == f"{nats_server.host}:{nats_server.port}"
        assert "s3cret" not in repr(logs)
    finally:
        await bus.drain()

